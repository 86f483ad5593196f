"""The scheduler's connection to its worker group: one persistent bidirectional Step stream per rank.

A step is written as: the payload frames each rank needs (every tensor serialized once, one chunk-sized frame
at a time, the same bytes written to every rank that needs them), then the StepControl serialized once and the
same bytes written to every rank; a step planned ahead with ``masks_follow`` gets its late masks later, in the next
step's control (``prior_masks``) or, when none is planned yet, in a frame to rank 0 alone (``send_late_masks``). The
step completes when every rank has answered it; rank 0's answer carries the sampled tokens. Any broken stream,
protocol error, handshake refusal or missed deadline raises ``GroupDown``; the caller recovers and calls ``connect``
again, which opens fresh streams under a newer epoch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import grpc

from common import codec, item_proto, tracing
from common.ids import ItemId
from common.local_stream import is_local
from mmcast.v1 import worker_pb2
from scheduler_svc.core.inputs import GroupBudget
from scheduler_svc.transport.rank_stream import WRITE_ERRORS, GroupDown, RankStream

log = logging.getLogger(__name__)

__all__ = [
    "ByteCounters",
    "GroupDown",
    "PayloadTensors",
    "WorkerGroup",
    "default_channel_options",
]


@dataclasses.dataclass
class ByteCounters:
    """Bytes written to the rank streams, summed over ranks, by kind."""

    payload: int = 0
    metadata: int = 0
    control: int = 0

    def add(self, kind: str, n: int) -> None:
        setattr(self, kind, getattr(self, kind) + n)


@dataclasses.dataclass(frozen=True)
class PayloadTensors:
    """One item's payload tensors, written as frames before a step's control on the ranks that need them.

    (``scheduler_svc.core.step_plan.PayloadSend`` is the plan's decision; the engine turns each into one of these.)"""

    identifier: ItemId
    fields: Sequence[tuple[str, object]]  # (field name, torch.Tensor) of the payload (non keep_on_cpu) fields


def default_channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    # No HTTP/2 keepalive pings: servers refuse frequent ones; Keepalive frames detect half-open streams.
    # Each connect() opens fresh channels and the engine paces the attempts (--reconnect-backoff-*). A channel
    # must therefore try at once: with gRPC's global subchannel pool, every channel to an address shares one
    # connection whose reconnect backoff grows through an outage (~10 s after half a minute down), so attempts
    # kept failing with "Connection refused" long after a restarted rank was serving.
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.use_local_subchannel_pool", 1),
    ]


class WorkerGroup:
    """Connects to every rank, runs steps, and reports the group down on any failure."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        model_fingerprint: str,
        block_size: int,
        scheduler_id: str = "",
        chunk_size: int = codec.DEFAULT_CHUNK_SIZE,
        handshake_timeout: float = 10.0,
        step_timeout: float = 120.0,
        max_message_bytes: int = 64 << 20,
        channel_factory: Callable[[str, list], grpc.aio.Channel] | None = None,
        on_bytes: Callable[[str, int], None] | None = None,
        call_metadata: Sequence[tuple[str, str]] = (),
        image_formats: Sequence[str] = (),
        max_image_pixels: int = 0,
        video_limits: worker_pb2.VideoDecodeLimits | None = None,
    ) -> None:
        """``channel_factory``: (address, options) -> channel (TLS); ``call_metadata``: sent when opening every
        Step stream (the ranks' shared token); ``image_formats`` / ``max_image_pixels``: the limits a rank applies
        to an encoded payload before decoding it (the frontend's own, sent in the handshake); ``video_limits``:
        likewise for encoded videos (None: the ranks refuse them)."""
        if not addresses:
            raise ValueError("workers: at least one rank address is required (--workers host:port,...)")
        self.addresses = list(addresses)
        self.model_fingerprint = model_fingerprint
        self.block_size = block_size
        self.scheduler_id = scheduler_id
        self.chunk_size = chunk_size
        self.handshake_timeout = handshake_timeout
        self.step_timeout = step_timeout
        self.channel_options = default_channel_options(max_message_bytes)
        self.max_message_bytes = max_message_bytes
        self._channel_factory = channel_factory or (lambda addr, opts: grpc.aio.insecure_channel(addr, options=opts))
        self.call_metadata = tuple(call_metadata)
        self.image_formats = list(image_formats)
        self.max_image_pixels = max_image_pixels
        self.video_limits = video_limits
        self.bytes = ByteCounters()
        self._on_bytes_hook = on_bytes
        self.epoch = 0
        self._streams: list[RankStream] = []
        self.budget: GroupBudget | None = None
        self.last_sent_at = 0.0  # perf_counter() when the latest step's control was written to every rank
        self._deadlines: dict[int, float] = {}  # step id -> monotonic() deadline for its answers (steps written)
        self.last_sampled_input = False  # every rank takes a step's input from its own last sample (async steps)
        self.late_token_masks = False  # every rank takes a step's masks after its control (StepControl.masks_follow)
        self.any_failed = asyncio.Event()  # set when a connected rank's stream fails (wakes an idle step loop)

    @property
    def world_size(self) -> int:
        return len(self.addresses)

    @property
    def failure(self) -> str | None:
        """Why the first failed rank stream failed, if one has."""
        return next((s.failure for s in self._streams if s.failed.is_set()), None)

    @property
    def up(self) -> bool:
        return self.budget is not None and all(not s.failed.is_set() for s in self._streams)

    def _count(self, kind: str, n: int) -> None:
        self.bytes.add(kind, n)
        if self._on_bytes_hook is not None:
            self._on_bytes_hook(kind, n)

    async def connect(self) -> GroupBudget:
        """Open a stream to every rank under a new epoch and check the handshakes. Raises GroupDown."""
        await self.close()
        self.epoch = max(self.epoch + 1, time.time_ns())
        self.any_failed = asyncio.Event()
        streams = [
            RankStream(
                rank,
                addr,
                None if is_local(addr) else self._channel_factory(addr, self.channel_options),
                self._count,
                self.any_failed.set,
                self.call_metadata,
                self.max_message_bytes,
            )
            for rank, addr in enumerate(self.addresses)
        ]
        self._streams = streams

        async def shake(s: RankStream) -> worker_pb2.HandshakeAck:
            hs = worker_pb2.Handshake(
                protocol_version=item_proto.PROTOCOL_VERSION,
                model_fingerprint=self.model_fingerprint,
                rank=s.rank,
                world_size=self.world_size,
                scheduler_epoch=self.epoch,
                scheduler_id=self.scheduler_id,
                block_size=self.block_size,
                image_formats=self.image_formats,
                max_image_pixels=self.max_image_pixels,
                video_limits=self.video_limits,
            )
            return await s.handshake(hs, self.handshake_timeout)

        try:
            acks = await asyncio.gather(*(shake(s) for s in streams))
        except BaseException:
            await self.close()
            raise
        for s, ack in zip(streams, acks, strict=True):
            problems = []
            if ack.protocol_version != item_proto.PROTOCOL_VERSION:
                problems.append(f"protocol_version {ack.protocol_version} != {item_proto.PROTOCOL_VERSION}")
            if ack.model_fingerprint != self.model_fingerprint:
                problems.append(f"model_fingerprint {ack.model_fingerprint[:12]} != {self.model_fingerprint[:12]}")
            if ack.rank != s.rank:
                problems.append(f"rank {ack.rank} != {s.rank} (address order of --workers)")
            if ack.world_size != self.world_size:
                problems.append(f"world_size {ack.world_size} != {self.world_size} (number of --workers)")
            if problems:
                await self.close()
                raise GroupDown(f"rank {s.rank} ({s.address}) disagrees: " + "; ".join(problems))
        self.last_sampled_input = all(a.last_sampled_input for a in acks)
        self.late_token_masks = all(a.late_token_masks for a in acks)
        self._deadlines = {}
        self.budget = GroupBudget(
            num_ranks=self.world_size,
            kv_blocks=min(a.kv_blocks for a in acks),
            encoder_cache_tokens=min(a.encoder_cache_tokens for a in acks),
            payload_cache_bytes=min(a.payload_cache_bytes for a in acks),
            max_tensor_bytes=min(a.max_tensor_bytes for a in acks),
            max_model_len=min(a.max_model_len for a in acks),
            encoder_row_bytes=max(a.encoder_output_row_bytes for a in acks),
        )
        log.info(
            "worker group connected",
            extra={"epoch": self.epoch, "ranks": self.world_size, **dataclasses.asdict(self.budget)},
        )
        return self.budget

    def _check_up(self) -> None:
        if self.budget is None:
            raise GroupDown("group not connected")
        for s in self._streams:
            if s.failed.is_set():
                raise GroupDown(s.failure or f"rank {s.rank} failed")

    async def _write(self, targets: Sequence[RankStream], raw: bytes, kind: str) -> None:
        try:
            await asyncio.gather(*(s.write(raw, kind) for s in targets))
        except WRITE_ERRORS as exc:
            raise GroupDown(f"write to a rank failed: {exc!r}") from None

    async def run_step(
        self, step_id: int, control: worker_pb2.StepControl, rank_payloads: Sequence[Sequence[PayloadTensors]]
    ) -> list[worker_pb2.StepResult]:
        """Write one step to every rank and wait for every rank's answer (index = rank). Raises GroupDown."""
        await self.send_step(step_id, control, rank_payloads)
        return await self.step_results(step_id)

    async def send_step(
        self, step_id: int, control: worker_pb2.StepControl, rank_payloads: Sequence[Sequence[PayloadTensors]]
    ) -> None:
        """Write one step to every rank (``step_results`` then waits for the answers). Raises GroupDown."""
        self._check_up()
        if len(rank_payloads) != self.world_size:
            raise ValueError(f"rank_payloads has {len(rank_payloads)} entries for {self.world_size} ranks")
        # One deadline for writing the step and for its answers: a rank whose link takes no bytes (a partition,
        # a link far too slow for the payload) holds the write on gRPC flow control for as long as it lasts.
        deadline = time.monotonic() + self.step_timeout
        with tracing.span("mmcast.broadcast", step_id=step_id, ranks=self.world_size) as current:
            try:
                await asyncio.wait_for(self._broadcast(control, rank_payloads, current), self.step_timeout)
            except TimeoutError:
                stuck = ", ".join(f"rank {s.rank} ({s.address})" for s in self._streams if s.writing) or "a rank"
                raise GroupDown(
                    f"{stuck}: step {step_id} not written within {self.step_timeout:.1f}s (--step-timeout-seconds); "
                    "its link takes no more bytes"
                ) from None
        self.last_sent_at = time.perf_counter()
        self._deadlines[step_id] = deadline

    async def send_late_masks(self, frame: worker_pb2.LateTokenMasks) -> None:
        """Writes the late masks of step ``frame.step_id`` (written with ``masks_follow``, not yet answered) to rank
        0, the rank that samples, as a frame of their own (when no next control carries them in ``prior_masks``),
        before anything of a later step. Raises GroupDown."""
        self._check_up()
        step_id = frame.step_id
        raw = worker_pb2.StepRequest(late_token_masks=frame).SerializeToString()
        remaining = max(0.0, self._deadlines[step_id] - time.monotonic())
        try:
            await asyncio.wait_for(self._write(self._streams[:1], raw, "control"), remaining)
        except TimeoutError:
            raise GroupDown(
                f"rank 0 ({self.addresses[0]}): the late token masks of step {step_id} not written within "
                f"{self.step_timeout:.1f}s (--step-timeout-seconds); its link takes no more bytes"
            ) from None

    async def step_results(self, step_id: int) -> list[worker_pb2.StepResult]:
        """Every rank's answer to the step ``send_step`` wrote (index = rank), within its deadline."""
        return await self._await_results(step_id, self._deadlines.pop(step_id))

    async def _broadcast(
        self, control: worker_pb2.StepControl, rank_payloads: Sequence[Sequence[PayloadTensors]], current
    ) -> None:
        """Writes the payload frames each rank needs, then the one serialized control to every rank."""
        # Every item once, in first-seen order; each rank receives its own subsequence of it.
        order: dict[ItemId, PayloadTensors] = {}
        needed_by: dict[ItemId, list[RankStream]] = {}
        for stream, sends in zip(self._streams, rank_payloads, strict=True):
            for send in sends:
                order.setdefault(send.identifier, send)
                needed_by.setdefault(send.identifier, []).append(stream)
        for ident, send in order.items():
            targets = needed_by[ident]
            for name, tensor in send.fields:
                for raw in codec.iter_payload_frames(ident, name, tensor, chunk_size=self.chunk_size):
                    await self._write(targets, raw, "payload")
        raw_control = worker_pb2.StepRequest(control=control).SerializeToString()
        metadata, rest = item_proto.control_byte_breakdown(control, len(raw_control))
        try:
            await asyncio.gather(*(s.write_raw(raw_control) for s in self._streams))
        except WRITE_ERRORS as exc:
            raise GroupDown(f"write to a rank failed: {exc!r}") from None
        for _ in self._streams:
            self._count("metadata", metadata)
            self._count("control", rest)
        tracing.set_attributes(current, payload_items=len(order), control_bytes=len(raw_control))

    async def _await_results(self, step_id: int, deadline: float) -> list[worker_pb2.StepResult]:
        results: list[worker_pb2.StepResult] = []
        for s in self._streams:
            get = asyncio.ensure_future(s.results.get())
            failed = asyncio.ensure_future(s.failed.wait())
            remaining = max(0.0, deadline - time.monotonic())
            done, _ = await asyncio.wait({get, failed}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            failed.cancel()
            await asyncio.gather(failed, return_exceptions=True)
            if get not in done:
                get.cancel()
                await asyncio.gather(get, return_exceptions=True)
                if s.failed.is_set():
                    raise GroupDown(s.failure or f"rank {s.rank} failed")
                raise GroupDown(
                    f"rank {s.rank} ({s.address}): no answer to step {step_id} within {self.step_timeout:.1f}s "
                    "(--step-timeout-seconds)"
                )
            result = get.result()
            if result.step_id != step_id:
                raise GroupDown(f"rank {s.rank} answered step {result.step_id}, expected {step_id}")
            results.append(result)
        return results

    async def keepalive(self, stale_after: float) -> None:
        """Send a keepalive to every rank of an idle group. A rank silent for ``stale_after`` seconds (it did
        not echo earlier keepalives: a stalled process or a half-open connection) or a failed write raises
        GroupDown."""
        if self.budget is None:
            return
        self._check_up()
        now = time.monotonic()
        for s in self._streams:
            if now - s.last_heard > stale_after:
                raise GroupDown(
                    f"rank {s.rank} ({s.address}): silent for {now - s.last_heard:.1f}s (keepalives unanswered)"
                )
        raw = worker_pb2.StepRequest(keepalive=worker_pb2.Keepalive(sent_unix_nanos=time.time_ns())).SerializeToString()
        await self._write(self._streams, raw, "control")

    async def close(self) -> None:
        streams, self._streams = self._streams, []
        self.budget = None
        for s in streams:
            try:
                await s.close()
            except Exception:  # closing a dead channel must not stop closing the others
                log.debug("closing rank %d stream failed", s.rank, exc_info=True)
