"""The scheduler's service and security settings (ports, deadlines, TLS, tokens): the third part of
``SchedulerConfig`` (config.py)."""

from __future__ import annotations

import dataclasses

from common import tls_settings
from common.settings import LOG_LEVELS, setting
from scheduler_svc.config_limits import INT_MAX, SECURITY, SERVICE


@dataclasses.dataclass
class ServiceSettings:
    """The ports, deadlines, reconnects, logging and the secrets the service reads."""

    # --- service --------------------------------------------------------------------------------------------------
    listen: str = setting(
        "[::]:50051",
        "address the client API listens on (HOST:PORT; port 0 picks one)",
        section=SERVICE,
        metavar="HOST:PORT",
    )
    http_port: int = setting(
        0,
        "port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health) on the "
        "host of --listen, with the client port's TLS and tokens (0 = off)",
        min=0,
        max=65535,
        section=SERVICE,
    )
    http_header_timeout_seconds: float = setting(
        10.0,
        "an HTTP request's headers must be complete this long after the connection opens (or after the next "
        "request's first byte); otherwise 408 and the connection is closed (slow or idle clients)",
        min=0.1,
        max=3600.0,
        section=SERVICE,
    )
    http_write_timeout_seconds: float = setting(
        30.0,
        "an HTTP response (a stream too) whose client reads nothing for this long is aborted and its request cancelled",
        min=0.1,
        max=86400.0,
        section=SERVICE,
    )
    served_model_name: str = setting(
        "",
        "the model name the HTTP API answers to and lists in /v1/models (default: the model folder's name)",
        section=SERVICE,
        metavar="NAME",
    )
    kv_events_endpoint: str = setting(
        "",
        "ZeroMQ endpoint to publish prefix-cache events on, in vLLM's KV-event format (e.g. tcp://*:5557; "
        "scheduler_svc/transport/kv_events.py); empty = off",
        section=SERVICE,
        metavar="ENDPOINT",
    )
    kv_events_topic: str = setting(
        "", "topic frame of every KV-event message (vLLM's default: empty)", section=SERVICE, metavar="TOPIC"
    )
    kv_events_queue: int = setting(
        100_000,
        "KV events queued for the publisher at most; when full they are replaced by one AllBlocksCleared, "
        "so the step loop never waits for a subscriber",
        min=1,
        max=INT_MAX,
        section=SERVICE,
    )
    metrics_port: int = setting(
        9400, "port of the Prometheus /metrics endpoint (0 = disabled)", min=0, max=65535, section=SERVICE
    )
    metrics_host: str = setting(
        "0.0.0.0", "address the /metrics endpoint binds (127.0.0.1 keeps it local)", section=SERVICE, metavar="HOST"
    )
    workers: list = setting(
        [],
        "worker rank addresses HOST:PORT, ordered by rank (comma separated on the CLI); local:PATH opens the Step "
        "stream on the Unix-domain socket a rank on this machine serves with --step-socket PATH (no TLS there: the "
        "token of --worker-token-file guards it)",
        section=SERVICE,
        metavar="HOST:PORT,...",
    )
    scheduler_id: str = setting(
        "mmcast-scheduler", "name sent in the handshake; ranks may accept only this name", section=SERVICE
    )
    group_deadline_seconds: float = setting(
        60.0,
        "how long requests wait for a lost worker group to return before failing with UNAVAILABLE",
        min=0.0,
        max=86400.0,
        section=SERVICE,
    )
    step_timeout_seconds: float = setting(
        120.0,
        "how long a step may take on the ranks before the group counts as lost",
        min=0.1,
        max=86400.0,
        section=SERVICE,
    )
    drain_seconds: float = setting(
        30.0, "grace period for in-flight requests on shutdown", min=0.0, max=86400.0, section=SERVICE
    )
    keepalive_seconds: float = setting(
        10.0, "idle time before a keepalive on a rank stream; two missed = lost", min=0.1, max=3600.0, section=SERVICE
    )
    reconnect_backoff_initial_seconds: float = setting(
        0.2, "first delay between reconnect attempts to a rank", min=0.001, max=3600.0, section=SERVICE
    )
    reconnect_backoff_max_seconds: float = setting(
        2.0, "largest delay between reconnect attempts (doubling)", min=0.001, max=3600.0, section=SERVICE
    )
    log_level: str = setting("info", "level of the JSON logs", choices=LOG_LEVELS, section=SERVICE)

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
        section=SECURITY,
        metavar="FILE",
    )
    health_port: int = setting(
        0,
        "also serve grpc.health.v1 alone, in plaintext, on this port (for probes that cannot speak TLS; 0 = off)",
        min=0,
        max=65535,
        section=SECURITY,
    )
    worker_tls_ca_file: str = setting(
        "",
        "PEM CA bundle that signed the ranks' certificates; set = TLS to the ranks",
        section=SECURITY,
        metavar="PEM",
    )
    worker_tls_cert_file: str = setting(
        "",
        "PEM client certificate presented to the ranks (mutual TLS); with --worker-tls-key-file",
        section=SECURITY,
        metavar="PEM",
    )
    worker_tls_key_file: str = setting("", "PEM private key of --worker-tls-cert-file", section=SECURITY, metavar="PEM")
    worker_tls_server_name: str = setting(
        "",
        "name to verify in the ranks' certificates instead of the host of each --workers address",
        section=SECURITY,
        metavar="NAME",
    )
    worker_token_file: str = setting(
        "",
        "file holding the token sent on every Step stream (the ranks' --shared-token-file)",
        section=SECURITY,
        metavar="FILE",
    )
