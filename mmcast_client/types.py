"""What the SDK returns: streamed deltas, the final result and the server's usage counters."""

from __future__ import annotations

import dataclasses
import warnings

from google.protobuf import duration_pb2

from mmcast.v1 import generation_pb2 as pb


def seconds(duration: duration_pb2.Duration) -> float:
    """A google.protobuf.Duration as float seconds (the SDK reports durations as seconds)."""
    return duration.ToNanoseconds() / 1e9


@dataclasses.dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float  # natural log


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # natural log of the generated token's probability
    top_logprobs: tuple[TopLogprob, ...] = ()  # most likely first; as many as `logprobs=` asked for

    @classmethod
    def from_proto(cls, msg: pb.TokenLogprob) -> TokenLogprob:
        return cls(msg.token_id, msg.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in msg.top_logprobs))


@dataclasses.dataclass(frozen=True)
class Delta:
    """Tokens produced since the previous delta of a stream."""

    token_ids: tuple[int, ...]
    text: str  # may lag a token at multi-byte boundaries; the deltas' texts concatenate to Result.text
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token when logprobs= was set (not None)


@dataclasses.dataclass(frozen=True)
class Usage:
    """The server's per-request counters (mmcast.v1.Usage); item counts (images and videos alike) are deliveries
    summed over ranks."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    images: int = 0  # images in the prompt
    images_sent: int = 0  # deliveries with payload
    images_stripped: int = 0  # deliveries whose payload the prefix cache made unnecessary
    images_rank_cached: int = 0  # deliveries the ranks already held
    payload_bytes_broadcast: int = 0  # payload bytes written to the ranks for this request
    payload_bytes_saved: int = 0  # bytes the `full` transfer mode would have written in addition
    preemptions: int = 0
    encoder_runs: int = 0  # vision-encoder runs over the group for this request's images
    encoder_output_bytes_shared: int = 0  # encoder-output bytes the owner rank shared with the others (sharded)
    image_cpu_seconds: float = 0.0  # the scheduler's CPU seconds on this request's images
    images_encoder_shared: int = 0  # deliveries replaced by the owner's encoder output (sharded placement)
    videos: int = 0  # videos in the prompt (the images_* and byte counters count videos as items too)

    @property
    def payload_bytes_full(self) -> int:
        """What `full` would have broadcast for this request: broadcast + saved."""
        return self.payload_bytes_broadcast + self.payload_bytes_saved

    @classmethod
    def from_proto(cls, msg: pb.Usage) -> Usage:
        fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls) if f.name != "image_cpu_seconds"}
        return cls(**fields, image_cpu_seconds=seconds(msg.image_cpu_time))


FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: "unspecified",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}


@dataclasses.dataclass(frozen=True)
class Result:
    """One finished generation."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...]  # one per token when logprobs= was set (not None), else empty
    finish_reason: str  # "stop" | "length" | "cancelled" (the server aborted it); errors raise instead
    usage: Usage
    stop_reason: str = ""  # the stop string or token that ended generation, if any
    server_ttft_seconds: float = 0.0  # on the server: request received -> first token sent
    server_total_seconds: float = 0.0
    queue_seconds: float = 0.0  # on the server: request received -> first scheduled
    ttft_seconds: float = 0.0  # on the client: generate() called (uploads included) -> first token received
    total_seconds: float = 0.0  # on the client: generate() called -> final message received
    live: dict | None = None  # a live session's turn: session_id, turns, tokens, evicted_turns, next_position, closed


@dataclasses.dataclass(frozen=True)
class Backoff:
    """The waits between gRPC's retries of UNAVAILABLE (the channel's `retryPolicy`): before retry n (1-based) gRPC
    waits a uniformly random time in [0, min(initial * multiplier**(n-1), maximum)] (its own jitter)."""

    initial: float = 0.1  # seconds, > 0
    maximum: float = 2.0  # cap on one wait, seconds, > 0
    multiplier: float = 2.0  # >= 1
    jitter: float | None = None  # deprecated and ignored: gRPC applies its own jitter

    def __post_init__(self) -> None:
        if self.initial <= 0 or self.maximum <= 0:
            raise ValueError(f"backoff initial={self.initial} and maximum={self.maximum} must be > 0 seconds")
        if self.multiplier < 1:
            raise ValueError(f"backoff multiplier={self.multiplier} must be >= 1")
        if self.jitter is not None:
            warnings.warn(
                "Backoff(jitter=) is deprecated and ignored: retries are gRPC's, which waits a uniformly random "
                "time up to each backoff step",
                DeprecationWarning,
                stacklevel=3,
            )
