"""A request that fails at the rank fails alone: the real scheduler service in-process, connected to a real
in-process rank (world size 1, the tiny model), with rank 0's sampler made to raise for marked requests.

The failure is injected by wrapping ``worker_svc.step_sampling.sample_batch`` in the test (no fault hook in production code):
requests with seed ``FAIL_SEED + k`` raise from output token ``k`` on. Checked: the failing request ends with
INTERNAL naming its id (an abort when nothing was streamed, a final with the error otherwise), a concurrent request
is answered exactly as the transformers oracle answers it, the rank's stream is never torn down (no recovery), the
rank drops the failed request's state, and the next request is correct too.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from mmcast.v1 import generation_pb2 as g
from mmcast.v1 import generation_pb2_grpc as gg
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import SchedulerServer
from tests.support.oracle import Oracle, wait_until
from tests.support.service_harness import LoopThread
from tests.support.worker_driver import InProcessWorker, rank_token_file
from worker_svc import step_sampling
from worker_svc.config import WorkerConfig

FAIL_SEED = 7_000_000
N = 8


def _marked(params, index) -> bool:
    return FAIL_SEED <= params.seed < FAIL_SEED + 100 and index >= params.seed - FAIL_SEED


def failing_batch(real):
    """A draw raises when any of its rows is marked: the step's batched draw fails, the rank then samples each
    request alone (a batch of one, failing again for the marked ones), so only those fail."""

    def sample_batch(logits, params, indices, *args, **kwargs):
        if any(_marked(p, i) for p, i in zip(params, indices, strict=True)):
            if len(params) == 1:  # a request sampled alone
                raise RuntimeError(f"injected failure at output token {indices[0]}")
            raise RuntimeError("injected failure of the batched draw")
        return real(logits, params, indices, *args, **kwargs)

    return sample_batch


@pytest.fixture(scope="module")
def service(tiny_model_dir):
    rank = InProcessWorker(
        WorkerConfig(
            model=str(tiny_model_dir),
            listen="127.0.0.1:0",
            kv_blocks=256,
            scheduler_id="test",
            shared_token_file=rank_token_file(),
        )
    )
    lt = LoopThread()
    config = SchedulerConfig(
        model=str(tiny_model_dir),
        workers=[rank.target],
        listen="127.0.0.1:0",
        metrics_port=0,
        scheduler_id="test",
        worker_token_file=rank_token_file(),
    )
    server = SchedulerServer(config)

    async def up():
        port = await server.start()
        assert await server.engine.wait_ready(30), server.engine.last_down_reason
        return port

    port = lt.run(up())
    try:
        yield server, rank, f"127.0.0.1:{port}"
    finally:
        lt.run(server.stop(drain_seconds=0))
        lt.close()
        rank.stop()


def generate(stub, rid, prompt, seed=None, max_tokens=N):
    sampling = g.SamplingParams(max_tokens=max_tokens, ignore_eos=True, return_logprobs=True, temperature=0.0)
    if seed is not None:
        sampling.seed = seed
    req = g.GenerateRequest(
        request_id=rid,
        messages=[g.ChatMessage(role=g.ROLE_USER, content=[g.ContentPart(text=prompt)])],
        sampling=sampling,
    )
    tokens, logprobs, final = [], [], None
    for resp in stub.Generate(req, timeout=60):
        if resp.HasField("delta"):
            tokens += resp.delta.token_ids
            logprobs += [lp.logprob for lp in resp.delta.logprobs]
        else:
            final = resp.final
    return tokens, logprobs, final


def counter(server, name, **labels):
    return server.metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_a_request_that_fails_at_the_rank_fails_alone(service, tiny_model_dir, monkeypatch):
    server, rank, target = service
    monkeypatch.setattr(step_sampling, "sample_batch", failing_batch(step_sampling.sample_batch))
    oracle = Oracle(tiny_model_dir)
    good_prompt, later_prompt = "Describe a quiet harbour at dawn.", "Name three colours of the sea."
    expected = oracle([{"role": "user", "content": good_prompt}], N)
    expected_later = oracle([{"role": "user", "content": later_prompt}], N)
    recoveries = counter(server, "mmcast_worker_group_recoveries_total")

    results, errors = {}, {}

    def run(name, *args, **kw):
        with grpc.insecure_channel(target) as ch:
            try:
                results[name] = generate(gg.GenerationServiceStub(ch), *args, **kw)
            except grpc.RpcError as exc:
                errors[name] = exc

    threads = [
        threading.Thread(target=run, args=("good", "good-1", good_prompt)),
        threading.Thread(target=run, args=("at-once", "poison-first", "Anything at all."), kwargs={"seed": FAIL_SEED}),
        threading.Thread(target=run, args=("later", "poison-third", "Anything else."), kwargs={"seed": FAIL_SEED + 3}),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)

    # Nothing streamed yet: the call ends with INTERNAL naming the request.
    assert set(errors) == {"at-once"}, errors
    err = errors["at-once"]
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "poison-first" in err.details() and "injected failure at output token 0" in err.details()
    # Three tokens streamed: they stay, and the final carries the error.
    tokens, _, final = results["later"]
    assert len(tokens) == 3
    assert final.finish_reason == g.FINISH_REASON_ERROR
    assert final.error.grpc_code == grpc.StatusCode.INTERNAL.value[0]
    assert "poison-third" in final.error.message and "output token 3" in final.error.message
    # The batch-mate is exact.
    tokens, logprobs, final = results["good"]
    assert final.finish_reason == g.FINISH_REASON_LENGTH
    assert tokens == expected[0]
    assert max(abs(a - b) for a, b in zip(logprobs, expected[1], strict=True)) < 1e-3

    # The rank's stream was never torn down, and the rank dropped the failed requests' state.
    assert counter(server, "mmcast_worker_group_recoveries_total") == recoveries
    assert counter(server, "mmcast_requests_finished_total", reason="error") >= 2
    assert wait_until(lambda: not rank.worker.active.session.requests, 10), rank.worker.active.session.requests
    with grpc.insecure_channel(target) as ch:
        tokens, logprobs, final = generate(gg.GenerationServiceStub(ch), "after", later_prompt)
    assert tokens == expected_later[0] and final.finish_reason == g.FINISH_REASON_LENGTH
    assert counter(server, "mmcast_worker_group_recoveries_total") == recoveries
