"""Deadlines uvicorn does not keep on its own, for clients that hold a connection without using it.

uvicorn arms its keep-alive timer only after a response, and a byte received disarms it; its flow control waits for
a paused socket without limit. So a client that trickles header bytes (slowloris) or connects and never speaks
held a connection and its file descriptor forever, and a streaming client that stopped reading held its response
(and the request behind it, and the events queued for it) forever. This protocol adds:

- a header deadline (``--http-header-timeout-seconds``): a request's head must be complete this long after the
  connection opens or after the first byte of the next request on a kept-alive one; otherwise the client gets
  ``408`` naming the flag and the connection is closed;
- a write deadline (``--http-write-timeout-seconds``): a response whose socket stays full (the client reads
  nothing) for this long is aborted; the ASGI app sees the disconnect, so a streamed request is cancelled as if the
  client had left.

Both are logged with the client's address (``http connection closed``, ``reason``) and counted in
``mmcast_http_connections_closed_total{reason}``.
"""

from __future__ import annotations

import asyncio
import json
import logging

from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.http.flow_control import FlowControl

log = logging.getLogger("mmcast.scheduler.http")


class _BoundedFlow(FlowControl):
    """uvicorn's flow control, whose wait for a writable socket ends after ``timeout`` by aborting it."""

    def __init__(self, transport: asyncio.Transport, timeout: float, on_timeout) -> None:
        super().__init__(transport)
        self._timeout, self._on_timeout = timeout, on_timeout

    async def drain(self) -> None:
        try:
            await asyncio.wait_for(self._is_writable_event.wait(), self._timeout)
        except TimeoutError:
            self._on_timeout()


def _timeout_answer(seconds: float) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"the request headers were not complete within {seconds:g} s "
                "(--http-header-timeout-seconds)",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def guarded_protocol(header_timeout: float, write_timeout: float, on_close=None) -> type:
    """uvicorn's HTTP protocol class with the two deadlines; ``on_close(reason)`` is called for each closing."""

    class GuardedHttpProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.flow = _BoundedFlow(transport, write_timeout, self._write_stalled)
            self._head_timer = None
            self._head_cycle = None
            self._arm_head()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_head()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self.cycle is not self._head_cycle:  # the parser has built a new request: its head is complete
                self._disarm_head()

        def connection_lost(self, exc) -> None:
            self._disarm_head()
            super().connection_lost(exc)

        def _arm_head(self) -> None:
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(header_timeout, self._head_expired)

        def _disarm_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            self._closed("header_timeout", f"request headers not complete within {header_timeout:g} s")
            self.transport.write(_timeout_answer(header_timeout))
            self.transport.close()

        def _write_stalled(self) -> None:
            if self.transport.is_closing():
                return
            self._closed("write_timeout", f"client not reading: its socket stayed full for {write_timeout:g} s")
            self.transport.abort()  # close() would wait for the buffer to drain, which it never will

        def _closed(self, reason: str, why: str) -> None:
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
            log.warning("http connection closed: %s", why, extra={"client": client, "reason": reason})
            if on_close is not None:
                on_close(reason)

    return GuardedHttpProtocol
