"""``mmcast.v1.WorkerService`` over grpc.aio: translates step-stream frames into calls on the ``Worker``.

Frames of one stream are handled in order. A step's compute runs on the worker's compute thread, so the event loop
keeps answering other streams (a superseding handshake, health checks) meanwhile; a short step of running requests
alone runs on the event loop's own thread instead, sparing the two hand-overs (``worker_svc/inline_steps.py``). The
one frame read inside a step is on rank 0, for a control that announced ``masks_follow``: once its forward is done,
the step's late masks, in a ``LateTokenMasks`` frame or in the next control's ``prior_masks``; the event loop then
samples the step itself (``worker_svc/late_masks.py``). Received bytes are counted where they arrive, with the same
split the scheduler uses for its sent counters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from common import tracing
from common.item_proto import control_byte_breakdown
from common.parse_guard import Unparsable
from mmcast.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.handshake import HandshakeRejected
from worker_svc.late_masks import LateMasks
from worker_svc.metrics import WorkerMetrics
from worker_svc.session import SamplesAwaitMasks, StepOutcome
from worker_svc.step_errors import StepError, code, code_name
from worker_svc.worker import StreamHandle, Worker

log = logging.getLogger(__name__)


def step_result(
    step_id: int,
    rank: int,
    outcome: StepOutcome,
    handle: StreamHandle,
    payload_bytes: int,
    t0: float,
    assemble_seconds: float = 0.0,
):
    session = handle.session
    result = worker_pb2.StepResult(step_id=step_id, rank=rank)
    for request_id, s in outcome.sampled:
        token = result.sampled.add(request_id=request_id, token_id=s.token_id)
        if s.logprob is not None:
            token.logprob = s.logprob
            for token_id, logprob in s.top_logprobs:
                token.top_logprobs.add(token_id=token_id, logprob=logprob)
    for request_id, message in outcome.failed:
        result.failures.add(request_id=request_id, message=message)
    for ident, message in outcome.item_failures:
        result.item_failures.add(item_identifier=ident, message=message)
    stats = result.stats
    stats.encoder_time.FromNanoseconds(int(outcome.encoder_seconds * 1e9))
    stats.encoder_items = outcome.encoder_items
    stats.encoder_runs = outcome.encoder_runs
    stats.collective_bytes = outcome.collective_bytes
    stats.collective_time.FromNanoseconds(int(outcome.collective_seconds * 1e9))
    stats.preprocess_time.FromNanoseconds(int(outcome.preprocess_seconds * 1e9))
    stats.payload_cache_bytes = session.payloads.nbytes
    stats.payload_cache_items = len(session.payloads)
    stats.encoder_cache_tokens = session.encoded.tokens
    stats.received_payload_bytes = payload_bytes
    stats.forward_time.FromNanoseconds(int(outcome.forward_seconds * 1e9))
    stats.sample_time.FromNanoseconds(int(outcome.sample_seconds * 1e9))
    stats.assemble_time.FromNanoseconds(int(assemble_seconds * 1e9))
    stats.step_time.FromNanoseconds(int((time.perf_counter() - t0) * 1e9))
    return result


@dataclasses.dataclass
class _Received:
    """What arrived for the next step before its control: payload bytes, and the time spent assembling them."""

    payload_bytes: int = 0
    assemble_seconds: float = 0.0
    ahead: list = dataclasses.field(default_factory=list)  # a control read during the step before (prior_masks)


def _rank_step_span(control: worker_pb2.StepControl, rank: int):
    """This rank's span of one step: a trace of its own, matched to the scheduler's ``mmcast.step`` span by the
    step id and request ids (common/tracing.py says why no context crosses the stream)."""
    if not tracing.enabled():
        return tracing.span("mmcast.rank_step")
    ids = [r.request_id for r in control.new_requests] + [r.request_id for r in control.running]
    return tracing.span(
        "mmcast.rank_step",
        rank=rank,
        step_id=control.step_id,
        request_ids=ids,
        new_requests=len(control.new_requests),
        encoder_inputs=len(control.encoder_inputs),
    )


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, worker: Worker, metrics: WorkerMetrics, report_readiness=None) -> None:
        """``report_readiness``: async (ready: bool) -> None, called when a handshake or a stream's end may have
        changed ``worker.serving`` (the readiness health status)."""
        self.worker = worker
        self.metrics = metrics
        self._report_readiness = report_readiness
        self._received = {k: metrics.received_bytes.labels(kind=k) for k in ("payload", "metadata", "control")}

    def _count(self, frame: worker_pb2.StepRequest) -> int:
        """Counts the frame's bytes by kind; returns its payload bytes."""
        size = frame.ByteSize()
        kind = frame.WhichOneof("frame")
        if kind == "payload":
            self._received["payload"].inc(size)
            return size
        if kind == "control":
            metadata, control = control_byte_breakdown(frame.control, size)
            self._received["metadata"].inc(metadata)
            self._received["control"].inc(control)
        else:
            self._received["control"].inc(size)
        return 0

    async def Step(self, request_iterator, context: grpc.aio.ServicerContext):
        frame = await context.read()
        if frame is grpc.aio.EOF:
            return
        if isinstance(frame, Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, frame.message)
        self._count(frame)
        kind = frame.WhichOneof("frame")
        if kind != "handshake":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"the first frame of a Step stream must be a handshake, got {kind}"
            )
        if not self.worker.ready:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"rank {self.worker.config.rank} is still loading the model or forming its group; retry",
            )
        try:
            handle = self.worker.open_stream(frame.handshake)
        except HandshakeRejected as exc:
            log.warning("handshake refused", extra={"reason": str(exc)})
            await self._readiness()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        await self._readiness()
        try:
            await context.write(worker_pb2.StepResponse(handshake_ack=self.worker.ack()))
            await self._serve(handle, context)
        finally:
            self.worker.close_stream(handle)
            await self._readiness()

    async def _readiness(self) -> None:
        if self._report_readiness is not None:
            await self._report_readiness(self.worker.serving)

    async def _next(self, handle: StreamHandle, context, superseded: asyncio.Future):
        """The next frame, or None when the stream was superseded."""
        read = asyncio.ensure_future(context.read())
        await asyncio.wait({read, superseded}, return_when=asyncio.FIRST_COMPLETED)
        if not read.done():
            read.cancel()
            return None
        return read.result()

    async def _serve(self, handle: StreamHandle, context) -> None:
        rank = self.worker.config.rank
        superseded = asyncio.ensure_future(handle.superseded.wait())
        received = _Received()
        try:
            while True:
                # read_ahead: a control rank 0 read while the step before it ran (it carried that step's late masks)
                read_ahead = bool(received.ahead)
                frame = received.ahead.pop() if read_ahead else await self._next(handle, context, superseded)
                if frame is None or handle.superseded.is_set():
                    await context.abort(
                        grpc.StatusCode.ABORTED,
                        f"stream of epoch {handle.epoch} superseded by a stream of epoch {handle.superseded_by}",
                    )
                if frame is grpc.aio.EOF:
                    return
                if isinstance(frame, Unparsable):  # the stream's state is dropped (close_stream)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, frame.message)
                if not read_ahead:  # else counted when it was read
                    received.payload_bytes += self._count(frame)
                kind = frame.WhichOneof("frame")
                if kind == "payload":
                    if handle.pending_error is None:
                        a0 = time.perf_counter()  # per frame (tens of KB to MBs), not per token
                        try:
                            handle.session.receive_payload(frame.payload)
                        except StepError as exc:
                            handle.pending_error = exc  # reported with the step, after the peers agree
                        received.assemble_seconds += time.perf_counter() - a0
                elif kind == "keepalive":
                    await context.write(worker_pb2.StepResponse(keepalive=frame.keepalive))
                elif kind == "control":
                    if not read_ahead and frame.control.HasField("prior_masks") and rank == 0:
                        await self._refuse_late(handle, context, frame.control.prior_masks.step_id, "prior_masks")
                        return
                    if not await self._step(handle, context, frame.control, received, superseded):
                        return
                elif kind == "late_token_masks":  # none is awaited between steps
                    await self._refuse_late(handle, context, frame.late_token_masks.step_id, "late_token_masks")
                    return
                else:
                    await context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"unexpected {kind} frame on an open stream (epoch {handle.epoch})",
                    )
        finally:
            superseded.cancel()

    async def _step(self, handle: StreamHandle, context, control, received: _Received, superseded) -> bool:
        """Applies one control, on the compute thread or for a short step on this one (``worker_svc/inline_steps.py``),
        and writes its answer; False when the step was refused (the stream ends). On rank 0, a control with
        ``masks_follow`` comes back from its forward unsampled: this reads its late masks and samples it
        (``Worker.finish_step``, here on a rank of one thread; ``worker_svc/late_masks.py``)."""
        rank = self.worker.config.rank
        t0 = time.perf_counter()
        with _rank_step_span(control, rank):
            try:
                if self.worker.compute_idle and self.worker.inline.fits(control):
                    self.metrics.steps.labels("event_loop").inc()
                    outcome = self.worker.apply_step(handle, control)  # short: worker_svc/inline_steps.py
                else:
                    self.metrics.steps.labels("compute").inc()
                    outcome = await asyncio.wrap_future(self.worker.on_compute(self.worker.apply_step, handle, control))
                if isinstance(outcome, SamplesAwaitMasks):
                    late = handle.session.late_masks_of(control)
                    masks = await self._read_late_masks(context, late, superseded, received)
                    if handle.superseded.is_set():
                        return True  # the next read reports it
                    if self.worker.loop_computes:
                        outcome = self.worker.finish_step(control, outcome, masks)
                    else:
                        finish = self.worker.on_compute(self.worker.finish_step, control, outcome, masks)
                        outcome = await asyncio.wrap_future(finish)
            except StepError as exc:
                if handle.superseded.is_set():
                    return True  # the next read reports it
                await self._refuse(handle, context, exc, control.step_id, rank)
                return False
            if handle.superseded.is_set():
                return True  # the next read reports it
            result = step_result(
                control.step_id, rank, outcome, handle, received.payload_bytes, t0, received.assemble_seconds
            )
            received.payload_bytes, received.assemble_seconds = 0, 0.0
            await context.write(worker_pb2.StepResponse(step_result=result))
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        return True

    async def _read_late_masks(self, context, late: LateMasks, superseded, received: _Received) -> dict:
        """The late masks of a step whose forward is done (request -> TokenMask), read from the stream: a
        ``LateTokenMasks`` frame, or the next control carrying them in ``prior_masks`` (kept in ``received.ahead``
        for after this step's answer). Keepalives are answered meanwhile. Raises ``StepError`` for any other frame
        (the scheduler writes the masks before anything else of a later step), for the stream's end or its
        supersession, and past ``late.timeout`` seconds."""
        deadline = time.monotonic() + late.timeout
        while True:
            read = asyncio.ensure_future(context.read())
            done, _ = await asyncio.wait(
                {read, superseded}, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
            )
            if read not in done:  # superseded, or past the bound
                read.cancel()
                await asyncio.gather(read, return_exceptions=True)
                if superseded in done:
                    raise StepError(code.STATE_MISMATCH, f"the stream was superseded while {late.waiting}")
                raise late.timed_out()
            frame = read.result()
            if frame is grpc.aio.EOF or isinstance(frame, Unparsable):
                why = "the stream ended" if frame is grpc.aio.EOF else frame.message
                raise StepError(code.STATE_MISMATCH, f"{why} while {late.waiting}")
            self._count(frame)
            kind = frame.WhichOneof("frame")
            if kind == "keepalive":
                await context.write(worker_pb2.StepResponse(keepalive=frame.keepalive))
            elif kind == "late_token_masks":
                return late.take(frame.late_token_masks)
            elif kind == "control" and frame.control.HasField("prior_masks"):
                masks = late.take(frame.control.prior_masks)
                received.ahead.append(frame)  # applied once this step is answered
                return masks
            else:
                why = f"a {kind} frame came while {late.waiting}; the masks must come first (or in prior_masks)"
                raise StepError(code.STATE_MISMATCH, why)

    async def _refuse_late(self, handle: StreamHandle, context, step_id: int, field: str) -> None:
        """Refuses late masks no step of the stream waits for (``field``: where they came)."""
        rank = self.worker.config.rank
        why = (
            f"{field} for step {step_id}: no step of this stream waits for late masks (rank {rank}; only rank 0 "
            "takes them, while it runs a StepControl that announced masks_follow)"
        )
        await self._refuse(handle, context, StepError(code.STATE_MISMATCH, why), step_id, rank)

    async def _refuse(self, handle: StreamHandle, context, exc: StepError, step_id: int, rank: int) -> None:
        """Reports a refused step and ends the stream; its state is dropped."""
        self.metrics.protocol_errors.labels(code=code_name(exc.code)).inc()
        log.warning(
            "step refused",
            extra={
                "step_id": step_id,
                "code": code_name(exc.code),
                "reason": exc.message,
                "request_id": exc.request_id,
            },
        )
        await context.write(worker_pb2.StepResponse(error=exc.to_proto(step_id, rank)))
