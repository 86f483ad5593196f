"""Translation of client-API messages into domain objects, with every limit checked.

Pure functions: no gRPC here. Errors are ``common.errors`` exceptions whose message names the field, the value,
the limit and the flag that moves it, and whose ``fields`` give the field's path in the request (the same path the
message starts with); the servicer maps them to status codes and details.
"""

from __future__ import annotations

import math
import re

from common import penalties
from common.errors import InvalidArgument
from common.video_input import VideoOptions
from mmcast.v1 import generation_pb2
from scheduler_svc.engine.request_input import (
    ImageContent,
    LiveSpec,
    SamplingSpec,
    TextContent,
    Turn,
    VideoContent,
)

ROLES = {
    generation_pb2.ROLE_SYSTEM: "system",
    generation_pb2.ROLE_USER: "user",
    generation_pb2.ROLE_ASSISTANT: "assistant",
}
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 256
# fullmatch, never match with "$": "$" also matches before a trailing newline.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]+")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


MAX_VIDEO_FPS = 60.0


def video_options(
    where: str,
    *,
    fps: float | None,
    num_frames: int | None,
    max_frames: int | None,
    min_pixels: int | None,
    max_pixels: int | None,
) -> VideoOptions:
    """The sampling options of one video part, each range checked (``where``: the part's field path)."""
    if fps is not None and not (math.isfinite(fps) and 0.0 < fps <= MAX_VIDEO_FPS):
        raise InvalidArgument(f"{where}.fps={fps} must be in (0, {MAX_VIDEO_FPS:g}]", field=f"{where}.fps")
    if fps is not None and num_frames is not None:
        raise InvalidArgument(
            f"{where}: fps and num_frames are exclusive (fps={fps:g}, num_frames={num_frames}); give one",
            field=f"{where}.num_frames",
        )
    for name, value in (("num_frames", num_frames), ("max_frames", max_frames)):
        if value is not None and value < 1:
            raise InvalidArgument(f"{where}.{name}={value} must be >= 1", field=f"{where}.{name}")
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and value < 1:
            raise InvalidArgument(f"{where}.{name}={value} must be >= 1", field=f"{where}.{name}")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise InvalidArgument(
            f"{where}: min_pixels={min_pixels} exceeds max_pixels={max_pixels}", field=f"{where}.min_pixels"
        )
    return VideoOptions(
        fps=fps, num_frames=num_frames, max_frames=max_frames, min_pixels=min_pixels, max_pixels=max_pixels
    )


def _source(message, where: str) -> tuple[bytes | None, str | None]:
    """``(data, uploaded_sha256)`` of an ImageInput or VideoInput, checked."""
    source = message.WhichOneof("source")
    if source == "data":
        if not message.data:
            raise InvalidArgument(f"{where}.data is empty", field=f"{where}.data")
        return message.data, None
    if source == "uploaded_sha256":
        digest = message.uploaded_sha256
        if not _SHA256_HEX.fullmatch(digest):
            raise InvalidArgument(
                f"{where}.uploaded_sha256={digest[:80]!r} is not 64 lowercase hex characters",
                field=f"{where}.uploaded_sha256",
            )
        return None, digest
    raise InvalidArgument(f"{where} has neither data nor uploaded_sha256", field=where)


def parse_sampling(
    p: generation_pb2.SamplingParams,
    *,
    max_tokens_limit: int,
    max_logprobs: int,
    vocab_size: int,
    max_tokens_known: bool = True,
) -> SamplingSpec:
    """``max_tokens_known`` False: ``p.max_tokens`` is a placeholder the context replaces after tokenizing
    (completion.py then checks min_tokens against the real value)."""
    if p.max_tokens < 1:
        raise InvalidArgument("sampling.max_tokens must be >= 1 (got 0 or unset)", field="sampling.max_tokens")
    if max_tokens_limit and p.max_tokens > max_tokens_limit:  # 0: the context alone bounds it (admission.py)
        raise InvalidArgument(
            f"sampling.max_tokens={p.max_tokens} exceeds the limit {max_tokens_limit} (--max-tokens-limit)",
            field="sampling.max_tokens",
        )
    if not math.isfinite(p.temperature) or not 0.0 <= p.temperature <= 2.0:
        raise InvalidArgument(f"sampling.temperature={p.temperature} must be in [0, 2]", field="sampling.temperature")
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p={top_p} must be in (0, 1]", field="sampling.top_p")
    # Above the vocabulary a top_k would be the same as none; refused so a client's mistake (a model with a smaller
    # vocabulary than it assumed) is told rather than silently sampled without the cut it asked for.
    if p.top_k > vocab_size:
        raise InvalidArgument(
            f"sampling.top_k={p.top_k} exceeds the model's vocabulary of {vocab_size} tokens (0 = no top-k cut)",
            field="sampling.top_k",
        )
    if p.logprobs > max_logprobs:
        raise InvalidArgument(
            f"sampling.logprobs={p.logprobs} exceeds the limit {max_logprobs} (--max-logprobs)",
            field="sampling.logprobs",
        )
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(
            f"sampling.stop has {len(p.stop)} strings; the limit is {MAX_STOP_STRINGS}", field="sampling.stop"
        )
    for i, s in enumerate(p.stop):
        if not s:
            raise InvalidArgument(f"sampling.stop[{i}] is empty", field=f"sampling.stop[{i}]")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(
                f"sampling.stop[{i}] has {len(s)} characters; the limit is {MAX_STOP_STRING_CHARS}",
                field=f"sampling.stop[{i}]",
            )
    for i, t in enumerate(p.stop_token_ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(
                f"sampling.stop_token_ids[{i}]={t} is outside the vocabulary [0, {vocab_size})",
                field=f"sampling.stop_token_ids[{i}]",
            )
    return SamplingSpec(
        max_tokens=p.max_tokens,
        temperature=float(p.temperature),
        top_p=float(top_p),
        top_k=int(p.top_k),
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        return_logprobs=p.return_logprobs or p.logprobs > 0,
        penalties=penalties.parse(p, vocab_size=vocab_size, max_tokens=p.max_tokens if max_tokens_known else None),
    )


def parse_messages(messages, *, max_images: int) -> list[Turn]:
    if not messages:
        raise InvalidArgument("messages is empty: at least one message with content is required", field="messages")
    turns: list[Turn] = []
    images = 0
    has_content = False
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidArgument(
                f"messages[{i}].role={m.role} is not a known role (ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT)",
                field=f"messages[{i}].role",
            )
        parts: list[TextContent | ImageContent | VideoContent] = []
        for j, part in enumerate(m.content):
            kind = part.WhichOneof("part")
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                parts.append(TextContent(part.text))
                has_content = has_content or bool(part.text.strip())
            elif kind == "image":
                data, digest = _source(part.image, f"{where}.image")
                parts.append(ImageContent(data, digest, f"{where}.image"))
                images += 1
                has_content = True
                if images > max_images:
                    raise InvalidArgument(
                        f"{where}: more than {max_images} images in one request (--max-images-per-request)",
                        field=where,
                    )
            elif kind == "video":
                v = part.video
                data, digest = _source(v, f"{where}.video")
                options = video_options(
                    f"{where}.video",
                    fps=v.fps if v.HasField("fps") else None,
                    num_frames=v.num_frames if v.HasField("num_frames") else None,
                    max_frames=v.max_frames if v.HasField("max_frames") else None,
                    min_pixels=v.min_pixels if v.HasField("min_pixels") else None,
                    max_pixels=v.max_pixels if v.HasField("max_pixels") else None,
                )
                parts.append(VideoContent(data, digest, f"{where}.video", options))
                has_content = True
            else:
                raise InvalidArgument(
                    f"{where} has no text, image or video (unknown or empty content part)", field=where
                )
        turns.append(Turn(ROLES[m.role], tuple(parts)))
    if not has_content:
        raise InvalidArgument("messages contain no text and no image: the prompt is empty", field="messages")
    return turns


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"request_id has {len(request_id)} characters; the limit is {MAX_REQUEST_ID_CHARS}", field="request_id"
        )
    if request_id and not _REQUEST_ID.fullmatch(request_id):
        raise InvalidArgument("request_id may contain only letters, digits and ._:@/+=-", field="request_id")


def check_cache_salt(salt: str) -> None:
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(
            f"cache_salt has {len(salt)} characters; the limit is {MAX_CACHE_SALT_CHARS}", field="cache_salt"
        )


_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def parse_live(msg) -> LiveSpec:
    if not _SESSION_ID.fullmatch(msg.session_id):
        raise InvalidArgument(
            f"live.session_id={msg.session_id[:40]!r} must be 1-128 characters of letters, digits and ._:-",
            field="live.session_id",
        )
    return LiveSpec(msg.session_id, int(msg.keep_turns), bool(msg.close))
