"""Chat-style messages (the shape Hugging Face chat templates take) -> `mmcast.v1.ChatMessage`s.

    [{"role": "user", "content": [{"type": "image", "image": "cat.jpg"}, {"type": "text", "text": "What is it?"}]},
     {"role": "assistant", "content": "A cat."}]

Content is a string or a list of parts, kept in order. Text parts: `{"type": "text", "text": ...}` or a bare string.
Image parts: `{"type": "image", "image": X}` (X as `images.ImageStore.resolve` takes), `{"type": "image", "path":
...}`, `{"type": "image", "url": ...}` or the OpenAI form `{"type": "image_url", "image_url": {"url": ...}}`.
Video parts: `{"type": "video", "video": X, "fps": 2.0}` (X a path, the container file's bytes, a data: URL or an
uploaded "sha256:<hex>"; sampling options `fps`, `num_frames`, `max_frames`, `min_pixels`, `max_pixels`, each
optional: the model's video processor defaults otherwise) or the OpenAI form `{"type": "video_url", "video_url":
{"url": ...}}`. Videos upload and travel by hash exactly as images do.
Conversion runs in two steps so the client can upload between them: `prepare` resolves every image to its hash,
`to_proto` emits each image as bytes or as an uploaded reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

from mmcast.v1 import generation_pb2 as pb
from mmcast_client.errors import InvalidArgument, NotFound
from mmcast_client.images import ImageRef, ImageStore

ROLES = {"system": pb.ROLE_SYSTEM, "user": pb.ROLE_USER, "assistant": pb.ROLE_ASSISTANT}

VIDEO_OPTIONS = ("fps", "num_frames", "max_frames", "min_pixels", "max_pixels")


@dataclasses.dataclass(frozen=True)
class VideoPart:
    """A video in a message: its file (resolved like an image) and how to sample it (None: the server's default)."""

    ref: ImageRef
    fps: float | None = None
    num_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None

    def to_proto(self, source: dict) -> pb.VideoInput:
        options = {k: getattr(self, k) for k in VIDEO_OPTIONS if getattr(self, k) is not None}
        return pb.VideoInput(**source, **options)


Part = str | ImageRef | VideoPart


@dataclasses.dataclass
class Prepared:
    """Messages with every image resolved; `images` lists each distinct image once, in first-use order."""

    messages: list[tuple[pb.Role, list[Part]]]  # (role, parts in order)
    images: list[ImageRef]


def normalize(messages: str | Sequence[dict], images: Sequence[Any] | None) -> Sequence[dict]:
    """The shortcut `generate("prompt", images=[...])` is one user turn: the images first, then the text."""
    if isinstance(messages, str):
        content: list[dict] = [{"type": "image", "image": image} for image in images or ()]
        content.append({"type": "text", "text": messages})
        return [{"role": "user", "content": content}]
    if images:
        raise InvalidArgument(message="images= goes with a prompt string; with messages, put images in the content")
    if isinstance(messages, dict) or not isinstance(messages, Sequence):
        raise InvalidArgument(
            message=f"messages must be a list of dicts or a prompt string, not {type(messages).__name__}"
        )
    return cast(Sequence[dict], messages)


def prepare(messages: Sequence[dict], store: ImageStore) -> Prepared:
    if not messages:
        raise InvalidArgument(message="messages is empty; give at least one message")
    out: list[tuple[pb.Role, list[Part]]] = []
    seen: dict[str, ImageRef] = {}
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidArgument(message=f"{where} is a {type(message).__name__}, not a dict with role and content")
        role = ROLES.get(message.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise InvalidArgument(message=f"{where}.role={message.get('role')!r}; use one of {sorted(ROLES)}")
        content = message.get("content")
        if isinstance(content, str):
            out.append((role, [content]))
            continue
        if not isinstance(content, Sequence):
            raise InvalidArgument(message=f"{where}.content must be a string or a list of parts")
        parts: list[Part] = []
        for j, part in enumerate(content):
            part_where = f"{where}.content[{j}]"
            item = _part(part, part_where, store)
            ref = item.ref if isinstance(item, VideoPart) else item
            if isinstance(ref, ImageRef):
                # Keep the first reference that carries bytes or a path, so later duplicates need no lookup.
                known = seen.get(ref.sha256)
                if known is None or (known.data is None and known.path is None):
                    seen[ref.sha256] = ref
            parts.append(item)
        out.append((role, parts))
    return Prepared(out, list(seen.values()))


def to_proto(
    prepared: Prepared, by_hash: Callable[[ImageRef], bool], load: Callable[[ImageRef], bytes | None]
) -> list[pb.ChatMessage]:
    """`by_hash(ref)`: reference the upload; otherwise the bytes from `load(ref)` go inline."""
    inline: dict[str, bytes] = {}
    result = []
    for role, parts in prepared.messages:
        msg = pb.ChatMessage(role=role)
        for part in parts:
            if isinstance(part, str):
                msg.content.add(text=part)
                continue
            ref = part.ref if isinstance(part, VideoPart) else part
            if by_hash(ref):
                source: dict = {"uploaded_sha256": ref.sha256}
            else:
                data = inline.get(ref.sha256)
                if data is None:
                    data = load(ref)
                    if data is None:
                        raise NotFound(
                            message=f"file sha256:{ref.sha256} is not known to this client, so it cannot be sent "
                            "inline; upload it with this client first or pass its bytes or path"
                        )
                    inline[ref.sha256] = data
                source = {"data": data}
            if isinstance(part, VideoPart):
                msg.content.add(video=part.to_proto(source))
            else:
                msg.content.add(image=pb.ImageInput(**source))
        result.append(msg)
    return result


def _part(part: Any, where: str, store: ImageStore) -> Part:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise InvalidArgument(message=f"{where} is a {type(part).__name__}; parts are dicts with a 'type'")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidArgument(message=f"{where}.text must be a string, got {type(text).__name__}")
        return text
    if kind == "image":
        for key in ("image", "path", "url"):
            if part.get(key) is not None:
                return store.resolve(part[key], f"{where}.{key}")
        raise InvalidArgument(message=f"{where}: an image part needs 'image' (or 'path' or 'url')")
    if kind in ("video", "video_url"):
        return _video_part(part, where, store)
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise InvalidArgument(message=f"{where}.image_url.url must be a string")
        return store.resolve(url, f"{where}.image_url.url")
    raise InvalidArgument(
        message=f"{where}.type={kind!r}; supported part types: 'text', 'image', 'image_url', 'video', 'video_url'"
    )


def _video_part(part: dict, where: str, store: ImageStore) -> VideoPart:
    source: Any
    if part.get("type") == "video_url":
        url = part.get("video_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise InvalidArgument(message=f"{where}.video_url.url must be a string")
        source, key = url, "video_url.url"
    else:
        found = next((k for k in ("video", "path", "url") if part.get(k) is not None), None)
        if found is None:
            raise InvalidArgument(message=f"{where}: a video part needs 'video' (or 'path' or 'url')")
        source, key = part[found], found
    if not isinstance(source, str | bytes | bytearray | memoryview) and not hasattr(source, "__fspath__"):
        raise InvalidArgument(
            message=f"{where}.{key}: a video is a path, the file's bytes, a data: URL or an uploaded 'sha256:<hex>' "
            f"reference, not {type(source).__name__}"
        )
    options: dict[str, Any] = {}
    for name in VIDEO_OPTIONS:
        value = part.get(name)
        if value is None:
            continue
        integer = name != "fps"
        ok = not isinstance(value, bool) and isinstance(value, int if integer else int | float)
        if not ok or value <= 0:
            kind = "an integer >= 1" if integer else "a number > 0"
            raise InvalidArgument(message=f"{where}.{name}={value!r} must be {kind}")
        options[name] = float(value) if name == "fps" else int(value)
    return VideoPart(store.resolve(source, f"{where}.{key}"), **options)
