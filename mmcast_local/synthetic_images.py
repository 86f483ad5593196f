"""Deterministic synthetic scenes (sky, sun, hills, clouds, soft shapes) as realistic photo-sized JPEGs.

The demo and the benchmarks need many distinct 1280×720 images that compress like photographs (~100–300 KB as
JPEG), not like noise (megabytes) or flat colour (a few KB). A scene is smooth at large scales — gradients, a sun
with a glow, layered hills, blurred blobs — with fractal detail (sums of smooth, upsampled octaves) for clouds and
ground texture. The same seed always gives the same pixels and, with the same Pillow, the same bytes.
"""

from __future__ import annotations

import functools
import io

import numpy as np

DEFAULT_SIZE = (1280, 720)
# Relative strength of the ground texture; it sets where the JPEG size lands (~100-300 KB at 1280x720).
GRASS_CONTRAST = 0.2


def _smooth_octave(rng: np.random.Generator, height: int, width: int, cells: int) -> np.ndarray:
    """A field in [0, 1] that varies smoothly over about `cells` cells across the width (bilinear upsampling)."""
    gh = max(2, round(cells * height / width) + 2)
    gw = cells + 2
    grid = rng.random((gh, gw), dtype=np.float32)
    ys = np.linspace(0, gh - 1.001, height, dtype=np.float32)
    xs = np.linspace(0, gw - 1.001, width, dtype=np.float32)
    y0 = ys.astype(np.int32)
    x0 = xs.astype(np.int32)
    fy = ys - y0
    fx = xs - x0
    # smoothstep weights hide the grid.
    fy = (fy * fy * (3 - 2 * fy))[:, None]
    fx = (fx * fx * (3 - 2 * fx))[None, :]
    # Separable: interpolate each grid row along x, then the rows along y.
    rows = grid[:, x0] * (1 - fx) + grid[:, x0 + 1] * fx
    return rows[y0] * (1 - fy) + rows[y0 + 1] * fy


def _fractal(
    rng: np.random.Generator, height: int, width: int, base_cells: int, octaves: int, persistence: float = 0.5
) -> np.ndarray:
    """Octaves of smooth fields, each twice as fine and `persistence` times as strong; normalised to [0, 1]."""
    total = np.zeros((height, width), dtype=np.float32)
    amplitude, norm = 1.0, 0.0
    for octave in range(octaves):
        total += amplitude * _smooth_octave(rng, height, width, base_cells * 2**octave)
        norm += amplitude
        amplitude *= persistence
    return total / norm


def synthetic_scene(seed: int, size: tuple[int, int] = DEFAULT_SIZE):
    """A PIL RGB image of a landscape determined by `seed`; `size` is (width, height)."""
    from PIL import Image

    width, height = size
    rng = np.random.default_rng(seed)
    yy = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    xx = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]

    # Sky: a vertical gradient between two seed-chosen colours.
    zenith = rng.uniform([10, 40, 110], [80, 120, 200]).astype(np.float32)
    horizon_colour = rng.uniform([170, 150, 140], [250, 220, 200]).astype(np.float32)
    t = yy[..., None]
    image = zenith * (1 - t) + horizon_colour * t
    image = np.broadcast_to(image, (height, width, 3)).copy()

    # Sun with a soft glow.
    sun_x, sun_y = rng.uniform(0.1, 0.9), rng.uniform(0.08, 0.4)
    aspect = width / height
    dist = np.sqrt(((xx - sun_x) * aspect) ** 2 + (yy - sun_y) ** 2)
    sun_radius = rng.uniform(0.04, 0.08)
    glow = np.exp(-((dist / (sun_radius * 4)) ** 2))[..., None]
    disc = np.clip((sun_radius - dist) / 0.006, 0, 1)[..., None]
    sun_colour = rng.uniform([240, 200, 120], [255, 250, 220]).astype(np.float32)
    image = image * (1 - 0.5 * glow) + sun_colour * 0.5 * glow
    image = image * (1 - disc) + sun_colour * disc

    # Clouds: fractal cover, thresholded softly, thicker near the top.
    cover = _fractal(rng, height, width, base_cells=4, octaves=6)
    cloud = np.clip((cover - rng.uniform(0.45, 0.6)) * 4, 0, 1) * np.clip(1.2 - yy * 1.6, 0, 1)
    shade = 0.85 + 0.15 * _fractal(rng, height, width, base_cells=16, octaves=4)
    image = image * (1 - cloud[..., None]) + (245 * shade)[..., None] * cloud[..., None]

    # Hills: layered ridgelines from smooth 1-D profiles, each layer nearer, darker and more textured.
    n_layers = int(rng.integers(2, 5))
    horizon = rng.uniform(0.45, 0.65)
    for layer in range(n_layers):
        profile = _smooth_octave(rng, 1, width, cells=int(rng.integers(3, 8)))[0]
        profile += 0.3 * _smooth_octave(rng, 1, width, cells=int(rng.integers(12, 30)))[0]
        ridge = horizon + layer * (1 - horizon) / (n_layers + 1) + (profile - 0.6) * rng.uniform(0.08, 0.2)
        top = max(0, int(ridge.min() * height) - 2)  # rows above the ridge are untouched: skip them
        below = yy[top:] - ridge[None, :]
        mask = np.clip(below * height / 2.0, 0, 1)[..., None]
        ground = rng.uniform([30, 70, 20], [120, 160, 80]).astype(np.float32) * (1 - 0.12 * layer)
        # Grass-like detail down to a few pixels: what makes the JPEG photo-sized.
        texture = _fractal(rng, height - top, width, base_cells=60 * (layer + 1), octaves=4, persistence=0.9)
        texture = (texture - texture.mean()) / (texture.std() + 1e-6)
        depth = np.clip(below * 2, 0, 1)
        layer_colour = ground * (1 + GRASS_CONTRAST * texture[..., None]) * (1 - 0.3 * depth[..., None])
        image[top:] = image[top:] * (1 - mask) + layer_colour * mask

    # Soft shapes: blurred coloured ellipses (trees, rocks, balloons — whatever the eye makes of them).
    for _ in range(int(rng.integers(3, 8))):
        cx, cy = rng.uniform(0, 1), rng.uniform(0.2, 1)
        rx, ry = rng.uniform(0.02, 0.12), rng.uniform(0.03, 0.15)
        r = np.sqrt(((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2)
        alpha = (np.clip(1.2 - r, 0, 1) ** 1.5 * rng.uniform(0.6, 0.95))[..., None]
        colour = rng.uniform(20, 230, size=3).astype(np.float32)
        image = image * (1 - alpha) + colour * alpha

    # A gentle vignette.
    vignette = 1 - 0.25 * (((xx - 0.5) * 1.6) ** 2 + ((yy - 0.5) * 1.6) ** 2)
    image *= vignette[..., None]
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8), "RGB")


@functools.lru_cache(maxsize=64)  # ~150 KB each; rendering one costs ~0.5 s on a small CPU
def synthetic_jpeg(seed: int, size: tuple[int, int] = DEFAULT_SIZE, quality: int = 90) -> bytes:
    """The JPEG bytes of `synthetic_scene(seed, size)` (baseline, no EXIF; deterministic for a given Pillow)."""
    buffer = io.BytesIO()
    synthetic_scene(seed, size).save(buffer, format="JPEG", quality=quality, optimize=False)
    return buffer.getvalue()
