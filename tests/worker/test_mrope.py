"""M-RoPE positions from placeholder ranges and grids equal transformers' ``get_rope_index`` (docs/ARCHITECTURE.md §3, invariant 4)."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import (
    LlamaConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from common.families import family_of
from common.mrope import (
    decode_positions,
    mrope_positions,
    mrope_positions_for_window,
    uses_mrope,
)
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

MERGE = 2
VOCAB = 1024
VISION_START, VISION_END, IMAGE, VIDEO = 1018, 1019, 1020, 1021
TEXT_IDS = st.integers(0, 1000)  # below every special id
TOKENS_PER_SECOND = 2  # Qwen2.5-VL


def _config_kwargs() -> dict:
    text = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        bos_token_id=1010,
        eos_token_id=1011,
        pad_token_id=1010,
    )
    ids = dict(
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END
    )
    return {"text_config": text, **ids}


@pytest.fixture(scope="module")
def qwen2_vl():
    config = Qwen2VLConfig(
        vision_config=dict(depth=1, embed_dim=32, hidden_size=128, num_heads=4, spatial_merge_size=MERGE),
        **_config_kwargs(),
    )
    return Qwen2VLForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def qwen3_vl():
    kwargs = _config_kwargs()
    text = {**kwargs.pop("text_config"), "head_dim": 16}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        out_hidden_size=128,
        num_heads=4,
        spatial_merge_size=MERGE,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision, **kwargs)).eval()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def image_model(request):
    """A model of each family whose image positions mmcast computes with the same rule."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def qwen2_5_vl():
    config = Qwen2_5_VLConfig(
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=128,
            num_heads=4,
            spatial_merge_size=MERGE,
            tokens_per_second=TOKENS_PER_SECOND,
        ),
        **_config_kwargs(),
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


# ---- factories -------------------------------------------------------------------------------------------------


def image_item(offset: int, t: int, h: int, w: int, ident: str = "img") -> MultiModalFeatureSpec:
    data = MultiModalKwargsItem(
        {
            "image_grid_thw": MultiModalFieldElem(torch.tensor([[t, h, w]]), keep_on_cpu=True),
            "pixel_values": MultiModalFieldElem(torch.zeros(t * h * w, 1176), kind=FieldKind.FLAT),
        }
    )
    return MultiModalFeatureSpec(
        data=data,
        modality=Modality.IMAGE,
        identifier=ident,
        mm_position=PlaceholderRange(offset, t * h * w // MERGE**2),
    )


def video_item(offset: int, t: int, h: int, w: int, second_per_grid_t: float | None) -> MultiModalFeatureSpec:
    fields = {
        "video_grid_thw": MultiModalFieldElem(torch.tensor([[t, h, w]]), keep_on_cpu=True),
        "pixel_values_videos": MultiModalFieldElem(torch.zeros(t * h * w, 1176), kind=FieldKind.FLAT),
    }
    if second_per_grid_t is not None:
        fields["second_per_grid_ts"] = MultiModalFieldElem(torch.tensor([second_per_grid_t]), keep_on_cpu=True)
    return MultiModalFeatureSpec(
        data=MultiModalKwargsItem(fields),
        modality=Modality.VIDEO,
        identifier="vid",
        mm_position=PlaceholderRange(offset, t * h * w // MERGE**2),
    )


def build_prompt(segments: list) -> tuple[list[int], list[MultiModalFeatureSpec]]:
    """``segments``: token-id lists (text) and ``(modality, t, h, w[, second_per_grid_t])`` tuples (items)."""
    ids: list[int] = []
    features = []
    for seg in segments:
        if isinstance(seg, list):
            ids.extend(seg)
            continue
        modality, t, h, w, *rest = seg
        if modality is Modality.IMAGE:
            feature = image_item(len(ids), t, h, w, ident=f"img{h}x{w}")
        else:
            feature = video_item(len(ids), t, h, w, rest[0] if rest else None)
        features.append(feature)
        ids.extend([IMAGE if modality is Modality.IMAGE else VIDEO] * feature.mm_position.length)
    return ids, features


def hf_rope_index(model, ids: list[int], features, token_types: torch.Tensor | None = None):
    """transformers' answer; mm_token_type_ids come from the token ids, as the processor makes them."""
    input_ids = torch.tensor([ids])
    if token_types is None:
        token_types = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
    grids = {m: [f.data[n].data for f in features if f.modality is m] for m, n in _GRID_NAMES.items()}
    seconds = [f.data["second_per_grid_ts"].data for f in features if "second_per_grid_ts" in (f.data or {})]
    kwargs = {}
    if seconds:
        kwargs["second_per_grid_ts"] = torch.cat(seconds)
    positions, deltas = model.model.get_rope_index(
        input_ids,
        mm_token_type_ids=token_types,
        image_grid_thw=torch.cat(grids[Modality.IMAGE]) if grids[Modality.IMAGE] else None,
        video_grid_thw=torch.cat(grids[Modality.VIDEO]) if grids[Modality.VIDEO] else None,
        **kwargs,
    )
    return positions[:, 0], int(deltas.reshape(-1)[0])


_GRID_NAMES = {Modality.IMAGE: "image_grid_thw", Modality.VIDEO: "video_grid_thw"}


def rope_index_kwargs(config) -> dict:
    """What the rank passes ``mrope_positions`` besides the prompt: its family's rule (``Family.rope_kwargs``)."""
    return family_of(config).rope_kwargs(config)


def ours(model, ids, features):
    return mrope_positions(ids, features, **rope_index_kwargs(model.config))


def assert_same(model, ids, features, token_types=None):
    want_pos, want_delta = hf_rope_index(model, ids, features, token_types)
    got_pos, got_delta = ours(model, ids, features)
    assert got_pos.dtype == torch.int64 and got_pos.shape == (3, len(ids))
    assert torch.equal(got_pos, want_pos)
    assert got_delta == want_delta
    return got_pos, got_delta


# ---- property --------------------------------------------------------------------------------------------------

_SIDE = st.integers(1, 20).map(lambda k: k * MERGE)  # even multiples of the merge size in [2, 40]


@st.composite
def prompts(draw):
    n_images = draw(st.integers(0, 6))
    segments: list = [draw(st.lists(TEXT_IDS, min_size=0, max_size=12))]  # may be empty: image at the very start
    for _ in range(n_images):
        segments.append((Modality.IMAGE, 1, draw(_SIDE), draw(_SIDE)))
        # Real prompts wrap each image in <vision_start> ... <vision_end>; transformers needs >= 1 text token
        # between two images (see test_directly_abutting_images for what we do without one).
        segments.append([VISION_END] + draw(st.lists(TEXT_IDS, max_size=12)) + [VISION_START])
    ids, features = build_prompt(segments)
    num_computed = draw(st.integers(0, len(ids)))
    return ids, features, num_computed


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts())
def test_property_equals_transformers_with_stripped_items(image_model, prompt):
    ids, features, num_computed = prompt
    if not ids:  # transformers cannot take an empty prompt
        assert mrope_positions(ids, features, MERGE)[0].shape == (3, 0)
        return
    wire = strip_covered_mm_data(features, num_computed, uses_mrope=True)
    for f in wire or ():
        if f.payload_state is PayloadState.STRIPPED:
            assert set(f.data) == {"image_grid_thw"}  # only the keep_on_cpu field is left
    want_pos, want_delta = hf_rope_index(image_model, ids, features)
    got_pos, got_delta = ours(image_model, ids, wire)
    assert torch.equal(got_pos, want_pos)
    assert got_delta == want_delta


@st.composite
def mixed_prompts(draw):
    """Images and videos (Qwen2.5-VL): frames 1-8, fractional seconds per grid, sometimes none."""
    segments: list = [draw(st.lists(TEXT_IDS, min_size=1, max_size=6))]
    for _ in range(draw(st.integers(1, 4))):
        side = st.integers(1, 6).map(lambda k: k * MERGE)
        if draw(st.booleans()):
            segments.append((Modality.IMAGE, 1, draw(side), draw(side)))
        else:
            seconds = draw(st.one_of(st.none(), st.sampled_from([0.25, 0.5, 2 / 3, 1.0, 1.5, 2.0, 7 / 3])))
            segments.append((Modality.VIDEO, draw(st.integers(1, 8)), draw(side), draw(side), seconds))
        segments.append([VISION_END] + draw(st.lists(TEXT_IDS, max_size=6)) + [VISION_START])
    ids, features = build_prompt(segments)
    return ids, features, draw(st.integers(0, len(ids)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mixed_prompts())
def test_property_videos_equal_transformers_qwen2_5_vl(qwen2_5_vl, prompt):
    ids, features, num_computed = prompt
    if any(f.modality is Modality.VIDEO and "second_per_grid_ts" not in f.data for f in features) and any(
        "second_per_grid_ts" in f.data for f in features
    ):
        # transformers takes one second_per_grid_ts tensor for all videos or none at all
        features = [_without_seconds(f) for f in features]
    want_pos, want_delta = hf_rope_index(qwen2_5_vl, ids, features)
    got_pos, got_delta = ours(qwen2_5_vl, ids, strip_covered_mm_data(features, num_computed, uses_mrope=True))
    assert torch.equal(got_pos, want_pos)
    assert got_delta == want_delta


def _without_seconds(feature: MultiModalFeatureSpec) -> MultiModalFeatureSpec:
    if "second_per_grid_ts" not in feature.data:
        return feature
    fields = {k: v for k, v in feature.data.items() if k != "second_per_grid_ts"}
    return MultiModalFeatureSpec(
        data=MultiModalKwargsItem(fields),
        modality=feature.modality,
        identifier=feature.identifier,
        mm_position=feature.mm_position,
    )


# ---- explicit cases --------------------------------------------------------------------------------------------


def test_text_only(qwen2_vl):
    ids = list(range(10, 27))
    pos, delta = assert_same(qwen2_vl, ids, [])
    assert torch.equal(pos, torch.arange(17).expand(3, 17)) and delta == 0
    assert mrope_positions([], None, MERGE)[0].shape == (3, 0)


def test_image_at_the_very_start(qwen2_vl):
    ids, features = build_prompt([(Modality.IMAGE, 1, 4, 6), [VISION_END, 5, 6]])
    pos, delta = assert_same(qwen2_vl, ids, features)
    assert pos[:, :6].tolist() == [[0] * 6, [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2]]
    assert pos[:, 6].tolist() == [3, 3, 3] and delta == 3 + 3 - 9


def test_two_adjacent_images(qwen2_vl):
    ids, features = build_prompt(
        [[1, VISION_START], (Modality.IMAGE, 1, 4, 8), [VISION_END, VISION_START], (Modality.IMAGE, 1, 6, 2), [9]]
    )
    assert_same(qwen2_vl, ids, features)


def test_directly_abutting_images(qwen2_vl):
    """No token between two blocks: transformers' groupby would merge them into one group, so we ask it with the
    second block typed as a Qwen2-VL video (t=1, unit temporal step: the same positions as an image)."""
    ids, features = build_prompt([[1, 2], (Modality.IMAGE, 1, 4, 8), (Modality.IMAGE, 1, 6, 2), [9]])
    token_types = torch.zeros(1, len(ids), dtype=torch.int)
    token_types[0, 2:10] = 1
    token_types[0, 10:13] = 2
    want_pos, want_delta = qwen2_vl.model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids=token_types,
        image_grid_thw=features[0].data["image_grid_thw"].data,
        video_grid_thw=features[1].data["image_grid_thw"].data,
    )
    got_pos, got_delta = ours(qwen2_vl, ids, features)
    assert torch.equal(got_pos, want_pos[:, 0]) and got_delta == int(want_delta)


def test_same_image_twice(qwen2_vl):
    ids, features = build_prompt(
        [[3, VISION_START], (Modality.IMAGE, 1, 8, 4), [VISION_END, 4, 5, VISION_START], (Modality.IMAGE, 1, 8, 4)]
    )
    assert features[0].identifier == features[1].identifier
    pos, _ = assert_same(qwen2_vl, ids, features)
    # Same content, different place: the second block is the first one shifted.
    first, second = (f.mm_position for f in features)
    block = pos[:, first.offset : first.end]
    assert torch.equal(pos[:, second.offset : second.end], block + (pos[0, second.offset] - pos[0, first.offset]))


def test_qwen2_5_vl_video_with_second_per_grid_ts(qwen2_5_vl):
    # interval = 2 tokens/s * 0.6667 s = 1.3333 -> temporal offsets (0, 1, 2, 4, 5, 6, 8, 9): float32 truncation.
    # The video's temporal span (9) exceeds its spatial one (3): the text after it resumes at start + 3.
    ids, features = build_prompt(
        [
            [7, VISION_START],
            (Modality.IMAGE, 1, 4, 4),
            [VISION_END, 8, VISION_START],
            (Modality.VIDEO, 8, 4, 6, 2 / 3),
            [VISION_END, 11, 12],
        ]
    )
    pos, delta = assert_same(qwen2_5_vl, ids, features)
    video = features[1].mm_position
    start = int(pos[1, video.offset])
    assert pos[0, video.offset : video.end : 6].tolist() == [start + k for k in (0, 1, 2, 4, 5, 6, 8, 9)]
    assert int(pos[0, video.end]) == start + 3  # transformers 5.x; the original Qwen rule gives start + 10
    assert delta == start + 9 + 1 - len(ids)  # from the temporal row's maximum, not the last text position


def test_qwen2_5_vl_video_without_second_per_grid_ts(qwen2_5_vl):
    ids, features = build_prompt([[7, VISION_START], (Modality.VIDEO, 3, 2, 4, None), [VISION_END, 1]])
    pos, _ = assert_same(qwen2_5_vl, ids, features)
    assert pos[0, 2:8].tolist() == [2, 2, 4, 4, 6, 6]  # step tokens_per_second * 1


def test_qwen2_vl_video_ignores_second_per_grid_ts(qwen2_vl):
    ids, features = build_prompt([[7, VISION_START], (Modality.VIDEO, 4, 4, 2, 5.0), [VISION_END, 1]])
    pos, _ = assert_same(qwen2_vl, ids, features)
    assert pos[0, 2:10].tolist() == [2, 2, 3, 3, 4, 4, 5, 5]


def test_window_slices_equal_full_columns(qwen2_vl):
    ids, features = build_prompt(
        [[1, VISION_START], (Modality.IMAGE, 1, 10, 6), [VISION_END, 2, 3, VISION_START], (Modality.IMAGE, 1, 2, 8)]
    )
    pos, delta = ours(qwen2_vl, ids, features)
    n = len(ids)
    for start, end in [(0, n), (0, 5), (3, 17), (16, n - 2), (n - 1, n), (n, n)]:
        assert torch.equal(mrope_positions_for_window(pos, start, end), pos[:, start:end])
    # Past the prompt the window continues with decode positions.
    window = mrope_positions_for_window(pos, n - 3, n + 4)
    assert torch.equal(window, torch.cat([pos[:, n - 3 :], decode_positions(n, 4, delta)], dim=1))
    assert torch.equal(mrope_positions_for_window(pos, n + 2, n + 5, delta), decode_positions(n + 2, 3, delta))


class _CacheOfLength:
    def __init__(self, length: int) -> None:
        self.length = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen2_5_vl"])
def test_decode_positions_continue_like_transformers_generate(variant, request):
    model = request.getfixturevalue(variant)
    ids, features = build_prompt(
        [[1, VISION_START], (Modality.IMAGE, 1, 6, 4), [VISION_END, VISION_START], (Modality.VIDEO, 6, 2, 2, 1.0)]
    )
    pos, delta = assert_same(model, ids, features)
    grids = {
        "image_grid_thw": features[0].data["image_grid_thw"].data,
        "video_grid_thw": features[1].data["video_grid_thw"].data,
        "attention_mask": None,
    }
    if variant == "qwen2_5_vl":
        grids["second_per_grid_ts"] = features[1].data["second_per_grid_ts"].data
    token_types = (torch.tensor([ids]) == IMAGE).int() + 2 * (torch.tensor([ids]) == VIDEO).int()
    model.model.rope_deltas = None
    prefill = model.model.compute_3d_position_ids(
        input_ids=torch.tensor([ids]), inputs_embeds=None, cache=None, mm_token_type_ids=token_types, **grids
    )  # stores rope_deltas, as the first forward of generate() does
    assert torch.equal(prefill[:, 0], pos)
    n = len(ids)
    for past, count in [(n, 1), (n + 5, 1), (n, 3)]:
        hf = model.model.compute_3d_position_ids(
            input_ids=torch.zeros(1, count, dtype=torch.long),
            inputs_embeds=torch.zeros(1, count, 128),
            cache=_CacheOfLength(past),
            mm_token_type_ids=torch.zeros(1, count, dtype=torch.int),
            **grids,
        )
        assert torch.equal(decode_positions(past, count, delta), hf[:, 0])


# ---- errors and config -----------------------------------------------------------------------------------------


def test_item_without_grid_is_refused():
    ids, features = build_prompt([[1], (Modality.IMAGE, 1, 4, 4), [2]])
    bare = strip_covered_mm_data(features, len(ids), uses_mrope=False)  # a non-M-RoPE strip drops the grid too
    with pytest.raises(ValueError, match="image_grid_thw.*uses_mrope=True"):
        mrope_positions(ids, bare, MERGE)


def test_placeholder_count_must_match_grid():
    feature = image_item(1, 1, 4, 4)
    with pytest.raises(ValueError, match="4 placeholder tokens but its grid"):
        mrope_positions([0] * 10, [feature], MERGE + 2)
    with pytest.raises(ValueError, match="runs past the prompt"):
        mrope_positions([0] * 4, [feature], MERGE)
    with pytest.raises(ValueError, match="overlaps"):
        mrope_positions([0] * 10, [feature, image_item(3, 1, 4, 4)], MERGE)


def test_is_embed_marks_the_vision_block(qwen2_vl):
    ids, features = build_prompt([[1, VISION_START], (Modality.IMAGE, 1, 4, 4), [VISION_END, 2]])
    want, want_delta = ours(qwen2_vl, ids, features)
    wide = image_item(1, 1, 4, 4)
    wide = MultiModalFeatureSpec(
        data=wide.data,
        modality=Modality.IMAGE,
        identifier="img",
        mm_position=PlaceholderRange(1, 6, is_embed=[False, True, True, True, True, False]),
    )
    got, got_delta = mrope_positions(ids, [wide], MERGE)
    assert torch.equal(got, want) and got_delta == want_delta


def test_uses_mrope(qwen2_vl, qwen2_5_vl, qwen3_vl):
    assert uses_mrope(qwen2_vl.config) and uses_mrope(qwen2_5_vl.config) and uses_mrope(qwen3_vl.config)
    assert uses_mrope(qwen3_vl.config.text_config)
    assert rope_index_kwargs(qwen3_vl.config) == {"spatial_merge_size": MERGE, "tokens_per_second": None}
    assert uses_mrope(qwen2_vl.config.text_config)
    assert uses_mrope({"model_type": "other", "text_config": {"rope_parameters": {"mrope_section": [16, 24, 24]}}})
    assert not uses_mrope(LlamaConfig(vocab_size=32, hidden_size=16, num_attention_heads=2, num_hidden_layers=1))
    assert not uses_mrope({"model_type": "llama", "rope_parameters": {"rope_type": "default"}})
    assert rope_index_kwargs(qwen2_vl.config) == {"spatial_merge_size": MERGE, "tokens_per_second": None}
    assert rope_index_kwargs(qwen2_5_vl.config) == {"spatial_merge_size": MERGE, "tokens_per_second": 2}


def test_qwen3_vl_video_blocks_equal_transformers(qwen3_vl):
    """A Qwen3-VL video as the processor writes it: per temporal patch a timestamp (text), vision start, the patch's
    placeholders, vision end — one item whose is_embed marks the placeholders. transformers splits its grid into
    (1, h, w) grids, one per block; mmcast's blocks must land on the same positions, and the text between blocks
    and after the video continue as transformers' do. A non-contiguous mask that does not match the grid fails."""
    t, h, w = 3, 4, 6
    per = h * w // MERGE**2
    ids = [7, VISION_START]
    offset = len(ids)
    mask: list[bool] = []
    for stamp in ([21, 22], [23], [24, 25, 26]):  # "<0.5 seconds>" etc.: a few text tokens each
        block = [*stamp, VISION_START, *[VIDEO] * per, VISION_END]
        ids += block
        mask += [False] * (len(stamp) + 1) + [True] * per + [False]
    ids += [VISION_END, 9, 10]
    item = video_item(offset, t, h, w, None)
    item = MultiModalFeatureSpec(
        data=item.data,
        modality=Modality.VIDEO,
        identifier="vid",
        mm_position=PlaceholderRange(offset, len(mask), is_embed=mask),
    )
    pos, delta = assert_same(qwen3_vl, ids, [item])
    assert int(pos[0, offset + 3]) == int(pos[0, offset + 2]) + 1  # every block at temporal offset 0 of its own
    broken = dataclasses.replace(item, mm_position=PlaceholderRange(offset, len(mask), is_embed=[True] + mask[1:]))
    with pytest.raises(ValueError, match="blocks"):
        mrope_positions(ids, [broken], MERGE)
