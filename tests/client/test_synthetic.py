"""Synthetic scenes: photo-sized 1280x720 JPEGs, deterministic, smooth (not noise)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from mmcast_local.synthetic_images import synthetic_jpeg, synthetic_scene


def test_jpeg_size_format_and_dimensions():
    for data in (synthetic_jpeg(seed) for seed in range(4)):
        assert 100 << 10 <= len(data) <= 300 << 10, len(data)
        image = Image.open(io.BytesIO(data))
        assert image.format == "JPEG" and image.size == (1280, 720) and image.mode == "RGB"


def test_deterministic_and_distinct():
    uncached = synthetic_jpeg.__wrapped__
    assert uncached(7) == uncached(7)
    assert uncached(7) != uncached(8)
    assert len({synthetic_jpeg(seed) for seed in range(4)}) == 4


def test_scenes_are_smooth_not_noise():
    pixels = np.asarray(synthetic_scene(3), dtype=np.float32)
    step = np.abs(np.diff(pixels, axis=1)).mean()
    assert step < 8, step  # uniform noise would average ~85 between neighbours
    assert pixels.std() > 20  # and not flat either
