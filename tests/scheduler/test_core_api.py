"""The scheduler core's service-facing API: every limit's error, the step protocol's guard rails, service-side
stops, and group loss / reconnect."""

from __future__ import annotations

import dataclasses

import pytest

from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, ResourceExhausted
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.inputs import GroupBudget
from scheduler_svc.core.request import FinishReason, Request, RequestSampling
from scheduler_svc.core.scheduler import Scheduler, StepOutputError
from scheduler_svc.transport.plan_proto import step_control
from tests.support.sched_sim import EOS, Harness, outcome, request, text

GROUP = GroupBudget(num_ranks=2, kv_blocks=64, encoder_cache_tokens=64, payload_cache_bytes=2048)


def make(mode="lazy", group=GROUP, **overrides) -> Scheduler:
    config = SchedulerConfig(transfer_mode=mode, max_model_len=512, **overrides)
    return Scheduler(config, group, uses_mrope=True, eos_token_ids={EOS})


def plain(rid="r", n=10, **sampling) -> Request:
    sampling.setdefault("max_tokens", 4)
    return Request(rid, list(range(1, n + 1)), [], RequestSampling(**sampling))


# --- config -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"block_size": 0}, ["block_size=0", "[1, 1024]"]),
        ({"transfer_mode": "eager"}, ["transfer_mode='eager'", "full, strip, lazy"]),
        ({"max_num_batched_tokens": -1}, ["max_num_batched_tokens=-1"]),
        ({"max_logprobs": 5000}, ["max_logprobs=5000", "1024"]),
        ({"workers": "a:1,b"}, ["workers[1]='b'", "HOST:PORT", "local:PATH"]),
        ({"workers": "local:/run/r0.sock,local:r1.sock"}, ["workers[1]='local:r1.sock'", "absolute socket path"]),
        ({"max_num_seqs": 2.5}, ["max_num_seqs=2.5", "integer"]),
        (
            {"reconnect_backoff_initial_seconds": 2.0, "reconnect_backoff_max_seconds": 1.0},
            ["reconnect_backoff_max_seconds=1.0"],
        ),
    ],
)
def test_config_errors_name_the_setting_value_and_range(overrides, needles):
    with pytest.raises(ValueError) as info:
        SchedulerConfig(**overrides)
    for needle in needles:
        assert needle in str(info.value)


def test_workers_may_name_local_sockets_beside_ports():
    assert SchedulerConfig(workers="local:/run/mmcast/r0.sock,127.0.0.1:5").workers == [
        "local:/run/mmcast/r0.sock",
        "127.0.0.1:5",
    ]


def test_every_config_field_has_help_text():
    for f in dataclasses.fields(SchedulerConfig):
        assert f.metadata.get("help", "").strip(), f.name


def test_budgets_come_from_the_handshake_unless_configured_lower():
    s = make(kv_blocks=32)
    assert (s.kv_blocks, s.encoder_cache_tokens, s.payload_cache_bytes) == (32, 64, 2048)
    with pytest.raises(ValueError, match="kv_blocks=100 exceeds what the ranks reported"):
        make(kv_blocks=100)
    assert make(group=dataclasses.replace(GROUP, max_model_len=300)).max_model_len == 300


# --- add_request ----------------------------------------------------------------------------------------------
def _with_feature_payload(nbytes_rows: int):
    return request("img", [text("t", 4), ("big", nbytes_rows), text("u", 4)])


@pytest.mark.parametrize(
    ("make_kwargs", "req", "error", "needles"),
    [
        ({}, plain("r", 0), InvalidArgument, ["prompt is empty"]),
        ({}, plain("r", 600), InvalidArgument, ["600 prompt tokens", "context of 512", "--max-model-len"]),
        ({}, plain(max_tokens=0), InvalidArgument, ["sampling.max_tokens=0"]),
        ({}, plain(max_tokens=505), InvalidArgument, ["sampling.max_tokens=505", "context of 512", "at most 502"]),
        ({"max_tokens_limit": 8}, plain(max_tokens=9), InvalidArgument, ["max_tokens=9", "8", "--max-tokens-limit"]),
        ({}, plain(logprobs=21), InvalidArgument, ["sampling.logprobs=21", "[0, 20]", "--max-logprobs"]),
        ({}, plain(temperature=3.0), InvalidArgument, ["sampling.temperature=3.0"]),
        ({}, plain(top_p=0.0), InvalidArgument, ["sampling.top_p=0.0"]),
        ({}, plain(top_k=-1), InvalidArgument, ["sampling.top_k=-1", "[0, 2^32)"]),
        ({}, plain(top_k=2**32), InvalidArgument, ["sampling.top_k=4294967296", "[0, 2^32)"]),
        ({"kv_blocks": 2}, plain(n=30, max_tokens=4), ResourceExhausted, ["34 tokens", "KV pool of 32", "--kv-blocks"]),
        ({}, _with_feature_payload(80), ResourceExhausted, ["80 encoder rows", "holds 64", "--encoder-cache-tokens"]),
        (
            {"payload_cache_bytes": 512},
            _with_feature_payload(40),
            ResourceExhausted,
            ["640 payload bytes", "512", "--payload-cache-bytes"],
        ),
        (
            {"group": dataclasses.replace(GROUP, max_tensor_bytes=100)},
            _with_feature_payload(8),
            ResourceExhausted,
            ["pixel_values has 128 bytes", "up to 100 bytes"],
        ),
    ],
)
def test_add_request_limits(make_kwargs, req, error, needles):
    s = make(**make_kwargs)
    with pytest.raises(error) as info:
        s.add_request(req)
    for needle in needles:
        assert needle in info.value.message, info.value.message
    assert not s.has_requests()


def test_full_refuses_requests_whose_images_exceed_a_rank_payload_cache():
    req = lambda: request("r", [text("t", 4), ("a", 40), text("u", 2), ("b", 40), text("v", 2)])  # noqa: E731
    with pytest.raises(ResourceExhausted, match="--transfer-mode lazy"):
        make("full", payload_cache_bytes=1000).add_request(req())
    make("lazy", payload_cache_bytes=1000).add_request(req())  # one image at a time fits
    make("strip", payload_cache_bytes=1000).add_request(req())  # deferred when it cannot travel at once


def test_duplicate_ids_and_a_full_queue():
    s = make(max_waiting=2)
    s.add_request(plain("a"))
    with pytest.raises(AlreadyExists, match="request_id='a' is already in flight"):
        s.add_request(plain("a"))
    s.add_request(plain("b"))
    with pytest.raises(ResourceExhausted, match="waiting queue is full .*--max-waiting=2"):
        s.add_request(plain("c"))
    assert s.stats.num_waiting == 2


# --- the step protocol ------------------------------------------------------------------------------------------
def test_steps_are_synchronous_and_sampled_tokens_must_match_the_plan():
    s = make()
    s.add_request(plain("a", max_tokens=2))
    plan = s.schedule()
    assert plan.sampling_request_ids == ["a"]
    with pytest.raises(FailedPrecondition, match="still in flight"):
        s.schedule()
    with pytest.raises(StepOutputError, match=r"no token for \['a'\]"):
        s.update_from_output(plan, outcome({}))
    with pytest.raises(StepOutputError, match=r"unexpected tokens for \['zz'\]"):
        s.update_from_output(plan, outcome({"a": 5, "zz": 6}))
    assert s.get_request("a").num_computed_tokens == 0  # nothing was applied
    updates = s.update_from_output(plan, outcome({"a": (5, -0.25, [(5, -0.25)])}))
    assert [(u.request_id, u.new_token_ids, u.logprobs, u.finished) for u in updates] == [("a", [5], None, None)]
    plan = s.schedule()
    assert step_control(plan).running[0].new_token_ids == [5] and plan.num_scheduled_tokens == {"a": 1}
    (update,) = s.update_from_output(plan, outcome({"a": 6}))
    assert update.finished is FinishReason.LENGTH and update.usage is not None


def test_sampling_reaches_the_ranks_control_top_k_included():
    s = make()
    s.add_request(plain("k", temperature=1.5, top_p=0.5, top_k=7, seed=9, logprobs=2, return_logprobs=True))
    s.add_request(plain("off"))
    by_id = {m.request_id: m.sampling for m in step_control(s.schedule()).new_requests}
    k = by_id["k"]
    assert (k.top_k, k.top_p, k.temperature, k.seed, k.logprobs, k.return_logprobs) == (7, 0.5, 1.5, 9, 2, True)
    assert by_id["off"].top_k == 0  # no cut: the proto's unset value


def test_eos_stop_tokens_logprobs_and_ignore_eos():
    s = make()
    s.add_request(plain("eos", max_tokens=5, return_logprobs=True, logprobs=1))
    s.add_request(plain("stop", max_tokens=5, stop_token_ids=(42,)))
    s.add_request(plain("ignore", max_tokens=2, ignore_eos=True))
    plan = s.schedule()
    got = {
        u.request_id: u
        for u in s.update_from_output(plan, outcome({"eos": (EOS, -0.5, [(EOS, -0.5)]), "stop": 42, "ignore": EOS}))
    }
    assert got["eos"].finished is FinishReason.STOP and got["eos"].stop_token_id == EOS
    assert got["eos"].logprobs == [(-0.5, [(EOS, -0.5)])]
    assert got["stop"].finished is FinishReason.STOP and got["stop"].stop_token_id == 42
    assert got["ignore"].finished is None


def test_finish_during_a_step_and_reusing_the_id_right_away():
    s = make()
    s.add_request(plain("a", max_tokens=8))
    plan = s.schedule()
    final = s.finish_request("a", FinishReason.CANCELLED)  # the client went away while the step ran
    assert final.finished is FinishReason.CANCELLED and s.stats.kv_blocks_used == 0
    s.add_request(plain("a", max_tokens=1))  # a new request may take the id at once
    assert s.update_from_output(plan, outcome({"a": 7})) == []  # the old step's token is dropped
    plan = s.schedule()
    assert plan.finished_request_ids == ["a"] and plan.new_requests == []  # ranks drop the old one first
    s.update_from_output(plan, outcome({}))
    plan = s.schedule()
    assert [n.request_id for n in plan.new_requests] == ["a"]


def test_cancelling_a_waiting_request_tells_nobody():
    s = make(max_num_seqs=1)
    s.add_request(plain("a"))
    s.add_request(plain("b"))
    plan = s.schedule()
    assert s.finish_request("b", FinishReason.CANCELLED).finished is FinishReason.CANCELLED
    s.update_from_output(plan, outcome({"a": 3}))
    assert s.schedule().finished_request_ids == []


def test_recover_voids_the_step_in_flight_and_reset_group_fails_what_no_longer_fits():
    s = make()
    s.add_request(plain("a", n=20, max_tokens=8))
    s.add_request(plain("b", n=100, max_tokens=8))
    plan = s.schedule()
    s.update_from_output(plan, outcome({"a": 1, "b": 2}))
    stale = s.schedule()
    s.recover()
    with pytest.raises(FailedPrecondition, match="not the step in flight"):
        s.update_from_output(stale, outcome({"a": 1, "b": 2}))
    assert s.stats.num_running == 0 and s.stats.num_waiting == 2
    failed = s.reset_group(dataclasses.replace(GROUP, kv_blocks=4))  # 64 tokens: b (108) no longer fits
    assert [(u.request_id, u.finished) for u in failed] == [("b", FinishReason.ERROR)]
    assert "KV pool of 64" in failed[0].error
    plan = s.schedule()
    assert plan.reset_caches and step_control(plan).reset_caches
    (new,) = plan.new_requests
    assert new.request_id == "a" and new.num_output_tokens == 1 and new.prompt_token_ids[-1] == 1
    assert s.stats.kv_blocks_total == 4


def test_reset_group_needs_recover_first():
    s = make()
    s.add_request(plain())
    s.schedule()
    with pytest.raises(FailedPrecondition, match="recover"):
        s.reset_group(GROUP)


def test_plan_accounting_and_stats_for_the_metrics():
    h = Harness("strip", num_ranks=2, keep_plans=True)
    segs = [text("s", 20), ("a", 16), text("t", 30)]
    h.add(request("r1", segs))
    first = h.step().plan
    assert first.totals().sent == 2 and first.totals().payload_bytes_sent == 2 * 256
    h.run()
    h.add(request("r2", segs))
    plan = h.step().plan
    acc = plan.accounting["r2"]
    assert (acc.stripped, acc.bytes_saved_prefix_covered, acc.sent) == (2, 512, 0)
    stats = h.sched.stats
    assert stats.prefix_query_tokens == 132 and stats.prefix_hit_tokens == 64
    assert stats.num_running == 1 and stats.kv_blocks_used == 5


@pytest.mark.parametrize("uses_mrope", (True, False))
def test_stripped_items_keep_exactly_the_keep_on_cpu_fields_for_mrope_models(uses_mrope):
    from mmcast.v1 import multimodal_pb2

    config = SchedulerConfig(transfer_mode="strip", max_model_len=512)
    s = Scheduler(config, GROUP, uses_mrope=uses_mrope, eos_token_ids={EOS})
    segs = [text("s", 20), ("a", 16), text("t", 30)]
    for rid in ("r1", "r2"):
        s.add_request(request(rid, segs, max_tokens=1))
        plan = s.schedule()
        s.update_from_output(plan, outcome({rid: 3}))
        s.update_from_output(s.schedule(), outcome({}))  # tells the ranks r1 finished
    item = step_control(plan).new_requests[0].mm_items[0]
    assert item.payload_state == multimodal_pb2.PAYLOAD_STATE_STRIPPED
    assert [f.name for f in item.fields] == (["image_grid_thw"] if uses_mrope else [])
    assert s.get_request("r2") is None  # finished; the scheduler's own copy was never stripped:
    assert plan.scheduled[0][0].mm_features[0].data["pixel_values"].data.shape == (16, 4)
