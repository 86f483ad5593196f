"""Dataclass <-> proto conversions: every payload state survives, keep_on_cpu travels inline."""

import pytest
import torch

from common import item_proto
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
from mmcast.v1 import multimodal_pb2, worker_pb2


def feature(state=PayloadState.PRESENT, is_embed=None):
    data = MultiModalKwargsItem(
        {
            "pixel_values": MultiModalFieldElem(torch.randn(16, 1176), kind=FieldKind.FLAT),
            "image_grid_thw": MultiModalFieldElem(torch.tensor([[1, 4, 4]]), keep_on_cpu=True),
        }
    )
    return MultiModalFeatureSpec(
        data=data,
        modality=Modality.IMAGE,
        identifier="ab" * 32,
        mm_position=PlaceholderRange(7, 4, is_embed),
        payload_state=state,
    )


@pytest.mark.parametrize("state", list(PayloadState))
def test_every_state_round_trips(state):
    f = feature()
    msg = item_proto.feature_to_proto(f, payload_state=state)
    back = item_proto.feature_from_proto(multimodal_pb2.MultiModalItem.FromString(msg.SerializeToString()))
    assert back.payload_state is state
    assert (back.identifier, back.modality, back.mm_position) == (f.identifier, f.modality, f.mm_position)
    assert torch.equal(back.data["image_grid_thw"].data, f.data["image_grid_thw"].data)
    assert back.data["image_grid_thw"].keep_on_cpu
    assert "pixel_values" not in back.data  # payload travels as frames, never inside the metadata
    # a stripped item's metadata no longer announces its payload fields
    assert back.payload_nbytes == (0 if state is PayloadState.STRIPPED else 16 * 1176 * 4)


def test_payload_fields_travel_header_only_and_refill_from_frames():
    f = feature()
    msg = item_proto.feature_to_proto(f)
    pv = item_proto.payload_field_headers(msg)["pixel_values"]
    assert pv.tensor.byte_size == 16 * 1176 * 4 and not pv.tensor.inline_data and list(pv.tensor.shape) == [16, 1176]
    back = item_proto.feature_from_proto(msg, {"pixel_values": f.data["pixel_values"].data})
    assert torch.equal(back.data["pixel_values"].data, f.data["pixel_values"].data)
    assert back.data["pixel_values"].kind is FieldKind.FLAT and not back.data["pixel_values"].keep_on_cpu
    with pytest.raises(item_proto.WireError, match="metadata announces"):
        item_proto.feature_from_proto(msg, {"pixel_values": torch.zeros(15, 1176)})


def test_stripped_item_carries_exactly_keep_on_cpu_fields():
    stripped = strip_covered_mm_data([feature()], 11, uses_mrope=True)[0]
    msg = item_proto.feature_to_proto(stripped)
    assert [fld.name for fld in msg.fields] == ["image_grid_thw"]
    assert msg.payload_state == multimodal_pb2.PAYLOAD_STATE_STRIPPED
    assert msg.ByteSize() < 256  # the per-item metadata budget of a cached image
    no_mrope = item_proto.feature_to_proto(strip_covered_mm_data([feature()], 11)[0])
    assert list(no_mrope.fields) == []


def test_is_embed_mask_round_trips():
    f = feature(is_embed=[True, False, True, True])
    back = item_proto.feature_from_proto(item_proto.feature_to_proto(f))
    assert list(back.mm_position.is_embed) == [True, False, True, True]
    assert back.mm_position.get_num_embeds() == 3


def test_bad_metadata_is_rejected_with_field_names():
    msg = item_proto.feature_to_proto(feature())
    msg.payload_state = 42
    with pytest.raises(item_proto.WireError, match="payload_state=42"):
        item_proto.feature_from_proto(msg)
    msg = item_proto.feature_to_proto(feature())
    with pytest.raises(item_proto.WireError, match=r"position \[7, 11\) exceeds the prompt length 10"):
        item_proto.feature_from_proto(msg, max_prompt_len=10)
    msg.fields[1].tensor.byte_size += 1
    with pytest.raises(item_proto.WireError, match="image_grid_thw"):
        item_proto.feature_from_proto(msg)


def test_control_byte_breakdown_sums_item_messages():
    ctrl = worker_pb2.StepControl(step_id=3)
    req = ctrl.new_requests.add(request_id="r1", prompt_token_ids=list(range(20)))
    req.mm_items.append(item_proto.feature_to_proto(feature()))
    req.mm_items.append(item_proto.feature_to_proto(feature(), payload_state=PayloadState.DEFERRED))
    raw = worker_pb2.StepRequest(control=ctrl).SerializeToString()
    metadata, control = item_proto.control_byte_breakdown(ctrl, len(raw))
    assert metadata == sum(i.ByteSize() for i in req.mm_items)
    assert metadata + control == len(raw)
