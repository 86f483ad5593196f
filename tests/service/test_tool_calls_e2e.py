"""Tool calling through the real ``openai`` package against the shared ``serve-local`` TP=2 group of the random tiny
model: an agent loop (a user message with an image → a forced tool call → the tool's result → a second tool call →
an answer) whose calls' arguments parse as JSON valid under each tool's parameters; the tools rendered through the
model's own chat template; calls streamed as ``tool_calls`` deltas; refusals naming the field."""

from __future__ import annotations

import base64
import json

import jsonschema
import openai
import pytest

from tests.support.security_catalogue import png

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": CLOCK}},
]
PARAMS = {"get_weather": WEATHER, "get_time": CLOCK}
IMAGE = "data:image/png;base64," + base64.b64encode(png(56, 56, seed=4)).decode()
QUESTION = {
    "role": "user",
    "content": [{"type": "image_url", "image_url": {"url": IMAGE}}, {"type": "text", "text": "Weather there?"}],
}


def check_calls(message, names) -> None:
    assert [c.function.name for c in message.tool_calls] == names
    for c in message.tool_calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


def test_agent_loop_with_an_image_and_two_tool_calls(api, model_name):
    messages = [QUESTION]
    first = api.chat.completions.create(
        model=model_name,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        seed=1,
        max_tokens=64,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message, ["get_weather"])
    plain = api.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
    assert first.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools section of the template
    messages += [choice.message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny, 21 C"}]

    second = api.chat.completions.create(
        model=model_name,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=2,
        max_tokens=64,
    )
    choice = second.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message, [choice.message.tool_calls[0].function.name])
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result went back in
    messages += [choice.message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "12:00"}]

    answer = api.chat.completions.create(
        model=model_name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    ).choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.content and not answer.message.tool_calls


def test_forced_call_streams_as_tool_call_deltas(api, model_name):
    kwargs = dict(
        model=model_name,
        messages=[QUESTION],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=1.0,
        seed=3,
        max_tokens=96,
    )
    whole = api.chat.completions.create(**kwargs).choices[0].message
    chunks = [c for c in api.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_time"]
    assert deltas[0].function.arguments == whole.tool_calls[0].function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_auto_finds_a_call_the_model_writes(api, model_name):
    # A random model does not call tools by itself: a regex makes it write one, and tool_choice auto finds it.
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "(UTC|CET)"}}\n</tool_call>'
    pattern = call.replace("{", r"\{").replace("}", r"\}")
    msg = api.chat.completions.create(
        model=model_name, messages=[QUESTION], tools=TOOLS, max_tokens=64, extra_body={"guided_regex": pattern}
    ).choices[0]
    assert msg.finish_reason == "tool_calls"
    check_calls(msg.message, ["get_time"])
    assert msg.message.content is None


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {
                "messages": [
                    QUESTION,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_requests_are_refused_by_field(api, model_name, kwargs, param):
    kwargs = {"messages": [QUESTION], **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=model_name, max_tokens=4, **kwargs)
    assert info.value.body["param"] == param, info.value.body
