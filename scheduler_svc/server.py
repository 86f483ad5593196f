"""Assembles the scheduler process: frontend, scheduler core, worker group, engine, gRPC server, the
OpenAI-compatible HTTP API (``--http-port``; http_server.py, on the same event loop and the same request path,
completion.py), /metrics.

Health has two levels: the server ("") is SERVING as soon as it listens (liveness); the service
``mmcast.v1.GenerationService`` is SERVING only while every rank of the group has completed its handshake (readiness).
With TLS on the client port, ``--health-port`` serves the same health service in plaintext on its own port (and
nothing else), for probes that cannot speak TLS (the kubelet's gRPC probes).

Security (docs/SECURITY.md): ``--tls-*`` files put TLS (mutual with a client CA) on the client port;
``--auth-tokens-file`` requires a bearer token on every ``mmcast.v1.GenerationService`` call and names the caller's
tenant; ``--worker-tls-*`` and ``--worker-token-file`` secure the rank streams.
Shutdown: stop accepting new requests, let in-flight ones finish within ``drain_seconds``, cancel the rest,
then close the rank streams.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from common import tls
from common.auth import BearerTokenInterceptor, TokenTable, read_token_file
from common.hashing import model_fingerprint
from common.parse_guard import ParseGuardInterceptor
from common.process import StartupError, freeze_startup_heap
from mmcast.v1 import generation_pb2, generation_pb2_grpc, worker_pb2
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.structured_output import GrammarCompiler
from scheduler_svc.doors.http_server import HttpMetrics, HttpServer
from scheduler_svc.doors.servicer import GenerationServiceServicer
from scheduler_svc.engine.completion import Completions
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.step_loop import Engine
from scheduler_svc.transport.rank_streams import WorkerGroup

log = logging.getLogger("mmcast.scheduler")

SERVICE_NAME = "mmcast.v1.GenerationService"
GUARDED_METHODS = (
    "/mmcast.v1.GenerationService/",
)  # what a bearer token is required for; health and reflection stay open


def _worker_credentials(config: SchedulerConfig) -> tuple:
    """(the rank streams' TLS files, the metadata every rank stream sends): read now, so a bad file stops the start."""
    worker_tls = tls.channel_files(
        config.worker_tls_ca_file, config.worker_tls_cert_file, config.worker_tls_key_file, prefix="--worker-"
    )
    worker_metadata = ()
    if config.worker_token_file:
        token = read_token_file(config.worker_token_file, "--worker-token-file")
        worker_metadata = (("authorization", f"Bearer {token}"),)
    elif not config.worker_tls_cert_file:
        log.warning(
            "no credentials for the rank streams (--worker-token-file, --worker-tls-cert-file): ranks that require "
            "authentication (the default) refuse this scheduler with UNAUTHENTICATED"
        )
    return worker_tls, worker_metadata


class SchedulerServer:
    """Everything one scheduler process runs; usable in-process by tests (``start``/``stop``)."""

    def __init__(self, config: SchedulerConfig, *, metrics: SchedulerMetrics | None = None) -> None:
        from scheduler_svc.core.request import Request, RequestSampling
        from scheduler_svc.core.scheduler import Scheduler
        from scheduler_svc.engine.frontend import Frontend

        self.config = config
        self.metrics = metrics or SchedulerMetrics()
        # Secrets first: a missing or malformed file stops the start before the model is loaded.
        self.server_credentials = tls.server_credentials(
            config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
        )
        self.tokens = TokenTable(config.auth_tokens_file) if config.auth_tokens_file else None
        worker_tls, worker_metadata = _worker_credentials(config)
        model_dir = Path(config.model)
        self.fingerprint = model_fingerprint(model_dir)
        self.frontend = Frontend(model_dir, config, metrics=self.metrics)
        self.uploads = self.frontend.uploads
        self.tokenizer = self.frontend.tokenizer
        self.uses_mrope = self.frontend.uses_mrope
        eos = self.frontend.eos_token_ids
        self._Request, self._RequestSampling = Request, RequestSampling

        self.kv_events = self._kv_events()  # prefix-cache events for outside pickers (--kv-events-endpoint)

        def core_factory(budget):
            return Scheduler(
                config,
                budget,
                uses_mrope=self.uses_mrope,
                eos_token_ids=eos,
                max_model_len=self.frontend.max_model_len,
                kv_events=self.kv_events.sink if self.kv_events else None,
            )

        self.group = self._worker_group(worker_tls, worker_metadata)
        self.metrics.upload_store_bytes.set_function(lambda: self.uploads.used)
        self.metrics.processor_cache_bytes.set_function(lambda: self.frontend.cache.used)
        self.metrics.upload_pending_bytes.set_function(lambda: self.uploads.pending.total)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.engine = Engine(
            group=self.group,
            core_factory=core_factory,
            metrics=self.metrics,
            group_deadline_seconds=config.group_deadline_seconds,
            model_max_len=self.frontend.max_model_len,
            keepalive_seconds=config.keepalive_seconds,
            reconnect_backoff=(config.reconnect_backoff_initial_seconds, config.reconnect_backoff_max_seconds),
            on_group_state=self._on_group_state,
            async_scheduling=config.async_scheduling,
            late_masks=config.async_grammar,
        )
        self.completions = Completions(
            engine=self.engine,
            frontend=self.frontend,
            config=config,
            tokenizer=self.tokenizer,
            make_request=self._make_request,
            grammars=GrammarCompiler(
                self.tokenizer,
                vocab_size=self.frontend.vocab_size,
                eos_token_ids=eos,
                max_grammar_bytes=config.max_grammar_bytes,
            ),
        )
        self.servicer = GenerationServiceServicer(
            completions=self.completions, uploads=self.uploads, server_info=self._server_info, tokens=self.tokens
        )
        self.http: HttpServer | None = None  # the OpenAI-compatible API, when --http-port is set
        if config.http_port:
            self.http = self._http_server()
        self.server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None
        self.health_port = 0
        self.http_port = 0
        self.port = 0
        self._health_state: dict[str, int] = {}

    def _kv_events(self):
        """The KV-event publisher every core of this process feeds through one sink; None when off."""
        config = self.config
        if not config.kv_events_endpoint:
            return None
        from scheduler_svc.transport.kv_events import KVEventPublisher, KVEventSink

        sink = KVEventSink(config.block_size, config.kv_events_queue, self.metrics)
        return KVEventPublisher(config.kv_events_endpoint, config.kv_events_topic, sink, self.metrics)

    def _worker_group(self, worker_tls, worker_metadata) -> WorkerGroup:
        config = self.config
        return WorkerGroup(
            config.workers,
            model_fingerprint=self.fingerprint,
            block_size=config.block_size,
            scheduler_id=config.scheduler_id,
            chunk_size=config.chunk_size_bytes,
            step_timeout=config.step_timeout_seconds,
            on_bytes=lambda kind, n: self.metrics.broadcast_bytes.labels(kind).inc(n),
            channel_factory=self._worker_channel_factory(worker_tls),
            call_metadata=worker_metadata,
            image_formats=config.image_formats,
            max_image_pixels=config.max_image_pixels,
            video_limits=worker_pb2.VideoDecodeLimits(
                max_bytes=config.max_upload_bytes,
                max_frame_pixels=config.max_video_frame_pixels,
                max_duration_seconds=config.max_video_seconds,
                max_total_frames=config.max_video_total_frames,
                max_sampled_frames=config.max_video_frames,
                max_streams=config.max_video_streams,
            ),
        )

    def _http_server(self) -> HttpServer:
        from scheduler_svc.doors.media_urls import MediaLoader, MediaPolicy
        from scheduler_svc.doors.openai_api import OpenAIApi

        c = self.config
        self.openai = OpenAIApi(
            completions=self.completions,
            uploads=self.uploads,
            media=MediaLoader(MediaPolicy.from_config(c)),
            model_name=self.model_name,
            tokens=self.tokens,
            max_body_bytes=c.max_request_bytes,
            metrics_registry=self.metrics.registry,
        )
        app = HttpMetrics(self.openai.app(), self.metrics)
        https = tls.https_context(c.tls_cert_file, c.tls_key_file, c.tls_client_ca_file)
        return HttpServer(
            app,
            host=c.listen.rsplit(":", 1)[0],
            port=c.http_port,
            https=https,
            header_timeout=c.http_header_timeout_seconds,
            write_timeout=c.http_write_timeout_seconds,
            on_close=lambda reason: self.metrics.http_closed.labels(reason).inc(),
        )

    @property
    def model_name(self) -> str:
        """The name both APIs report (GetServerInfo.model, /v1/models) and the HTTP API's requests must give."""
        return self.config.served_model_name or Path(self.config.model).name

    def _worker_channel_factory(self, files: tls.ChannelCertificateFiles | None):
        if files is None:
            return None  # the group's default: plaintext
        override = self.config.worker_tls_server_name

        def factory(address: str, options: list) -> grpc.aio.Channel:
            # Called on every group (re)connect: rotated CA/client-certificate files are taken then (common/tls.py).
            opts = list(options) + ([("grpc.ssl_target_name_override", override)] if override else [])
            return grpc.aio.secure_channel(address, files.credentials(), options=opts)

        return factory

    def _make_request(self, request_id, processed, sampling, cache_salt):
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        params = self._RequestSampling(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=seed,
            stop_token_ids=tuple(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            logprobs=sampling.logprobs,
            return_logprobs=sampling.return_logprobs,
            penalties=sampling.penalties.with_ending_tokens(
                set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.frontend.eos_token_ids))
            ),
        )
        return self._Request(
            request_id=request_id,
            prompt_token_ids=list(processed.token_ids),
            mm_features=list(processed.mm_features),
            sampling=params,
            cache_salt=cache_salt or None,
            arrival_time=time.monotonic(),
            image_fields=processed.image_fields,
        )

    def _server_info(self) -> generation_pb2.GetServerInfoResponse:
        c = self.config
        return generation_pb2.GetServerInfoResponse(
            model=self.model_name,
            # model_fingerprint is left unset: it is what a rank checks in a handshake, and no client needs it.
            max_model_len=self.engine.max_model_len,
            max_images_per_request=c.max_images_per_request,
            max_image_pixels=c.max_image_pixels,
            max_request_bytes=c.max_request_bytes,
            max_upload_bytes=c.max_upload_bytes,
            transfer_mode=generation_pb2.TransferMode.Value(f"TRANSFER_MODE_{c.transfer_mode.upper()}"),
            tensor_parallel_size=len(c.workers),
            group_ready=self.engine.ready,
            max_video_frames=c.max_video_frames if self.frontend.videos is not None else 0,
            max_video_seconds=c.max_video_seconds,
            max_video_frame_pixels=c.max_video_frame_pixels,
        )

    def _on_group_state(self, up: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        asyncio.get_running_loop().create_task(self.health.set(SERVICE_NAME, status))

    async def start(self) -> int:
        from common.grpc_metrics import AioServerMetricsInterceptor

        c = self.config
        # Outermost first: metrics see every status, the token check runs before the request is parsed, and the
        # decode guard turns unparsable bytes into INVALID_ARGUMENT.
        generation_service = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
        interceptors = [AioServerMetricsInterceptor(self.metrics.registry, services=[generation_service])]
        if self.tokens is not None:
            interceptors.append(BearerTokenInterceptor(self.tokens, GUARDED_METHODS))
        interceptors.append(ParseGuardInterceptor())
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", c.max_request_bytes),
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.so_reuseport", 0),
            ],
        )
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (
            generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        if self.server_credentials is not None:
            self.port = self.server.add_secure_port(c.listen, self.server_credentials)
        else:
            self.port = self.server.add_insecure_port(c.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {c.listen} (--listen)")
        if c.health_port:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            host = c.listen.rsplit(":", 1)[0]
            self.health_port = self.health_server.add_insecure_port(f"{host}:{c.health_port}")
            if self.health_port == 0:
                raise OSError(f"cannot listen on {host}:{c.health_port} (--health-port)")
            await self.health_server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.http is not None:
            self.http_port = await self.http.start()
        if self.kv_events is not None:
            self.kv_events.start()
        self.engine.start()
        log.info(
            "scheduler listening",
            extra={
                "port": self.port,
                "http_port": self.http_port,
                "workers": ",".join(c.workers),
                "transfer_mode": c.transfer_mode,
            },
        )
        return self.port

    async def stop(self, drain_seconds: float | None = None) -> None:
        """Graceful: refuse new requests, drain in-flight ones, then close the group."""
        drain = self.config.drain_seconds if drain_seconds is None else drain_seconds
        self.completions.draining = True
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + drain
        while self.engine.handles and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self.engine.handles):
            self.engine.finish(request_id, "cancelled")
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.http is not None:
            await self.http.stop()
        if self.health_server is not None:
            await self.health_server.stop(grace=None)
        await self.engine.stop()
        if self.kv_events is not None:
            self.kv_events.close()
        log.info("scheduler stopped")


async def serve(config: SchedulerConfig, stop: asyncio.Event) -> None:
    """Runs until ``stop`` is set. Anything that fails before the server listens raises StartupError: the same
    configuration would fail again, so a supervisor should not restart it."""
    try:
        server = SchedulerServer(config)
        if config.metrics_port:
            start_http_server(config.metrics_port, addr=config.metrics_host, registry=server.metrics.registry)
        await server.start()
        freeze_startup_heap(log)
    except StartupError:
        raise
    except Exception as exc:
        raise StartupError(f"the scheduler cannot start: {type(exc).__name__}: {' '.join(str(exc).split())}") from exc
    await stop.wait()
    log.info("shutdown requested; draining", extra={"drain_seconds": config.drain_seconds})
    await server.stop()
