"""The frontend: chat turns with text and images -> prompt token ids and multimodal items.

It loads the model folder's HF processor (``common.processor.load_processor``: the parts ``AutoProcessor`` finds,
without the video processor when torchvision is absent; a folder without an image processor or a chat template stops
the start) and works with the processor of any family of ``common/families/`` (an image token the processor
expands into the family's placeholder count: ``grid.prod() / merge_size**2`` for the Qwen-VL families, a constant
for LLaVA; the item carries the family's grid field, if it has one).

Images enter as the model's processor takes a decoded file: upright (the EXIF orientation applied, as transformers'
``load_image`` does), then handed over in their own mode, so the processor's ``convert_to_rgb`` composites
transparency onto white and converts palette, CMYK and 16-bit images itself (tests/scheduler/test_image_modes.py compares
``pixel_values`` and served tokens with the processor fed the file as sent).

Every check whose input is at hand runs before the work it protects (docs/SECURITY.md section 5):
1. structure, sizes and the text's UTF-8 bytes (``--max-prompt-bytes``) — before anything is tokenized;
2. per image: the encoded bytes' sha256 (computed once for inline bytes; an upload is already stored under it),
   then the processor cache keyed by the tenant and that sha256 (a hit: no decoding, preprocessing or hashing), else
   the header (``common.image_header``: allowed formats only, pixels, placeholder tokens by the processor's
   resize rule) — before any pixel is decoded;
3. the images' tokens plus the tokens to generate against the context (``admission.check_images_fit``) — before
   any image is decoded;
4. decode, EXIF orientation, preprocess (at most ``--max-concurrent-decodes`` at once) and
   ``common.hashing.item_identifier(encoded bytes, processor settings, scope=tenant)``;
5. the chat template with one image token per image, tokenized once with the calling thread's own tokenizer, each
   image token expanded to the item's placeholder count exactly as the processor would (tests compare with the
   processor itself); the whole prompt against the context (``admission.check_prompt_fits``).
A video takes the same steps (docs/ARCHITECTURE.md §2.9): its container header and sampling plan
(``common.video_input``: the --max-video-* limits, the frames the model's video processor samples) in step 2, keyed
by the tenant, the sha256 and the sampling options; under ``encoded`` its file and frame indices are the payload and
nothing is decoded, under ``pixels`` the sampled frames are decoded in step 4; in step 5 its one video token becomes
the placeholders (Qwen3-VL: the processor's timestamped blocks, one item with ``is_embed``).
Newly processed images and videos enter the processor cache only through ``commit``, once the request is admitted.
All of it runs on the service's thread pool, never on the event loop.

Errors (``common.errors``; messages name the field, the value, the limit and the flag):
InvalidArgument — unknown role, empty prompt, too many images, text over ``max_prompt_bytes``, an image of a format
not in ``image_formats``, undecodable / zero-size / over-``max_image_pixels`` image, images whose tokens exceed the
context, image placeholder text in a message, prompt not shorter than the context (the context limit's one message:
``scheduler_svc/core/admission.py``); ResourceExhausted — an image
over ``max_upload_bytes``, a request over ``max_request_bytes``; NotFound — an uploaded hash not in the store.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import torch

from common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from common.families import family_of, uses_mrope
from common.hashing import item_identifier
from common.ids import ItemId
from common.image_header import ImageHeader
from common.image_input import ImageInput
from common.mrope import mrope_positions
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
from scheduler_svc.config import PROMPT_BYTES_PER_TOKEN, SchedulerConfig, context_length
from scheduler_svc.core import admission
from scheduler_svc.engine.upload_store import ByteLRU, UploadStore

__all__ = ["ChatTurn", "Frontend", "ImagePart", "ProcessedPrompt", "TextPart", "UploadStore"]

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class TextPart:
    text: str


@dataclasses.dataclass(frozen=True)
class ImagePart:
    data: bytes | None = None  # encoded image file bytes (PNG, JPEG, WebP, ...)
    uploaded_sha256: str | None = None  # or the hash of an earlier upload
    field: str | None = None  # where it came from, for errors (default: messages[i].content[j].image)


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    role: str  # system | user | assistant
    parts: list  # TextPart / ImagePart in order (any objects with .text, or .data / .uploaded_sha256)


@dataclasses.dataclass
class ProcessedPrompt:
    token_ids: list[int]  # the whole prompt, image placeholders expanded
    mm_features: list[MultiModalFeatureSpec]  # one per image, ordered by position, payload included
    num_images: int  # images among mm_features
    image_sha256: list[str]  # sha256 of each item's encoded bytes (the processor-cache / upload-store key)
    processor_cache_hits: int  # images served by the processor cache (not decoded, processed nor hashed)
    # (cache key, processed image) of every image processed for this prompt; Frontend.commit stores them once the
    # request is admitted (and empties the list), so a refused request leaves nothing in the cache.
    pending_cache: list = dataclasses.field(default_factory=list)
    image_cpu_seconds: float = 0.0  # this thread's CPU time on the images: hashing, headers, decoding (pixels)
    image_fields: list[str] = dataclasses.field(default_factory=list)  # where each item came from, for errors
    num_videos: int = 0  # videos among mm_features (num_images counts the images)


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


class Frontend:
    def __init__(
        self, model_dir: str | Path, config: SchedulerConfig, *, upload_store: UploadStore | None = None, metrics=None
    ):
        from transformers import AutoConfig

        from common.processor import load_processor

        self.config = config
        self.model_dir = Path(model_dir)
        self.processor = load_processor(self.model_dir)
        self.tokenizer = self.processor.tokenizer
        self.image_processor = self.processor.image_processor
        self.image_token = self.processor.image_token
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        video_token = getattr(self.processor, "video_token", None)
        self.video_token_id = self.tokenizer.convert_tokens_to_ids(video_token) if video_token else None
        self._placeholder_tokens = [t for t in (self.image_token, video_token) if t]
        self.processor_settings = json.loads(json.dumps(self.image_processor.to_dict(), sort_keys=True, default=str))
        model_config = AutoConfig.from_pretrained(self.model_dir)
        text_config = getattr(model_config, "text_config", model_config)
        self.vocab_size = int(text_config.vocab_size)
        model_len = int(getattr(text_config, "max_position_embeddings", 0) or 0)
        # Before any rank has answered: the configured and the model's; the core narrows it at connect.
        self.max_model_len = context_length(config.max_model_len, model_len)  # 0: unknown
        self.uses_mrope = uses_mrope(model_config)  # the rule the ranks apply too (common/families/__init__.py)
        self._rope_kwargs = family_of(model_config).rope_kwargs(model_config) if self.uses_mrope else {}
        self.eos_token_ids = self._eos_token_ids()
        self.max_prompt_bytes = config.max_prompt_bytes or (self.max_model_len * PROMPT_BYTES_PER_TOKEN or 2**31 - 1)
        self.uploads = upload_store or UploadStore(
            config.upload_store_bytes,
            config.max_upload_bytes,
            pending_total=config.max_pending_upload_bytes,
            pending_per_tenant=config.max_pending_upload_bytes_per_tenant,
        )
        self.cache = ByteLRU(config.processor_cache_bytes)
        self.family = family_of(model_config)  # its header rule (common/families/)
        self.images = ImageInput(
            self.image_processor, config.image_formats, config.max_image_pixels, self.family, processor=self.processor
        )
        self.headers = self.images.headers
        self.videos = self._video_input(config)  # None: this model folder serves no video
        self.encoded = config.payload_encoding == "encoded"  # header-only: the ranks decode (common/image_input.py)
        self._decode_slots = threading.BoundedSemaphore(config.max_concurrent_decodes)
        self._local = threading.local()  # per thread: its own tokenizer
        # Work done, for /metrics and tests: images_decoded, decoded_pixels, prompts_tokenized, tokenized_bytes.
        self.counts: collections.Counter = collections.Counter()
        self._counts_lock = threading.Lock()
        self.metrics = metrics  # SchedulerMetrics or None

    def _video_input(self, config: SchedulerConfig):
        """The container-header checks and sampling rule of the folder's video processor, under the --max-video-*
        limits; None when the folder has no video processor config (video parts are then refused)."""
        from common.video_input import VideoInput

        if not (self.model_dir / "video_preprocessor_config.json").is_file() or config.max_videos_per_request < 1:
            return None
        return VideoInput.from_model_dir(self.model_dir, video_limits(config), self.family)

    def _eos_token_ids(self) -> set[int]:
        from transformers import GenerationConfig

        ids: set[int] = set()
        try:
            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
        except OSError:
            eos = None
        for value in eos if isinstance(eos, list | tuple) else [eos]:
            if value is not None:
                ids.add(int(value))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # --- images ----------------------------------------------------------------------------------------------
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
            sha = hashlib.sha256(data).hexdigest()
        elif not sha:
            raise InvalidArgument(f"{field} has neither data nor uploaded_sha256", field=field)
        if data is None:  # a reference: the store holds the bytes under this hash (NOT_FOUND when it does not)
            data = self.uploads.get(sha, field=f"{field}.uploaded_sha256", tenant=tenant)
        if options is not None:
            return self._resolve_video(data, sha, options, field, tenant, seen)
        key = (tenant, sha)  # per tenant: a hit's timing must not tell one tenant what another sent
        if key in seen:
            return seen[key]
        cached = None if self.encoded else self.cache.get(key)  # encoded: nothing to reuse but the header
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

    # --- text ----------------------------------------------------------------------------------------------
    def encode_words(self, text: str) -> list[int]:
        """``text``'s token ids without special tokens (this thread's tokenizer): bad words (common/penalties.py)."""
        return self._thread_tokenizer()(text, add_special_tokens=False)["input_ids"]

    def _thread_tokenizer(self):
        """This thread's own tokenizer: a fast tokenizer refuses concurrent use ("Already borrowed"), and one shared
        lock would let one long prompt hold every other request."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tokenizer

    def _tokenize(
        self, messages: list, add_generation_prompt: bool, continue_final_message: bool = False, tools=None
    ) -> list[int]:
        """Chat template + tokenizer (this thread's own). ``continue_final_message``: the template's own rule
        (transformers' ``continue_final_message``): the last message's end-of-turn is cut, so the answer continues
        its text."""
        tokenizer = self._thread_tokenizer()
        if continue_final_message:
            last = messages[-1]["content"] if messages else []
            if not last or last[-1].get("type") != "text" or not last[-1]["text"]:
                raise InvalidArgument(
                    f"messages[{len(messages) - 1}]: continue_final_message needs the last message to end with text "
                    "to continue",
                    field=f"messages[{len(messages) - 1}]",
                )
        try:
            text = self.processor.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **({"tools": list(tools)} if tools else {}),
            )
        except ValueError as exc:  # transformers: the rendered prompt does not hold the final message's text
            raise InvalidArgument(
                f"messages: continue_final_message: the chat template does not end with the last message's text ({exc})",
                field="messages",
            ) from None
        self._count("prompts_tokenized", 1)
        self._count("tokenized_bytes", len(text.encode()))
        return tokenizer(text)["input_ids"]

    def _count(self, name: str, amount: int) -> None:
        with self._counts_lock:
            self.counts[name] += amount
        if self.metrics is not None:
            self.metrics.frontend_counter(name).inc(amount)

    # --- prompts ---------------------------------------------------------------------------------------------
    def process(
        self,
        turns,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tenant: str = "",
        reserve_tokens: int = 1,
        context: int | None = None,
        tools=None,
    ) -> ProcessedPrompt:
        """Chat turns -> token ids with expanded image placeholders and one item per image.

        ``tenant`` scopes uploads, processor-cache entries and item identifiers ("" when authentication is off).
        ``reserve_tokens``: tokens to generate (``sampling.max_tokens``); ``context``: the context length to check
        against (default ``max_model_len``). Checks run cheapest first and before the work they protect: sizes,
        text bytes, image headers and the images' tokens against the context, then decoding, then tokenizing.
        New processed images are returned in ``pending_cache``; ``commit`` stores them once the request is admitted.
        """
        context = self.max_model_len if context is None else context
        messages, images = self._collect(turns)
        media = self._media(images, tenant, context, reserve_tokens)
        template_ids = self._tokenize(messages, add_generation_prompt, continue_final_message, tools)
        return self._prompt(template_ids, media, context)

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

    def _prompt(self, template_ids: list[int], media, context: int) -> ProcessedPrompt:
        pending, processed, decoded, hits, image_cpu_seconds = media
        token_ids, features = self._expand(template_ids, processed)
        admission.check_prompt_fits("messages", len(token_ids), 1, context)
        videos = sum(1 for f in features if f.modality is Modality.VIDEO)
        cacheable = [] if self.encoded else list(decoded.items())
        return ProcessedPrompt(
            token_ids,
            features,
            len(features) - videos,
            [p.key[1] for p in pending],
            hits,
            cacheable,
            image_cpu_seconds,
            [p.field for p in pending],
            videos,
        )

    def process_live(self, turns, *, first: bool, tenant: str = "", reserve_tokens: int = 1, context=None):
        """A live session's turn (``scheduler_svc/core/live_sessions.py``): its new messages' tokens as the chat template
        renders them after an earlier assistant turn, with the template's prefix (its default system prompt, or the
        turn's own system message) ahead of them on the ``first`` turn. Returns ``(ProcessedPrompt, turn_start,
        extent, close_ids)``: where the messages begin, their position span under the model's rule (the next token
        after them sits at ``extent``), and the template's end of an assistant turn."""
        context = self.max_model_len if context is None else context
        for i, turn in enumerate(turns):
            if turn.role != "user" and not (first and i == 0 and turn.role == "system"):
                raise InvalidArgument(
                    f"messages[{i}].role={turn.role!r}: a live session's turn sends only user messages (the first "
                    "turn may start with a system message); the server holds the answers",
                    field=f"messages[{i}].role",
                )
        messages, images = self._collect(turns)
        media = self._media(images, tenant, context, reserve_tokens)
        prefix_text, turn_text, close_text = self._live_texts(messages, first)
        tokenizer = self._thread_tokenizer()
        prefix_ids = tokenizer(prefix_text)["input_ids"] if prefix_text else []
        processed = self._prompt(prefix_ids + tokenizer(turn_text)["input_ids"], media, context)
        self._count("prompts_tokenized", 1)
        if self.uses_mrope:
            _, delta = mrope_positions(processed.token_ids, processed.mm_features, **self._rope_kwargs)
            extent = delta + len(processed.token_ids)
        else:
            extent = len(processed.token_ids)
        return processed, len(prefix_ids), extent, tokenizer(close_text)["input_ids"]

    def _live_texts(self, messages: list[dict], first: bool) -> tuple[str, str, str]:
        """(prefix, the messages, the end of an assistant turn) as the chat template renders them: the messages
        are what rendering them after a user and an assistant turn adds, the end is what follows an assistant
        message's text. Refuses a template that does not render a conversation as the concatenation of its turns."""
        render = self.processor.apply_chat_template
        user = {"role": "user", "content": [{"type": "text", "text": "\x01"}]}
        answer = {"role": "assistant", "content": [{"type": "text", "text": "\x02"}]}
        before = render([user, answer], tokenize=False)
        users = [m for m in messages if m["role"] == "user"]
        after = render([user, answer, *users], tokenize=False, add_generation_prompt=True)
        end = before.rfind("\x02")
        if not after.startswith(before) or end < 0:
            raise FailedPrecondition(
                "this model's chat template does not render turns one after another; live sessions need one",
                field="live",
            )
        turn_text, close_text = after[len(before) :], before[end + 1 :]
        prefix_text = ""
        if first:
            whole = render(messages, tokenize=False, add_generation_prompt=True)
            if not whole.endswith(turn_text):
                raise FailedPrecondition(
                    "this model's chat template renders a first turn differently from a later one; live sessions "
                    "need it to render turns one after another",
                    field="live",
                )
            prefix_text = whole[: len(whole) - len(turn_text)]
        return prefix_text, turn_text, close_text

    def process_text(self, prompt: str, *, reserve_tokens: int = 1, context: int | None = None) -> ProcessedPrompt:
        """A plain text prompt (the OpenAI completions API) -> its token ids, tokenized as is: no chat template, no
        images. The same limits as a chat prompt's text, checked before tokenizing."""
        context = self.max_model_len if context is None else context
        size = len(prompt.encode())
        if size > self.max_prompt_bytes:
            raise InvalidArgument(
                f"prompt has {size} bytes; the limit is {self.max_prompt_bytes} (--max-prompt-bytes; default the "
                f"context {self.max_model_len} tokens x {PROMPT_BYTES_PER_TOKEN} bytes)",
                field="prompt",
            )
        if not prompt.strip():
            raise InvalidArgument("prompt is empty", field="prompt")
        for token in self._placeholder_tokens:
            if token in prompt:
                raise InvalidArgument(
                    f"prompt contains the placeholder token {token!r}; send images to the chat "
                    "completions API as image_url parts",
                    field="prompt",
                )
        tokenizer = self._thread_tokenizer()
        self._count("prompts_tokenized", 1)
        self._count("tokenized_bytes", size)
        token_ids = tokenizer(prompt)["input_ids"]
        admission.check_prompt_fits(("prompt", admission.GENERATE_FIELD), len(token_ids), reserve_tokens, context)
        return ProcessedPrompt(token_ids, [], 0, [], 0, [], 0.0, [])

    def commit(self, prompt: ProcessedPrompt) -> None:
        """Stores the prompt's newly processed images in the processor cache: call once the request is admitted,
        so a refused request leaves nothing behind."""
        for key, item in prompt.pending_cache:
            self.cache.put(key, item, item.payload.nbytes + 64)
        prompt.pending_cache = []

    def _collect(self, turns) -> tuple[list[dict], list[tuple[str, Any]]]:
        """Template messages and (field, image part) pairs, with the structural and byte limits checked."""
        cfg = self.config
        if not turns:
            raise InvalidArgument("messages is empty: at least one message is required", field="messages")
        messages, images = [], []  # images: every media item (images and videos), in prompt order
        videos = request_bytes = text_bytes = 0
        has_content = False
        for i, turn in enumerate(turns):
            if turn.role not in ROLES:
                raise InvalidArgument(
                    f"messages[{i}].role={turn.role!r} is not one of {', '.join(ROLES)}", field=f"messages[{i}].role"
                )
            content = []
            for j, part in enumerate(turn.parts):
                if hasattr(part, "text"):
                    if not isinstance(part.text, str):
                        raise InvalidArgument(
                            f"messages[{i}].content[{j}].text is not a string", field=f"messages[{i}].content[{j}].text"
                        )
                    size = len(part.text.encode())
                    text_bytes += size
                    if text_bytes > self.max_prompt_bytes:
                        raise InvalidArgument(
                            f"messages[{i}].content[{j}].text: the request's text reaches {text_bytes} bytes; the "
                            f"limit is {self.max_prompt_bytes} (--max-prompt-bytes; default the context "
                            f"{self.max_model_len} tokens x {PROMPT_BYTES_PER_TOKEN} bytes)",
                            field=f"messages[{i}].content[{j}].text",
                        )
                    for token in self._placeholder_tokens:
                        if token in part.text:
                            raise InvalidArgument(
                                f"messages[{i}].content[{j}].text contains the placeholder token {token!r}; "
                                "send images as image parts",
                                field=f"messages[{i}].content[{j}].text",
                            )
                    content.append({"type": "text", "text": part.text})
                    request_bytes += size
                    has_content = has_content or bool(part.text.strip())
                    continue
                is_video = getattr(part, "video_options", None) is not None
                kind = "video" if is_video else "image"
                field = getattr(part, "field", None) or f"messages[{i}].content[{j}].{kind}"
                if is_video:
                    videos += 1
                    if videos > cfg.max_videos_per_request:
                        raise InvalidArgument(
                            f"{field}: more than {cfg.max_videos_per_request} videos in one request "
                            "(--max-videos-per-request)",
                            field=field,
                        )
                elif len(images) - videos >= cfg.max_images_per_request:
                    raise InvalidArgument(
                        f"{field}: more than {cfg.max_images_per_request} images in one request "
                        "(--max-images-per-request)",
                        field=field,
                    )
                images.append((field, part))
                request_bytes += len(getattr(part, "data", None) or b"")
                content.append({"type": kind})
                has_content = True
            message = {"role": turn.role, "content": content}
            if getattr(turn, "tool_calls", ()):  # an assistant's tool calls, rendered by the template
                message["tool_calls"] = [{"type": "function", "function": c} for c in turn.tool_calls]
                has_content = True
            messages.append(message)
        if not has_content:
            raise InvalidArgument("messages contain no text, image or video: the prompt is empty", field="messages")
        if request_bytes > cfg.max_request_bytes:
            raise ResourceExhausted(
                f"the request carries {request_bytes} bytes of text and images; the limit is {cfg.max_request_bytes} "
                "(--max-request-bytes); upload large images and videos first and reference them by hash",
                field="messages",  # a limit of the request: no retry hint
            )
        return messages, images

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
