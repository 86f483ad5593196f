"""The one log record every admitted request leaves when it ends, whatever the reason (docs/ARCHITECTURE.md §2.7).

The numbers are those the client's ``GenerateFinal`` carries (its ``Usage`` and ``Timings`` are built from the same
``RequestSummary``), so a line can be matched to what a caller saw; a request whose client left, or that failed
before its first token, gets the line too (the client got no final message). Requests refused before admission
have their own "request rejected" line.
"""

from __future__ import annotations

import dataclasses
import logging

FINISHED_MESSAGE = "request finished"


@dataclasses.dataclass(frozen=True)
class RequestSummary:
    request_id: str  # the engine's id (tenant-scoped, as every other line of the request)
    tenant: str  # "" when authentication is off; then the record carries no tenant key
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int  # image placeholders included
    completion_tokens: int  # tokens streamed to the client
    cached_tokens: int  # prompt tokens found in the prefix cache
    images: int  # images in the prompt
    payload_bytes_broadcast: int  # payload tensor bytes written to the ranks for it, summed over ranks
    payload_bytes_saved: int  # bytes `full` would have written for its items that were not sent, summed over ranks
    preemptions: int
    time_to_first_token_seconds: float | None  # None: no token was streamed
    total_seconds: float  # request received -> finished (the e2e latency)
    queue_seconds: float  # request received -> first step that scheduled it (total_seconds if never scheduled)
    # Its TTFT breakdown, stage -> seconds, for the stages measured (scheduler_svc/engine/stage_timing.py defines them):
    # the record's ttft_<stage>_seconds keys.
    stage_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    videos: int = 0  # videos in the prompt
    error_code: str = ""  # the gRPC status name when finish_reason is "error"
    error: str = ""  # its message

    def record(self) -> dict[str, object]:
        """The log record's keys (added to the JSON line beside ts, time, level, msg ...)."""
        out: dict[str, object] = {
            "request_id": self.request_id,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "images": self.images,
            "videos": self.videos,
            "payload_bytes_broadcast": self.payload_bytes_broadcast,
            "payload_bytes_saved": self.payload_bytes_saved,
            "preemptions": self.preemptions,
            "time_to_first_token_seconds": _seconds(self.time_to_first_token_seconds),
            "total_seconds": _seconds(self.total_seconds),
            "queue_seconds": _seconds(self.queue_seconds),
        }
        for stage, seconds in self.stage_seconds.items():
            out[f"ttft_{stage}_seconds"] = _seconds(seconds)
        if self.tenant:
            out["tenant"] = self.tenant
        if self.error_code:
            out["error_code"], out["error"] = self.error_code, self.error
        return out

    def log(self, logger: logging.Logger) -> None:
        logger.info(FINISHED_MESSAGE, extra=self.record())


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
