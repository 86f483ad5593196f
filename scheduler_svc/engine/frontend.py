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
import json
import threading
from pathlib import Path
from typing import Any

from common.errors import InvalidArgument, ResourceExhausted
from common.families import family_of, uses_mrope
from common.image_input import ImageInput
from common.multimodal import (
    Modality,
    MultiModalFeatureSpec,
)
from scheduler_svc.config import PROMPT_BYTES_PER_TOKEN, SchedulerConfig, context_length
from scheduler_svc.core import admission
from scheduler_svc.engine.frontend_live import LiveTurns
from scheduler_svc.engine.frontend_media import MediaItems, video_limits
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
    committed: list = dataclasses.field(default_factory=list)  # the cache keys commit added (forget removes them)


class Frontend(MediaItems, LiveTurns):
    """Chat turns and prompts -> token ids and items; its image and video work in ``MediaItems``
    (frontend_media.py), a live session's turn in ``LiveTurns`` (frontend_live.py)."""

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

    def _prompt(self, template_ids: list[int], media, context: int) -> ProcessedPrompt:
        pending, processed, decoded, hits, image_cpu_seconds = media
        token_ids, features = self._expand(template_ids, processed)
        admission.check_prompt_fits("messages", len(token_ids), 1, context)
        videos = sum(1 for f in features if f.modality is Modality.VIDEO)
        # encoded videos are probed again each time: the owner rank decodes only their sampled frames, and a file
        # corrupt past its header fails there
        cacheable = [(k, v) for k, v in decoded.items() if not (self.encoded and v.modality is Modality.VIDEO)]
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
            new = key not in self.cache
            if self.cache.put(key, item, item.payload.nbytes + 64) and new:
                prompt.committed.append(key)
        prompt.pending_cache = []

    def forget(self, prompt: ProcessedPrompt) -> None:
        """Removes what ``commit`` added for a request that then failed: an image the ranks could not decode
        (``--payload-encoding encoded`` checks only its header here) leaves nothing behind."""
        for key in prompt.committed:
            self.cache.discard(key)
        prompt.committed = []

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
