"""Tool calls without a server: the Hermes parser, the streamed split of content and calls, the forced-call grammar
(sampled at random under its mask, every answer parses and validates), and tool_choice's checks."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from common.errors import InvalidArgument
from common.families import family_of
from common.families.tool_calls import HermesToolCalls, ParsedCall, tool_calls_of
from scheduler_svc.core.structured_output import GrammarCompiler
from scheduler_svc.doors import tool_calls
from worker_svc.token_mask import allowed_tokens

HERMES = HermesToolCalls()
ARGS = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "count", "parameters": ARGS}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "additionalProperties": False}}},
]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain answer", "plain answer", []),
        (
            'Sure.\n<tool_call>\n{"name": "count", "arguments": {"n": 3}}\n</tool_call>',
            "Sure.",
            [("count", '{"n": 3}')],
        ),
        (
            '<tool_call>{"name":"a","arguments":{}}</tool_call>\n<tool_call>{"name":"b","arguments":"{\\"x\\": 1}"}</tool_call>',
            "",
            [("a", "{}"), ("b", '{"x": 1}')],
        ),
        ('<tool_call>\n{"name": "a", "arguments": {}}', "", [("a", "{}")]),  # cut before its end marker
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ('<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
    ],
)
def test_hermes_parser(text, content, calls):
    got_content, got_calls = HERMES.parse(text)
    assert got_content == content
    assert got_calls == [ParsedCall(n, a) for n, a in calls]


def test_the_stream_passes_content_and_holds_calls():
    stream = tool_calls.CallStream(HERMES)
    pieces = ["Let me ", "check <", "to", "ol_call>\n", '{"name": "ping", ', '"arguments": {}}\n</tool_call>']
    out = [stream.feed(p) for p in pieces]
    assert "".join(out) == "Let me check "
    assert out[1] == "check "  # "<" held: it may begin a call
    rest, calls = stream.finish()
    assert rest == "" and calls == [ParsedCall("ping", "{}")]
    plain = tool_calls.CallStream(HERMES)
    assert plain.feed("a <b") == "a <b" and plain.feed("<") == "" and plain.finish() == ("<", [])


def test_each_family_names_its_tool_format():
    assert tool_calls_of(family_of({"model_type": "qwen2_vl"}).tool_format) is not None
    assert tool_calls_of(family_of({"model_type": "qwen3_vl"}).tool_format) is not None
    assert tool_calls_of(family_of({"model_type": "llava"}).tool_format) is None


@pytest.mark.parametrize(
    ("tools", "choice", "field"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        (None, "required", "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        ([{"type": "retrieval"}], "auto", "tools[0].type"),
        ([{"type": "function", "function": {"name": "x", "parameters": []}}], "auto", "tools[0].function.parameters"),
    ],
)
def test_tool_requests_are_refused_by_field(tools, choice, field):
    with pytest.raises(InvalidArgument) as info:
        tool_calls.parse_tools(tools, choice, None, HERMES)
    assert info.value.fields[0] == field


def test_a_family_without_a_tool_format_refuses_tools():
    with pytest.raises(InvalidArgument, match="no tool-call format"):
        tool_calls.parse_tools(TOOLS, "auto", None, None)


@pytest.mark.parametrize(("choice", "parallel"), [({"function": {"name": "count"}}, True), ("required", False)])
def test_forced_calls_sampled_at_random_always_parse(tiny_model_dir, choice, parallel):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    compiler = GrammarCompiler(tok, vocab_size=1024, eos_token_ids={tok.eos_token_id}, max_grammar_bytes=8192)
    req = tool_calls.parse_tools(TOOLS, choice, parallel, HERMES)
    spec = tool_calls.forced_grammar(req, HERMES)
    rng = random.Random(0)
    for _ in range(10):
        grammar, out = compiler.compile(spec), []
        while not grammar.complete:
            allowed = torch.nonzero(allowed_tokens(grammar.mask(), 1024)).flatten().tolist()
            token = rng.choice(allowed)
            assert grammar.advance(token)
            out.append(token)
            assert len(out) < 200
        content, calls = HERMES.parse(tok.decode(out))
        assert content == "" and len(calls) == 1
        if isinstance(choice, dict):
            assert calls[0].name == "count"
        if calls[0].name == "count":
            jsonschema.validate(json.loads(calls[0].arguments), ARGS)
