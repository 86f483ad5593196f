"""Qwen3-VL and LLaVA end to end: a real TP=2 rank group (two `mmcast-worker` processes) under the real scheduler
server, compared with plain transformers fed the files as sent (docs/ARCHITECTURE.md §3, invariant 3).

The defaults (encoded payload, sharded encoder placement, lazy transfer) with a step budget that splits an image
over two prefill steps: each image is decoded and encoded by one owner rank, whose rows — for Qwen3-VL the merged
features and both DeepStack levels (common/families/qwen3_vl.py), for LLaVA the projected CLIP rows — go to the
other rank over the group's collective. The second turn hits the prefix holding the first turn's images, which
travel as metadata only. Then the pixels payload with replicated placement under `strip`: a covered item reaches
the ranks with its grid alone (Qwen3-VL, M-RoPE) or with no field at all (LLaVA, 1-D positions). A negative control
shows the comparison can fail.
"""

from __future__ import annotations

import dataclasses

import pytest

from common.multimodal import PayloadState
from mmcast_local.synthetic_images import synthetic_jpeg
from scheduler_svc.transport import plan_proto
from tests.support.oracle import GENERATE, Oracle, assert_matches, mismatch, user_turn
from tests.support.rank_group import Group
from tests.support.service_harness import scheduler_client

pytestmark = pytest.mark.slow


@dataclasses.dataclass(frozen=True)
class Family:
    model_fixture: str
    size: tuple[int, int]  # the test images' width x height
    tokens: int  # placeholder tokens of one such image
    row_bytes: int  # one encoder-output row as the owner rank broadcasts it
    budget: int  # --max-num-batched-tokens: a step boundary falls inside an image of turn 1
    stripped_fields: list[str]  # the fields a prefix-covered item keeps on the wire
    covered: int  # turn 1's images inside turn 2's prefix hit


FAMILIES = {
    # Qwen3-VL's 32-pixel step: 224x160 -> 7 x 5 merged patches = 35 image tokens; rows: merged + 2 DeepStack levels
    "qwen3_vl": Family("tiny_model_q3_dir", (224, 168), 35, 3 * 128 * 4, 24, ["image_grid_thw"], 2),
    # every image is center-cropped to 42x42 -> 9 tokens at [28, 37) and [40, 49): the step boundary 32 cuts image 1,
    # and turn 2's prefix hit (48 tokens) covers image 1 while image 2 straddles it (encoded again, its tail rows used)
    "llava": Family("tiny_model_llava_dir", (120, 90), 9, 128 * 4, 32, [], 1),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(family, request):
    return request.getfixturevalue(FAMILIES[family].model_fixture)


@pytest.fixture(scope="module")
def ranks(model_dir, family, tmp_path_factory):
    group = Group(model_dir, tmp_path_factory.mktemp(f"{family}-ranks"), world_size=2, timeout_s=60.0)
    yield group
    group.stop()


@pytest.fixture(scope="module")
def oracle(model_dir) -> Oracle:
    return Oracle(model_dir)


def image(family: str, seed: int) -> bytes:
    return synthetic_jpeg(8000 + seed, FAMILIES[family].size)


def scheduler(ranks, model_dir, **settings):
    """The real scheduler server, connected to the shared ranks under a new epoch; yields an SDK client."""
    return scheduler_client(ranks.ports, model_dir, **settings)


def two_images(a: bytes, b: bytes) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": a},
                {"type": "text", "text": "and"},
                {"type": "image", "image": b},
                {"type": "text", "text": "compare them"},
            ],
        }
    ]


@pytest.fixture
def wire(monkeypatch):
    """(state, field names) of every item the scheduler writes into a step control for the ranks."""
    written = []
    to_proto = plan_proto.feature_to_proto

    def recorded(feature, *args, **kwargs):
        msg = to_proto(feature, *args, **kwargs)
        written.append((feature.payload_state, sorted(field.name for field in msg.fields)))
        return msg

    monkeypatch.setattr(plan_proto, "feature_to_proto", recorded)
    return written


def stripped(wire) -> list[list[str]]:
    return [fields for state, fields in wire if state is PayloadState.STRIPPED]


def test_defaults_with_chunked_prefill_and_a_prefix_hit(ranks, model_dir, family, oracle, wire):
    f = FAMILIES[family]
    a, b, c = image(family, 1), image(family, 2), image(family, 3)
    first = two_images(a, b)
    with scheduler(ranks, model_dir, max_num_batched_tokens=f.budget) as client:
        r1 = client.generate(first, **GENERATE)
        assert_matches(r1, oracle(first), "turn 1")
        second = [*first, {"role": "assistant", "content": r1.text}, user_turn(c, "and this one?")]
        r2 = client.generate(second, **GENERATE)
        assert_matches(r2, oracle(second), "turn 2")
    # one delivery and one encoder run per new image; each owner shares all its rows (DeepStack levels included)
    assert (r1.usage.images_sent, r1.usage.encoder_runs) == (2, 2), r1.usage
    assert r1.usage.encoder_output_bytes_shared == 2 * f.tokens * f.row_bytes, r1.usage
    assert r2.usage.cached_tokens > 0 and r2.usage.encoder_runs == 1, r2.usage
    assert r2.usage.images_sent == 1, r2.usage  # the first turn's images: metadata only
    # lazy transfer strips covered items too: what they keep on the wire is the family's rule
    assert stripped(wire) and all(fields == f.stripped_fields for fields in stripped(wire)), wire
    # negative control: the same answer does not pass for a conversation with one image swapped
    assert mismatch(r1, oracle(two_images(a, image(family, 4)))) is not None


def test_pixels_replicated_strip(ranks, model_dir, family, oracle, wire):
    first = two_images(image(family, 5), image(family, 6))
    with scheduler(
        ranks, model_dir, payload_encoding="pixels", encoder_placement="replicated", transfer_mode="strip"
    ) as client:
        r1 = client.generate(first, **GENERATE)
        assert_matches(r1, oracle(first), "turn 1")
        second = [*first, {"role": "assistant", "content": r1.text}, user_turn(image(family, 7), "and this one?")]
        r2 = client.generate(second, **GENERATE)
        assert_matches(r2, oracle(second), "turn 2")
    assert r1.usage.encoder_output_bytes_shared == 0 and r1.usage.encoder_runs == 4, r1.usage
    f = FAMILIES[family]
    assert r2.usage.images_stripped == 2 * f.covered, r2.usage  # the covered images, to both ranks
    assert stripped(wire) == [f.stripped_fields] * f.covered, wire  # written once into turn 2's control
