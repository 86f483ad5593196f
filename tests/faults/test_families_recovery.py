"""Families beside the default one under `serve-local`'s supervisor: a lost rank mid-generation is invisible to
clients, and every answer still equals plain transformers (docs/ARCHITECTURE.md §3, invariants 2 and 3).

One LocalGroup (the code behind `mmcast serve-local`: a scheduler and a TP=2 worker group as processes, supervised)
per family checkpoint, with the defaults (lazy transfer, encoded payloads, sharded encoder placement). Three
streaming requests, each with its own image, run until every one has tokens; rank 1 is killed with SIGKILL; the
supervisor restarts the group, the scheduler requeues each request with the tokens it already sent, and each stream
must finish with the tokens and log-probabilities of the checkpoint run whole in transformers. A recomputed request
re-encodes its image on the new group (the rank caches died with it): the family's encoder rows (for Qwen3-VL the
DeepStack levels too) must come back exact, and its positions too (LLaVA: 1-D, its items travel with no grid).
"""

from __future__ import annotations

import signal
import threading

import pytest

from mmcast_client import Client
from mmcast_local.supervisor import LocalGroup
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.support.oracle import Oracle, assert_matches, scrape, user_turn, wait_until

pytestmark = pytest.mark.slow

TP = 2
N_TOKENS = 128  # long enough that the kill lands mid-generation
STREAMS = 3
SIZE = (160, 128)  # Qwen3-VL: a 32-pixel grid step, 5 x 4 merged patches; LLaVA crops it to its square
# Family checkpoints (fixtures of tests/conftest.py) whose recovery runs here; the default model's is in test_e2e.py.
FAMILY_MODELS = ("tiny_model_q3_dir", "tiny_model_llava_dir")


def messages(k: int) -> list[dict]:
    return [user_turn(synthetic_jpeg(9100 + k, SIZE), f"Picture {k}: what is in it, and where is the light from?")]


class Streams:
    """One streaming generation per prompt, each on its own client; ``seen`` counts tokens as they arrive."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.seen = [0] * STREAMS
        self.outcomes: list = [None] * STREAMS  # Result or the exception
        self.threads = [threading.Thread(target=self._run, args=(k,)) for k in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        try:
            with Client(self.target, timeout=300, first_token_timeout=None) as client:
                stream = client.generate(messages(k), max_tokens=N_TOKENS, ignore_eos=True, logprobs=0, stream=True)
                for delta in stream:
                    self.seen[k] += len(delta.token_ids)
                self.outcomes[k] = stream.result
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            self.outcomes[k] = exc

    def join(self, timeout: float) -> list:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), f"streams still running: {self.seen}"
        return self.outcomes


@pytest.mark.parametrize("model_fixture", FAMILY_MODELS)
def test_kill_9_of_a_rank_mid_generation_is_invisible_and_answers_equal_transformers(model_fixture, request, tmp_path):
    model_dir = request.getfixturevalue(model_fixture)
    group = LocalGroup(
        model_dir,
        TP,
        "lazy",
        kv_blocks=256,
        log_dir=tmp_path / "logs",
        ready_timeout=240,
        worker_args=["--group-timeout-seconds", "10"],
    )
    group.start()
    try:
        oracle = Oracle(model_dir)
        expected = [oracle(messages(k), N_TOKENS) for k in range(STREAMS)]  # computed while the processes start
        group.wait_ready()
        recoveries = "mmcast_worker_group_recoveries_total"
        before = scrape(group.metrics_urls["scheduler"], recoveries)
        streams = Streams(group.target)
        assert wait_until(lambda: min(streams.seen) >= 2, 180, 0.01), f"streams stuck at {streams.seen}"
        generation = group.kill_rank(1, signal.SIGKILL)
        at_kill = list(streams.seen)
        group.wait_restarted(generation, timeout=180)
        outcomes = streams.join(240)
        assert all(n < N_TOKENS for n in at_kill), f"a stream ended before the kill: {at_kill}"
        for k, outcome in enumerate(outcomes):
            assert not isinstance(outcome, BaseException), f"stream {k}: {type(outcome).__name__}: {outcome}"
            assert outcome.finish_reason == "length"
            assert_matches(outcome, expected[k], f"{model_fixture} stream {k}")
        assert scrape(group.metrics_urls["scheduler"], recoveries) >= before + 1
    finally:
        group.stop()
