"""Payload encoding x encoder placement x transfer mode on one real TP=2 rank group (two `mmcast-worker` processes),
served by the real scheduler server, compared with plain transformers fed the files as sent.

The ranks follow the step control whatever the scheduler's flags, so one group serves a fresh scheduler per
combination (each under a newer epoch). Every combination other than the default (encoded + sharded + lazy, which
the other end-to-end tests run) serves a two-turn conversation whose first turn holds two new images (sharded
placement gives them to different owners); the default also serves a corrupt file beside a good request: the file
fails its request alone with INVALID_ARGUMENT, the group keeps serving without a restart.
"""

from __future__ import annotations

import itertools
import threading

import pytest

from mmcast_client import InvalidArgument
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.support.oracle import GENERATE, Oracle, assert_matches, scrape, user_turn
from tests.support.rank_group import Group
from tests.support.service_harness import scheduler_client

pytestmark = pytest.mark.slow

SIZE = (224, 168)  # 8 x 6 merged patches = 48 image tokens: real preprocessing, cheap
DEFAULT = ("encoded", "sharded", "lazy")
COMBINATIONS = [
    c
    for c in itertools.product(("encoded", "pixels"), ("sharded", "replicated"), ("full", "strip", "lazy"))
    if c != DEFAULT
]


def image(seed: int) -> bytes:
    return synthetic_jpeg(7000 + seed, SIZE)


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tmp_path_factory):
    group = Group(tiny_model_dir, tmp_path_factory.mktemp("placement-ranks"), world_size=2, timeout_s=60.0)
    yield group
    for proc in group.procs:
        proc.terminate()
    for proc in group.procs:
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def oracle(tiny_model_dir) -> Oracle:
    return Oracle(tiny_model_dir)


def scheduler(ranks, model_dir, **settings):
    """The real scheduler server, connected to the shared ranks under a new epoch; yields an SDK client."""
    return scheduler_client(ranks.ports, model_dir, **settings)


@pytest.mark.parametrize(("encoding", "placement", "mode"), COMBINATIONS)
def test_every_combination_serves_the_oracle_tokens(ranks, tiny_model_dir, oracle, encoding, placement, mode):
    a, b, c = image(1), image(2), image(3)
    first = [
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
    with scheduler(
        ranks, tiny_model_dir, payload_encoding=encoding, encoder_placement=placement, transfer_mode=mode
    ) as client:
        r1 = client.generate(first, **GENERATE)
        assert_matches(r1, oracle(first), f"{encoding}+{placement}+{mode} turn 1")
        second = [*first, {"role": "assistant", "content": r1.text}, user_turn(c, "and this one?")]
        r2 = client.generate(second, **GENERATE)
        assert_matches(r2, oracle(second), f"{encoding}+{placement}+{mode} turn 2")
    per_image = 1 if placement == "sharded" else 2  # deliveries and encoder runs of one new image
    assert (r1.usage.images_sent, r1.usage.encoder_runs) == (2 * per_image, 2 * per_image), r1.usage
    assert r2.usage.encoder_runs == per_image, r2.usage  # the earlier images' outputs are reused
    if encoding == "encoded":
        assert r1.usage.payload_bytes_broadcast == per_image * (len(a) + len(b)), r1.usage
    assert (r1.usage.encoder_output_bytes_shared > 0) == (placement == "sharded"), r1.usage


def test_a_corrupt_file_fails_its_request_alone(ranks, tiny_model_dir, oracle):
    """The header passes the frontend; the owner rank cannot decode the rest. The failure reaches every rank inside
    the step, the request ends INVALID_ARGUMENT naming the image, a concurrent request is served exactly, and the
    group serves on: no rank restarts."""
    good = image(4)
    broken = image(5)
    broken = broken[: len(broken) // 2]  # a JPEG cut in half: its header (size, format) is intact
    good_messages = [user_turn(good, "describe the picture")]
    expected = oracle(good_messages)
    with scheduler(ranks, tiny_model_dir) as client:
        outcome: dict = {}

        def serve_good() -> None:
            outcome["good"] = client.generate(good_messages, **GENERATE)

        thread = threading.Thread(target=serve_good)
        thread.start()
        with pytest.raises(
            InvalidArgument, match=r"messages\[0\]\.content\[0\]\.image \(item .*\) could not be used: .*decoded"
        ):
            client.generate([user_turn(broken, "what is this?")], **GENERATE)
        thread.join()
        assert_matches(outcome["good"], expected, "beside a corrupt file")
        again = [user_turn(image(6), "and this one?")]
        assert_matches(client.generate(again, **GENERATE), oracle(again), "after a corrupt file")
    assert all(proc.poll() is None for proc in ranks.procs)  # nobody restarted anything
    failures = sum(
        scrape(f"http://127.0.0.1:{p}/metrics", "mmcast_worker_image_failures_total") for p in ranks.metrics_ports
    )
    assert failures == 1
