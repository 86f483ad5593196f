"""Configuration of one worker rank: a validated dataclass, and its command line / environment form.

Every field is a ``common.settings.setting``, from which ``build_parser``/``load_config`` generate the flag
``--kebab-name`` and the environment variable ``MMCAST_UPPER_SNAKE`` (for Kubernetes) — the same mechanism as the
scheduler's (scheduler_svc/config.py): a flag wins over the variable, the variable over the default, choices take
any case.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping, Sequence

from common import settings, tls_settings
from common.process import default_threads
from common.settings import LOG_LEVELS, invalid, setting

_DEVICES = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_HOST = re.compile(r"^[A-Za-z0-9_.\-:]*$")
_ADDR = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]*):\d{1,5}$")
# --help sections
_GROUP, _CACHES, _SERVICE = "model and group", "caches", "service"
_SECURITY = tls_settings.SECURITY
PROG = "mmcast-worker"
DESCRIPTION = "One tensor-parallel rank of the mmcast worker group (gRPC WorkerService.Step)."


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """One rank of the tensor-parallel worker group."""

    # --- model and group ----------------------------------------------------------------------------------------
    model: str = setting(
        help="model folder (config.json, weights, processor, tokenizer); loaded with from_pretrained",
        section=_GROUP,
        metavar="DIR",
    )
    rank: int = setting(0, "rank of this process in [0, world-size)", min=0, section=_GROUP)
    world_size: int = setting(
        1,
        "tensor-parallel size of the group; every rank loads its shard of the decoder",
        min=1,
        max=1024,
        section=_GROUP,
    )
    dist_init: str = setting(
        "",
        "torch.distributed init method (tcp://HOST:PORT, file://PATH, env://), required when world-size > 1",
        section=_GROUP,
        metavar="URL",
    )
    dist_bind_host: str = setting(
        "",
        "address rank 0's tcp:// rendezvous store binds (empty: every interface, torch's own)",
        section=_GROUP,
        metavar="HOST",
    )
    group_timeout_seconds: float = setting(
        60.0,
        "torch.distributed timeout: a lost peer ends the rank after this long",
        min=0.5,
        max=86400,
        section=_GROUP,
    )
    device: str = setting(
        "auto",
        "auto (cuda when available, else cpu), cpu, cuda or cuda:N",
        section=_GROUP,
        metavar="{auto,cpu,cuda,cuda:N}",
    )
    dtype: str = setting(
        "auto", "weights and activations (auto: float32 on CPU, bfloat16 on CUDA)", choices=_DTYPES, section=_GROUP
    )
    cpu_linear: str = setting(
        "auto",
        "decoder linear layers of a one-rank float32 CPU group: onednn (every weight packed for oneDNN, faster "
        "at decode batch sizes from ~0.5M weights up), auto (only those of at least 300k weights; smaller "
        "products run faster dense) or dense (PyTorch's own layout); other ranks are always dense",
        choices=("auto", "onednn", "dense"),
        section=_GROUP,
    )
    attention_backend: str = setting(
        "auto",
        "the decoder's attention over the KV pool: cpu (batched decode matmuls, SDPA per prefill window), sdpa "
        "(flash-attn's varlen kernel where importable on CUDA with a half-precision pool, else torch SDPA) or "
        "auto (cpu on a CPU rank, sdpa on a CUDA one)",
        choices=("auto", "cpu", "sdpa"),
        section=_GROUP,
    )
    threads: int = setting(
        0,
        "torch intra-op threads (0: the CPUs this process may use, by affinity and cgroup quota, less "
        "--reserved-cpus, divided by --local-ranks, at least 1; resolved at start)",
        min=0,
        max=1024,
        section=_GROUP,
    )
    encoder_threads: int = setting(
        0,
        "torch intra-op threads while the vision encoder runs (0: as an explicit --threads; with --threads 0, the "
        "CPUs this process may use divided by --local-ranks, those --reserved-cpus keeps for the scheduler "
        "included: a step that encodes new images is one the scheduler waits for; resolved at start). The "
        "language model's steps keep --threads",
        min=0,
        max=1024,
        section=_GROUP,
    )
    reserved_cpus: int = setting(
        0,
        "CPUs the default --threads leaves to other processes on the machine (serve-local sets 1: its scheduler "
        "and clients run beside the ranks, and a rank's parallel regions stall on every descheduled thread)",
        min=0,
        max=1024,
        section=_GROUP,
    )
    cpu_allreduce: str = setting(
        "auto",
        "all-reduce of CPU ranks: auto (through shared memory where every rank of the group can open one "
        "segment under /dev/shm, gloo otherwise) or gloo (always over loopback/network TCP)",
        choices=("auto", "gloo"),
        section=_GROUP,
    )
    local_ranks: int = setting(
        1,
        "ranks of the group sharing this machine's CPUs (serve-local sets it; divides the default threads)",
        min=1,
        max=1024,
        section=_GROUP,
    )

    # --- caches -------------------------------------------------------------------------------------------------
    kv_blocks: int = setting(
        0,
        "KV pool size in blocks (the scheduler's prefix cache has exactly this many); 0: sized from the memory "
        "available after the model loads, by --kv-cache-memory-fraction and --kv-cache-max-bytes",
        min=0,
        max=1 << 24,
        section=_CACHES,
    )
    kv_cache_memory_fraction: float = setting(
        0.5,
        "share of the memory available after the model loads that the KV pool takes when --kv-blocks is 0 (CUDA: "
        "the device's free memory; CPU: MemAvailable or the cgroup's limit, divided among --local-ranks)",
        min=0.001,
        max=1.0,
        section=_CACHES,
    )
    kv_cache_max_bytes: int = setting(
        1 << 30,
        "most bytes the KV pool takes when sized from free memory (0: no cap; raise it on a machine of its own)",
        min=0,
        section=_CACHES,
    )
    block_size: int = setting(16, "tokens per KV block (must equal the scheduler's)", min=1, max=1024, section=_CACHES)
    payload_cache_bytes: int = setting(
        2 << 30,
        "bytes of received payload tensors the rank keeps until the scheduler tells it to evict",
        min=0,
        section=_CACHES,
    )
    encoder_cache_tokens: int = setting(
        65536,
        "encoder-output rows (LLM tokens) the rank keeps until the scheduler tells it to evict",
        min=0,
        section=_CACHES,
    )
    max_tensor_bytes: int = setting(
        256 << 20, "largest single payload tensor accepted, in bytes", min=1, max=1 << 40, section=_CACHES
    )

    # --- service ------------------------------------------------------------------------------------------------
    listen: str = setting(
        "0.0.0.0:50061",
        "gRPC address of the WorkerService (HOST:PORT; port 0 picks one)",
        section=_SERVICE,
        metavar="HOST:PORT",
    )
    step_socket: str = setting(
        "",
        "also serve the Step stream on a Unix-domain socket at this absolute path (mode 0600), for a scheduler on "
        "this machine (its --workers entry local:PATH): the same messages without gRPC's per-message threads; needs "
        "--shared-token-file, which every stream's hello must carry (empty: off)",
        section=_SERVICE,
        metavar="PATH",
    )
    metrics_port: int = setting(0, "Prometheus /metrics port (0: off)", min=0, max=65535, section=_SERVICE)
    metrics_host: str = setting(
        "0.0.0.0", "address /metrics binds (127.0.0.1 keeps it local)", section=_SERVICE, metavar="HOST"
    )
    scheduler_id: str = setting("", "accept only this scheduler's streams (empty: any)", section=_SERVICE)
    late_mask_timeout_seconds: float = setting(
        60.0,
        "rank 0's longest wait for the token masks a step announced to come later (async scheduling of constrained "
        "requests); past it the step is refused as a protocol error",
        min=0.1,
        max=3600,
        section=_SERVICE,
    )
    inline_step_max_ms: float = setting(
        20.0,
        "on a rank of one intra-op thread (--threads 1, serve-local's default on 2 CPUs), steps of running requests "
        "alone whose size recently took at most this long run on its event-loop thread, sparing two thread "
        "hand-overs per step; the loop answers nothing else meanwhile (0: every step on the compute thread)",
        min=0,
        max=1000,
        section=_SERVICE,
    )
    log_level: str = setting("info", "level of the JSON logs", choices=LOG_LEVELS, section=_SERVICE)

    # --- security -----------------------------------------------------------------------------------------------
    tls_cert_file: str = tls_settings.cert_file(
        "PEM certificate of the Step port (with --tls-key-file: TLS only); re-read when it changes"
    )
    tls_key_file: str = tls_settings.key_file()
    tls_client_ca_file: str = tls_settings.client_ca_file(
        "PEM CA bundle; the scheduler must present a certificate it signed (mutual TLS)"
    )
    shared_token_file: str = setting(
        "",
        "file holding the token every Step stream must carry (authorization: Bearer ...); others get UNAUTHENTICATED",
        section=_SECURITY,
        metavar="FILE",
    )
    health_port: int = setting(
        0,
        "also serve grpc.health.v1 alone, in plaintext, on this port (probes; 0: off)",
        min=0,
        max=65535,
        section=_SECURITY,
    )
    # Only for a port nothing untrusted can reach; a rank refuses to start without authentication unless this is set.
    insecure_allow_unauthenticated: bool = setting(
        False,
        "serve Step streams without a token or client certificate (UNSAFE: any peer that reaches the port can "
        "drive the rank); without it a rank needs --shared-token-file or --tls-client-ca-file",
        section=_SECURITY,
    )

    def __post_init__(self) -> None:
        settings.check_fields(self)  # types, ranges, choices (any case)
        if not self.model:
            raise invalid("model", self.model, "a model folder path")
        if not self.rank < self.world_size:
            raise invalid("rank", self.rank, f"in [0, {self.world_size - 1}] (world_size={self.world_size})")
        if not _ADDR.match(self.listen):
            raise invalid("listen", self.listen, "HOST:PORT (e.g. 0.0.0.0:50061, [::]:50061, localhost:0)")
        if self.world_size > 1 and not self.dist_init.startswith(("tcp://", "file://", "env://")):
            raise invalid("dist_init", self.dist_init, "tcp://HOST:PORT, file://PATH or env:// when world_size > 1")
        if not _DEVICES.match(self.device):
            raise invalid("device", self.device, "auto, cpu, cuda or cuda:N")
        auto_threads = self.threads == 0
        if auto_threads:  # a rank started alone cannot know its neighbours: --local-ranks tells it
            object.__setattr__(self, "threads", default_threads(self.local_ranks, reserved=self.reserved_cpus))
        if self.encoder_threads == 0:  # an explicit --threads holds for the encoder too
            encoder = default_threads(self.local_ranks) if auto_threads else self.threads
            object.__setattr__(self, "encoder_threads", max(self.threads, encoder))
        self._check_security()
        if self.step_socket:
            if not os.path.isabs(self.step_socket) or len(self.step_socket.encode()) > 100:
                raise invalid("step_socket", self.step_socket, "an absolute path of at most 100 bytes")
            if not (self.shared_token_file or self.insecure_allow_unauthenticated):
                raise ValueError(
                    f"step_socket={self.step_socket!r} (--step-socket) needs --shared-token-file: a client certificate "
                    "cannot be checked on a Unix-domain socket, and the token is what a local stream must carry"
                )
        for name in ("metrics_host", "dist_bind_host"):
            if not _HOST.match(getattr(self, name)) or (name == "metrics_host" and not self.metrics_host):
                raise invalid(
                    name, getattr(self, name), "a host name or IP address without a port (e.g. 127.0.0.1, ::1)"
                )
        if not (self.shared_token_file or self.tls_client_ca_file or self.insecure_allow_unauthenticated):
            raise ValueError(
                "the Step port would serve any peer: set --shared-token-file FILE (a token every Step stream must "
                "carry) and/or --tls-client-ca-file PEM (mutual TLS, with --tls-cert-file/--tls-key-file); "
                "--insecure-allow-unauthenticated serves unauthenticated peers (only where nothing untrusted can reach "
                "the port); see docs/SECURITY.md"
            )

    def _check_security(self) -> None:
        """Pairs come together and named files exist; their contents are checked when the server starts."""
        tls_settings.check_server_tls(self)
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "shared_token_file"):
            if getattr(self, name) and not os.path.isfile(getattr(self, name)):
                raise invalid(name, getattr(self, name), "an existing file")


def build_parser() -> argparse.ArgumentParser:
    """``mmcast-worker``'s command line: a flag per ``WorkerConfig`` field, ``--version``, ``--print-config``."""
    return settings.build_parser(WorkerConfig, prog=PROG, description=DESCRIPTION)


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> WorkerConfig:
    """Flags over environment over defaults. A bad flag exits 2 (argparse); anything else raises ValueError naming
    the setting or variable."""
    return settings.load(WorkerConfig, build_parser(), argv, environ)
