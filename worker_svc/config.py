"""Configuration of one worker rank: a validated dataclass, and its command line / environment form.

Every setting is a flag ``--kebab-name`` and an environment variable ``MMCAST_UPPER_SNAKE`` (for Kubernetes);
a flag wins over the variable, the variable over the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping, Sequence

from common.process import default_threads

_DEVICES = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOG_LEVELS = ("debug", "info", "warning", "error")
_HOST = re.compile(r"^[A-Za-z0-9_.\-:]*$")
_ADDR = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]*):\d{1,5}$")


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """One rank of the tensor-parallel worker group."""

    model: str  # model folder (config, weights, processor, tokenizer); loaded with from_pretrained
    rank: int = 0  # this process's rank in [0, world_size)
    world_size: int = 1  # tensor-parallel size; every rank loads its shard of the decoder
    listen: str = "0.0.0.0:50061"  # gRPC address of the WorkerService (port 0: pick a free one)
    dist_init: str = ""  # torch.distributed init method, e.g. tcp://rank0-host:29500; required when world_size > 1
    dist_bind_host: str = ""  # address rank 0's tcp:// rendezvous store binds; empty: every interface (torch's own)
    device: str = "auto"  # auto (cuda when available, else cpu), cpu, cuda, cuda:N
    dtype: str = "auto"  # auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16, float16
    kv_blocks: int = 1024  # blocks in the KV pool; the scheduler's prefix cache has exactly this many
    block_size: int = 16  # tokens per KV block; must equal the scheduler's
    metrics_port: int = 0  # Prometheus /metrics port; 0 disables the endpoint
    metrics_host: str = "0.0.0.0"  # address /metrics binds (serve-local: 127.0.0.1)
    payload_cache_bytes: int = 2 << 30  # bytes of received payload tensors the rank keeps until told to evict
    encoder_cache_tokens: int = 65536  # encoder-output rows (LLM tokens) the rank keeps until told to evict
    max_tensor_bytes: int = 256 << 20  # largest single payload tensor accepted
    scheduler_id: str = ""  # accept only this scheduler's streams when set; any scheduler when empty
    group_timeout_seconds: float = 60.0  # torch.distributed timeout: a lost peer ends the rank after this long
    threads: int = 0  # torch intra-op threads (CPU); 0: this process's CPUs / local_ranks (resolved at start)
    local_ranks: int = 1  # ranks sharing this process's CPUs (serve-local sets it); divides the default threads
    log_level: str = "info"
    tls_cert_file: str = ""  # PEM certificate of the Step port; with tls_key_file the port serves TLS only
    tls_key_file: str = ""  # PEM private key of tls_cert_file
    tls_client_ca_file: str = ""  # PEM CA: a scheduler must present a certificate it signed (mutual TLS)
    shared_token_file: str = ""  # file with the token every Step stream must carry (authorization: Bearer ...)
    health_port: int = 0  # also serve grpc.health.v1 alone, in plaintext, on this port (0: off)
    # Serve Step streams to any peer that reaches the port, without a token or a client certificate. Only for a
    # port nothing untrusted can reach; a rank refuses to start without authentication unless this is set.
    insecure_allow_unauthenticated: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, value: object, allowed: str) -> ValueError:
            flag = "--" + name.replace("_", "-")
            return ValueError(f"{name}={value!r} ({flag}): must be {allowed}")

        if not self.model:
            raise bad("model", self.model, "a model folder path")
        if self.world_size < 1 or self.world_size > 1024:
            raise bad("world_size", self.world_size, "in [1, 1024]")
        if not 0 <= self.rank < self.world_size:
            raise bad("rank", self.rank, f"in [0, {self.world_size - 1}] (world_size={self.world_size})")
        if not _ADDR.match(self.listen):
            raise bad("listen", self.listen, "HOST:PORT (e.g. 0.0.0.0:50061, [::]:50061, localhost:0)")
        if self.world_size > 1 and not self.dist_init.startswith(("tcp://", "file://", "env://")):
            raise bad("dist_init", self.dist_init, "tcp://HOST:PORT, file://PATH or env:// when world_size > 1")
        if not _DEVICES.match(self.device):
            raise bad("device", self.device, "auto, cpu, cuda or cuda:N")
        if self.dtype not in _DTYPES:
            raise bad("dtype", self.dtype, f"one of {', '.join(_DTYPES)}")
        if not 1 <= self.kv_blocks <= 1 << 24:
            raise bad("kv_blocks", self.kv_blocks, f"in [1, {1 << 24}]")
        if not 1 <= self.block_size <= 1024:
            raise bad("block_size", self.block_size, "in [1, 1024]")
        if not 0 <= self.metrics_port <= 65535:
            raise bad("metrics_port", self.metrics_port, "in [0, 65535] (0 disables /metrics)")
        if self.payload_cache_bytes < 0:
            raise bad("payload_cache_bytes", self.payload_cache_bytes, ">= 0")
        if self.encoder_cache_tokens < 0:
            raise bad("encoder_cache_tokens", self.encoder_cache_tokens, ">= 0")
        if not 1 <= self.max_tensor_bytes <= 1 << 40:
            raise bad("max_tensor_bytes", self.max_tensor_bytes, f"in [1, {1 << 40}]")
        if not 0.5 <= self.group_timeout_seconds <= 86400:
            raise bad("group_timeout_seconds", self.group_timeout_seconds, "in [0.5, 86400]")
        if not 0 <= self.threads <= 1024:
            raise bad("threads", self.threads, "in [0, 1024] (0: the CPUs available / --local-ranks)")
        if not 1 <= self.local_ranks <= 1024:
            raise bad("local_ranks", self.local_ranks, "in [1, 1024]")
        if self.threads == 0:  # a rank started alone cannot know its neighbours: --local-ranks tells it
            object.__setattr__(self, "threads", default_threads(self.local_ranks))
        if self.log_level.lower() not in _LOG_LEVELS:
            raise bad("log_level", self.log_level, f"one of {', '.join(_LOG_LEVELS)}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given = "tls_cert_file" if self.tls_cert_file else "tls_key_file"
            raise bad(given, getattr(self, given), "set together with the other of --tls-cert-file/--tls-key-file")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise bad("tls_client_ca_file", self.tls_client_ca_file, "used with --tls-cert-file and --tls-key-file")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "shared_token_file"):
            if getattr(self, name) and not os.path.isfile(getattr(self, name)):
                raise bad(name, getattr(self, name), "an existing file")
        if not 0 <= self.health_port <= 65535:
            raise bad("health_port", self.health_port, "in [0, 65535] (0: off)")
        for name in ("metrics_host", "dist_bind_host"):
            if not _HOST.match(getattr(self, name)) or (name == "metrics_host" and not self.metrics_host):
                raise bad(name, getattr(self, name), "a host name or IP address without a port (e.g. 127.0.0.1, ::1)")
        if not (self.shared_token_file or self.tls_client_ca_file or self.insecure_allow_unauthenticated):
            raise ValueError(
                "the Step port would serve any peer: set --shared-token-file FILE (a token every Step stream must "
                "carry) and/or --tls-client-ca-file PEM (mutual TLS, with --tls-cert-file/--tls-key-file); "
                "--insecure-allow-unauthenticated serves unauthenticated peers (only where nothing untrusted can reach "
                "the port); see docs/SECURITY.md"
            )


_HELP = {
    "model": "model folder (config.json, weights, processor, tokenizer)",
    "rank": "rank of this process in [0, world-size)",
    "world_size": "tensor-parallel size of the group",
    "listen": "gRPC listen address HOST:PORT",
    "dist_init": "torch.distributed init method (tcp://HOST:PORT), required when world-size > 1",
    "device": "auto | cpu | cuda | cuda:N",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: float32 on CPU, bfloat16 on CUDA)",
    "kv_blocks": "KV pool size in blocks (the scheduler's prefix-cache size)",
    "block_size": "tokens per KV block (must equal the scheduler's)",
    "metrics_port": "Prometheus /metrics port (0: off)",
    "metrics_host": "address /metrics binds (127.0.0.1 keeps it local)",
    "dist_bind_host": "address rank 0's tcp:// rendezvous store binds (empty: every interface)",
    "payload_cache_bytes": "payload-cache budget in bytes",
    "encoder_cache_tokens": "encoder-cache budget in rows (LLM tokens)",
    "max_tensor_bytes": "largest payload tensor accepted, in bytes",
    "scheduler_id": "accept only this scheduler id (empty: any)",
    "group_timeout_seconds": "process-group timeout; a lost peer ends the rank after this long",
    "threads": "torch intra-op threads (0: the CPUs this process may use, by affinity and cgroup quota, divided by "
    "--local-ranks)",
    "local_ranks": "ranks of the group sharing this machine's CPUs (serve-local sets it; divides the default threads)",
    "log_level": "debug | info | warning | error",
    "tls_cert_file": "PEM certificate of the Step port (with --tls-key-file: TLS only)",
    "tls_key_file": "PEM private key of --tls-cert-file",
    "tls_client_ca_file": "PEM CA bundle; the scheduler must present a certificate it signed (mutual TLS)",
    "shared_token_file": "file holding the token every Step stream must carry; others get UNAUTHENTICATED",
    "health_port": "also serve grpc.health.v1 alone, in plaintext, on this port (probes; 0: off)",
    "insecure_allow_unauthenticated": "serve Step streams without a token or client certificate (UNSAFE: any peer "
    "that reaches the port can drive the rank); without it a rank needs --shared-token-file or --tls-client-ca-file",
}


def env_name(field: str) -> str:
    return "MMCAST_" + field.upper()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmcast-worker",
        description="One tensor-parallel rank of the mmcast worker group (gRPC WorkerService.Step).",
    )
    for field in dataclasses.fields(WorkerConfig):
        default = "" if field.default is dataclasses.MISSING else f" (default {field.default!r})"
        flag, help_text = "--" + field.name.replace("_", "-"), f"{_HELP[field.name]}; env {env_name(field.name)}{default}"
        if str(field.type) == "bool":
            parser.add_argument(flag, dest=field.name, nargs="?", const=True, type=_parse_bool, default=None,
                                metavar="BOOL", help=help_text)
            continue
        kind = {"int": int, "float": float}.get(str(field.type), str)
        parser.add_argument(flag, dest=field.name, type=kind, default=None, help=help_text)
    return parser


def _parse_bool(raw: str) -> bool:
    if raw.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if raw.strip().lower() in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{raw!r} is not a boolean (1/true/yes/on or 0/false/no/off)")


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> WorkerConfig:
    """Flags over environment over defaults. Raises ValueError naming the setting on bad input."""
    environ = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(argv))
    values: dict[str, object] = {}
    for field in dataclasses.fields(WorkerConfig):
        value = args.get(field.name)
        if value is None and env_name(field.name) in environ:
            raw = environ[env_name(field.name)]
            kind = {"int": int, "float": float, "bool": _parse_bool}.get(str(field.type), str)
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{env_name(field.name)}={raw!r}: not a valid {field.type}") from None
        if value is not None:
            values[field.name] = value
    if "model" not in values:
        raise ValueError(f"model: required (--model DIR or {env_name('model')})")
    return WorkerConfig(**values)  # type: ignore[arg-type]
