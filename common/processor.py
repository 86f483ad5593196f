"""A model folder's HF processor, found as ``AutoProcessor.from_pretrained`` finds it, and checked for what serving
needs.

Where torchvision is installed this is ``AutoProcessor.from_pretrained(model_dir)``. Without it, transformers 5.24
cannot build a Qwen2-VL-family processor (every one gets a torchvision video processor), so the processor class the
model family names (``common/families/``: ``load_processor_class``; by default the folder config's own class) is
loaded through its own ``from_pretrained`` with the video processor left out: the same
resolution of every other part — the image processor from ``preprocessor_config.json`` (or ``processor_config.json``),
the tokenizer, and the chat template from ``chat_template.jinja``, ``chat_template.json`` or
``processor_config.json``. A template that only ``tokenizer_config.json`` holds (older checkpoints) is what the
tokenizer's own ``apply_chat_template`` uses; the processor does not carry it over, so it is taken from there.

``load_processor`` raises ``StartupError`` — one line naming the folder and what is missing — when the folder has no
image processor or no chat template, or the processor cannot be loaded at all: a scheduler must not report SERVING
and then fail every request (docs/DEPLOYMENT.md, "Model folder").
"""

from __future__ import annotations

import os
from pathlib import Path

from common.process import StartupError

# Where transformers looks for a chat template, in the words of the error that names them.
TEMPLATE_FILES = (
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json (chat_template)",
    "tokenizer_config.json (chat_template)",
)


def _from_pretrained(model_dir: Path):
    from transformers import AutoConfig, AutoProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return AutoProcessor.from_pretrained(model_dir)
    from common.families import Family, family_for_type

    config = AutoConfig.from_pretrained(model_dir)
    family = family_for_type(config.model_type) or Family()  # an unserved type fails later, naming itself
    return family.load_processor_class(config).from_pretrained(model_dir)


def _has_image_processor(model_dir: Path) -> bool:
    from transformers import AutoImageProcessor

    try:
        AutoImageProcessor.from_pretrained(model_dir)
    except Exception:  # noqa: BLE001 - OSError for a missing file, ValueError for an unknown type: both mean none
        return False
    return True


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def load_processor(model_dir: str | os.PathLike):
    """The processor of ``model_dir`` with its chat template; ``StartupError`` when a part serving needs is missing."""
    model_dir = Path(model_dir)
    try:
        processor = _from_pretrained(model_dir)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for an incomplete folder
        if not _has_image_processor(model_dir):
            raise StartupError(
                f"model folder {model_dir} has no image processor: transformers' AutoImageProcessor found no usable "
                "preprocessor_config.json; copy it from the checkpoint this model was trained from"
            ) from None
        raise StartupError(f"cannot load the processor of model folder {model_dir}: {_reason(exc)}") from exc
    if getattr(processor, "image_processor", None) is None:
        raise StartupError(f"model folder {model_dir} has no image processor (preprocessor_config.json)")
    if not processor.chat_template:
        template = getattr(processor.tokenizer, "chat_template", None)
        if not template:
            raise StartupError(
                f"model folder {model_dir} has no chat template: none of {', '.join(TEMPLATE_FILES)} holds one; "
                "copy chat_template.jinja (or chat_template.json) from the checkpoint this model was trained from"
            )
        processor.chat_template = template
    return processor
