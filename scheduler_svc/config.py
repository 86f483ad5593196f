"""Configuration of the scheduler process: one dataclass, validated on construction.

Every field carries ``metadata={"help": ...}`` (and, where a range applies, ``"min"``/``"max"``), so the command
line (``--kv-blocks``, ...) and the environment (``MMCAST_KV_BLOCKS``, ...) can be generated from the fields alone.
A value of 0 for a cache budget means "take it from the ranks' handshake" (the minimum over the group); see
``SchedulerConfig.effective`` for how configured and handshake values combine.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

TRANSFER_MODES = ("full", "strip", "lazy")
PAYLOAD_ENCODINGS = ("encoded", "pixels")
ENCODER_PLACEMENTS = ("sharded", "replicated")
_INT_MAX = 2**63 - 1
# Pillow format names the frontend opens by default; every other plugin (ICO, TIFF, PSD, ...) never runs.
DEFAULT_IMAGE_FORMATS = ["JPEG", "PNG", "WEBP", "GIF", "BMP"]
# The default --max-prompt-bytes is the context times this: the most text bytes one token may stand for in a prompt
# that still fits. Measured on the shipped byte-level BPE (docs/SECURITY.md section 5): English prose 3.3
# bytes/token, random CJK, emoji, printable ASCII and random bytes 1.0; subword tokenizers of real checkpoints
# reach ~4-5 on English and ~4.5 on CJK (1.5 characters of 3 bytes per token). 8 leaves room above all of them.
PROMPT_BYTES_PER_TOKEN = 8


def _field(default: Any, help: str, *, min: float | None = None, max: float | None = None, choices=None) -> Any:
    meta: dict[str, Any] = {"help": help}
    if min is not None:
        meta["min"] = min
    if max is not None:
        meta["max"] = max
    if choices is not None:
        meta["choices"] = tuple(choices)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class SchedulerConfig:
    """Settings of the scheduler core (frontend, prefix cache, step builder) and of the service around it."""

    # --- model and limits on requests -------------------------------------------------------------------------
    model: str = _field("", "model folder (config, weights, tokenizer, processor); the ranks must load the same one")
    max_model_len: int = _field(
        0, "context length: prompt + max_tokens must fit (0 = the model config's, capped by the ranks')", min=0
    )
    max_tokens_limit: int = _field(4096, "largest sampling.max_tokens a request may ask for (the context still caps it)",
                                   min=1, max=2**31 - 1)
    max_logprobs: int = _field(20, "largest sampling.logprobs (top alternatives per token) a request may ask for",
                               min=0, max=1024)
    max_images_per_request: int = _field(64, "images one request may contain", min=0, max=100_000)
    max_image_pixels: int = _field(
        33_554_432, "width * height of one image, checked on the header before decoding (decompression bombs)",
        min=1, max=2**40,
    )
    max_upload_bytes: int = _field(32 << 20, "bytes of one encoded image (inline or uploaded)", min=1, max=_INT_MAX)
    max_request_bytes: int = _field(
        64 << 20, "bytes of one serialized GenerateRequest (also the gRPC receive limit)", min=1024, max=2**31 - 1
    )
    max_prompt_bytes: int = _field(
        0, f"UTF-8 bytes of all text parts of one request, checked before tokenizing (0 = the context length x "
        f"{PROMPT_BYTES_PER_TOKEN})", min=0, max=2**31 - 1,
    )
    image_formats: list = _field(
        DEFAULT_IMAGE_FORMATS, "image formats the frontend opens (Pillow names, comma separated on the CLI); no other "
        "decoder ever runs",
    )
    max_concurrent_decodes: int = _field(
        2, "images decoded and preprocessed at once (each may hold ~1.4 GiB at the default limits: docs/SECURITY.md)",
        min=1, max=1024,
    )
    frontend_threads: int = _field(
        4, "threads that check, decode and tokenize requests off the event loop (each has its own tokenizer)",
        min=1, max=1024,
    )
    max_pending_upload_bytes: int = _field(
        128 << 20, "bytes held by unfinished uploads, all tenants together; more get RESOURCE_EXHAUSTED",
        min=1, max=_INT_MAX,
    )
    max_pending_upload_bytes_per_tenant: int = _field(
        64 << 20, "bytes held by one tenant's unfinished uploads; more get RESOURCE_EXHAUSTED", min=1, max=_INT_MAX,
    )

    # --- caches -------------------------------------------------------------------------------------------------
    processor_cache_bytes: int = _field(
        1 << 30, "bytes of processed images kept so an image seen before is neither decoded, processed nor hashed",
        min=0, max=_INT_MAX,
    )
    upload_store_bytes: int = _field(256 << 20, "bytes of uploaded encoded images kept for reference by hash",
                                     min=0, max=_INT_MAX)
    block_size: int = _field(16, "tokens per KV block (prefix-cache granularity); must equal the ranks'",
                             min=1, max=1024)
    kv_blocks: int = _field(0, "KV blocks to use (0 = the ranks' pool size; never more than it)", min=0, max=2**31 - 1)
    encoder_cache_tokens: int = _field(
        0, "encoder-output rows the ranks hold and one step may encode (0 = the ranks' budget; never more)",
        min=0, max=_INT_MAX,
    )
    payload_cache_bytes: int = _field(
        0, "payload bytes each rank holds (0 = the ranks' budget; never more)", min=0, max=_INT_MAX
    )

    # --- batching ---------------------------------------------------------------------------------------------
    max_num_batched_tokens: int = _field(8192, "tokens computed in one step over all requests (chunked prefill)",
                                         min=1, max=2**31 - 1)
    max_num_seqs: int = _field(64, "requests running at once", min=1, max=65536)
    max_waiting: int = _field(256, "requests queued before admission; more get RESOURCE_EXHAUSTED", min=0,
                              max=1_000_000)

    # --- wire ---------------------------------------------------------------------------------------------------
    transfer_mode: str = _field(
        "lazy", "which payloads go to the ranks: full (all at admission), strip (uncovered at admission), "
        "lazy (in the step that encodes them, only to ranks lacking them)", choices=TRANSFER_MODES,
    )
    payload_encoding: str = _field(
        "encoded", "what an image's payload is on the way to the ranks: encoded (the file as the client sent it; the "
        "rank that encodes it decodes and preprocesses it) or pixels (the frontend's float32 pixel_values)",
        choices=PAYLOAD_ENCODINGS,
    )
    encoder_placement: str = _field(
        "sharded", "which ranks run the vision encoder on an item: sharded (one owner per item, its output shared over "
        "the group's collective) or replicated (every rank, each with its own copy of the payload)",
        choices=ENCODER_PLACEMENTS,
    )
    chunk_size_bytes: int = _field(1 << 20, "bytes per payload chunk on the step streams", min=1, max=64 << 20)

    # --- service --------------------------------------------------------------------------------------------------
    listen: str = _field("[::]:50051", "address the client API listens on (HOST:PORT; port 0 picks one)")
    metrics_port: int = _field(9400, "port of the Prometheus /metrics endpoint (0 = disabled)", min=0, max=65535)
    metrics_host: str = _field("0.0.0.0", "address the /metrics endpoint binds (127.0.0.1 keeps it local)")
    workers: list = _field([], "worker rank addresses HOST:PORT, ordered by rank (comma separated on the CLI)")
    scheduler_id: str = _field("mmcast-scheduler", "name sent in the handshake; ranks may accept only this name")
    group_deadline_seconds: float = _field(
        60.0, "how long requests wait for a lost worker group to return before failing with UNAVAILABLE",
        min=0.0, max=86400.0,
    )
    step_timeout_seconds: float = _field(120.0, "how long a step may take on the ranks before the group counts as lost",
                                         min=0.1, max=86400.0)
    drain_seconds: float = _field(30.0, "grace period for in-flight requests on shutdown", min=0.0, max=86400.0)
    keepalive_seconds: float = _field(10.0, "idle time before a keepalive on a rank stream; two missed = lost",
                                      min=0.1, max=3600.0)
    reconnect_backoff_initial_seconds: float = _field(0.2, "first delay between reconnect attempts to a rank",
                                                      min=0.001, max=3600.0)
    reconnect_backoff_max_seconds: float = _field(2.0, "largest delay between reconnect attempts (doubling)",
                                                  min=0.001, max=3600.0)
    log_level: str = _field("INFO", "log level of the JSON logs", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    # --- security (docs/SECURITY.md); secrets are file paths, as Kubernetes mounts Secrets --------------------------
    tls_cert_file: str = _field("", "PEM certificate (chain) of the client port; set with --tls-key-file to serve TLS")
    tls_key_file: str = _field("", "PEM private key of --tls-cert-file")
    tls_client_ca_file: str = _field(
        "", "PEM CA bundle: clients must present a certificate it signed (mutual TLS); needs --tls-cert-file"
    )
    auth_tokens_file: str = _field(
        "", "bearer tokens: lines '<tenant> <token>' or a JSON object {token: tenant}; set = every "
        "mmcast.v1.GenerationService call needs 'authorization: Bearer <token>' (health and reflection stay open); "
        "uploads and caches are scoped per tenant; re-read when the file changes",
    )
    health_port: int = _field(
        0, "also serve grpc.health.v1 alone, in plaintext, on this port (for probes that cannot speak TLS; 0 = off)",
        min=0, max=65535,
    )
    worker_tls_ca_file: str = _field("", "PEM CA bundle that signed the ranks' certificates; set = TLS to the ranks")
    worker_tls_cert_file: str = _field(
        "", "PEM client certificate presented to the ranks (mutual TLS); with --worker-tls-key-file"
    )
    worker_tls_key_file: str = _field("", "PEM private key of --worker-tls-cert-file")
    worker_tls_server_name: str = _field(
        "", "name to verify in the ranks' certificates instead of the host of each --workers address"
    )
    worker_token_file: str = _field("", "file holding the token sent on every Step stream (the ranks' --shared-token-file)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            meta = f.metadata
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{f.name}={value!r} must be an integer")
            if f.type in ("float", float):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"{f.name}={value!r} must be a number")
                value = float(value)
                setattr(self, f.name, value)
            lo, hi = meta.get("min"), meta.get("max")
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                raise ValueError(f"{f.name}={value!r} is out of range; allowed [{lo}, {hi if hi is not None else 'inf'}]")
            if "choices" in meta and value not in meta["choices"]:
                raise ValueError(f"{f.name}={value!r} is not allowed; choose one of {', '.join(meta['choices'])}")
        if isinstance(self.workers, str):
            self.workers = [w.strip() for w in self.workers.split(",") if w.strip()]
        self._check_image_formats()
        for i, address in enumerate(self.workers):
            if not isinstance(address, str) or ":" not in address or not address.rsplit(":", 1)[1].isdigit():
                raise ValueError(f"workers[{i}]={address!r} must be HOST:PORT")
        if not self.metrics_host or not all(c.isalnum() or c in ".-_:" for c in self.metrics_host):
            raise ValueError(f"metrics_host={self.metrics_host!r} must be a host name or IP address without a port "
                             "(--metrics-host)")
        self._check_secret_files()
        if self.reconnect_backoff_max_seconds < self.reconnect_backoff_initial_seconds:
            raise ValueError(
                f"reconnect_backoff_max_seconds={self.reconnect_backoff_max_seconds} must be >= "
                f"reconnect_backoff_initial_seconds={self.reconnect_backoff_initial_seconds}"
            )

    def _check_image_formats(self) -> None:
        """Names Pillow can open (upper case); the list is never empty."""
        if isinstance(self.image_formats, str):
            self.image_formats = [f.strip() for f in self.image_formats.split(",") if f.strip()]
        self.image_formats = [str(f).upper() for f in self.image_formats]
        if not self.image_formats:
            raise ValueError("image_formats is empty: allow at least one format (--image-formats JPEG,PNG)")
        from PIL import Image

        Image.init()
        unknown = [f for f in self.image_formats if f not in Image.OPEN]
        if unknown:
            raise ValueError(f"image_formats={','.join(unknown)} unknown to Pillow; choose from {','.join(sorted(Image.OPEN))}")

    def _check_secret_files(self) -> None:
        """Pairs come together and named files exist; their contents are checked when the server starts."""
        pairs = [("tls_cert_file", "tls_key_file"), ("worker_tls_cert_file", "worker_tls_key_file")]
        for cert, key in pairs:
            if bool(getattr(self, cert)) != bool(getattr(self, key)):
                given, missing = (cert, key) if getattr(self, cert) else (key, cert)
                raise ValueError(f"{given} is set but {missing} is not: a TLS certificate needs its private key")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file: mutual TLS is TLS first")
        for f in dataclasses.fields(self):
            if f.name.endswith("_file") and getattr(self, f.name) and not os.path.isfile(getattr(self, f.name)):
                raise ValueError(f"{f.name}={getattr(self, f.name)!r}: no such file (--{f.name.replace('_', '-')})")

    @staticmethod
    def effective(configured: int, from_ranks: int, name: str) -> int:
        """The budget to use: the ranks' value when the setting is 0, else the setting, which may not exceed it."""
        if configured == 0:
            if from_ranks <= 0:
                raise ValueError(f"{name}=0 takes the ranks' value, but the ranks reported {from_ranks}")
            return from_ranks
        if from_ranks > 0 and configured > from_ranks:
            raise ValueError(
                f"{name}={configured} exceeds what the ranks reported ({from_ranks}); lower --{name.replace('_', '-')}"
            )
        return configured

    @classmethod
    def help_texts(cls) -> dict[str, str]:
        """Field name -> one-line help, for generated command lines."""
        return {f.name: f.metadata["help"] for f in dataclasses.fields(cls)}
