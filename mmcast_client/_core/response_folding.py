"""A stream's responses folded into Deltas and one Result; a failed stream's error given the output so far."""

from __future__ import annotations

import time

from mmcast.v1 import generation_pb2 as pb
from mmcast_client.errors import Internal, MmcastError, from_google_rpc_code
from mmcast_client.types import FINISH_REASONS, Delta, Result, TokenLogprob, Usage, seconds


class Accumulator:
    """Collects one stream's deltas into a Result; times are measured from `started` (time.monotonic())."""

    def __init__(self, request_id: str, started: float) -> None:
        self.request_id = request_id
        self.started = started
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.first_token_at: float | None = None

    @property
    def tokens_seen(self) -> bool:
        return self.first_token_at is not None

    def delta(self, msg: pb.TokenDelta) -> Delta:
        if msg.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        ids = tuple(msg.token_ids)
        lps = tuple(TokenLogprob.from_proto(lp) for lp in msg.logprobs)
        self.token_ids.extend(ids)
        self.text.append(msg.text)
        self.logprobs.extend(lps)
        return Delta(ids, msg.text, lps)

    def partial(self, error: MmcastError) -> MmcastError:
        """`error` carrying the output received so far (a stream that failed after its first token)."""
        error.token_ids = tuple(self.token_ids)
        error.text = "".join(self.text)
        error.logprobs = tuple(self.logprobs)
        if self.token_ids:
            error.message += f" (after {len(self.token_ids)} tokens; they are on this error's token_ids and text)"
            error.args = (f"{error.code.name}: {error.message}",)
        return error

    def final(self, msg: pb.GenerateFinal) -> Result:
        """The Result, or the typed exception of a final message with FINISH_REASON_ERROR."""
        if msg.finish_reason == pb.FINISH_REASON_ERROR:
            raise from_google_rpc_code(msg.error.grpc_code, msg.error.message or "generation failed on the server")
        now = time.monotonic()
        return Result(
            request_id=msg.request_id or self.request_id,
            token_ids=tuple(self.token_ids),
            text="".join(self.text),
            logprobs=tuple(self.logprobs),
            finish_reason=FINISH_REASONS.get(msg.finish_reason, "unspecified"),
            usage=Usage.from_proto(msg.usage),
            stop_reason=msg.stop_reason,
            server_ttft_seconds=seconds(msg.timings.time_to_first_token),
            server_total_seconds=seconds(msg.timings.total_time),
            queue_seconds=seconds(msg.timings.queue_time),
            ttft_seconds=(self.first_token_at if self.first_token_at is not None else now) - self.started,
            total_seconds=now - self.started,
            live=_live_state(msg.live) if msg.HasField("live") else None,
        )


def _live_state(msg: pb.LiveSessionState) -> dict:
    fields = ("session_id", "turns", "tokens", "evicted_turns", "next_position", "closed")
    return {name: getattr(msg, name) for name in fields}


def no_final_error(request_id: str) -> MmcastError:
    return Internal(message=f"the stream of request {request_id} ended without a final message")
