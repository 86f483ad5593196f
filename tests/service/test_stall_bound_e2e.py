"""The stall bound (``--max-decode-stall-ms``, ``scheduler_svc/core/step_costs.py``) on a real local group: with a
target far below what one image costs, every step with a running decode carries at most its first prefill window,
so a burst of new images beside a long decode is spread over many steps, one image each. Every answer, the long
decode's and the burst's, must still be plain transformers' (tests/support/oracle.py); the scheduler's
``mmcast_steps_stall_bounded_total`` shows the bound did cut steps.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from mmcast_client import Client
from mmcast_local.supervisor import LocalGroup
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.support.oracle import Oracle, assert_matches, scrape, user_turn, wait_until

pytestmark = pytest.mark.slow

LONG = 384  # tokens of the decode the burst arrives beside: it must outlast the burst on a fast machine too
N = 8  # tokens of each burst answer
BURST = 4


def messages(k: int) -> list[dict]:
    return [user_turn(synthetic_jpeg(8300 + k, (112, 112)), "Tell me everything about this picture.")]


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    return Oracle(tiny_model_dir)


@pytest.fixture(scope="module")
def group(tiny_model_dir):
    with LocalGroup(
        tiny_model_dir, 1, "lazy", scheduler_args=["--max-decode-stall-ms", "1"], ready_timeout=240
    ) as g:  # fmt: skip
        yield g


def bounded(group) -> float:
    return scrape(group.metrics_urls["scheduler"], "mmcast_steps_stall_bounded_total")


def generate(group, k: int, n: int, first: threading.Event | None = None):
    """Request ``k``'s answer of ``n`` tokens, streamed; ``first`` is set at its first token."""
    with Client(group.target, timeout=300, first_token_timeout=None) as c:
        s = c.generate(messages(k), max_tokens=n, ignore_eos=True, logprobs=0, temperature=0.0, stream=True)
        for delta in s:
            if first is not None and delta.token_ids:
                first.set()
        return s.result


def test_a_burst_beside_a_decode_is_cut_to_one_image_a_step_and_every_answer_equals_the_oracle(group, oracle):
    # two requests alone first: the ranks' clocks give the bound its rates (a decode step, a prefill, an image)
    for k in (0, 1):
        assert_matches(generate(group, k, 4), oracle(messages(k), 4), f"warm-up {k}")
    before = bounded(group)
    first = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(BURST + 1) as pool:
        long = pool.submit(generate, group, 10, LONG, first)
        assert wait_until(first.is_set, 120) and not long.done(), "the long decode never streamed"
        burst = [pool.submit(generate, group, 20 + k, N) for k in range(BURST)]
        results = [f.result() for f in burst]
        # the burst was served beside the decode (else nothing had to be cut, and the count below proves nothing)
        assert not long.done(), f"the {LONG}-token decode ended before the burst was served"
        long_result = long.result()
    for k, result in enumerate(results):
        assert_matches(result, oracle(messages(20 + k), N), f"burst request {k}")
    assert_matches(long_result, oracle(messages(10), LONG), "the long decode")
    assert bounded(group) > before  # the burst's steps were cut while the long request decoded
