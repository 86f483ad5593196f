"""Lost-rank recovery on the tiny LLaVA (no M-RoPE): a `serve-local`-style deployment (LocalGroup: the scheduler and
a TP=2 worker group as processes) loses rank 1 to kill -9 while three streams are mid-generation; the supervisor
restarts the group, the scheduler requeues every running request as new with the tokens it already produced, and
every client's answer still equals plain transformers fed the input as sent (docs/ARCHITECTURE.md §2.5). A resumed
LLaVA request's prompt holds its images in full: their items travel again with no grid, and positions stay 1-D."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from mmcast_client import Client
from mmcast_local.supervisor import LocalGroup
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.support.oracle import Oracle, assert_matches, scrape, user_turn, wait_until

pytestmark = pytest.mark.slow

N_TOKENS = 192  # long enough that the kill lands mid-generation
STREAMS = 3


def messages(k: int) -> list[dict]:
    return [user_turn(synthetic_jpeg(9100 + k, (120, 90)), "Tell me everything about this picture.")]


def test_kill_9_of_a_rank_mid_generation_is_invisible_to_llava_clients(tiny_model_llava_dir, tmp_path):
    group = LocalGroup(
        tiny_model_llava_dir, 2, "lazy", log_dir=tmp_path, ready_timeout=240,
        scheduler_args=["--step-timeout-seconds", "5", "--keepalive-seconds", "2", "--group-deadline-seconds", "60",
                        "--reconnect-backoff-max-seconds", "0.5"],
        worker_args=["--group-timeout-seconds", "5"],
    )  # fmt: skip
    group.start()
    try:
        oracle = Oracle(tiny_model_llava_dir)
        expected = [oracle(messages(k), N_TOKENS) for k in range(STREAMS)]  # while the processes start
        group.wait_ready()
        seen, outcomes = [0] * STREAMS, [None] * STREAMS

        def run(k: int) -> None:
            try:
                with Client(group.target, timeout=300, first_token_timeout=None) as client:
                    stream = client.generate(messages(k), max_tokens=N_TOKENS, ignore_eos=True, logprobs=0,
                                             temperature=0.0, stream=True)
                    for delta in stream:
                        seen[k] += len(delta.token_ids)
                    outcomes[k] = stream.result
            except Exception as exc:  # noqa: BLE001 - inspected below
                outcomes[k] = exc

        threads = [threading.Thread(target=run, args=(k,)) for k in range(STREAMS)]
        for t in threads:
            t.start()
        assert wait_until(lambda: min(seen) >= 2, 120, 0.01), f"streams stuck at {seen}"
        generation = group.kill_rank(1, signal.SIGKILL)
        at_kill = list(seen)
        group.wait_restarted(generation, timeout=180)
        deadline = time.monotonic() + 180
        for t in threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), f"streams still running: {seen}"
        assert all(2 <= n < N_TOKENS for n in at_kill), at_kill  # every stream was mid-generation at the kill
        for k, outcome in enumerate(outcomes):
            assert not isinstance(outcome, BaseException), f"stream {k}: {type(outcome).__name__}: {outcome}"
            assert outcome.finish_reason == "length"
            assert_matches(outcome, expected[k], f"stream {k}")
        assert scrape(group.metrics_urls["scheduler"], "mmcast_worker_group_recoveries_total") >= 1
    finally:
        group.stop()
