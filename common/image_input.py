"""One image file -> what the model's processor gives it: the single implementation the frontend and the ranks share.

``--payload-encoding pixels``: the frontend decodes and preprocesses each new image and the ranks receive
``pixel_values``. ``encoded`` (the default): the frontend reads only the header and the ranks receive the file
exactly as the client sent it; the rank that encodes the item runs ``process`` here on the same bytes, with an image
processor loaded from the same model folder (``common.processor.load_processor``; the handshake's model fingerprint
covers the processor files), so both paths give identical ``pixel_values`` and grid (``image_grid_thw``; none for
a family without one, ``common/families/``)
(tests/common/test_image_input.py compares them with the processor fed the file as sent, bit for bit).

- ``open``: the header checks of ``common.image_header`` (format whitelist, pixels, tokens; nothing decoded).
- ``grid``: the ``image_grid_thw`` the processor will produce, from the header's upright size and the processor's
  own resize rule (the model family's ``image_grid``, ``common/families/``; for the Qwen-VL families
  ``smart_resize`` with its patch size, merge size and min/max pixels): the frontend builds the prompt and the
  M-RoPE metadata from it without decoding a pixel. A family without a grid (LLaVA) has only the header's token
  count, the same for every image.
- ``process``: decode, EXIF orientation applied as transformers' ``load_image`` does, then the processor on the
  image in its own mode (its ``convert_to_rgb`` composites transparency onto white, converts palette/CMYK/16-bit).
  Any failure is ``InvalidArgument`` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import ImageOps

from common.errors import InvalidArgument
from common.families import Family
from common.image_header import ImageHeader, ImageHeaderReader, reason

__all__ = ["ImageHeader", "ImageInput"]


class ImageInput:
    """Header checks, grid prediction and preprocessing for one model's image processor."""

    def __init__(
        self, image_processor, formats: Sequence[str], max_pixels: int, family: Family | None = None, processor=None
    ) -> None:
        """``processor``: the whole processor, which some families' token rule reads (LLaVA's patch size and
        feature strategy live there, not in the image processor)."""
        from common.families.qwen2_vl import QWEN2_VL

        self.image_processor = image_processor
        self.family = QWEN2_VL if family is None else family  # its grid rule; None: the Qwen2-VL processor's
        family = self.family
        self.headers = ImageHeaderReader(
            formats,
            max_pixels,
            image_processor,
            lambda height, width: family.image_tokens(processor, image_processor, height, width),
        )
        self.patch_size = int(getattr(image_processor, "patch_size", 0) or 0)  # 0: the image processor has none
        self.merge_size = int(getattr(image_processor, "merge_size", 1) or 1)

    def open(self, data: bytes, field: str):
        """``(image, header)``: opened lazily with the allowed plugins only, every header limit checked."""
        return self.headers.open(data, field)

    def grid(self, header: ImageHeader) -> torch.Tensor | None:
        """``image_grid_thw`` (1, 3) int64 the processor gives an image of the header's (upright) size; None for a
        family without a grid."""
        return self.family.image_grid(self.image_processor, header.height, header.width)

    def tokens(self, grid: torch.Tensor | None, header: ImageHeader) -> int:
        """Placeholder tokens of an image processed to ``grid``; without a grid, the header's count (a family
        without a grid gives every image the same shape, so the decoded image cannot differ from its header)."""
        return header.tokens if grid is None else self.family.grid_tokens(self.image_processor, grid)

    def process(self, image, field: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(pixel_values, grid)`` of an image ``open`` returned (grid: the family's grid field, None where it has
        none); decodes it (and frees the pixels)."""
        try:
            image.load()
            ImageOps.exif_transpose(image, in_place=True)
            out = self.image_processor(images=[image], return_tensors="pt")
        except Exception as exc:  # noqa: BLE001 - PIL and the processor raise many types for bad input
            raise InvalidArgument(
                f"{field}: the image could not be decoded or preprocessed ({reason(exc)})", field=field
            ) from None
        finally:
            image.close()
        name = self.family.grid_field
        return out["pixel_values"], (None if name is None else out[name].reshape(1, 3))

    def process_bytes(self, data: bytes, field: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``open`` then ``process``: what a rank does with an encoded payload.

        The prompt and M-RoPE positions were built from ``grid(header)``; a file whose decoded grid differs (its
        metadata disagrees with its pixels) fails rather than be served with positions that do not match them."""
        image, header = self.open(data, field)
        pixel_values, grid = self.process(image, field)
        predicted = self.grid(header)
        if grid is None or predicted is None:  # a family without a grid: one shape for every image
            return pixel_values, grid
        if not torch.equal(grid, predicted):
            raise InvalidArgument(
                f"{field}: the decoded image has a {grid[0, 1]}x{grid[0, 2]} patch grid but its header gave "
                f"{predicted[0, 1]}x{predicted[0, 2]} (its metadata disagrees with its pixels); re-save it with the "
                "orientation applied",
                field=field,
            )
        return pixel_values, grid
