"""Transport floors: what moving one image's ``pixel_values`` to N same-host receiver processes costs at best.

Three transports, each to N ∈ {1, 2, 4} real receiver processes, the allocator environment of common/process.py set in
every process (sender and receivers):

- ``grpc``: a bare bidirectional gRPC stream per receiver (grpc.aio on both ends, as the scheduler and workers
  use), the product's own codec: ``common.codec.iter_payload_frames`` (1 MiB chunks) on the sender, each frame
  written to every stream; ``StepRequest`` parsing and ``common.codec.TensorAssembler`` on the receiver,
  which answers once the tensor is built. This is the floor for the ``full`` mode's per-image broadcast.
- ``tcp``: a raw loopback socket per receiver, 1 MiB ``sendall``s interleaved over the receivers; each receiver
  ``recv_into``s a preallocated, pre-faulted buffer and answers one byte.
- ``shm``: one reused, pre-faulted shared-memory segment (a file in /dev/shm) that every receiver keeps mapped;
  the sender copies the image in and signals over a socket, each receiver copies it out into its own pre-faulted
  buffer (so it may be reused at once) and answers. The same-host physical limit.

Time per image = from the sender's first byte to the last receiver's answer. ``python -m benchmarks.transfer.floors``
prints a table; ``measure_floors()`` returns the rows for ``benchmarks.run``.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.support import stats
from common.process import ALLOCATOR_ENV, ensure_allocator_env

# pixel_values shapes of Qwen2-VL's image processor (14-px patches, 2x2 merge, float32, 1176 = 3*2*14*14):
# 1280x720 resizes to 1288x728 → grid (1, 52, 92) → 4784 rows; 448x448 → grid (1, 32, 32).
PAYLOAD_SHAPES: dict[str, tuple[int, int]] = {"1280x720": (4784, 1176), "448x448": (1024, 1176)}
TRANSPORTS = ("grpc", "tcp", "shm")
CHUNK = 1 << 20
_METHOD = "/mmcast.bench.Floor/Step"
_HDR = struct.Struct("<Q")  # payload length announced by the sender on tcp/shm
_READY_TIMEOUT_S = 60.0


# --- receivers (one process each) -------------------------------------------------------------------------
def _serve_grpc() -> None:
    import grpc

    from common import codec
    from mmcast.v1 import worker_pb2

    async def step(request_iterator, context):
        assembler = None
        async for frame in request_iterator:
            payload = frame.payload
            if payload.HasField("header"):
                assembler = codec.TensorAssembler(payload.header, max_bytes=1 << 31, name="floor")
            chunk = payload.chunk
            assembler.add_chunk(chunk.index, chunk.data)  # read the bytes field once
            if assembler.complete:
                assembler.tensor()
                assembler = None
                yield b"k"

    async def main() -> None:
        opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        server = grpc.aio.server(options=opts)
        handler = grpc.stream_stream_rpc_method_handler(
            step, request_deserializer=worker_pb2.StepRequest.FromString, response_serializer=None
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("mmcast.bench.Floor", {"Step": handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"READY {port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("sender closed the socket")
        got += n


def _serve_socket(kind: str, shm_path: str | None, capacity: int) -> None:
    """tcp: receive the payload into a private buffer. shm: copy it out of the shared segment on a signal."""
    private = np.empty(capacity, dtype=np.uint8)
    private[:] = 1  # pre-fault: the floor must not include first-touch page faults
    segment = None
    if kind == "shm":
        fd = os.open(shm_path, os.O_RDONLY)
        segment = np.frombuffer(mmap.mmap(fd, capacity, prot=mmap.PROT_READ), dtype=np.uint8)
        os.close(fd)
        private[:] = segment  # fault the mapping in once; it stays mapped
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"READY {listener.getsockname()[1]}", flush=True)
    head = memoryview(bytearray(_HDR.size))
    pview = memoryview(private)
    while True:  # one sender connection per measured point
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                try:
                    _recv_exact(conn, head)
                except ConnectionError:
                    break
                (length,) = _HDR.unpack(head)
                if kind == "tcp":
                    _recv_exact(conn, pview[:length])
                else:
                    np.copyto(private[:length], segment[:length])
                conn.sendall(b"k")


# --- sender ------------------------------------------------------------------------------------------------
class _Receivers:
    """Up to ``count`` receiver processes of one transport, started with the allocator environment."""

    def __init__(self, kind: str, count: int, capacity: int, shm_path: str | None = None) -> None:
        env = dict(os.environ, **ALLOCATOR_ENV, MMCAST_ALLOCATOR_ENV_SET="1")
        args = [sys.executable, "-m", "benchmarks.transfer.floors", "--serve", kind, "--capacity", str(capacity)]
        if shm_path:
            args += ["--shm-path", shm_path]
        self.procs = [
            subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True, cwd=_repo_root()) for _ in range(count)
        ]
        self.ports: list[int] = []
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for p in self.procs:
            line = p.stdout.readline() if time.monotonic() < deadline else ""
            if not line.startswith("READY "):
                self.close()
                raise RuntimeError(f"floor receiver ({kind}) did not start: got {line!r}, exit code {p.poll()}")
            self.ports.append(int(line.split()[1]))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def _grpc_times(ports: Sequence[int], tensor, repeats: int, warmup: int) -> list[float]:
    import grpc

    from common import codec

    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}", options=opts) for p in ports]
    calls = [ch.stream_stream(_METHOD, request_serializer=None, response_deserializer=None)() for ch in channels]
    times = []
    try:
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            for raw in codec.iter_payload_frames("floor-item", "pixel_values", tensor, chunk_size=CHUNK):
                await asyncio.gather(*(c.write(raw) for c in calls))
            acks = await asyncio.gather(*(c.read() for c in calls))
            elapsed = time.perf_counter() - t0
            if any(a != b"k" for a in acks):
                raise RuntimeError(f"grpc floor: unexpected answers {acks!r}")
            if i >= warmup:
                times.append(elapsed * 1e3)
    finally:
        for c in calls:
            await c.done_writing()
        for ch in channels:
            await ch.close(grace=None)
    return times


def _socket_times(
    kind: str, ports: Sequence[int], data: np.ndarray, segment: np.ndarray | None, repeats: int, warmup: int
) -> list[float]:
    conns = [socket.create_connection(("127.0.0.1", p)) for p in ports]
    for c in conns:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(data).cast("B")
    header = _HDR.pack(len(view))
    ack = bytearray(1)
    times = []
    try:
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            if kind == "tcp":
                for c in conns:
                    c.sendall(header)
                for start in range(0, len(view), CHUNK):
                    for c in conns:
                        c.sendall(view[start : start + CHUNK])
            else:
                np.copyto(segment[: len(view)], data.view(np.uint8).reshape(-1))
                for c in conns:
                    c.sendall(header)
            for c in conns:
                _recv_exact(c, memoryview(ack))
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                times.append(elapsed * 1e3)
    finally:
        for c in conns:
            c.close()
    return times


def measure_floors(
    sizes: Sequence[str] = ("1280x720", "448x448"),
    ranks: Sequence[int] = (1, 2, 4),
    transports: Sequence[str] = TRANSPORTS,
    repeats: int = 15,
    warmup: int = 3,
    progress=None,
) -> list[dict]:
    """One row per (transport, size, ranks): ms per image to all ranks (p50, p90, samples)."""
    import torch

    if repeats < 10:
        raise ValueError(f"repeats={repeats}: floors report p90, use at least 10")
    tensors = {s: torch.rand(PAYLOAD_SHAPES[s], dtype=torch.float32) for s in sizes}
    capacity = max(t.numel() * 4 for t in tensors.values())
    rows: list[dict] = []
    for kind in transports:
        shm_path = segment = None
        if kind == "shm":
            shm_path = f"/dev/shm/mmcast-floor-{os.getpid()}"
            with open(shm_path, "wb") as f:
                f.truncate(capacity)
            fd = os.open(shm_path, os.O_RDWR)
            segment = np.frombuffer(mmap.mmap(fd, capacity), dtype=np.uint8)
            os.close(fd)
            segment[:] = 0  # pre-fault the sender's side
        receivers = _Receivers(kind, max(ranks), capacity, shm_path)
        try:
            for size, tensor in tensors.items():
                for n in ranks:
                    ports = receivers.ports[:n]
                    if kind == "grpc":
                        samples = asyncio.run(_grpc_times(ports, tensor, repeats, warmup))
                    else:
                        samples = _socket_times(kind, ports, tensor.numpy(), segment, repeats, warmup)
                    s = stats.summary(samples)
                    rows.append(
                        {
                            "transport": kind,
                            "size": size,
                            "ranks": n,
                            "payload_bytes": tensor.numel() * 4,
                            "p50_ms": s["p50"],
                            "p90_ms": s["p90"],
                            "samples_ms": samples,
                        }
                    )
                    if progress is not None:
                        progress(rows[-1])
        finally:
            receivers.close()
            if shm_path:
                os.unlink(shm_path)
    return rows


def floors_table(rows: Sequence[dict]) -> str:
    """A Markdown table: one line per transport and size, p50 / p90 ms per image for each rank count."""
    ranks = sorted({r["ranks"] for r in rows})
    head = "| transport | image | " + " | ".join(f"{n} rank{'s' if n > 1 else ''} p50 / p90 ms" for n in ranks) + " |"
    lines = [head, "|" + "---|" * (2 + len(ranks))]
    keys = list(dict.fromkeys((r["transport"], r["size"]) for r in rows))
    for kind, size in keys:
        cells = []
        for n in ranks:
            hit = [r for r in rows if (r["transport"], r["size"], r["ranks"]) == (kind, size, n)]
            cells.append(f"{hit[0]['p50_ms']:.2f} / {hit[0]['p90_ms']:.2f}" if hit else "–")
        mb = next(r["payload_bytes"] for r in rows if (r["transport"], r["size"]) == (kind, size)) / 1e6
        lines.append(f"| {kind} | {size} ({mb:.1f} MB) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", choices=TRANSPORTS, help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--shm-path", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats per point (≥ 10)")
    parser.add_argument("--ranks", default="1,2,4", help="receiver counts, comma separated")
    parser.add_argument("--sizes", default="1280x720,448x448", help=f"of {sorted(PAYLOAD_SHAPES)}")
    args = parser.parse_args(argv)
    if args.serve == "grpc":
        return _serve_grpc()
    if args.serve:
        return _serve_socket(args.serve, args.shm_path, args.capacity)
    rows = measure_floors(
        sizes=args.sizes.split(","),
        ranks=[int(n) for n in args.ranks.split(",")],
        repeats=args.repeats,
        progress=lambda r: print(
            f"{r['transport']:>4} {r['size']:>8} x{r['ranks']}: p50 {r['p50_ms']:.2f} ms  p90 {r['p90_ms']:.2f} ms",
            file=sys.stderr,
        ),
    )
    print(floors_table(rows))


if __name__ == "__main__":
    if "--serve" not in sys.argv:
        ensure_allocator_env()  # the sender too; receivers get it from their parent's environment
    main()
