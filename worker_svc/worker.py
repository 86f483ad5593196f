"""A rank as a plain object: it loads the model, admits scheduler streams and applies their steps on one compute
thread (short ones, on a rank of one intra-op thread, on the event loop's: ``worker_svc/inline_steps.py``). The gRPC
servicer only translates frames to calls on this object.

Failure policy:
- A failure of one request alone is that request's error, never the rank's: sampling (and its log-probabilities)
  runs on rank 0 after every collective of the step, so when it fails for one request (``Session._sample``) the
  group's state is intact; the StepResult lists the request in ``failures``, the scheduler fails it with INTERNAL
  and tells every rank to drop it in the next step's ``finished_request_ids``.
- A step the rank cannot apply is a ``StepError``: reported to the scheduler, the stream's state dropped, the
  rank keeps serving.
- With ``world_size > 1``, anything else failing during a step (a collective that timed out or lost its peer, a
  crash inside the sharded forward) leaves the group in an unknown state: the rank logs one clear line and exits
  non-zero, so the supervisor restarts the whole group. Only such faults of the rank or its group end a rank; if a
  request's input is what crashes the group, the scheduler's poison isolation (``scheduler_svc/core/poison.py``) finds
  and fails that request after the group's second failure with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import sys
import threading
import time

import torch

from common.hashing import model_fingerprint
from common.item_proto import PROTOCOL_VERSION
from mmcast.v1 import worker_pb2
from worker_svc.config import WorkerConfig
from worker_svc.handshake import EpochGate, HandshakeRejected, RankIdentity, check_handshake
from worker_svc.inline_steps import InlineSteps
from worker_svc.metrics import WorkerMetrics
from worker_svc.process_group import Group
from worker_svc.session import SamplesAwaitMasks, Session, StepOutcome
from worker_svc.step_errors import StepError, code, code_name

log = logging.getLogger(__name__)

EXIT_GROUP_FAILURE = 3  # exit status of a rank whose group failed during a step


def _exit_process(message: str, **extra: object) -> None:
    log.critical(message, extra=extra)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_GROUP_FAILURE)


@dataclasses.dataclass
class StreamHandle:
    """One admitted scheduler stream."""

    epoch: int
    session: Session
    superseded: asyncio.Event  # set (on the event loop) when a newer epoch takes over
    superseded_by: int = 0
    pending_error: StepError | None = None  # a payload frame failed; reported with the next control


def _pil_formats() -> set[str]:
    from PIL import Image

    Image.init()
    return set(Image.OPEN)


class Worker:
    def __init__(self, config: WorkerConfig, metrics: WorkerMetrics, *, fatal=_exit_process) -> None:
        self.config = config
        self.metrics = metrics
        self.fatal = fatal
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self._compute_lock = threading.Lock()
        self._compute_pending = 0  # tasks handed to the compute thread and not yet done
        # Torch work on the event loop's thread (short steps, a constrained step's sampling) only on a rank of one
        # intra-op thread: with more, that thread's work starts a second OpenMP team, and the runtime then throttles
        # the waiting of both (the compute thread's 16-request decode step at 2B widths, 2 threads: 33 -> 39 ms).
        self.loop_computes = config.threads == 1
        self.inline = InlineSteps(config.inline_step_max_ms / 1000 if self.loop_computes else 0.0)
        self.gate = EpochGate()
        self.runner = None
        self.image_processor = None
        self.processor = None
        self.group: Group | None = None
        self.identity: RankIdentity | None = None
        self.active: StreamHandle | None = None
        self.ready = False
        self.refused: str | None = None  # why the latest handshake was refused; None once one is admitted

    @property
    def serving(self) -> bool:
        """Readiness: loaded, and not locked out — a refused handshake with no stream active means the scheduler
        cannot use this rank (a stale-epoch lock-out, a wrong model or scheduler id), which an orchestrator must
        see. A refusal while a stream is active (a stray older scheduler) leaves the rank serving that stream."""
        return self.ready and (self.active is not None or self.refused is None)

    # --- start-up (compute thread) ---------------------------------------------------------------------------

    def load(self) -> None:
        """Forms the group and loads the model; blocking. Raises on failure."""
        from worker_svc.runner import ModelRunner, resolve_device

        torch.set_num_threads(self.config.threads)
        self.identity = RankIdentity(
            model_fingerprint=model_fingerprint(self.config.model),
            rank=self.config.rank,
            world_size=self.config.world_size,
            block_size=self.config.block_size,
            scheduler_id=self.config.scheduler_id,
        )
        self.group = Group(self.config, resolve_device(self.config.device, self.config.rank))
        self.runner = ModelRunner(self.config)
        # The model folder's own image processor, as the frontend loads it: encoded payloads are preprocessed here.
        from common.processor import load_processor

        self.processor = load_processor(self.config.model)  # the whole processor: some families count tokens there
        self.image_processor = self.processor.image_processor
        self.ready = True

    def ack(self) -> worker_pb2.HandshakeAck:
        c, r = self.config, self.runner
        return worker_pb2.HandshakeAck(
            protocol_version=PROTOCOL_VERSION,
            model_fingerprint=self.identity.model_fingerprint,
            rank=c.rank,
            world_size=c.world_size,
            kv_blocks=r.pool.num_blocks,  # --kv-blocks, or what the free memory allowed (kv_sizing.py)
            payload_cache_bytes=c.payload_cache_bytes,
            encoder_cache_tokens=c.encoder_cache_tokens,
            max_tensor_bytes=c.max_tensor_bytes,
            max_model_len=r.max_model_len,
            device=str(r.device),
            encoder_output_row_bytes=r.row_width * r.row_dtype.itemsize,
            last_sampled_input=True,
            late_token_masks=True,
        )

    # --- streams (event loop) --------------------------------------------------------------------------------

    def open_stream(self, hs: worker_pb2.Handshake) -> StreamHandle:
        """Admits a handshake (raises ``HandshakeRejected``); a newer epoch supersedes the active stream. Only
        authenticated peers get here when the rank has a token or mutual TLS (the interceptor or TLS refuses the
        rest before a frame is read), so only they can claim an epoch."""
        try:
            check_handshake(hs, self.identity)
            superseding = self.gate.admit(hs.scheduler_epoch)
        except HandshakeRejected as exc:
            self.refused = str(exc)
            self.metrics.handshakes_refused.inc()
            raise
        self.refused = None
        old = self.active
        if superseding and old is not None:
            old.superseded_by = hs.scheduler_epoch
            old.superseded.set()
            self.executor.submit(old.session.clear)  # after any step of the old stream still computing
            log.warning("stream superseded", extra={"old_epoch": old.epoch, "new_epoch": hs.scheduler_epoch})
        c = self.config
        session = Session(
            self.runner,
            rank=c.rank,
            payload_cache_bytes=c.payload_cache_bytes,
            encoder_cache_tokens=c.encoder_cache_tokens,
            max_tensor_bytes=c.max_tensor_bytes,
            metrics=self.metrics,
            group=self.group,
            images=self._image_input(hs),
            videos=self._video_input(hs),
            late_mask_timeout=c.late_mask_timeout_seconds,
        )
        self.active = StreamHandle(hs.scheduler_epoch, session, asyncio.Event())
        log.info("stream admitted", extra={"epoch": hs.scheduler_epoch, "scheduler_id": hs.scheduler_id})
        return self.active

    def _image_input(self, hs: worker_pb2.Handshake):
        """The checks and preprocessing of encoded payloads under the scheduler's limits (its --image-formats and
        --max-image-pixels, sent in the handshake); None when it allows no format."""
        from common.families import family_of
        from common.image_input import ImageInput
        from common.model_checks import read_config

        if not hs.image_formats or self.image_processor is None:
            return None
        formats = [f for f in hs.image_formats if f in _pil_formats()]
        if not formats:
            return None
        return ImageInput(
            self.image_processor,
            formats,
            hs.max_image_pixels or 1,
            family_of(read_config(self.config.model)),
            processor=self.processor,
        )

    def _video_input(self, hs: worker_pb2.Handshake):
        """The checks and preprocessing of encoded videos under the scheduler's --max-video-* limits (sent in the
        handshake); None when it sent none or the model folder has no video processor config."""
        from pathlib import Path

        from common.families import family_of
        from common.model_checks import read_config
        from common.video_input import VideoInput, VideoLimits

        folder = Path(self.config.model)
        if not hs.HasField("video_limits") or not (folder / "video_preprocessor_config.json").is_file():
            return None
        v = hs.video_limits
        limits = VideoLimits(
            max_bytes=v.max_bytes,
            max_frame_pixels=v.max_frame_pixels,
            max_duration_s=v.max_duration_seconds,
            max_total_frames=v.max_total_frames,
            max_sampled_frames=v.max_sampled_frames,
            max_streams=v.max_streams,
        )
        return VideoInput.from_model_dir(folder, limits, family_of(read_config(self.config.model)))

    def close_stream(self, handle: StreamHandle) -> None:
        if self.active is handle:
            self.active = None
            self.gate.release(handle.epoch)
        try:
            self.on_compute(handle.session.clear)
        except RuntimeError:  # the executor is shut down: the process is exiting, and its caches with it
            log.debug("stream closed during shutdown", extra={"epoch": handle.epoch})

    def on_compute(self, fn, *args) -> concurrent.futures.Future:
        """Runs ``fn(*args)`` on the compute thread (``compute_idle`` is False until it is done)."""

        def run():
            try:
                return fn(*args)
            finally:
                with self._compute_lock:
                    self._compute_pending -= 1

        with self._compute_lock:
            self._compute_pending += 1
        try:
            return self.executor.submit(run)
        except BaseException:
            with self._compute_lock:
                self._compute_pending -= 1
            raise

    @property
    def compute_idle(self) -> bool:
        """Nothing runs or waits on the compute thread: a step may run on the event loop's thread
        (``worker_svc/inline_steps.py``)."""
        return self._compute_pending == 0

    # --- steps (the compute thread, or the event loop's for short ones: worker_svc/inline_steps.py) --------------

    def apply_step(self, handle: StreamHandle, control: worker_pb2.StepControl) -> StepOutcome | SamplesAwaitMasks:
        """Plan, agree with the peers, then commit and execute. Raises ``StepError`` for a refused step. Rank 0
        returns a step that announced late masks unsampled (``finish_step`` samples it)."""
        t0 = time.perf_counter()
        try:
            return self._apply_step(handle, control)
        finally:
            self.inline.observe(control, time.perf_counter() - t0)

    def _apply_step(self, handle: StreamHandle, control: worker_pb2.StepControl) -> StepOutcome | SamplesAwaitMasks:
        error, checked = handle.pending_error, None
        if error is None:
            try:
                checked = handle.session.check(control)
            except StepError as exc:
                error = exc
            except Exception as exc:  # a bug in the step checks: refuse the step rather than run it
                log.exception("step checks failed", extra={"step_id": control.step_id})
                error = StepError(code.INTERNAL, f"step {control.step_id}: step checks failed: {exc!r}")
        try:
            agreed = self.group.agree(error.code if error else 0, handle.epoch, control.step_id)
        except Exception as exc:  # a lost or silent peer, or one voting on another step (GroupDesync)
            self.fatal(
                "tensor-parallel group failed while agreeing on a step; exiting so the group restarts",
                step_id=control.step_id,
                error=repr(exc),
            )
            raise
        if error is not None:
            raise error
        if agreed:
            raise StepError(
                agreed,
                f"step {control.step_id}: another rank of the group refused this step with {code_name(agreed)}; "
                "this rank drops the stream's state too",
            )

        def run() -> StepOutcome | SamplesAwaitMasks:
            handle.session.commit(checked)
            return handle.session.execute(checked)

        return self._executed(control, run)

    def finish_step(self, control: worker_pb2.StepControl, pending: SamplesAwaitMasks, masks: dict) -> StepOutcome:
        """Rank 0: the tokens of a step whose forward ``apply_step`` ran, under its late masks
        (``worker_svc/late_masks.py``); on the event loop's thread when ``loop_computes``, else on the compute
        thread. Failures are handled as in ``apply_step``."""
        return self._executed(control, lambda: pending.finish(masks))

    def _executed(self, control: worker_pb2.StepControl, run):
        """``run()``: a ``StepError`` passes; any other failure is the step's ``INTERNAL`` refusal, or with peers the
        rank's exit (the group's state is unknown)."""
        try:
            return run()
        except StepError:
            raise
        except Exception as exc:
            if self.config.world_size > 1:
                self.fatal(
                    "step failed inside the tensor-parallel group (collective timeout or lost peer); exiting so "
                    "the group restarts",
                    step_id=control.step_id,
                    error=repr(exc),
                    group_timeout_seconds=self.config.group_timeout_seconds,
                )
            log.exception("step failed", extra={"step_id": control.step_id})
            raise StepError(
                code.INTERNAL, f"step {control.step_id} failed on rank {self.config.rank}: {exc!r}"
            ) from exc
