"""The frontend and the image input on the tiny LLaVA (a family with no grid and no M-RoPE): the header-only token
count equals the processor's own output for every size of the header corpus and every file of the image-input
corpus; the prompt equals ``LlavaProcessor`` fed the input as sent, in both payload encodings; an item carries only
its payload (no keep_on_cpu field); ``process_bytes`` on the file as sent is bit-identical to transformers' image
processor. The references never go through the project's code."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from common.families import family_of
from common.image_header import ImageHeaderReader
from common.image_input import ImageInput
from common.model_checks import read_config
from common.multimodal import ENCODED_FIELD
from common.processor import load_processor
from scheduler_svc.config import DEFAULT_IMAGE_FORMATS, SchedulerConfig
from scheduler_svc.engine.frontend import ChatTurn, Frontend, ImagePart, TextPart
from tests.common import test_image_input as corpus
from tests.scheduler.test_frontend import IMG_A, IMG_B, png
from tests.scheduler.test_image_header import SIZES, encoded
from tests.support.oracle import image_as_sent


@pytest.fixture(scope="module")
def processor(tiny_model_llava_dir):
    return load_processor(tiny_model_llava_dir)


@pytest.fixture(scope="module")
def image_input(tiny_model_llava_dir, processor):
    family = family_of(read_config(tiny_model_llava_dir))
    return ImageInput(processor.image_processor, DEFAULT_IMAGE_FORMATS, 1 << 40, family, processor=processor)


def processor_tokens(processor, image) -> int:
    """Placeholders the LLaVA processor itself gives ``image`` (its expansion of one image token)."""
    ids = processor(text=[processor.image_token], images=[image], return_tensors="pt")["input_ids"][0]
    return int((ids == processor.image_token_id).sum())


def test_header_tokens_equal_the_processors_output_for_every_size(image_input, processor):
    # LLaVA resizes and center-crops: no size is refused (the Qwen-VL rule refuses aspect ratios over 200).
    for width, height in SIZES:
        _, header = image_input.open(encoded(width, height), "x")
        assert image_input.grid(header) is None
        want = processor_tokens(processor, Image.new("RGB", (width, height)))
        assert header.tokens == want == 9, (width, height, header.tokens, want)


def test_header_reader_without_the_processor_refuses_to_guess(processor):
    # The count lives in the whole processor (patch size, feature strategy), not the image processor.
    family = family_of({"model_type": "llava"})
    reader = ImageHeaderReader(
        DEFAULT_IMAGE_FORMATS,
        1 << 40,
        processor.image_processor,
        lambda h, w: family.image_tokens(None, processor.image_processor, h, w),
    )
    with pytest.raises(Exception, match="processor"):
        reader.open(encoded(20, 20), "x")


@pytest.mark.parametrize("name", corpus.CASE_NAMES)
def test_corpus_file_tokens_and_pixels_equal_the_processors(image_input, processor, tiny_model_llava_dir, name):
    c = corpus.case(name)
    _, header = image_input.open(c.data, "x")
    assert header.tokens == processor_tokens(processor, image_as_sent(c.data)), name
    pixels, grid = image_input.process_bytes(c.data, "messages[0].content[0]")
    assert grid is None and tuple(pixels.shape) == (1, 3, 42, 42)
    reference = AutoImageProcessor.from_pretrained(tiny_model_llava_dir)
    ref = reference(images=[image_as_sent(c.data)], return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels, ref), (name, float((pixels - ref).abs().max()))


@pytest.mark.parametrize("encoding", ["pixels", "encoded"])
def test_prompt_equals_the_llava_processor_and_items_carry_no_grid(tiny_model_llava_dir, processor, encoding):
    fe = Frontend(tiny_model_llava_dir, SchedulerConfig(payload_encoding=encoding))
    tall = png(30, 200, 9)
    prompt = fe.process(
        [ChatTurn("user", [TextPart("hello"), ImagePart(IMG_A), TextPart("and"), ImagePart(tall), ImagePart(IMG_B)])]
    )
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hello"},
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image"},
                {"type": "image"},
            ],
        }
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = processor(text=[text], images=[image_as_sent(x) for x in (IMG_A, tall, IMG_B)], return_tensors="pt")
    assert prompt.token_ids == ref["input_ids"][0].tolist()
    image_positions = torch.nonzero(ref["input_ids"][0] == processor.image_token_id).flatten().tolist()
    assert [p for f in prompt.mm_features for p in range(f.mm_position.offset, f.mm_position.end)] == image_positions
    payload = "pixel_values" if encoding == "pixels" else ENCODED_FIELD
    for f in prompt.mm_features:
        assert list(f.data) == [payload] and not f.data[payload].keep_on_cpu
    if encoding == "pixels":
        pixels = torch.cat([f.data["pixel_values"].data for f in prompt.mm_features])
        assert torch.equal(pixels, ref["pixel_values"])
    else:
        assert [bytes(f.data[ENCODED_FIELD].data.numpy()) for f in prompt.mm_features] == [IMG_A, tall, IMG_B]
