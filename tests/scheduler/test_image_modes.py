"""Images enter as the model's processor takes the file the user sent (scheduler_svc/engine/frontend.py): transparency
composited onto white by the processor's ``convert_to_rgb``, palette, CMYK and 16-bit images converted by it, the
EXIF orientation applied as transformers' ``load_image`` applies it.

The references are transformers itself, fed the file as sent: ``processor(load_image(path))`` for opaque images
(``load_image`` ends in ``convert("RGB")``, which would drop alpha unblended) and ``processor(Image.open(path))``
for unturned ones. Both hold for the test oracle's loader (tests/support/oracle.py ``image_as_sent``), which then answers
for the served tokens, through a real scheduler and real ranks, with negative controls: the frontend's old handling
(alpha dropped, no turn) gives other pixel values and other log-probabilities.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from transformers.image_utils import load_image

from mmcast_client import Client
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.frontend import ChatTurn, Frontend, ImagePart, TextPart
from tests.support.oracle import GENERATE, LOGPROB_TOLERANCE, Oracle, assert_matches, image_as_sent, user_turn

W, H = 112, 84  # 4 x 3 merged patches: 12 image tokens
QUESTION = "What is in this picture?"


def _noise(seed: int, channels: int, high: int = 256, dtype=np.uint8) -> np.ndarray:
    shape = (H, W, channels) if channels > 1 else (H, W)
    return np.random.default_rng(seed).integers(0, high, shape).astype(dtype)


def _encode(image: Image.Image, fmt: str, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def _alpha(seed: int) -> np.ndarray:
    """Mostly opaque or fully transparent, some half: every compositing case, over colours far from white."""
    return np.random.default_rng(seed).choice(np.array([0, 0, 128, 255, 255], np.uint8), (H, W))


def _palette_with_transparency() -> bytes:
    image = Image.fromarray(_noise(3, 1, 16)).convert("P")  # 16 grey levels as palette indices
    image.putpalette(np.random.default_rng(4).integers(0, 200, 768).astype(np.uint8).tobytes())
    return _encode(image, "PNG", transparency=5)


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


# name -> (encoded file, whether it has transparency, whether its EXIF orientation turns it)
CASES = {
    "RGBA PNG": (_encode(Image.fromarray(np.dstack([_noise(1, 3), _alpha(2)]), "RGBA"), "PNG"), True, False),
    "LA PNG": (_encode(Image.fromarray(np.dstack([_noise(5, 1), _alpha(6)]), "LA"), "PNG"), True, False),
    "P PNG with a transparent index": (_palette_with_transparency(), True, False),
    "CMYK JPEG": (_encode(Image.fromarray(_noise(7, 4), "CMYK"), "JPEG", quality=95), False, False),
    "16-bit greyscale PNG": (_encode(Image.fromarray(_noise(8, 1, 600, np.uint16)), "PNG"), False, False),
    "JPEG rotated by EXIF (6)": (_encode(Image.fromarray(_noise(9, 3)), "JPEG", exif=_exif(6)), False, True),
    "RGBA PNG mirrored and rotated by EXIF (7)": (
        _encode(Image.fromarray(np.dstack([_noise(10, 3), _alpha(11)]), "RGBA"), "PNG", exif=_exif(7)),
        True,
        True,
    ),
}


def _old_handling(data: bytes) -> bytes:
    """The negative control: the file's colours with its transparency ignored and its orientation not applied (what
    the frontend's former ``convert("RGB")`` gave an RGBA or LA file), re-encoded losslessly. Only the pixel array is
    kept: ``convert("RGB")`` of a palette image keeps its transparent colour in ``info``, which the processor would
    still composite."""
    return _encode(Image.fromarray(np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))), "PNG")


def _pixels(processor, image) -> tuple:
    out = processor(images=[image], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.mark.parametrize("variant", ["tiny_model_dir", "tiny_model_25_dir"])
def test_pixel_values_equal_the_processor_fed_the_file_as_sent(variant, request, tmp_path):
    frontend = Frontend(request.getfixturevalue(variant), SchedulerConfig(payload_encoding="pixels"))
    processor = frontend.image_processor
    for name, (data, transparent, turned) in CASES.items():
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.img"
        path.write_bytes(data)
        prompt = frontend.process([ChatTurn("user", [ImagePart(data), TextPart(QUESTION)])])
        item = prompt.mm_features[0]
        served = item.data["pixel_values"].data, item.data["image_grid_thw"].data

        transformers_refs = []
        if not transparent:  # load_image's convert("RGB") drops alpha: it is transformers' answer for opaque files
            transformers_refs.append(("processor(load_image(file))", _pixels(processor, load_image(str(path)))))
        if not turned:  # the processor fed the decoded file as it is
            transformers_refs.append(("processor(Image.open(file))", _pixels(processor, Image.open(path))))
        # A turned transparent file has no transformers entry point that both turns it and composites its alpha:
        # only the oracle's loader answers for it.
        assert bool(transformers_refs) != (transparent and turned), name
        oracle_ref = _pixels(processor, image_as_sent(data))
        for what, (pixels, grid) in [*transformers_refs, ("the oracle's image_as_sent", oracle_ref)]:
            assert served[1].tolist() == grid.tolist(), (name, what, served[1].tolist(), grid.tolist())
            assert served[0].shape == pixels.shape and bool((served[0] == pixels).all()), (name, what)

        # Tokens: the header predicted the turned image's count and size before decoding.
        _, header = frontend.check_image_header(data, "x")
        assert item.mm_position.length == header.tokens == int(served[1].prod()) // 4, name
        upright = image_as_sent(data).size
        assert (header.width, header.height) == upright, (name, header, upright)

        # Negative control: the old handling (alpha dropped, no turn) gives other pixels where it matters.
        old_pixels, old_grid = _pixels(processor, Image.open(io.BytesIO(_old_handling(data))))
        if turned:
            assert old_grid.tolist() != served[1].tolist(), name
        elif transparent:
            assert float((old_pixels - served[0]).abs().max()) > 0.5, name
        else:  # CMYK and 16-bit: the processor converts them as convert("RGB") did
            assert bool((old_pixels == served[0]).all()), name


def _ask(client: Client, data: bytes):
    return client.generate([user_turn(data, QUESTION)], **GENERATE)


def _check_served(client: Client, oracle: Oracle, what: str) -> None:
    controls = 0
    for name, (data, transparent, turned) in CASES.items():
        result = _ask(client, data)
        assert_matches(result, oracle([user_turn(data, QUESTION)]), f"{what}: {name}")
        if transparent or turned:  # the old handling answers otherwise: the comparison can tell them apart
            _, control = oracle([user_turn(_old_handling(data), QUESTION)])
            served = [lp.logprob for lp in result.logprobs]
            assert max(abs(a - b) for a, b in zip(served, control, strict=True)) > LOGPROB_TOLERANCE, name
            controls += 1
    assert controls == 5  # RGBA, LA, palette, and the two turned files


@pytest.mark.slow
def test_served_tokens_match_the_oracle_qwen2_vl_tp2(serve_local_tp2, tiny_model_dir):
    """Real processes (serve-local, TP=2)."""
    with Client(serve_local_tp2.target, timeout=300) as client:
        _check_served(client, Oracle(tiny_model_dir), "qwen2_vl TP=2")


@pytest.mark.slow
def test_served_tokens_match_the_oracle_qwen2_5_vl(tiny_model_25_dir):
    """The real scheduler server and a real rank, in this process (each on its own port and event loop)."""
    from tests.support.service_harness import scheduler_server
    from tests.support.worker_driver import InProcessWorker, rank_token_file
    from worker_svc.config import WorkerConfig

    rank = InProcessWorker(
        WorkerConfig(
            model=str(tiny_model_25_dir), listen="127.0.0.1:0", kv_blocks=256, shared_token_file=rank_token_file()
        )
    )
    config = SchedulerConfig(
        model=str(tiny_model_25_dir),
        workers=[rank.target],
        listen="127.0.0.1:0",
        metrics_port=0,
        worker_token_file=rank_token_file(),
    )
    try:
        with scheduler_server(config) as port, Client(f"127.0.0.1:{port}", timeout=300) as client:
            _check_served(client, Oracle(tiny_model_25_dir), "qwen2_5_vl TP=1")
    finally:
        rank.stop()
