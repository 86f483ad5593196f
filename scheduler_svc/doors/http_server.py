"""The HTTP port of the scheduler process: uvicorn serving the OpenAI API (openai_api.py) on the scheduler's own
event loop, beside the gRPC server, so both doors share one engine, one frontend and one set of caches.

- Bound on the host of ``--listen`` at ``--http-port``; TLS with the client port's files (common/tls.py's
  ``HttpsContext``, rotated files taken within ``HTTPS_REFRESH_SECONDS``), mutual when ``--tls-client-ca-file``.
- uvicorn runs without its own signal handlers and lifespan: the scheduler process owns shutdown (server.py) and
  stops this port after its in-flight requests drained.
- Clients that hold a connection without using it are cut off by the header and write deadlines of http_guard.py.
- ``HttpMetrics`` counts every answer by route, method and status and times it to its last byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import uvicorn

from common import tls
from scheduler_svc.doors.http_guard import guarded_protocol
from scheduler_svc.engine.metrics import SchedulerMetrics

log = logging.getLogger("mmcast.scheduler.http")

HTTP_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/metrics", "/health")
SHUTDOWN_GRACE_SECONDS = 5.0  # after the scheduler's own drain: only streams that missed it are left


class HttpMetrics:
    """ASGI middleware: ``mmcast_http_requests_total{route,method,status}``, the duration histogram and the
    in-flight gauge. Unknown paths share the route label "other", so a scan cannot grow the label set."""

    def __init__(self, app, metrics: SchedulerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in HTTP_ROUTES else "other"
        method = scope["method"] if scope["method"] in ("GET", "POST") else "other"
        status = 500  # what the client sees if the app fails before answering (Starlette answers 500)
        start = time.perf_counter()

        async def send_recording(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.http_in_flight.inc()
        try:
            await self.app(scope, receive, send_recording)
        finally:
            self.metrics.http_in_flight.dec()
            self.metrics.http_requests.labels(route, method, str(status)).inc()
            self.metrics.http_seconds.labels(route, method).observe(time.perf_counter() - start)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the scheduler process handles SIGTERM/SIGINT itself (main.py)
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``[::]``/``::`` is dual-stack; port 0 picks one) whose connections
    send without Nagle's delay.

    ``socket.create_server`` makes a socket of protocol 0, and asyncio sets ``TCP_NODELAY`` only on connections whose
    socket says ``IPPROTO_TCP``: on such a socket a server-sent event written after the response headers waited for
    the client's delayed ACK (~40 ms on Linux) before it left, and every streamed answer's first token with it. The
    socket is therefore re-made with its protocol named, and the option is set on the listener too (Linux connections
    inherit it)."""
    host = host.strip("[]")
    if ":" in host:
        made = socket.create_server((host, port), family=socket.AF_INET6, dualstack_ipv6=host == "::")
    else:
        made = socket.create_server((host, port))
    sock = socket.socket(made.family, made.type, socket.IPPROTO_TCP, fileno=made.detach())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class HttpServer:
    """One uvicorn server on one socket; ``start`` returns the bound port."""

    def __init__(
        self,
        app,
        *,
        host: str,
        port: int,
        https: tls.HttpsContext | None = None,
        header_timeout: float = 10.0,
        write_timeout: float = 30.0,
        on_close=None,
    ) -> None:
        """``header_timeout``, ``write_timeout``: the deadlines of http_guard.py; ``on_close(reason)`` counts them."""
        self.host, self.port, self.https = host, port, https
        self.config = uvicorn.Config(
            app,
            http=guarded_protocol(header_timeout, write_timeout, on_close),
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            proxy_headers=False,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
            timeout_keep_alive=30,
        )
        self.server = _Server(self.config)
        self._task: asyncio.Task | None = None
        self._refresh: asyncio.Task | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.https else "http"

    async def start(self) -> int:
        try:
            sock = bind(self.host, self.port)
        except OSError as exc:
            raise OSError(f"cannot listen on {self.host}:{self.port} (--http-port): {exc.strerror or exc}") from None
        self.port = sock.getsockname()[1]
        self.config.load()
        if self.https is not None:
            self.config.ssl = self.https.context
            self._refresh = asyncio.create_task(self._follow_tls_files(), name="https-refresh")
        self._task = asyncio.create_task(self.server.serve(sockets=[sock]), name="http-server")
        while not self.server.started:
            if self._task.done():  # failed to start: raise its error here
                self._task.result()
                raise OSError(f"the HTTP server on {self.host}:{self.port} stopped while starting")
            await asyncio.sleep(0.01)
        log.info("HTTP API listening", extra={"port": self.port, "scheme": self.scheme})
        return self.port

    async def _follow_tls_files(self) -> None:
        while True:
            await asyncio.sleep(tls.HTTPS_REFRESH_SECONDS)
            self.https.refresh()

    async def stop(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        if self._task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self._task, SHUTDOWN_GRACE_SECONDS + 5.0)
        except (TimeoutError, Exception):
            self.server.force_exit = True
            self._task.cancel()
