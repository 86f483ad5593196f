"""Prefix-cache-aware stripping (docs/ARCHITECTURE.md §3, invariant 1), rule by rule, plus properties."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.multimodal import (
    FieldKind,
    Modality,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PayloadState,
    PlaceholderRange,
    strip_covered_mm_data,
)


def make_item(offset: int, length: int, ident: str = "img", with_data: bool = True) -> MultiModalFeatureSpec:
    data = None
    if with_data:
        data = MultiModalKwargsItem(
            {
                "pixel_values": MultiModalFieldElem(torch.full((length * 4, 8), float(offset)), kind=FieldKind.FLAT),
                "image_grid_thw": MultiModalFieldElem(torch.tensor([[1, 2, length * 2]]), keep_on_cpu=True),
            }
        )
    return MultiModalFeatureSpec(
        data=data, modality=Modality.IMAGE, identifier=ident, mm_position=PlaceholderRange(offset, length)
    )


def test_covered_item_loses_payload():
    items = [make_item(2, 4)]
    out = strip_covered_mm_data(items, 10)
    assert out[0].data is None
    assert out[0].payload_state is PayloadState.STRIPPED
    assert out[0].payload_nbytes == 16 * 8 * 4


def test_boundary_equality_counts_as_covered():
    out = strip_covered_mm_data([make_item(2, 4)], 6)
    assert out[0].payload_state is PayloadState.STRIPPED


def test_uncovered_and_straddling_items_keep_payload():
    items = [make_item(10, 4, "later"), make_item(4, 4, "straddle")]
    out = strip_covered_mm_data(items, 7)
    assert out[0].data is items[0].data and out[1].data is items[1].data
    assert all(o.payload_state is PayloadState.PRESENT for o in out)


def test_already_none_stays_none():
    item = make_item(0, 4, with_data=False)
    out = strip_covered_mm_data([item], 10, uses_mrope=True)
    assert out[0].data is None and out[0].payload_state is PayloadState.STRIPPED


@pytest.mark.parametrize("features", [None, []])
def test_no_features_returns_same_object(features):
    assert strip_covered_mm_data(features, 100) is features


def test_zero_computed_returns_same_list():
    items = [make_item(0, 4)]
    assert strip_covered_mm_data(items, 0) is items


def test_inputs_never_mutated():
    items = [make_item(0, 4, "a"), make_item(8, 4, "b")]
    before = [(i.data, i.payload_state, i.identifier, i.mm_position) for i in items]
    snapshot = list(items)
    out = strip_covered_mm_data(items, 12, uses_mrope=True)
    assert out is not items
    assert items == snapshot
    assert [(i.data, i.payload_state, i.identifier, i.mm_position) for i in items] == before
    assert items[0].data["pixel_values"].data.shape == (16, 8)


def test_non_data_fields_unchanged():
    items = [make_item(3, 5, "ident-x")]
    out = strip_covered_mm_data(items, 8, uses_mrope=True)
    assert (out[0].identifier, out[0].modality, out[0].mm_position) == (
        "ident-x",
        Modality.IMAGE,
        PlaceholderRange(3, 5),
    )


def test_mrope_keeps_exactly_keep_on_cpu_fields():
    item = make_item(0, 4)
    out = strip_covered_mm_data([item], 4, uses_mrope=True)
    assert set(out[0].data) == {"image_grid_thw"}
    assert out[0].data["image_grid_thw"].data is item.data["image_grid_thw"].data
    # distinguishable from an item that still has its payload
    assert out[0].payload_state is PayloadState.STRIPPED and item.payload_state is PayloadState.PRESENT
    assert "pixel_values" in item.data and "pixel_values" not in out[0].data


def test_without_mrope_data_is_dropped_entirely():
    out = strip_covered_mm_data([make_item(0, 4)], 4, uses_mrope=False)
    assert out[0].data is None


spans = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 20)), min_size=1, max_size=8)


def layout(gaps_lengths):
    items, pos = [], 0
    for i, (gap, length) in enumerate(gaps_lengths):
        pos += gap
        items.append(make_item(pos, length, f"id{i}"))
        pos += length
    return items, pos


@settings(max_examples=200, deadline=None)
@given(spans, st.integers(0, 200), st.booleans())
def test_item_overlapping_uncomputed_tail_is_never_stripped(gaps_lengths, computed, mrope):
    items, _ = layout(gaps_lengths)
    out = strip_covered_mm_data(items, computed, uses_mrope=mrope)
    for before, after in zip(items, out, strict=True):
        if before.mm_position.offset + before.mm_position.length > computed:
            assert after is before
        else:
            assert after.payload_state is PayloadState.STRIPPED


@settings(max_examples=200, deadline=None)
@given(spans, st.integers(0, 200), st.booleans())
def test_stripping_is_idempotent(gaps_lengths, computed, mrope):
    items, _ = layout(gaps_lengths)
    once = strip_covered_mm_data(items, computed, uses_mrope=mrope)
    twice = strip_covered_mm_data(once, computed, uses_mrope=mrope)
    assert [dataclasses.astuple(a)[1:] for a in once] == [dataclasses.astuple(b)[1:] for b in twice]
    assert [a.data is None for a in once] == [b.data is None for b in twice]
    assert [set(a.data or {}) for a in once] == [set(b.data or {}) for b in twice]
