"""Configuration of the scheduler process: one dataclass, validated on construction, and its command line.

Every field is a ``common.settings.setting`` (help text, ``--help`` section, range, choices), from which
``build_parser``/``load_config`` generate the flags (``--kv-blocks``) and environment variables
(``MMCAST_KV_BLOCKS``): a flag wins over its variable, a variable over the default, choices in any case — the same
mechanism as the worker's (worker_svc/config.py). A value of 0 for a cache budget means "take it from the ranks'
handshake" (the minimum over the group); see ``SchedulerConfig.effective`` for how configured and handshake values
combine.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
from collections.abc import Mapping, Sequence

from common import settings, tls_settings
from common.settings import LOG_LEVELS, setting
from scheduler_svc.media_domains import normalize_domain

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
# --help sections
_LIMITS, _CACHES, _BATCHING = "model and request limits", "caches", "batching"
_WIRE, _SERVICE, _SECURITY = "transfer to the ranks", "service", tls_settings.SECURITY
_MEDIA = "image URLs (OpenAI API; docs/SECURITY.md)"
PROG = "mmcast-scheduler"
DESCRIPTION = "mmcast scheduler: serves mmcast.v1.GenerationService and drives one tensor-parallel worker group."


def context_length(*limits: int) -> int:
    """The context length requests must fit: the smallest of the known limits (--max-model-len, the model config's
    max_position_embeddings, what the ranks reported); 0 (unknown) is no limit, and 0 is returned when none is known."""
    known = [v for v in limits if v]
    return min(known) if known else 0


@dataclasses.dataclass
class SchedulerConfig:
    """Settings of the scheduler core (frontend, prefix cache, step builder) and of the service around it."""

    # --- model and limits on requests -------------------------------------------------------------------------
    model: str = setting(
        "",
        "model folder (config, weights, tokenizer, processor); the ranks must load the same one",
        section=_LIMITS,
        metavar="DIR",
    )
    max_model_len: int = setting(
        0,
        "context length: prompt + max_tokens must fit (0 = the model config's, capped by the ranks')",
        min=0,
        section=_LIMITS,
    )
    max_tokens_limit: int = setting(
        0,
        "largest sampling.max_tokens a request may ask for, an operator's cap below the context (0 = the context "
        "alone: prompt + max_tokens must fit it)",
        min=0,
        max=2**31 - 1,
        section=_LIMITS,
    )
    max_choices: int = setting(
        8,
        "largest n (choices of one prompt) an OpenAI API request may ask for; each choice is a request of its own",
        min=1,
        max=1024,
        section=_LIMITS,
    )
    max_logprobs: int = setting(
        20,
        "largest sampling.logprobs (top alternatives per token) a request may ask for",
        min=0,
        max=1024,
        section=_LIMITS,
    )
    max_grammar_bytes: int = setting(
        65536,
        "bytes of one request's structured-output grammar (a JSON schema, a regex, a choice list, the tools' schemas)",
        min=16,
        max=16 * 2**20,
        section=_LIMITS,
    )
    max_images_per_request: int = setting(64, "images one request may contain", min=0, max=100_000, section=_LIMITS)
    response_store_entries: int = setting(
        4096,
        "/v1/responses answers kept for previous_response_id (all tenants; least recently used go first)",
        min=1,
        max=10_000_000,
        section=_CACHES,
    )
    response_store_bytes: int = setting(
        64 << 20,
        "text bytes of the conversations kept for previous_response_id (media stay in the upload store)",
        min=1024,
        max=2**40,
        section=_CACHES,
    )
    max_prompts_per_request: int = setting(
        32, "prompts one /v1/completions request may list (one choice each)", min=1, max=4096, section=_LIMITS
    )
    max_image_pixels: int = setting(
        33_554_432,
        "width * height of one image, checked on the header before decoding (decompression bombs)",
        min=1,
        max=2**40,
        section=_LIMITS,
    )
    max_videos_per_request: int = setting(8, "videos one request may contain", min=0, max=10_000, section=_LIMITS)
    max_video_frames: int = setting(
        256,
        "frames one video may sample (each frame costs a decode and its patches); caps every fps/num_frames request",
        min=1,
        max=65_536,
        section=_LIMITS,
    )
    max_video_seconds: float = setting(
        3600.0, "duration of one video, from its container header", min=0.001, max=10**7, section=_LIMITS
    )
    max_video_total_frames: int = setting(
        1_000_000, "frames in one video's stream, from its container header", min=1, max=2**40, section=_LIMITS
    )
    max_video_frame_pixels: int = setting(
        3840 * 2160,
        "width * height of one video frame, from the container header before any frame is decoded",
        min=1,
        max=2**40,
        section=_LIMITS,
    )
    max_video_streams: int = setting(
        16, "streams (video, audio, subtitles, data) one container may hold", min=1, max=10_000, section=_LIMITS
    )
    max_upload_bytes: int = setting(
        32 << 20, "bytes of one encoded image (inline or uploaded)", min=1, max=_INT_MAX, section=_LIMITS
    )
    max_request_bytes: int = setting(
        64 << 20,
        "bytes of one serialized GenerateRequest (also the gRPC receive limit)",
        min=1024,
        max=2**31 - 1,
        section=_LIMITS,
    )
    max_prompt_bytes: int = setting(
        0,
        f"UTF-8 bytes of all text parts of one request, checked before tokenizing (0 = the context length x "
        f"{PROMPT_BYTES_PER_TOKEN})",
        min=0,
        max=2**31 - 1,
        section=_LIMITS,
    )
    image_formats: list = setting(
        DEFAULT_IMAGE_FORMATS,
        "image formats the frontend opens (Pillow names, comma separated on the CLI); no other decoder ever runs",
        section=_LIMITS,
    )
    max_concurrent_decodes: int = setting(
        2,
        "images the frontend decodes and preprocesses at once under --payload-encoding pixels (each may hold "
        "~1.4 GiB at the default limits: docs/SECURITY.md; under encoded the ranks decode)",
        min=1,
        max=1024,
        section=_LIMITS,
    )
    frontend_threads: int = setting(
        4,
        "threads that check, decode and tokenize requests off the event loop (each has its own tokenizer)",
        min=1,
        max=1024,
        section=_LIMITS,
    )
    max_pending_upload_bytes: int = setting(
        128 << 20,
        "bytes held by unfinished uploads, all tenants together; more get RESOURCE_EXHAUSTED",
        min=1,
        max=_INT_MAX,
        section=_LIMITS,
    )
    max_pending_upload_bytes_per_tenant: int = setting(
        64 << 20,
        "bytes held by one tenant's unfinished uploads; more get RESOURCE_EXHAUSTED",
        min=1,
        max=_INT_MAX,
        section=_LIMITS,
    )

    # --- image URLs of the OpenAI API (scheduler_svc/media_urls.py); everything off but data: URLs by default -----
    allowed_media_domains: list = setting(
        [],
        "host names whose http(s) image URLs may be fetched (comma separated; 'media.example.com' matches that "
        "host exactly, '*.example.com' its subdomains; empty = remote image URLs refused)",
        section=_MEDIA,
        metavar="HOST,...",
    )
    allowed_local_media_path: str = setting(
        "",
        "directory whose files file:// image URLs may read (symlinks and '..' out of it refused; empty = file "
        "URLs refused)",
        section=_MEDIA,
        metavar="DIR",
    )
    allowed_media_networks: list = setting(
        [],
        "CIDRs image fetches may reach although they are loopback, private, link-local or reserved (in-cluster "
        "media servers, tests); nothing else non-public is ever connected to",
        section=_MEDIA,
        metavar="CIDR,...",
    )
    media_fetch_timeout_seconds: float = setting(
        10.0,
        "time one image URL fetch may take in all: resolving, connecting, redirects and the body",
        min=0.001,
        max=3600.0,
        section=_MEDIA,
    )
    media_fetch_max_redirects: int = setting(
        3, "redirects one image URL fetch follows (each hop checked again)", min=0, max=20, section=_MEDIA
    )

    # --- caches -------------------------------------------------------------------------------------------------
    processor_cache_bytes: int = setting(
        1 << 30,
        "bytes of processed images kept so an image seen before is neither decoded, processed nor hashed "
        "(--payload-encoding pixels only; encoded images are not decoded by the frontend)",
        min=0,
        max=_INT_MAX,
        section=_CACHES,
    )
    upload_store_bytes: int = setting(
        256 << 20, "bytes of uploaded encoded images kept for reference by hash", min=0, max=_INT_MAX, section=_CACHES
    )
    block_size: int = setting(
        16, "tokens per KV block (prefix-cache granularity); must equal the ranks'", min=1, max=1024, section=_CACHES
    )
    kv_blocks: int = setting(
        0, "KV blocks to use (0 = the ranks' pool size; never more than it)", min=0, max=2**31 - 1, section=_CACHES
    )
    encoder_cache_tokens: int = setting(
        0,
        "encoder-output rows the ranks hold (0 = the ranks' budget; never more)",
        min=0,
        max=_INT_MAX,
        section=_CACHES,
    )
    max_live_sessions: int = setting(
        64,
        "live sessions open at once (each keeps its KV blocks between turns; GenerateRequest.live); 0 refuses them",
        min=0,
        max=65536,
        section=_CACHES,
    )
    live_session_idle_seconds: float = setting(
        300.0,
        "a live session with no turn for this long is closed and its KV freed",
        min=1.0,
        max=86400.0,
        section=_CACHES,
    )
    max_live_turns: int = setting(
        64, "turns one live session may keep in its KV (LiveSession.keep_turns)", min=1, max=4096, section=_CACHES
    )
    payload_cache_bytes: int = setting(
        0, "payload bytes each rank holds (0 = the ranks' budget; never more)", min=0, max=_INT_MAX, section=_CACHES
    )

    # --- batching ---------------------------------------------------------------------------------------------
    max_num_batched_tokens: int = setting(
        2048,
        "tokens computed in one step over all requests (chunked prefill): running decodes first, new prompts in "
        "the rest, so a burst of new requests prefills over several steps instead of stalling every decode",
        min=1,
        max=2**31 - 1,
        section=_BATCHING,
    )
    max_num_encoder_tokens: int = setting(
        1024,
        "encoder-output rows one step may encode (the vision encoder's work per step); a step's first item is "
        "encoded whatever its size, so no image is ever starved (0 = no limit but the encoder cache)",
        min=0,
        max=_INT_MAX,
        section=_BATCHING,
    )
    max_num_seqs: int = setting(64, "requests running at once", min=1, max=65536, section=_BATCHING)
    async_scheduling: bool = setting(
        False,
        "build a plain decode step while the previous one runs on the ranks, before its tokens are known (each rank "
        "takes the token it sampled last step as the input); other steps wait for the answer as before",
        section=_BATCHING,
    )
    max_waiting: int = setting(
        256, "requests queued before admission; more get RESOURCE_EXHAUSTED", min=0, max=1_000_000, section=_BATCHING
    )

    # --- wire ---------------------------------------------------------------------------------------------------
    transfer_mode: str = setting(
        "lazy",
        "which payloads go to the ranks: full (all at admission), strip (uncovered at admission), "
        "lazy (in the step that encodes them, only to ranks lacking them)",
        choices=TRANSFER_MODES,
        section=_WIRE,
    )
    payload_encoding: str = setting(
        "encoded",
        "what an image's payload is on the way to the ranks: encoded (the file as the client sent it; the "
        "rank that encodes it decodes and preprocesses it) or pixels (the frontend's float32 pixel_values)",
        choices=PAYLOAD_ENCODINGS,
        section=_WIRE,
    )
    encoder_placement: str = setting(
        "sharded",
        "which ranks run the vision encoder on an item: sharded (one owner per item, its output shared over "
        "the group's collective) or replicated (every rank, each with its own copy of the payload)",
        choices=ENCODER_PLACEMENTS,
        section=_WIRE,
    )
    chunk_size_bytes: int = setting(
        1 << 20, "bytes per payload chunk on the step streams", min=1, max=64 << 20, section=_WIRE
    )

    # --- service --------------------------------------------------------------------------------------------------
    listen: str = setting(
        "[::]:50051",
        "address the client API listens on (HOST:PORT; port 0 picks one)",
        section=_SERVICE,
        metavar="HOST:PORT",
    )
    http_port: int = setting(
        0,
        "port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health) on the "
        "host of --listen, with the client port's TLS and tokens (0 = off)",
        min=0,
        max=65535,
        section=_SERVICE,
    )
    http_header_timeout_seconds: float = setting(
        10.0,
        "an HTTP request's headers must be complete this long after the connection opens (or after the next "
        "request's first byte); otherwise 408 and the connection is closed (slow or idle clients)",
        min=0.1,
        max=3600.0,
        section=_SERVICE,
    )
    http_write_timeout_seconds: float = setting(
        30.0,
        "an HTTP response (a stream too) whose client reads nothing for this long is aborted and its request cancelled",
        min=0.1,
        max=86400.0,
        section=_SERVICE,
    )
    served_model_name: str = setting(
        "",
        "the model name the HTTP API answers to and lists in /v1/models (default: the model folder's name)",
        section=_SERVICE,
        metavar="NAME",
    )
    kv_events_endpoint: str = setting(
        "",
        "ZeroMQ endpoint to publish prefix-cache events on, in vLLM's KV-event format (e.g. tcp://*:5557; "
        "scheduler_svc/kv_events.py); empty = off",
        section=_SERVICE,
        metavar="ENDPOINT",
    )
    kv_events_topic: str = setting(
        "", "topic frame of every KV-event message (vLLM's default: empty)", section=_SERVICE, metavar="TOPIC"
    )
    kv_events_queue: int = setting(
        100_000,
        "KV events queued for the publisher at most; when full they are replaced by one AllBlocksCleared, "
        "so the step loop never waits for a subscriber",
        min=1,
        max=_INT_MAX,
        section=_SERVICE,
    )
    metrics_port: int = setting(
        9400, "port of the Prometheus /metrics endpoint (0 = disabled)", min=0, max=65535, section=_SERVICE
    )
    metrics_host: str = setting(
        "0.0.0.0", "address the /metrics endpoint binds (127.0.0.1 keeps it local)", section=_SERVICE, metavar="HOST"
    )
    workers: list = setting(
        [],
        "worker rank addresses HOST:PORT, ordered by rank (comma separated on the CLI)",
        section=_SERVICE,
        metavar="HOST:PORT,...",
    )
    scheduler_id: str = setting(
        "mmcast-scheduler", "name sent in the handshake; ranks may accept only this name", section=_SERVICE
    )
    group_deadline_seconds: float = setting(
        60.0,
        "how long requests wait for a lost worker group to return before failing with UNAVAILABLE",
        min=0.0,
        max=86400.0,
        section=_SERVICE,
    )
    step_timeout_seconds: float = setting(
        120.0,
        "how long a step may take on the ranks before the group counts as lost",
        min=0.1,
        max=86400.0,
        section=_SERVICE,
    )
    drain_seconds: float = setting(
        30.0, "grace period for in-flight requests on shutdown", min=0.0, max=86400.0, section=_SERVICE
    )
    keepalive_seconds: float = setting(
        10.0, "idle time before a keepalive on a rank stream; two missed = lost", min=0.1, max=3600.0, section=_SERVICE
    )
    reconnect_backoff_initial_seconds: float = setting(
        0.2, "first delay between reconnect attempts to a rank", min=0.001, max=3600.0, section=_SERVICE
    )
    reconnect_backoff_max_seconds: float = setting(
        2.0, "largest delay between reconnect attempts (doubling)", min=0.001, max=3600.0, section=_SERVICE
    )
    log_level: str = setting("info", "level of the JSON logs", choices=LOG_LEVELS, section=_SERVICE)

    # --- security (docs/SECURITY.md); secrets are file paths, as Kubernetes mounts Secrets --------------------------
    tls_cert_file: str = tls_settings.cert_file(
        "PEM certificate (chain) of the client port; set with --tls-key-file to serve TLS; re-read when it changes"
    )
    tls_key_file: str = tls_settings.key_file()
    tls_client_ca_file: str = tls_settings.client_ca_file(
        "PEM CA bundle: clients must present a certificate it signed (mutual TLS); needs --tls-cert-file"
    )
    auth_tokens_file: str = setting(
        "",
        "bearer tokens: lines '<tenant> <token>' or a JSON object {token: tenant}; set = every "
        "mmcast.v1.GenerationService call needs 'authorization: Bearer <token>' (health and reflection stay open); "
        "uploads and caches are scoped per tenant; re-read when the file changes",
        section=_SECURITY,
        metavar="FILE",
    )
    health_port: int = setting(
        0,
        "also serve grpc.health.v1 alone, in plaintext, on this port (for probes that cannot speak TLS; 0 = off)",
        min=0,
        max=65535,
        section=_SECURITY,
    )
    worker_tls_ca_file: str = setting(
        "",
        "PEM CA bundle that signed the ranks' certificates; set = TLS to the ranks",
        section=_SECURITY,
        metavar="PEM",
    )
    worker_tls_cert_file: str = setting(
        "",
        "PEM client certificate presented to the ranks (mutual TLS); with --worker-tls-key-file",
        section=_SECURITY,
        metavar="PEM",
    )
    worker_tls_key_file: str = setting(
        "", "PEM private key of --worker-tls-cert-file", section=_SECURITY, metavar="PEM"
    )
    worker_tls_server_name: str = setting(
        "",
        "name to verify in the ranks' certificates instead of the host of each --workers address",
        section=_SECURITY,
        metavar="NAME",
    )
    worker_token_file: str = setting(
        "",
        "file holding the token sent on every Step stream (the ranks' --shared-token-file)",
        section=_SECURITY,
        metavar="FILE",
    )

    def __post_init__(self) -> None:
        settings.check_fields(self)  # types, ranges, choices (any case), comma-separated lists
        self._check_image_formats()
        for i, address in enumerate(self.workers):
            if not isinstance(address, str) or ":" not in address or not address.rsplit(":", 1)[1].isdigit():
                raise ValueError(f"workers[{i}]={address!r} (--workers): must be HOST:PORT")
        if not self.metrics_host or not all(c.isalnum() or c in ".-_:" for c in self.metrics_host):
            raise ValueError(
                f"metrics_host={self.metrics_host!r} must be a host name or IP address without a port (--metrics-host)"
            )
        self._check_secret_files()
        self._check_media()
        if self.reconnect_backoff_max_seconds < self.reconnect_backoff_initial_seconds:
            raise ValueError(
                f"reconnect_backoff_max_seconds={self.reconnect_backoff_max_seconds} (--reconnect-backoff-max-seconds) "
                f"must be >= "
                f"reconnect_backoff_initial_seconds={self.reconnect_backoff_initial_seconds}"
            )

    def _check_image_formats(self) -> None:
        """Names Pillow can open (upper case); the list is never empty."""
        self.image_formats = [str(f).upper() for f in self.image_formats]
        if not self.image_formats:
            raise ValueError("image_formats is empty: allow at least one format (--image-formats JPEG,PNG)")
        from PIL import Image

        Image.init()
        unknown = [f for f in self.image_formats if f not in Image.OPEN]
        if unknown:
            raise ValueError(
                f"image_formats={','.join(unknown)} unknown to Pillow; choose from {','.join(sorted(Image.OPEN))}"
            )

    def _check_media(self) -> None:
        """Host names and CIDRs parse and the local media directory exists, so a typo fails at start-up rather than
        as every request's refusal. The rules themselves are scheduler_svc/media_domains.py's."""
        try:
            self.allowed_media_domains = [normalize_domain(str(d)) for d in self.allowed_media_domains]
        except ValueError as exc:
            raise ValueError(f"allowed_media_domains (--allowed-media-domains): {exc}") from None
        for cidr in self.allowed_media_networks:
            try:
                ipaddress.ip_network(str(cidr), strict=False)
            except ValueError:
                raise ValueError(
                    f"allowed_media_networks={cidr!r} (--allowed-media-networks): not a CIDR such as "
                    "10.0.0.0/8 or fd00::/8"
                ) from None
        if self.allowed_local_media_path and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(
                f"allowed_local_media_path={self.allowed_local_media_path!r} "
                "(--allowed-local-media-path): no such directory"
            )

    def _check_secret_files(self) -> None:
        """Pairs come together and named files exist; their contents are checked when the server starts."""
        tls_settings.check_server_tls(self)
        tls_settings.check_pair(self, prefix="worker_")
        for f in dataclasses.fields(self):
            if f.name.endswith("_file") and getattr(self, f.name) and not os.path.isfile(getattr(self, f.name)):
                raise ValueError(f"{f.name}={getattr(self, f.name)!r}: no such file ({settings.flag_of(f)})")

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


def build_parser() -> argparse.ArgumentParser:
    """``mmcast-scheduler``'s command line: a flag per ``SchedulerConfig`` field, ``--version``, ``--print-config``."""
    return settings.build_parser(SchedulerConfig, prog=PROG, description=DESCRIPTION)


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> SchedulerConfig:
    """Flags over environment over defaults. A bad flag exits 2 (argparse); anything else raises ValueError naming
    the setting or variable."""
    return settings.load(SchedulerConfig, build_parser(), argv, environ)
