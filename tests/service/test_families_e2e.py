"""Qwen3-VL end to end: a real TP=2 rank group (two `mmcast-worker` processes) under the real scheduler server,
compared with plain transformers fed the files as sent (docs/ARCHITECTURE.md §3, invariant 3).

The defaults (encoded payload, sharded encoder placement, lazy transfer) with a step budget that splits each image
over two prefill steps: each image is decoded and encoded by one owner rank, whose rows — merged features and both
DeepStack levels (common/families/qwen3_vl.py) — go to the other rank over the group's collective. The second turn
hits the prefix holding the first turn's images, which travel as metadata only. Then the pixels payload with
replicated placement under `strip`. A negative control shows the comparison can fail.
"""

from __future__ import annotations

import contextlib

import pytest

from mmcast_client import Client
from mmcast_local.synthetic_images import synthetic_jpeg
from scheduler_svc.config import SchedulerConfig
from tests.support.oracle import GENERATE, Oracle, assert_matches, mismatch, user_turn
from tests.support.rank_group import Group
from tests.support.service_harness import scheduler_server
from tests.support.worker_driver import rank_token_file

pytestmark = pytest.mark.slow

SIZE = (224, 168)  # Qwen3-VL's 32-pixel step: 224x160 -> 7 x 5 merged patches = 35 image tokens
ROW_BYTES = 3 * 128 * 4  # float32 rows of the merged features and 2 DeepStack levels


def image(seed: int) -> bytes:
    return synthetic_jpeg(8000 + seed, SIZE)


@pytest.fixture(scope="module")
def ranks(tiny_model_q3_dir, tmp_path_factory):
    group = Group(tiny_model_q3_dir, tmp_path_factory.mktemp("qwen3-ranks"), world_size=2, timeout_s=60.0)
    yield group
    group.stop()


@pytest.fixture(scope="module")
def oracle(tiny_model_q3_dir) -> Oracle:
    return Oracle(tiny_model_q3_dir)


@contextlib.contextmanager
def scheduler(ranks, model_dir, **settings):
    config = SchedulerConfig(
        model=str(model_dir), workers=[f"127.0.0.1:{p}" for p in ranks.ports], listen="127.0.0.1:0", metrics_port=0,
        worker_token_file=rank_token_file(), scheduler_id="test", kv_blocks=128, **settings,
    )
    with scheduler_server(config) as port, Client(f"127.0.0.1:{port}", timeout=300) as client:
        yield client


def two_images(a: bytes, b: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "and"},
                                         {"type": "image", "image": b}, {"type": "text", "text": "compare them"}]}]


def test_defaults_with_chunked_prefill_and_a_prefix_hit(ranks, tiny_model_q3_dir, oracle):
    a, b, c = image(1), image(2), image(3)
    first = two_images(a, b)
    with scheduler(ranks, tiny_model_q3_dir, max_num_batched_tokens=24) as client:
        r1 = client.generate(first, **GENERATE)
        assert_matches(r1, oracle(first), "turn 1")
        second = [*first, {"role": "assistant", "content": r1.text}, user_turn(c, "and this one?")]
        r2 = client.generate(second, **GENERATE)
        assert_matches(r2, oracle(second), "turn 2")
    # one delivery and one encoder run per new image; each owner shares all its rows (DeepStack levels included)
    assert (r1.usage.images_sent, r1.usage.encoder_runs) == (2, 2), r1.usage
    assert r1.usage.encoder_output_bytes_shared == 2 * 35 * ROW_BYTES, r1.usage
    assert r2.usage.cached_tokens > 0 and r2.usage.encoder_runs == 1, r2.usage
    assert r2.usage.images_sent == 1, r2.usage  # the first turn's images: metadata only
    # negative control: the same answer does not pass for a conversation with one image swapped
    assert mismatch(r1, oracle(two_images(a, image(4)))) is not None


def test_pixels_replicated_strip(ranks, tiny_model_q3_dir, oracle):
    first = two_images(image(5), image(6))
    with scheduler(ranks, tiny_model_q3_dir, payload_encoding="pixels", encoder_placement="replicated",
                   transfer_mode="strip") as client:
        r1 = client.generate(first, **GENERATE)
        assert_matches(r1, oracle(first), "turn 1")
        second = [*first, {"role": "assistant", "content": r1.text}, user_turn(image(7), "and this one?")]
        r2 = client.generate(second, **GENERATE)
        assert_matches(r2, oracle(second), "turn 2")
    assert r1.usage.encoder_output_bytes_shared == 0 and r1.usage.encoder_runs == 4, r1.usage
    assert r2.usage.images_stripped == 4, r2.usage  # both earlier images, to both ranks: covered by the hit
