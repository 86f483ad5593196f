"""M-RoPE positions (Qwen2-VL / Qwen2.5-VL) for a whole prompt, from its items' placeholder ranges and grids.

A text token gets the same position on all three rows (temporal, height, width). An item's placeholder tokens,
laid out ``t x h x w`` (in merged patches: ``h = grid_h // merge``, ``w = grid_w // merge``), get
``start + (floor(t_index * interval), h_index, w_index)``, where ``start`` is the position the next text token
would have had. After the prompt, token ``i`` sits at ``i + delta`` on every row, ``delta = max + 1 - len``.

Where the inputs come from: each item's ``mm_position`` and its ``keep_on_cpu`` fields (``image_grid_thw``;
``video_grid_thw`` and optionally ``second_per_grid_ts``), which survive prefix-cache stripping for M-RoPE models,
so a stripped item counts exactly like a present one. ``input_ids`` is used only for its length: nothing scans it
for special tokens, so placeholder ids that also occur in plain text cannot shift anything.

The rule is ``transformers`` 5.24's ``get_rope_index`` (the oracle of docs/ARCHITECTURE.md §3, invariants 3-4), exactly:

- images: identical to the original Qwen rule too — the text after an image resumes at
  ``start + max(h, w)``, which is the image's largest position + 1.
- videos: the temporal step is ``interval = tokens_per_second * second_per_grid_t`` (Qwen2.5-VL; 1 when the item
  has no ``second_per_grid_ts``), quantised as ``(arange(t) * interval).long()`` in the field's float dtype, as
  transformers does. Qwen2-VL ignores ``second_per_grid_ts`` and steps by 1: pass ``tokens_per_second=None``
  (the family's ``rope_kwargs`` does; its processor never emits the field, so the default 1.0 gives the same).
  The text after a video resumes at ``start + max(h, w)`` — transformers 5.x advances by the spatial extent only.
  The original Qwen code (Qwen2-VL / Qwen2.5-VL repos, vLLM) resumes at the block's largest position + 1, i.e.
  ``start + max(floor((t - 1) * interval) + 1, h, w)``, so the two differ whenever a video's temporal span
  exceeds its spatial one (many frames, or a Qwen2.5-VL interval above 1): under 5.x the following
  text reuses positions the video's temporal row already holds. We follow transformers because served tokens
  must equal plain transformers. Consequence, also as in transformers: ``delta`` comes from the largest position
  of the prompt, which for such a video is on the temporal row, so decode positions (``i + delta``) do **not**
  continue the prompt's text positions (``i + shift``) — a request resumed with its generated tokens appended to
  its prompt must keep the original prompt length and place the appended tokens with ``decode_positions``.

Cost (2-core dev VM, torch 2.13 CPU, medians): a 32,768-token prompt with 26 images of 1196 tokens (grid
1x52x92) takes ~0.5 ms, the same with 20 of them stripped; transformers' ``get_rope_index`` takes ~5 ms on it.
The work is a few whole-prompt tensor ops plus a handful of small ops per item (blocks of equal grids built once).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from common.families import uses_mrope  # noqa: F401  (the shared rule; re-exported for the runner)
from common.multimodal import Modality, MultiModalFeatureSpec

_GRID_FIELD = {Modality.IMAGE: "image_grid_thw", Modality.VIDEO: "video_grid_thw"}


def _vision_runs(feature: MultiModalFeatureSpec) -> list[tuple[int, int]]:
    """``(offset, length)`` of each contiguous run of the tokens that take the item's embeddings: one run (all of
    its tokens) unless ``is_embed`` says otherwise; several for a Qwen3-VL video, whose temporal patches are separate
    blocks with a timestamp between them."""
    pos = feature.mm_position
    if pos.is_embed is None:
        return [(pos.offset, pos.length)]
    mask = torch.as_tensor(pos.is_embed, dtype=torch.bool).reshape(-1)
    idx = mask.nonzero().reshape(-1)
    if idx.numel() == 0:
        return []
    breaks = (idx[1:] != idx[:-1] + 1).nonzero().reshape(-1) + 1
    bounds = [0, *breaks.tolist(), idx.numel()]
    return [(pos.offset + int(idx[a]), b - a) for a, b in zip(bounds, bounds[1:], strict=False)]


def _grid(feature: MultiModalFeatureSpec) -> tuple[int, int, int]:
    name = _GRID_FIELD[feature.modality]
    if feature.data is None or name not in feature.data:
        raise ValueError(
            f"item {feature.identifier!r} at offset {feature.mm_position.offset} has no {name}; M-RoPE needs every "
            "item's grid, cached or not — strip with strip_covered_mm_data(..., uses_mrope=True)"
        )
    grid = feature.data[name].data.reshape(-1)
    if grid.numel() != 3:
        raise ValueError(f"item {feature.identifier!r}: {name} has {grid.numel()} values, expected 3 (t, h, w)")
    t, h, w = (int(v) for v in grid.tolist())
    return t, h, w


def _blocks(features, merge: int):
    """``(feature, offset, length, t, h, w)`` of every block of placeholder tokens, in merged patches: an item is one
    block, or, when its embedding tokens form ``t`` separate runs (Qwen3-VL's video: a timestamp before each temporal
    patch), ``t`` blocks of one temporal patch each — transformers 5.24's Qwen3-VL ``get_rope_index`` splits the
    video's grid into ``t`` grids of ``(1, h, w)`` the same way, the text between them counting as text."""
    for feature in features:
        runs = _vision_runs(feature)
        if not runs:
            continue  # no placeholder token takes an embedding: the item holds no position of its own
        t, h, w = _grid(feature)
        offset = runs[0][0]
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise ValueError(
                f"item {feature.identifier!r} at offset {offset}: grid ({t}, {h}, {w}) must be positive with h and w "
                f"multiples of spatial_merge_size={merge}"
            )
        lt, lh, lw = t, h // merge, w // merge
        if len(runs) == 1:
            if lt * lh * lw != runs[0][1]:
                raise ValueError(
                    f"item {feature.identifier!r} at offset {offset} has {runs[0][1]} placeholder tokens but its grid "
                    f"({t}, {h}, {w}) with spatial_merge_size={merge} gives {lt * lh * lw}"
                )
            yield feature, offset, runs[0][1], lt, lh, lw
            continue
        if len(runs) != lt or any(length != lh * lw for _, length in runs):
            raise ValueError(
                f"item {feature.identifier!r} at offset {offset}: its embedding tokens form {len(runs)} blocks of "
                f"{[length for _, length in runs]} tokens; its grid ({t}, {h}, {w}) with spatial_merge_size={merge} "
                f"needs one block of {lh * lw} per temporal patch ({lt}), or a single block"
            )
        for run_offset, length in runs:
            yield feature, run_offset, length, 1, lh, lw


def _interval(feature: MultiModalFeatureSpec, tokens_per_second: float | None) -> Any:
    """Temporal step of the item, as the same Python/tensor scalar transformers multiplies by."""
    if feature.modality is not Modality.VIDEO:
        return 1
    if tokens_per_second is None:
        return 1.0  # Qwen2-VL
    elem = feature.data.get("second_per_grid_ts") if feature.data is not None else None
    if elem is None:
        return tokens_per_second * 1
    return tokens_per_second * elem.data.reshape(-1)[0]


def mrope_positions(
    input_ids: Sequence[int] | torch.Tensor,
    mm_features: Sequence[MultiModalFeatureSpec] | None,
    spatial_merge_size: int,
    tokens_per_second: float | None = 1.0,
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions of the whole prompt: ``(positions (3, len) int64, delta)``.

    ``tokens_per_second``: Qwen2.5-VL's ``vision_config.tokens_per_second``; None for Qwen2-VL (temporal step 1,
    ``second_per_grid_ts`` ignored). Raises ``ValueError`` when an item lacks its grid, when the grid is not
    positive or not a multiple of the merge size, when its placeholder count differs from
    ``t * (h // merge) * (w // merge)``, or when items overlap or run past the prompt.
    """
    n = len(input_ids)
    if spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size={spatial_merge_size} must be >= 1")
    features = sorted(mm_features or (), key=lambda f: f.mm_position.offset)

    # Per item (a few scalars): where its block lies, the position it starts at, its positions relative to that.
    offsets, ends, starts, blocks = [], [], [], []
    relative: dict[tuple, torch.Tensor] = {}  # blocks of equal shape and temporal steps are built once
    shift = 0  # position - index of the text before the current item
    for feature, offset, length, lt, lh, lw in _blocks(features, spatial_merge_size):
        prev_end = ends[-1] if ends else 0
        if offset < prev_end or offset + length > n:
            raise ValueError(
                f"item {feature.identifier!r} spans [{offset}, {offset + length}): it overlaps the previous item "
                f"(ending at {prev_end}) or runs past the prompt ({n} tokens)"
            )
        if lt == 1:
            steps, key = None, (lh, lw, 0)  # a single frame sits at temporal offset 0 whatever the interval
        else:
            steps = (torch.arange(lt) * _interval(feature, tokens_per_second)).long()
            key = (lh, lw, *steps.tolist())
        if key not in relative:
            steps = torch.zeros(1, dtype=torch.long) if steps is None else steps
            grid_t, grid_h, grid_w = torch.meshgrid(steps, torch.arange(lh), torch.arange(lw), indexing="ij")
            relative[key] = torch.stack([grid_t, grid_h, grid_w]).reshape(3, length)
        start = offset + shift
        offsets.append(offset)
        ends.append(offset + length)
        starts.append(start)
        blocks.append(relative[key])
        shift = start + max(lh, lw) - (offset + length)  # transformers 5.x: advance by the spatial extent only

    # Text: index + the shift in force there; it changes only right after each item.
    positions = torch.arange(n)
    if offsets:
        before = torch.tensor(starts) - torch.tensor(offsets)  # shift at each item's first token
        after = torch.cat([before[1:], torch.tensor([shift])])  # ... and right after its last one
        bump = torch.zeros(n + 1, dtype=torch.long).index_add_(0, torch.tensor(ends), after - before)
        positions = positions + torch.cumsum(bump[:n], 0)
    positions = positions.expand(3, n).clone()
    for offset, end, start, block in zip(offsets, ends, starts, blocks, strict=True):
        torch.add(block, start, out=positions[:, offset:end])

    delta = int(positions.max()) + 1 - n if n else 0
    return positions, delta


def decode_positions(start: int, count: int, delta: int) -> torch.Tensor:
    """Positions ``(3, count)`` of tokens ``start .. start + count - 1`` past the prompt: ``i + delta`` on every row."""
    return (torch.arange(start, start + count) + delta).expand(3, count).clone()


def mrope_positions_for_window(positions: torch.Tensor, start: int, end: int, delta: int | None = None) -> torch.Tensor:
    """Columns ``[start, end)`` of a request's positions; those past the prompt continue with ``i + delta``.

    ``positions`` is the whole prompt's ``mrope_positions`` result; ``delta`` defaults to the one it implies.
    """
    n = positions.shape[1]
    if not 0 <= start <= end:
        raise ValueError(f"window [{start}, {end}) must have 0 <= start <= end")
    if end <= n:
        return positions[:, start:end]
    if delta is None:
        delta = int(positions.max()) + 1 - n if n else 0
    tail_start = max(start, n)
    tail = decode_positions(tail_start, end - tail_start, delta)
    if start >= n:
        return tail
    return torch.cat([positions[:, start:], tail], dim=1)
