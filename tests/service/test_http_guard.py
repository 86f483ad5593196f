"""The HTTP door's header and write deadlines (scheduler_svc/doors/http_guard.py) on the real uvicorn server class of the
scheduler (HttpServer), in-process on port 0, with a small ASGI app: no model, no ranks."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from scheduler_svc.doors.http_server import HttpServer
from tests.support.service_harness import LoopThread

DEADLINE = 0.4  # both deadlines, seconds


class App:
    """``/ok`` answers at once; ``/stream`` sends 64 KiB chunks until the server reports the client gone (an
    ``http.disconnect`` from ``receive``, which Starlette's StreamingResponse also waits for), and records it."""

    def __init__(self) -> None:
        self.client_gone = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["path"] != "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})  # chunked, no end

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.client_gone.set()

        watcher = asyncio.create_task(watch())
        while not self.client_gone.is_set():
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            await asyncio.sleep(0)
        await watcher


@pytest.fixture
def server():
    loop = LoopThread()
    app, closed = App(), []
    http = HttpServer(
        app, host="127.0.0.1", port=0, header_timeout=DEADLINE, write_timeout=DEADLINE, on_close=closed.append
    )
    port = loop.run(http.start())
    try:
        yield port, app, closed
    finally:
        loop.run(http.stop())
        loop.close()


def read_all(s: socket.socket, timeout: float = 10.0) -> tuple[bytes, bool]:
    """What the server sends until it closes; whether it closed within ``timeout``."""
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        return data, False
    except ConnectionResetError:
        pass
    return data, True


def test_a_head_never_completed_gets_408_naming_the_flag(server):
    port, _, closed = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # and no end of headers
        for _ in range(3):  # bytes keep trickling: they do not reset the deadline
            time.sleep(DEADLINE / 3)
            s.sendall(b"X-A: b\r\n")
        data, ended = read_all(s)
    assert ended and data.startswith(b"HTTP/1.1 408"), data[:100]
    assert b"--http-header-timeout-seconds" in data
    assert closed == ["header_timeout"]


def test_a_silent_connection_is_closed_and_a_prompt_one_is_served(server):
    port, _, closed = server
    with socket.create_connection(("127.0.0.1", port)) as idle, socket.create_connection(("127.0.0.1", port)) as ok:
        ok.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer, _ = read_all(ok)
        data, ended = read_all(idle)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")
    assert ended and data.startswith(b"HTTP/1.1 408")
    assert closed == ["header_timeout"]


def test_the_next_request_on_a_kept_alive_connection_has_its_own_deadline(server):
    port, _, closed = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(DEADLINE * 2)  # idle between requests: the keep-alive timer's business, not the head deadline
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # the second head never completes
        data, ended = read_all(s)
    assert data.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in data and ended
    assert closed == ["header_timeout"]


def test_a_client_that_stops_reading_is_aborted_and_the_app_sees_it(server):
    port, app, closed = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        assert app.client_gone.wait(10), "the stream was still being written for a client that reads nothing"
        data, ended = read_all(s)
    assert ended and data.startswith(b"HTTP/1.1 200")
    assert closed == ["write_timeout"]
