"""The stages of one request up to its first token (its TTFT breakdown): the finished-request log line's
``ttft_<stage>_seconds`` keys and the histogram ``mmcast_request_stage_seconds{stage}`` (docs/METRICS.md).

Each stage is measured where its work is done, with a few clock reads per request and per step and none per token;
a step's numbers are kept by reference and read only for the requests whose first token that step produced.

The *disjoint* stages follow one another in time, so on one request they sum to at most its TTFT as the client
sees it (the gaps between them, such as the earlier prefill chunks of a long prompt or the wait for the step
loop's turn, belong to no stage):

- ``http_parse``: the call arrived → the door handed the parsed request to the request path. HTTP: reading and
  validating the body and loading its image URLs; gRPC: the caller's tenant and translating the message (grpc
  parses the protobuf before the handler starts, so that part is not seen).
- ``frontend``: chat template, image headers, hashing and tokenization on the frontend's threads (the wait for a
  free thread included).
- ``queue``: queued in the engine → the start of the ``schedule()`` that first schedules it (a resumed request
  keeps its first).
- ``schedule``, ``step_send``, ``rank``, ``result_back``: the step that produced the first token. ``schedule`` is the
  core's ``schedule()``; ``step_send`` building the ``StepControl``, serializing it and writing the payload frames
  and the control to every rank stream; ``rank`` the slowest rank's own step time (control received → answer
  sent, ``WorkerStepStats.step_time``); ``result_back`` the round trip (control written → every answer read) less
  ``rank``: the streams' latency both ways. The three add up to the step's time from the end of ``schedule`` to
  the last answer; a rank that starts before the writes to its peers end has that overlap counted in ``rank``.
- ``detokenize``: the first token's text.
- ``first_byte``: the engine delivered the first token → the door handed its message to the server's transport
  (grpc's write, uvicorn's send), less ``detokenize``. Streamed answers only (gRPC, HTTP with ``stream``): a
  whole HTTP answer is written after its last token.

The *parts* of a step on the ranks, of the same step, each the largest over the ranks: ``rank_encode`` (the
vision encoder, image decoding included: the owner's under sharded placement), ``rank_forward`` (the language
model), ``rank_sample`` (rank 0) lie inside ``rank``; ``rank_assemble`` (assembling the step's payload frames as
they arrive) overlaps ``step_send``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

DISJOINT_STAGES = (
    "http_parse",
    "frontend",
    "queue",
    "schedule",
    "step_send",
    "rank",
    "result_back",
    "detokenize",
    "first_byte",
)
RANK_PARTS = ("rank_assemble", "rank_encode", "rank_forward", "rank_sample")
STAGES = DISJOINT_STAGES + RANK_PARTS


def _seconds(duration) -> float:
    return duration.ToNanoseconds() / 1e9


@dataclasses.dataclass(slots=True)
class StepTimes:
    """One step's scheduler-side durations and its ranks' answers (``StepResult``), read on demand."""

    schedule: float
    send: float  # schedule() returned → StepControl built, serialized and written to every rank, payload frames first
    round_trip: float  # control written to every rank → every rank's answer read
    results: Sequence  # the ranks' StepResults, index = rank

    def stages(self) -> dict[str, float]:
        stats = [r.stats for r in self.results]
        window = self.send + self.round_trip
        rank = min(window, max((_seconds(s.step_time) for s in stats), default=0.0))
        # A rank whose control was written first starts the step while the writes to its peers go on, so the
        # rank's time may begin inside the send: the three stages split the step's window without counting that
        # overlap twice (it counts as rank).
        back = max(0.0, self.round_trip - rank)
        return {
            "schedule": self.schedule,
            "step_send": window - rank - back,
            "rank": rank,
            "result_back": back,
            "rank_assemble": max((_seconds(s.assemble_time) for s in stats), default=0.0),
            "rank_encode": max((_seconds(s.encoder_time) for s in stats), default=0.0),
            "rank_forward": max((_seconds(s.forward_time) for s in stats), default=0.0),
            "rank_sample": max((_seconds(s.sample_time) for s in stats), default=0.0),
        }


@dataclasses.dataclass(slots=True)
class RequestStages:
    """What is known of one request's stages so far; each field is set once, by the part that measures it."""

    http_parse: float | None = None
    frontend: float | None = None
    queue: float | None = None
    first_token_step: StepTimes | None = None
    detokenize: float | None = None
    first_byte: float | None = None

    def seconds(self) -> dict[str, float]:
        """Stage → seconds, for the stages measured (in ``STAGES`` order)."""
        out = {
            name: value
            for name, value in (
                ("http_parse", self.http_parse),
                ("frontend", self.frontend),
                ("queue", self.queue),
            )
            if value is not None
        }
        if self.first_token_step is not None:
            out.update(self.first_token_step.stages())
        if self.detokenize is not None:
            out["detokenize"] = self.detokenize
        if self.first_byte is not None:
            out["first_byte"] = self.first_byte
        return {name: out[name] for name in STAGES if name in out}
