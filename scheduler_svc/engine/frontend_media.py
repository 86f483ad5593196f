"""The frontend's images and videos (frontend.py): each part resolved (inline bytes or an upload, the processor
cache), its header checked, its tokens against the context, then decoded and preprocessed (``pixels``) or kept as
the file (``encoded``), and the template's placeholders expanded into one item per part. The processor cache keeps
either form of an image, so one seen before is neither decoded (``pixels``) nor opened and hashed again
(``encoded``); a request that fails afterwards takes its additions out again (``Frontend.forget``)."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any

import torch

from common.errors import InvalidArgument, ResourceExhausted
from common.hashing import item_identifier
from common.ids import ItemId
from common.image_header import ImageHeader
from common.multimodal import (
    ENCODED_FIELD,
    FRAME_INDICES_FIELD,
    VIDEO_ENCODED_FIELD,
    FieldKind,
    Modality,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PayloadEncoding,
    PlaceholderRange,
)
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import admission


@dataclasses.dataclass(frozen=True)
class _Processed:
    """One image ready for the prompt, as the processor cache keeps it (tensors are shared, never mutated)."""

    identifier: ItemId
    payload: Any  # pixels: (patches, patch_dim) float pixel_values; encoded: the file's bytes, 1-D uint8
    grid_thw: Any  # (1, 3) int64 tensor: keep_on_cpu metadata; None for a family without a grid field
    num_tokens: int  # placeholder tokens in the prompt
    encoding: PayloadEncoding = PayloadEncoding.PIXELS
    modality: Modality = Modality.IMAGE
    frame_indices: Any = None  # a video's sampled frames, 1-D int64 (encoded payloads: the rank decodes these)
    second_per_grid_t: Any = None  # a video's seconds per temporal patch, (1,) float32 (Qwen2.5-VL positions)
    # What replaces the template's one placeholder when it is more than num_tokens placeholders (Qwen3-VL's video:
    # a timestamp, then its own start/end tokens around each temporal patch), and which of those tokens take rows.
    placeholder_ids: list[int] | None = None
    is_embed: list[bool] | None = None


@dataclasses.dataclass
class _Pending:
    """One image of a request between its header check and its decoding."""

    field: str  # where it came from, for errors
    key: tuple[str, str]  # (tenant, sha256 of the encoded bytes): the processor-cache key
    data: bytes  # the encoded bytes
    cached: _Processed | None = None  # a processor-cache hit: nothing to decode
    image: Any = None  # else: the PIL image opened lazily (header read, pixels not decoded)
    header: ImageHeader | None = None
    tokens: int = 0  # placeholder tokens (from the cache or predicted from the header)
    video: Any = None  # a video: its VideoHeader (container header only) ...
    plan: Any = None  # ... and its VideoPlan (frames, grid, tokens), nothing decoded

    def describe(self) -> str:
        if self.cached is not None and self.cached.modality is Modality.VIDEO:
            return "the video"
        if self.video is not None:
            v = self.video
            return f"the {v.width}x{v.height} video ({len(self.plan.frame_indices)} sampled frames)"
        return f"the {self.header.width}x{self.header.height} image" if self.header else "the image"


class MediaItems:
    """The image and video work of ``Frontend`` (mixed into it; its attributes are the frontend's)."""

    def check_image_header(self, data: bytes, field: str = "image"):
        """Opens the image lazily (allowed formats only) and checks its header; returns ``(image, ImageHeader)``.

        Nothing is decoded. A single image over the context is refused here too: no request could use it."""
        image, header = self.headers.open(data, field)
        admission.check_image_fits(field, header.width, header.height, header.tokens, self.max_model_len)
        return image, header

    def check_upload(self, data: bytes, field: str = "upload") -> None:
        """An upload is an image whose header passes (``check_image_header``) or, where videos are served, a video
        whose container header passes the --max-video-* limits (its tokens depend on the sampling a request asks
        for, so they are checked per request); neither: InvalidArgument giving both reasons."""
        try:
            self.check_image_header(data, field)
            return
        except InvalidArgument as image_error:
            if self.videos is None:
                raise
            try:
                self.videos.probe(data, field)
            except InvalidArgument as video_error:
                image_why, video_why = (e.message.removeprefix(f"{field}: ") for e in (image_error, video_error))
                raise InvalidArgument(
                    f"{field}: neither an image ({image_why}) nor a video ({video_why})", field=field
                ) from None

    def _decode(self, pending: _Pending, tenant: str) -> _Processed:
        """Decodes and preprocesses one image whose header passed every check; at most ``max_concurrent_decodes``
        at once, which bounds the frontend's memory (docs/SECURITY.md section 5)."""
        with self._decode_slots:
            self._count("images_decoded", 1)
            self._count("decoded_pixels", pending.header.width * pending.header.height)
            try:
                # Upright and in its own mode, as the model's processor takes a decoded file (common/image_input.py).
                pixel_values, grid = self.images.process(pending.image, pending.field)
            finally:
                pending.image = None  # the decoded pixels go now, not when the request's last reference does
        num_tokens = self.images.tokens(grid, pending.header)
        identifier = item_identifier(pending.data, self.processor_settings, scope=tenant)
        return _Processed(identifier, pixel_values, grid, num_tokens)

    def _encoded(self, pending: _Pending, tenant: str) -> _Processed:
        """``--payload-encoding encoded``: the file as sent is the payload; its grid and placeholder count come from
        the header and the processor's resize rule, the rank that encodes it preprocesses it. Nothing is decoded."""
        grid = self.images.grid(pending.header)
        num_tokens = self.images.tokens(grid, pending.header)
        if num_tokens != pending.tokens:  # one resize rule, two uses: they cannot disagree unless the processor does
            shown = "(none)" if grid is None else grid.tolist()
            raise InvalidArgument(
                f"{pending.field}: the image's grid {shown} gives {num_tokens} tokens, its header {pending.tokens}",
                field=pending.field,
            )
        pending.image = None
        payload = torch.frombuffer(bytearray(pending.data), dtype=torch.uint8)
        identifier = item_identifier(pending.data, self.processor_settings, scope=tenant)
        return _Processed(identifier, payload, grid, num_tokens, PayloadEncoding.ENCODED)

    def _resolve(self, part: Any, field: str, tenant: str, seen: dict) -> _Pending:
        """The image's bytes and either its cached processing or its checked header (nothing decoded); an image
        repeated in the request (``seen``: key -> its first _Pending) is that same entry."""
        data, sha = getattr(part, "data", None), getattr(part, "uploaded_sha256", None)
        options = getattr(part, "video_options", None)
        if data:
            if len(data) > self.config.max_upload_bytes:
                raise ResourceExhausted(
                    f"{field}: {'video' if options is not None else 'image'} has {len(data)} bytes; the limit is "
                    f"{self.config.max_upload_bytes} (--max-upload-bytes)",
                    field=field,  # a limit of the field: no retry hint
                )
            sha = getattr(part, "data_sha256", None) or hashlib.sha256(data).hexdigest()
        elif not sha:
            raise InvalidArgument(f"{field} has neither data nor uploaded_sha256", field=field)
        if data is None:  # a reference: the store holds the bytes under this hash (NOT_FOUND when it does not)
            data = self.uploads.get(sha, field=f"{field}.uploaded_sha256", tenant=tenant)
        if options is not None:
            return self._resolve_video(data, sha, options, field, tenant, seen)
        key = (tenant, sha)  # per tenant: a hit's timing must not tell one tenant what another sent
        if key in seen:
            return seen[key]
        cached = self.cache.get(key)  # processed before: its pixels, or (encoded) its header's grid and identifier
        if cached is not None:
            seen[key] = _Pending(field, key, data, cached=cached, tokens=cached.num_tokens)
        else:
            image, header = self.headers.open(data, field)
            seen[key] = _Pending(field, key, data, image=image, header=header, tokens=header.tokens)
        return seen[key]

    def _resolve_video(self, data: bytes, sha: str, options, field: str, tenant: str, seen: dict) -> _Pending:
        """A video's container header checked (limits named) and its sampling planned; nothing decoded."""
        if self.videos is None:
            raise InvalidArgument(
                f"{field}: this model serves no video (its folder has no video_preprocessor_config.json, or "
                "--max-videos-per-request is 0)",
                field=field,
            )
        key = (tenant, sha, options)  # the same file sampled otherwise is another item
        if key in seen:
            return seen[key]
        cached = None if self.encoded else self.cache.get(key)  # pixels: a video processed before
        if cached is not None:
            seen[key] = _Pending(field, key, data, cached=cached, tokens=cached.num_tokens)
            return seen[key]
        header = self.videos.probe(data, field)
        plan = self.videos.plan(header, options, field)
        seen[key] = _Pending(field, key, data, video=header, plan=plan, tokens=plan.tokens)
        return seen[key]

    def _video(self, pending: _Pending, tenant: str) -> _Processed:
        """A video's item: under ``encoded`` the file as sent and the frames to decode (the owner rank decodes only
        those), under ``pixels`` the sampled frames decoded and preprocessed here (at most
        ``max_concurrent_decodes`` at once). The identifier covers the bytes and the sampling (frames and grid)."""
        plan, options = pending.plan, pending.key[2]
        settings = {"image": self.processor_settings, "video": self.videos.settings_key(options)}
        settings["frames"] = list(plan.frame_indices)
        settings["grid"] = plan.grid.reshape(-1).tolist()
        identifier = item_identifier(pending.data, settings, scope=tenant)
        frames = torch.tensor(plan.frame_indices, dtype=torch.int64)
        seconds = torch.tensor([plan.second_per_grid_t], dtype=torch.float32)
        if self.encoded:
            payload = torch.frombuffer(bytearray(pending.data), dtype=torch.uint8)
            encoding = PayloadEncoding.ENCODED
        else:
            with self._decode_slots:
                self._count("videos_decoded", 1)
                self._count("decoded_video_frames", len(plan.frame_indices))
                payload = self.videos.process(pending.data, plan, pending.field)
            encoding = PayloadEncoding.PIXELS
        ids, mask = self._video_placeholder(plan)
        return _Processed(
            identifier, payload, plan.grid, plan.tokens, encoding, Modality.VIDEO, frames, seconds, ids, mask
        )

    def _video_placeholder(self, plan) -> tuple[list[int] | None, list[bool] | None]:
        """Qwen3-VL: the token ids its processor writes for a video (``VideoInput.placeholder_text``: per temporal
        patch ``<t seconds>``, vision start, the patch's placeholders, vision end) and which take encoder rows; the
        text pieces sit between special tokens, so each is tokenized alone as the processor's whole text would be.
        Other families: None (the placeholder repeated ``plan.tokens`` times)."""
        from common.video_input import QWEN3_VL

        if self.videos.kind != QWEN3_VL:
            return None, None
        tokenizer = self._thread_tokenizer()
        start = self.tokenizer.convert_tokens_to_ids(self.processor.vision_start_token)
        end = self.tokenizer.convert_tokens_to_ids(self.processor.vision_end_token)
        ids: list[int] = []
        mask: list[bool] = []
        per = plan.tokens_per_grid_t
        for t in plan.timestamps:
            text = tokenizer(f"<{t:.1f} seconds>", add_special_tokens=False)["input_ids"]
            ids += [*text, start, *[self.video_token_id] * per, end]
            mask += [False] * (len(text) + 1) + [True] * per + [False]
        return ids, mask

    @staticmethod
    def _check_image_tokens(pending: list[_Pending], context: int, reserve: int) -> None:
        """The prompt holds at least every item's placeholders: refuse before decoding when they alone, with the
        tokens to generate, exceed the context (admission.check_images_fit)."""
        images = [(p.field, p.describe(), p.tokens) for p in pending]
        admission.check_images_fit(images, reserve, context)

    def _media(self, images, tenant: str, context: int, reserve_tokens: int):
        """The request's items resolved, checked against the context and processed (or found in the cache)."""
        seen: dict = {}
        cpu = time.thread_time()
        pending = [self._resolve(part, field, tenant, seen) for field, part in images]
        self._check_image_tokens(pending, context, max(1, reserve_tokens))
        decoded: dict = {}  # key -> _Processed of the images decoded for this request (a repeat is decoded once)
        processed = []
        for p in pending:
            if p.cached is None and p.key not in decoded:
                if p.video is not None:
                    decoded[p.key] = self._video(p, tenant)
                else:
                    decoded[p.key] = self._encoded(p, tenant) if self.encoded else self._decode(p, tenant)
            processed.append(p.cached if p.cached is not None else decoded[p.key])
        image_cpu_seconds = time.thread_time() - cpu
        if self.metrics is not None and pending:
            self.metrics.frontend_image_cpu_seconds.observe(image_cpu_seconds / len(pending))
        hits = len(pending) - len(decoded)  # from the cache, or a repeat of an image earlier in the request
        return pending, processed, decoded, hits, image_cpu_seconds

    def _expand(self, template_ids: list[int], items: list[_Processed]) -> tuple[list[int], list]:
        """Each image or video token of the template expanded to its item's placeholder count (in prompt order)."""
        video_id = self.video_token_id
        positions = [k for k, t in enumerate(template_ids) if t == self.image_token_id or t == video_id]
        if len(positions) != len(items):
            raise InvalidArgument(
                f"the chat template produced {len(positions)} image/video placeholders for {len(items)} items",
                field="messages",
            )
        token_ids: list[int] = []
        features = []
        prev = 0
        for pos, item in zip(positions, items, strict=True):
            video = item.modality is Modality.VIDEO
            if template_ids[pos] != (video_id if video else self.image_token_id):
                raise InvalidArgument("the chat template reordered the images and videos", field="messages")
            token_ids += template_ids[prev:pos]
            offset = len(token_ids)
            if item.placeholder_ids is not None:
                token_ids += item.placeholder_ids
            else:
                token_ids += [template_ids[pos]] * item.num_tokens
            prev = pos + 1
            features.append(self._feature(item, offset))
        token_ids += template_ids[prev:]
        return token_ids, features

    def _feature(self, item: _Processed, offset: int) -> MultiModalFeatureSpec:
        """The item of one image or video: its payload fields and its keep_on_cpu grid (and, for a video, what
        positions need: seconds per temporal patch; and what decoding needs: the sampled frames)."""
        encoded = item.encoding is PayloadEncoding.ENCODED
        video = item.modality is Modality.VIDEO
        if video:
            name = VIDEO_ENCODED_FIELD if encoded else "pixel_values_videos"
        else:
            name = ENCODED_FIELD if encoded else "pixel_values"
        fields = {name: MultiModalFieldElem(item.payload, keep_on_cpu=False, kind=FieldKind.FLAT)}
        payload_nbytes = int(item.payload.nbytes)
        if video and encoded:
            fields[FRAME_INDICES_FIELD] = MultiModalFieldElem(
                item.frame_indices, keep_on_cpu=False, kind=FieldKind.FLAT
            )
            payload_nbytes += int(item.frame_indices.nbytes)
        if self.family.grid_field is not None:  # the grid M-RoPE positions need; a fixed-size family has none
            grid_name = "video_grid_thw" if video else self.family.grid_field
            fields[grid_name] = MultiModalFieldElem(item.grid_thw, keep_on_cpu=True, kind=FieldKind.BATCHED)
        if video and getattr(self.family, "temporal_step_by_seconds", False):
            fields["second_per_grid_ts"] = MultiModalFieldElem(
                item.second_per_grid_t, keep_on_cpu=True, kind=FieldKind.BATCHED
            )
        return MultiModalFeatureSpec(
            MultiModalKwargsItem(fields),
            item.modality,
            item.identifier,
            PlaceholderRange(offset, len(item.is_embed), item.is_embed)
            if item.is_embed is not None
            else PlaceholderRange(offset, item.num_tokens),
            payload_nbytes=payload_nbytes,
            encoding=item.encoding,
        )


def video_limits(config: SchedulerConfig):
    """The ``VideoLimits`` of the scheduler's --max-video-* flags (the ranks receive the same in the handshake)."""
    from common.video_input import VideoLimits

    return VideoLimits(
        max_bytes=config.max_upload_bytes,
        max_frame_pixels=config.max_video_frame_pixels,
        max_duration_s=config.max_video_seconds,
        max_total_frames=config.max_video_total_frames,
        max_sampled_frames=config.max_video_frames,
        max_streams=config.max_video_streams,
    )
