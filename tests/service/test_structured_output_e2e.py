"""Structured output through the real ``openai`` package against the shared ``serve-local`` TP=2 group of the random
tiny model: 100 of 100 sampled answers (temperature 1) parse and validate against their JSON Schema; json_object,
regex and choice constraints; streaming; an unconstrained greedy request batched beside constrained ones keeps
its tokens; bad grammars are refused with 400 naming the field, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def test_100_of_100_sampled_answers_validate_against_the_schema(serve_local_tp2, model_name):
    async def main():
        async with openai.AsyncOpenAI(
            base_url=serve_local_tp2.openai_base_url, api_key="unused", max_retries=0, timeout=300
        ) as client:

            async def one(seed: int):
                return await client.chat.completions.create(
                    model=model_name,
                    messages=MESSAGES,
                    response_format=FORMAT,
                    temperature=1.0,
                    seed=seed,
                    max_tokens=96,
                )

            return await asyncio.gather(*(one(seed) for seed in range(100)))

    answers = asyncio.run(main())
    texts = set()
    for r in answers:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        texts.add(choice.message.content)
    assert len(texts) > 50  # sampled, not one answer repeated


def test_unconstrained_greedy_tokens_are_unchanged_beside_constrained_requests(serve_local_tp2, api, model_name):
    greedy = dict(model=model_name, messages=MESSAGES, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
    alone = api.chat.completions.create(**greedy).choices[0].message.content

    async def mixed():
        async with openai.AsyncOpenAI(base_url=serve_local_tp2.openai_base_url, api_key="unused", timeout=120) as c:
            constrained = [
                c.chat.completions.create(
                    model=model_name, messages=MESSAGES, response_format=FORMAT, temperature=1.0, seed=s, max_tokens=96
                )
                for s in range(4)
            ]
            return await asyncio.gather(c.chat.completions.create(**greedy), *constrained)

    together = asyncio.run(mixed())
    assert together[0].choices[0].message.content == alone
    for r in together[1:]:
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"extra_body": {"guided_regex": "[a-d]{3,5}-[0-9]{2}"}}, lambda t: re.fullmatch("[a-d]{3,5}-[0-9]{2}", t)),
        ({"extra_body": {"guided_choice": ["cat", "dog", "bird"]}}, lambda t: t in ("cat", "dog", "bird")),
        ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}, lambda t: t in ("yes", "no")),
        (
            {"extra_body": {"structured_outputs": {"json": SCHEMA}}},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA),
        ),
    ],
)
def test_each_constraint_kind(api, model_name, extra, check):
    for seed in range(2):
        kwargs = dict(model=model_name, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=96, **extra)
        text = api.chat.completions.create(**kwargs).choices[0].message.content
        assert check(text) is not False, text


def test_json_object_answers_that_end_are_objects(api, model_name):
    # Any object: random weights may write a key that runs past max_tokens ("length"); every answer that ends on its
    # own is one JSON object, and one that ran out of tokens is the start of one.
    ended = 0
    for seed in range(6):
        kwargs = dict(model=model_name, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=64)
        choice = api.chat.completions.create(response_format={"type": "json_object"}, **kwargs).choices[0]
        assert choice.message.content.startswith("{"), choice
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            ended += 1
    assert ended >= 1


def test_streamed_constrained_answer_is_the_whole_one(api, model_name):
    kwargs = dict(model=model_name, messages=MESSAGES, response_format=FORMAT, temperature=1.0, seed=5, max_tokens=96)
    whole = api.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(api.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_text_completions_take_the_guided_extras(api, model_name):
    r = api.completions.create(
        model=model_name, prompt="Pick:", max_tokens=8, extra_body={"guided_choice": ["left", "right"]}
    )
    assert r.choices[0].text in ("left", "right")


@pytest.mark.parametrize(
    ("kwargs", "param", "needles"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
            ["nope"],
        ),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", ["could not be compiled"]),
        ({"extra_body": {"guided_regex": "a" * 70000}}, "guided_regex", ["65536", "--max-grammar-bytes"]),
        ({"response_format": {"type": "yaml"}}, "response_format.type", ["yaml"]),
    ],
)
def test_bad_grammars_are_refused_and_the_server_keeps_serving(api, model_name, kwargs, param, needles):
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, **kwargs)
    err = info.value.body
    assert err["param"] == param, err
    for needle in needles:
        assert needle in err["message"], err
    ok = api.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_the_sdk_over_grpc_takes_the_same_grammars(serve_local_tp2):
    from mmcast_client import Client
    from mmcast_client.errors import InvalidArgument

    with Client(serve_local_tp2.target) as sdk:
        for seed in range(2):
            r = sdk.generate(
                "Describe a person as JSON.",
                max_tokens=96,
                temperature=1.0,
                seed=seed,
                structured_output={"json_schema": SCHEMA},
            )
            assert r.finish_reason == "stop"
            jsonschema.validate(json.loads(r.text), SCHEMA)
        r = sdk.generate("Pick.", max_tokens=8, structured_output={"choice": ["north", "south"]})
        assert r.text in ("north", "south")
        with pytest.raises(InvalidArgument) as info:
            sdk.generate("x", max_tokens=4, structured_output={"regex": "(oops"})
        assert "structured_output.regex" in str(info.value)
