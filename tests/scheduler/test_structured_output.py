"""Structured output without a server: the grammar compiler (cache, limits, refusals naming the field), the rank's
masking stage, and the scheduler core driving a grammar through preemption and group recovery with a simulated
rank 0 that draws at random among the tokens each step's mask allows."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from common.errors import InvalidArgument
from mmcast.v1 import worker_pb2
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.inputs import GroupBudget
from scheduler_svc.core.request import FinishReason, Request, RequestSampling
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.structured_output import GrammarCompiler, GrammarSpec
from scheduler_svc.doors import grammar_requests
from scheduler_svc.transport.plan_proto import step_control
from tests.support.sched_sim import outcome
from worker_svc.sampling import RowSampling, sample, sample_batch
from worker_svc.token_mask import allowed_tokens, mask_nbytes

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(
        tokenizer, vocab_size=1024, eos_token_ids={tokenizer.eos_token_id}, max_grammar_bytes=4096, cache_entries=2
    )


def test_a_schema_compiles_once_and_each_request_gets_its_own_matcher(compiler):
    spec = GrammarSpec.json_schema(SCHEMA, "response_format.json_schema.schema")
    before = compiler.compiles
    a, b = compiler.compile(spec), compiler.compile(spec)
    assert compiler.compiles == before + 1
    first = int(torch.nonzero(allowed_tokens(a.mask(), 1024))[0])
    assert a.advance(first)
    assert a.mask() != b.mask()  # b did not move with a
    for regex in ("a+", "b+", "c+"):  # the LRU keeps 2: the schema is evicted and compiled again
        compiler.compile(GrammarSpec("regex", regex, "guided_regex"))
    compiler.compile(spec)
    assert compiler.compiles == before + 5


@pytest.mark.parametrize(
    ("spec", "needles"),
    [
        (GrammarSpec("regex", "[a-", "guided_regex"), ["guided_regex could not be compiled", "unclosed"]),
        (GrammarSpec("json_schema", '{"type":"nope"}', "response_format.json_schema.schema"), ["nope"]),
        (GrammarSpec("regex", "x" * 5000, "guided_regex"), ["5000 bytes", "4096", "--max-grammar-bytes"]),
    ],
)
def test_bad_grammars_are_refused_naming_the_field(compiler, spec, needles):
    with pytest.raises(InvalidArgument) as info:
        compiler.compile(spec)
    assert info.value.fields[0] == spec.field
    for needle in needles:
        assert needle in info.value.message


class _Body:
    def __init__(self, **fields):
        self.__dict__.update(fields)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)
def test_the_doors_fields_are_refused_by_name(fields, field):
    with pytest.raises(InvalidArgument) as info:
        grammar_requests.from_openai(_Body(**fields))
    assert info.value.fields[0] == field


def test_the_grpc_field_reads_each_kind():
    from mmcast.v1 import generation_pb2 as g

    req = g.GenerateRequest(structured_output=g.StructuredOutput(choice=g.ChoiceList(choices=["yes", "no"])))
    assert grammar_requests.from_proto(req) == GrammarSpec(
        "choice", '["yes", "no"]', "structured_output.choice.choices"
    )
    assert grammar_requests.from_proto(g.GenerateRequest()) is None
    spec = grammar_requests.from_proto(g.GenerateRequest(structured_output=g.StructuredOutput(json_schema="{}")))
    assert spec.kind == "json_schema"


def test_the_rank_draws_only_allowed_tokens_and_keeps_the_models_logprobs():
    logits = torch.randn(3, 1024)
    allowed = torch.zeros(1024, dtype=torch.bool)
    allowed[[5, 700]] = True
    greedy = RowSampling(return_logprobs=True)
    hot = RowSampling(temperature=1.0, seed=3, return_logprobs=True)
    out = sample_batch(logits, [greedy, hot, greedy], [0, 0, 0], allowed={0: allowed, 1: allowed})
    assert out[0].token_id == (5 if logits[0, 5] > logits[0, 700] else 700)
    assert out[1].token_id in (5, 700)
    assert out[2].token_id == int(torch.argmax(logits[2]))  # the unconstrained row of the same batch
    assert out[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[out[0].token_id]), abs=1e-6)
    bits = bytearray(mask_nbytes(1024))
    bits[700 // 8] |= 1 << (700 % 8)
    assert torch.nonzero(allowed_tokens(bytes(bits), 1024)).flatten().tolist() == [700]
    assert sample(logits[0], greedy, 0, allowed=allowed_tokens(bytes(bits), 1024)).token_id == 700


def _run(s: Scheduler, rng: random.Random, disrupt=None) -> dict[str, list[int]]:
    """Steps the core to the end; rank 0 draws uniformly among each mask's tokens (anything for the others)."""
    out: dict[str, list[int]] = {}
    step = 0
    while s.has_requests():
        plan = s.schedule()
        control = step_control(plan)  # the masks travel in the control, as on the wire
        masks = {m.request_id: m.allowed for m in control.token_masks}
        assert set(masks) <= set(plan.sampling_request_ids)
        drawn = {}
        for rid in plan.sampling_request_ids:
            if rid in masks:
                drawn[rid] = rng.choice(torch.nonzero(allowed_tokens(masks[rid], 1024)).flatten().tolist())
            else:
                drawn[rid] = rng.randrange(900)
        if disrupt is not None and disrupt(s, step):
            s.recover()
            s.reset_group(s.group)
        else:
            for u in s.update_from_output(plan, outcome(drawn)):
                out.setdefault(u.request_id, []).extend(u.new_token_ids)
                if u.finished is not None:
                    out[u.request_id + ":finish"] = [u.finished.value, u.stop_token_id]
        step += 1
    return out


@pytest.mark.parametrize("disruption", ["none", "preemption", "recovery"])
def test_constrained_requests_stay_valid_through_preemption_and_recovery(compiler, tokenizer, disruption):
    eos = tokenizer.eos_token_id
    blocks = 24 if disruption == "preemption" else 64  # too few for every request's whole answer: preemptions
    config = SchedulerConfig(max_model_len=512, block_size=4)
    group = GroupBudget(num_ranks=1, kv_blocks=blocks, encoder_cache_tokens=64, payload_cache_bytes=2048)
    s = Scheduler(config, group, uses_mrope=False, eos_token_ids={eos})
    s.group = group
    spec = GrammarSpec.json_schema(SCHEMA, "f")
    for i in range(4):
        r = Request(f"c{i}", list(range(10, 18)), [], RequestSampling(max_tokens=80, temperature=1.0))
        r.grammar = compiler.compile(spec)
        s.add_request(r)
    s.add_request(Request("free", list(range(10, 18)), [], RequestSampling(max_tokens=20, ignore_eos=True)))
    disrupt = (lambda core, step: step in (6, 15)) if disruption == "recovery" else None
    out = _run(s, random.Random(7), disrupt)
    if disruption == "preemption":
        assert s.stats.preemptions > 0
    assert len(out["free"]) == 20
    for i in range(4):
        tokens, (finish, stop_token) = out[f"c{i}"], out[f"c{i}:finish"]
        assert finish == FinishReason.STOP.value
        text = tokenizer.decode([t for t in tokens if t != stop_token])
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_mask_of_the_wrong_size_or_for_a_request_not_sampled_is_refused():
    from worker_svc.step_errors import StepError
    from worker_svc.token_mask import check_token_masks

    class _State:
        request_id, token_ids = "a", [1, 2, 3]

    windows = [(_State(), 0, 3)]
    good = worker_pb2.StepControl(token_masks=[worker_pb2.TokenMask(request_id="a", allowed=bytes(128))])
    assert set(check_token_masks(good, windows, 1024)) == {"a"}
    # a running request: its window ends at the token its delta brings this step
    assert set(check_token_masks(good, [(_State(), 3, 4)], 1024, {"a": 1})) == {"a"}
    with pytest.raises(StepError, match="not sampled"):
        check_token_masks(good, [(_State(), 2, 3)], 1024, {"a": 1})  # a prefill chunk short of the end
    for control, needle in [
        (worker_pb2.StepControl(token_masks=[worker_pb2.TokenMask(request_id="a", allowed=bytes(4))]), "takes 128"),
        (worker_pb2.StepControl(token_masks=[worker_pb2.TokenMask(request_id="b", allowed=bytes(128))]), "not sampled"),
    ]:
        with pytest.raises(StepError, match=needle):
            check_token_masks(control, windows, 1024)


def test_the_sdk_builds_the_grpc_field():
    from mmcast_client._core.request_building import structured_output

    assert json.loads(structured_output({"json_schema": SCHEMA}).json_schema) == SCHEMA
    assert list(structured_output({"choice": ["a", "b"]}).choice.choices) == ["a", "b"]
    assert structured_output({"json_object": True}).WhichOneof("kind") == "json_object"
    for bad in ({"yaml": "x"}, {"regex": "a", "choice": ["b"]}, "json"):
        with pytest.raises(ValueError, match="structured_output="):
            structured_output(bad)
