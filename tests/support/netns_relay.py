"""TCP relays from this process's loopback into a network namespace, so a test (which stays in the root namespace,
where the lab adds no address) reaches servers living in the lab's namespaces.

Each relay is a thread: its listening sockets are made before the thread enters the namespace (so they stay on the
root namespace's 127.0.0.1), then the thread ``setns``es into the target namespace, a per-thread change, and every
upstream socket it opens is born there. Bytes are copied with back-pressure (a peer that stops reading stops the
other side), so a relay never buffers more than its sockets do.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import socket
import threading

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _enter(netns: str) -> None:
    fd = open(f"/var/run/netns/{netns}")  # noqa: SIM115 - held only for the call
    try:
        if _libc.setns(fd.fileno(), CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}) failed")
    finally:
        fd.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class Relay:
    """``add(host, port)`` → a 127.0.0.1 port forwarding to ``host:port`` as seen from namespace ``netns``."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self._pending: list[tuple[socket.socket, str, int]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._servers: list = []

    def add(self, host: str, port: int) -> int:
        if self._thread is not None:
            raise RuntimeError("add every target before start()")
        listener = socket.create_server(("127.0.0.1", 0))
        self._pending.append((listener, host, port))
        return listener.getsockname()[1]

    def start(self) -> Relay:
        self._thread = threading.Thread(target=self._run, name=f"relay-{self.netns}", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        try:
            _enter(self.netns)
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._serve_all())
            self._ready.set()
            self._loop.run_forever()
        except BaseException as exc:  # noqa: BLE001 - handed to start()
            self._error = exc
            self._ready.set()

    async def _serve_all(self) -> None:
        for listener, host, port in self._pending:

            async def handle(reader, writer, host=host, port=port):
                try:
                    up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
                except (OSError, TimeoutError):
                    writer.close()
                    return
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

            self._servers.append(await asyncio.start_server(handle, sock=listener))

    def stop(self) -> None:
        if self._loop is None:
            return
        loop = self._loop

        async def down():
            for server in self._servers:
                server.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(down(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
