"""What a door hands the engine for one request: the conversation's turns and their parts, the sampling spec, a live
session's turn. Plain frozen dataclasses; the doors build them with every limit checked (doors/request_parsing.py),
the engine and the core read them."""

from __future__ import annotations

import dataclasses

from common import penalties
from common.video_input import VideoOptions


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """Validated sampling parameters of one request."""

    max_tokens: int  # >= 1
    temperature: float  # [0, 2]; below 1e-5 (GREEDY_EPSILON, worker_svc/sampling.py) = greedy
    top_p: float  # (0, 1]
    top_k: int  # [0, vocab_size]; 0 = no top-k cut
    seed: int | None  # None: the server picks one
    stop: tuple[str, ...]  # stop strings, matched on the server
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int  # top alternatives per token
    return_logprobs: bool
    penalties: penalties.Penalties = penalties.NONE  # presence/frequency/repetition, logit_bias, min_tokens


@dataclasses.dataclass(frozen=True)
class TextContent:
    text: str


@dataclasses.dataclass(frozen=True)
class ImageContent:
    data: bytes | None  # encoded image bytes
    uploaded_sha256: str | None  # reference to an upload
    field: str  # where it came from, for error messages: "messages[1].content[0].image"
    data_sha256: str | None = None  # sha256 hex of ``data``, where the door computed it (so it is hashed once)


@dataclasses.dataclass(frozen=True)
class VideoContent:
    data: bytes | None  # the container file's bytes
    uploaded_sha256: str | None  # reference to an upload
    field: str  # where it came from, for error messages: "messages[1].content[0].video"
    video_options: VideoOptions  # how to sample it (unset options: the model's video processor defaults)
    data_sha256: str | None = None  # sha256 hex of ``data``, where the door computed it (so it is hashed once)


@dataclasses.dataclass(frozen=True)
class Turn:
    role: str  # system | user | assistant | tool
    parts: tuple[TextContent | ImageContent | VideoContent, ...]
    tool_calls: tuple[dict, ...] = ()  # an assistant turn's calls: {"name": str, "arguments": dict} (the template's)


@dataclasses.dataclass(frozen=True)
class LiveSpec:
    """``GenerateRequest.live``: the session a turn continues (``scheduler_svc/core/live_sessions.py``)."""

    session_id: str
    keep_turns: int  # 0: the server's default
    close: bool
