"""The HTTP door's listening socket (``scheduler_svc/doors/http_server.py bind``): its connections send without Nagle's
delay. Without ``TCP_NODELAY`` a server-sent event written after the response headers waits for the client's delayed
ACK (~40 ms on Linux), so every streamed answer's first token arrived late; asyncio sets the option only on sockets
that name ``IPPROTO_TCP``."""

from __future__ import annotations

import asyncio
import socket

import pytest

from scheduler_svc.doors.http_server import bind


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_connections_accepted_by_an_asyncio_server_have_tcp_nodelay(host):
    if host == "[::1]" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")

    async def main() -> int:
        try:
            listener = bind(host, 0)
        except OSError as exc:
            pytest.skip(f"cannot listen on {host}: {exc}")
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connection(reader, writer):
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=listener)
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection(host.strip("[]"), port)
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) != 0
