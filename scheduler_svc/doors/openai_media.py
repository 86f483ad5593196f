"""The media parts of an OpenAI chat body: ``image_url`` / ``video_url`` parts as the engine's turns, by URL
(media_urls.py) or by the ``uuid`` of a file the server holds (media_aliases.py), and the inline files kept in the
upload store once their request is admitted. Part of the HTTP API (openai_api.py)."""

from __future__ import annotations

import hashlib

from common.errors import MmcastError
from scheduler_svc.doors import media_aliases, openai_schema, request_parsing, tool_calls
from scheduler_svc.doors.openai_bodies import ROLES, Call
from scheduler_svc.doors.openai_errors import HttpError
from scheduler_svc.engine.request_input import ImageContent, TextContent, Turn, VideoContent


class MediaParts:
    """A chat body's messages as the engine's turns (mixed into ``OpenAIApi``)."""

    async def _turns(self, call: Call, messages, video_options=None) -> list[Turn]:
        turns = []
        for i, m in enumerate(messages):
            calls = tool_calls.turn_calls(m, i)
            if m.content is None and not calls:
                raise HttpError(
                    400,
                    f"messages[{i}].content is missing: send text or image parts (or, from the assistant, tool_calls)",
                    param=f"messages[{i}].content",
                    code="invalid_value",
                )
            parts: list[TextContent | ImageContent | VideoContent] = []
            content = (
                [openai_schema.TextContentPart(type="text", text=m.content)]
                if isinstance(m.content, str)
                else m.content or []
            )
            for j, part in enumerate(content):
                if part.type == "text":
                    parts.append(TextContent(part.text))
                elif part.type == "video_url":
                    parts.append(await self._video(call, part, f"messages[{i}].content[{j}]", video_options))
                else:
                    parts.append(await self._image(call, part, f"messages[{i}].content[{j}]"))
            turns.append(Turn(ROLES[m.role], tuple(parts), calls))
        return turns

    async def _video(self, call: Call, part, where: str, options) -> VideoContent:
        """A ``video_url`` part: the same sources as an image, sampled as the request's video options say."""
        if options is None:
            options = request_parsing.video_options(
                f"{where}.video_url", fps=None, num_frames=None, max_frames=None, min_pixels=None, max_pixels=None
            )
        data, digest, field, sha = await self._media(call, part, where, "video")
        return VideoContent(data, digest, field, options, sha)

    async def _image(self, call: Call, part, where: str) -> ImageContent:
        return ImageContent(*await self._media(call, part, where, "image"))

    async def _media(self, call: Call, part, where: str, kind: str) -> tuple[bytes | None, str | None, str, str | None]:
        """An ``image_url`` / ``video_url`` part as (bytes, None, field, their sha256 hex) — a ``data:`` URL, or a
        remote or local URL where allowed — or as (None, sha256 hex, field, None) when the URL is null and ``uuid``
        names a file the server holds. A ``sha256:`` uuid beside bytes must be their sha256; a free-form one beside
        bytes names them for the tenant's later requests (media_aliases.py). The bytes are hashed once, here."""
        field = f"{where}.{kind}_url"
        url = getattr(part, f"{kind}_url")
        digest, alias = self._uuid_digest(part, where)
        if url is None and alias is not None:
            digest = self.aliases.lookup(call.tenant, alias)
            if digest is None:
                raise HttpError(
                    404,
                    f"{where}.uuid={alias!r} names no {kind} this tenant sent with that uuid (or it was evicted); "
                    f"send the {kind} with its uuid again",
                    type="not_found_error",
                    param=f"{where}.uuid",
                    code=f"{kind}_not_found",
                )
        if url is None:
            if digest is None:
                raise HttpError(
                    400,
                    f"{field} is null and {where}.uuid is not set: send the {kind} as a URL, or "
                    "reference one the server holds by its uuid",
                    param=field,
                    code="invalid_value",
                )
            call.uuid_fields[digest] = (f"{where}.uuid", part.uuid)
            return None, digest, field, None
        text = _data_url_key(url.url, kind)
        data, sha = self._sent_before(call, text)
        if data is None:
            data = await self.media.load(url.url, f"{field}.url", kind)  # a large data: URL decodes off the loop
            sha = hashlib.sha256(data).hexdigest()
            if text is not None:
                call.data_urls.append((text, sha))
        if digest is not None and digest != sha:
            raise HttpError(
                400,
                f"{where}.uuid=sha256:{digest} does not match the sha256 of the file's bytes ({sha})",
                param=f"{where}.uuid",
                code="invalid_value",
            )
        call.inline.append((sha, data))
        if alias is not None:
            call.aliases.append((alias, sha))
        return data, None, field, sha

    def _sent_before(self, call: Call, text: str | None) -> tuple[bytes | None, str | None]:
        """(bytes, their sha256 hex) of a ``data:`` URL (``text``: its ``_data_url_key``) this tenant sent before in
        an admitted request whose bytes the upload store still holds, or (None, None). The URL's text is hashed
        (~0.03 ms for a 50 KB image's base64) instead of decoded and its bytes hashed (~0.15 ms): a conversation
        resends every earlier image each turn. The same text always decodes to the same bytes, and one that
        decoded once as this kind of media passed the checks."""
        if text is None:
            return None, None
        sha = self.data_urls.lookup(call.tenant, text)
        if sha is None:
            return None, None
        try:
            return self.uploads.get(sha, tenant=call.tenant), sha
        except MmcastError:  # evicted from the store since: decoded again
            return None, None

    @staticmethod
    def _uuid_digest(part, where: str) -> tuple[str | None, str | None]:
        """(sha256 hex, None) for a ``sha256:<hex>`` uuid, (None, the id) for a free-form one, (None, None) without."""
        if part.uuid is None:
            return None, None
        try:
            return media_aliases.parse_uuid(part.uuid)
        except media_aliases.BadUuid as exc:
            raise HttpError(
                400, f"{where}.uuid={part.uuid[:80]!r} {exc}", param=f"{where}.uuid", code="invalid_value"
            ) from None

    def _keep_inline(self, call: Call) -> None:
        """Admitted: its inline images become referable by uuid in later requests of the tenant."""
        for sha, data in call.inline:
            try:
                self.uploads.put(data, sha256_hex=sha, tenant=call.tenant)
            except MmcastError:  # larger than the whole store: it stays usable inline only
                pass
        call.inline.clear()
        for alias, sha in call.aliases:
            self.aliases.register(call.tenant, alias, sha)
        call.aliases.clear()
        for text, sha in call.data_urls:
            self.data_urls.register(call.tenant, text, sha)
        call.data_urls.clear()


def _data_url_key(url: str, kind: str) -> str | None:
    """What a ``data:`` URL sent as ``kind`` ("image" or "video") is remembered by: the sha256 of its text; None
    for any other URL."""
    if not url.startswith("data:"):
        return None
    return f"{kind}:{hashlib.sha256(url.encode()).hexdigest()}"
