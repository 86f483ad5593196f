"""``mmcast-worker``: one rank of the worker group as a process.

Start-up order: allocator environment (re-exec), JSON logs, ``/metrics``, the gRPC server with liveness SERVING
at once (service ""), then the process group and the model on the compute thread; the readiness of
``mmcast.v1.WorkerService`` turns SERVING only after both. A failure there ends the process non-zero with one
JSON line saying why. Problems a restart cannot cure (bad flags, a checkpoint whose ``config.json`` the rules of
``common/model_checks.py`` reject for this ``--world-size``, a model that does not load) end it with
``EXIT_STARTUP_FAILURE`` and one cause line, before any port is bound where the check needs only ``config.json``;
a group that cannot form (a peer missing or late) ends it with ``EXIT_GROUP_NOT_FORMED``, which a supervisor may
retry.

Security (docs/SECURITY.md): with ``--tls-cert-file``/``--tls-key-file`` the port serves TLS only, and with
``--tls-client-ca-file`` only a scheduler presenting a certificate signed by that CA completes the handshake;
with ``--shared-token-file`` a Step stream without ``authorization: Bearer <token>`` ends with UNAUTHENTICATED
before its first frame is read. A rank starts only with one of the two, or with ``--insecure-allow-unauthenticated``
(logged as a warning). Health and reflection stay open; ``--health-port`` serves health alone in plaintext for
TLS-less probes. Readiness turns NOT_SERVING while the last scheduler handshake was refused and no stream is
active (``worker_svc/worker.py``), so an orchestrator sees a rank its scheduler cannot use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import tls, tracing
from common.auth import BearerTokenInterceptor, TokenTable, read_token_file
from common.grpc_metrics import AioServerMetricsInterceptor
from common.local_stream import LocalStepServer
from common.model_checks import ModelConfigError, check_checkpoint
from common.parse_guard import ParseGuardInterceptor
from common.process import ensure_allocator_env, freeze_startup_heap, setup_logging, startup_failure
from mmcast.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.config import WorkerConfig, load_config
from worker_svc.kv_sizing import PoolSizeError
from worker_svc.metrics import WorkerMetrics

log = logging.getLogger("mmcast.worker")

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
EXIT_GROUP_NOT_FORMED = 1  # like a crash: the rendezvous failed (a peer died or is late); a restart may cure it
_MAX_MESSAGE_BYTES = 256 << 20  # a payload frame carries one chunk (~1 MiB); a control frame stays far below this


@dataclasses.dataclass
class RunningWorker:
    """A started rank: its gRPC server (already answering liveness) and the worker behind it."""

    server: grpc.aio.Server
    worker: object  # worker_svc.worker.Worker
    health: health.aio.HealthServicer
    metrics: WorkerMetrics
    port: int
    health_server: grpc.aio.Server | None = None  # plaintext health-only server (--health-port)
    local_server: LocalStepServer | None = None  # the Step stream on a Unix-domain socket (--step-socket)


async def start(config: WorkerConfig) -> RunningWorker:
    """Starts /metrics and the gRPC server; liveness SERVING, readiness NOT_SERVING until ``load``."""
    from prometheus_client import start_http_server

    from worker_svc.servicer import WorkerServicer
    from worker_svc.worker import Worker

    credentials = tls.server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    metrics = WorkerMetrics()
    step_service = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]
    interceptors = [AioServerMetricsInterceptor(metrics.registry, services=[step_service])]
    tokens = None
    if config.shared_token_file:
        token = read_token_file(config.shared_token_file, "--shared-token-file")
        tokens = TokenTable.single(token, "scheduler")
        interceptors.append(BearerTokenInterceptor(tokens, (f"/{SERVICE_NAME}/",)))
    interceptors.append(ParseGuardInterceptor())
    if not (config.shared_token_file or config.tls_client_ca_file):
        log.warning(
            "INSECURE: --insecure-allow-unauthenticated is set; any peer that reaches the Step port can open a stream, "
            "claim a scheduler epoch and drive this rank. Use --shared-token-file or mutual TLS (docs/SECURITY.md)",
            extra={"listen": config.listen},
        )
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.metrics_host, registry=metrics.registry)
    worker = Worker(config, metrics)
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ],
    )
    health_servicer = health.aio.HealthServicer()

    async def report_readiness(ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        await health_servicer.set(SERVICE_NAME, status)

    servicer = WorkerServicer(worker, metrics, report_readiness)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    if credentials is not None:
        port = server.add_secure_port(config.listen, credentials)
    else:
        port = server.add_insecure_port(config.listen)
    await server.start()
    local_server = None
    if config.step_socket:  # the same servicer, its streams checked against the same token
        local_server = LocalStepServer(
            config.step_socket, servicer, worker_pb2.StepRequest.FromString, tokens, _MAX_MESSAGE_BYTES
        )
        try:
            await local_server.start()
        except Exception:
            await server.stop(0)
            raise
    health_server = None
    if config.health_port:
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_server.add_insecure_port(f"{config.listen.rsplit(':', 1)[0]}:{config.health_port}")
        await health_server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info(
        "listening",
        extra={"port": port, "rank": config.rank, "world_size": config.world_size, "metrics_port": config.metrics_port},
    )
    return RunningWorker(server, worker, health_servicer, metrics, port, health_server, local_server)


async def load(running: RunningWorker, freeze: bool = False) -> None:
    """Forms the group and loads the model on the compute thread, then reports readiness. Raises on failure.
    ``freeze``: the process is this rank alone (``serve``), so its start-up heap is frozen before it serves (an
    in-process rank beside other work, as the tests run one, leaves its host's collector alone)."""
    worker = running.worker
    await asyncio.wrap_future(worker.on_compute(worker.load))
    if worker.loop_computes:  # this thread's torch work (worker_svc/inline_steps.py) on the rank's one thread too
        import torch

        torch.set_num_threads(worker.config.threads)
    if freeze:
        freeze_startup_heap(log)
    await running.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    log.info("ready", extra={"rank": worker.config.rank, "device": str(worker.runner.device)})


async def serve(config: WorkerConfig) -> int:
    try:
        running = await start(config)
    except Exception as exc:  # e.g. the port is taken
        return startup_failure(log, f"cannot serve --listen {config.listen}: {exc}", rank=config.rank)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await load(running, freeze=True)
    except Exception as exc:
        await running.server.stop(0)
        if running.local_server is not None:
            await running.local_server.close()
        if running.worker.group is None:  # Worker.load forms the group before it loads the model
            log.critical(
                "start-up failed: could not form the group",
                extra={"error": repr(exc), "dist_init": config.dist_init, "rank": config.rank},
            )
            return EXIT_GROUP_NOT_FORMED
        cause = f"could not load the model from --model {config.model}: {type(exc).__name__}: {exc}"
        if isinstance(exc, PoolSizeError):  # the model loaded; the settings leave its KV pool no room
            cause = str(exc)
        return startup_failure(log, cause, rank=config.rank)
    await stop.wait()
    log.info("shutting down", extra={"rank": config.rank})
    await running.health.enter_graceful_shutdown()
    if running.local_server is not None:
        await running.local_server.close()
    await running.server.stop(grace=5)
    if running.health_server is not None:
        await running.health_server.stop(grace=None)
    running.worker.executor.shutdown(wait=False, cancel_futures=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:  # before the re-exec, so --help, --version and --print-config answer at once
        config = load_config(argv)
    except ValueError as exc:  # the scheduler reports it the same way (scheduler_svc/main.py)
        setup_logging("worker")
        return startup_failure(log, f"bad configuration: {exc}")
    ensure_allocator_env()
    setup_logging("worker", config.log_level)
    try:
        tracing.configure("worker", rank=config.rank)
    except tracing.TracingError as exc:
        return startup_failure(log, str(exc), rank=config.rank)
    try:  # config.json alone, before any port or weight
        check_checkpoint(config.model, config.world_size, "--world-size")
    except ModelConfigError as exc:
        return startup_failure(log, str(exc), rank=config.rank)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
