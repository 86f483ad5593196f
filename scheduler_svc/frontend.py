"""The frontend: chat turns with text and images -> prompt token ids and multimodal items.

It loads the model folder's HF processor (``AutoProcessor.from_pretrained``, through
``common.tiny_model.load_processor`` which falls back to the same files without the video processor when
torchvision is absent) and works with any Qwen2-VL-family processor (an image token the processor expands into
``grid.prod() / merge_size**2`` placeholders).

Per image, in this order, each step only when the previous one missed:
1. the encoded bytes' sha256 — computed once for inline bytes; an upload is already stored under it (no hashing);
2. the processor cache, keyed by the tenant and that sha256: a hit gives the identifier and tensors without decoding,
   preprocessing or hashing anything again;
3. header check (``max_image_pixels`` from the header, before decoding: decompression bombs), decode, preprocess,
   ``common.hashing.item_identifier(encoded bytes, processor settings, scope=tenant)``.
The chat template is applied with one image token per image, tokenized once, and each image token is expanded to
the item's placeholder count, exactly as the processor would (tests compare with the processor itself).

Errors (``common.errors``; messages name the field, the value, the limit and the flag):
InvalidArgument — unknown role, empty prompt, too many images, undecodable / zero-size / over-``max_image_pixels``
image, image placeholder text in a message, prompt not shorter than the context; ResourceExhausted — an image
over ``max_upload_bytes``, a request over ``max_request_bytes``; NotFound — an uploaded hash not in the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import threading
import warnings
from pathlib import Path
from typing import Any

from common.errors import InvalidArgument, ResourceExhausted
from common.hashing import item_identifier
from common.ids import ItemId
from common.multimodal import (
    FieldKind,
    Modality,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PlaceholderRange,
)
from common.rope import uses_mrope
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.upload_store import ByteLRU, UploadStore

__all__ = ["ChatTurn", "Frontend", "ImagePart", "ProcessedPrompt", "TextPart", "UploadStore"]

ROLES = ("system", "user", "assistant")


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
    num_images: int
    image_sha256: list[str]  # sha256 of each image's encoded bytes (the processor-cache / upload-store key)
    processor_cache_hits: int  # images served by the processor cache (not decoded, processed nor hashed)


@dataclasses.dataclass(frozen=True)
class _Processed:
    """One processed image as the processor cache keeps it (tensors are shared, never mutated)."""

    identifier: ItemId
    pixel_values: Any  # (patches, patch_dim) float tensor: the payload
    grid_thw: Any  # (1, 3) int64 tensor: keep_on_cpu metadata
    num_tokens: int  # placeholder tokens in the prompt


def _reason(exc: BaseException) -> str:
    """An exception as a client may see it: its type and text, without object reprs (they hold heap addresses)."""
    text = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the data", str(exc))[:200]
    return f"{type(exc).__name__}: {text}"


class Frontend:
    def __init__(self, model_dir: str | Path, config: SchedulerConfig, *, upload_store: UploadStore | None = None):
        from transformers import AutoConfig

        from common.tiny_model import load_processor

        self.config = config
        self.model_dir = Path(model_dir)
        self.processor = load_processor(self.model_dir)
        self.tokenizer = self.processor.tokenizer
        self.image_processor = self.processor.image_processor
        self.image_token = self.processor.image_token
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        video_token = getattr(self.processor, "video_token", None)
        self._placeholder_tokens = [t for t in (self.image_token, video_token) if t]
        self.merge_size = int(self.image_processor.merge_size)
        self.processor_settings = json.loads(json.dumps(self.image_processor.to_dict(), sort_keys=True, default=str))
        model_config = AutoConfig.from_pretrained(self.model_dir)
        text_config = getattr(model_config, "text_config", model_config)
        self.vocab_size = int(text_config.vocab_size)
        model_len = int(getattr(text_config, "max_position_embeddings", 0) or 0)
        lengths = [v for v in (config.max_model_len, model_len) if v]
        self.max_model_len = min(lengths) if lengths else 0  # 0: unknown
        self.uses_mrope = uses_mrope(model_config)  # the rule the ranks apply too (common/rope.py)
        self.eos_token_ids = self._eos_token_ids()
        self.uploads = upload_store or UploadStore(config.upload_store_bytes, config.max_upload_bytes)
        self.cache = ByteLRU(config.processor_cache_bytes)
        self._text_lock = threading.Lock()

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
        """Opens the image lazily and checks its header; returns the (not yet decoded) PIL image."""
        from PIL import Image

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the check below is ours
                image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exc:  # PIL's own, far higher limit: the header claims a bomb
            pixels = re.search(r"\((\d+) pixels\)", str(exc))
            claimed = f"{pixels.group(1)} pixels" if pixels else f"over {2 * Image.MAX_IMAGE_PIXELS} pixels"
            raise InvalidArgument(f"{field}: image header claims {claimed}; the limit is "
                                  f"{self.config.max_image_pixels} (--max-image-pixels)") from None
        except Exception as exc:  # PIL raises many types for bad input
            raise InvalidArgument(f"{field}: {len(data)} bytes are not a decodable image ({_reason(exc)})") from None
        width, height = image.size
        if width < 1 or height < 1:
            raise InvalidArgument(f"{field}: image is {width}x{height}; both sides must be >= 1 pixel")
        if width * height > self.config.max_image_pixels:
            raise InvalidArgument(
                f"{field}: image is {width}x{height} = {width * height} pixels; the limit is "
                f"{self.config.max_image_pixels} (--max-image-pixels)"
            )
        return image

    def _process_image(self, data: bytes, field: str, tenant: str = "") -> _Processed:
        image = self.check_image_header(data, field)
        try:
            image.load()
            image = image.convert("RGB")
            out = self.image_processor(images=[image], return_tensors="pt")
        except InvalidArgument:
            raise
        except Exception as exc:
            raise InvalidArgument(f"{field}: the image could not be decoded or preprocessed ({_reason(exc)})") from None
        pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
        num_tokens = int(grid[0].prod()) // (self.merge_size**2)
        identifier = item_identifier(data, self.processor_settings, scope=tenant)
        return _Processed(identifier, pixel_values, grid.reshape(1, 3), num_tokens)

    def _image(self, part: Any, field: str, stats: dict, tenant: str) -> tuple[str, _Processed]:
        data, sha = getattr(part, "data", None), getattr(part, "uploaded_sha256", None)
        if data:
            if len(data) > self.config.max_upload_bytes:
                raise ResourceExhausted(
                    f"{field}: image has {len(data)} bytes; the limit is {self.config.max_upload_bytes} "
                    "(--max-upload-bytes)"
                )
            sha = hashlib.sha256(data).hexdigest()
        elif not sha:
            raise InvalidArgument(f"{field} has neither data nor uploaded_sha256")
        if data is None:  # a reference: the store holds the bytes under this hash (NOT_FOUND when it does not)
            data = self.uploads.get(sha, field=f"{field}.uploaded_sha256", tenant=tenant)
        key = (tenant, sha)  # per tenant: a hit's timing must not tell one tenant what another sent
        processed = self.cache.get(key)
        if processed is not None:
            stats["hits"] += 1
            return sha, processed
        processed = self._process_image(data, field, tenant)
        self.cache.put(key, processed, processed.pixel_values.nbytes + 64)
        return sha, processed

    # --- prompts ---------------------------------------------------------------------------------------------
    def process(self, turns, *, add_generation_prompt: bool = True, tenant: str = "") -> ProcessedPrompt:
        """Chat turns -> token ids with expanded image placeholders and one item per image.

        ``tenant`` scopes uploads, processor-cache entries and item identifiers ("" when authentication is off).
        """
        cfg = self.config
        if not turns:
            raise InvalidArgument("messages is empty: at least one message is required")
        messages, images = [], []
        request_bytes = 0
        has_content = False
        for i, turn in enumerate(turns):
            if turn.role not in ROLES:
                raise InvalidArgument(f"messages[{i}].role={turn.role!r} is not one of {', '.join(ROLES)}")
            content = []
            for j, part in enumerate(turn.parts):
                if hasattr(part, "text"):
                    if not isinstance(part.text, str):
                        raise InvalidArgument(f"messages[{i}].content[{j}].text is not a string")
                    for token in self._placeholder_tokens:
                        if token in part.text:
                            raise InvalidArgument(
                                f"messages[{i}].content[{j}].text contains the placeholder token {token!r}; "
                                "send images as image parts"
                            )
                    content.append({"type": "text", "text": part.text})
                    request_bytes += len(part.text.encode())
                    has_content = has_content or bool(part.text.strip())
                    continue
                field = getattr(part, "field", None) or f"messages[{i}].content[{j}].image"
                if len(images) >= cfg.max_images_per_request:
                    raise InvalidArgument(
                        f"{field}: more than {cfg.max_images_per_request} images in one request "
                        "(--max-images-per-request)"
                    )
                images.append((field, part))
                request_bytes += len(getattr(part, "data", None) or b"")
                content.append({"type": "image"})
                has_content = True
            messages.append({"role": turn.role, "content": content})
        if not has_content:
            raise InvalidArgument("messages contain no text and no image: the prompt is empty")
        if request_bytes > cfg.max_request_bytes:
            raise ResourceExhausted(
                f"the request carries {request_bytes} bytes of text and images; the limit is {cfg.max_request_bytes} "
                "(--max-request-bytes); upload large images first and reference them by hash"
            )
        stats = {"hits": 0}
        resolved = [self._image(part, field, stats, tenant) for field, part in images]
        with self._text_lock:  # a fast tokenizer refuses concurrent use ("Already borrowed")
            text = self.processor.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
            template_ids = self.tokenizer(text)["input_ids"]
        token_ids, features = self._expand(template_ids, [p for _, p in resolved])
        if self.max_model_len and len(token_ids) >= self.max_model_len:
            raise InvalidArgument(
                f"the prompt has {len(token_ids)} tokens; the context holds {self.max_model_len} including at least "
                "one generated token (--max-model-len / the model's max_position_embeddings)"
            )
        return ProcessedPrompt(token_ids, features, len(features), [sha for sha, _ in resolved], stats["hits"])

    def _expand(self, template_ids: list[int], images: list[_Processed]) -> tuple[list[int], list]:
        positions = [k for k, t in enumerate(template_ids) if t == self.image_token_id]
        if len(positions) != len(images):
            raise InvalidArgument(
                f"the chat template produced {len(positions)} image placeholders for {len(images)} images"
            )
        token_ids: list[int] = []
        features = []
        prev = 0
        for pos, image in zip(positions, images, strict=True):
            token_ids += template_ids[prev:pos]
            offset = len(token_ids)
            token_ids += [self.image_token_id] * image.num_tokens
            prev = pos + 1
            data = MultiModalKwargsItem({
                "pixel_values": MultiModalFieldElem(image.pixel_values, keep_on_cpu=False, kind=FieldKind.FLAT),
                "image_grid_thw": MultiModalFieldElem(image.grid_thw, keep_on_cpu=True, kind=FieldKind.BATCHED),
            })
            features.append(MultiModalFeatureSpec(
                data, Modality.IMAGE, image.identifier, PlaceholderRange(offset, image.num_tokens),
                payload_nbytes=int(image.pixel_values.nbytes),
            ))
        token_ids += template_ids[prev:]
        return token_ids, features
