"""``/v1/responses`` and caller-chosen media ``uuid``s through the real ``openai`` package against the shared
``serve-local`` TP=2 group. A response is the chat completion of the same conversation (whose text the chat tests
hold to transformers): text, an image, ``instructions``, streaming events, and ``previous_response_id``."""

from __future__ import annotations

import base64

import openai
import pytest

from tests.support.security_catalogue import png

pytestmark = pytest.mark.slow

IMG = png(56, 84, seed=11)
URL = "data:image/png;base64," + base64.b64encode(IMG).decode()
GREEDY = dict(temperature=0.0)


def chat(api, model_name, messages, n=6):
    out = api.chat.completions.create(model=model_name, messages=messages, max_tokens=n, **GREEDY)
    return out.choices[0].message.content, out.usage.prompt_tokens


def test_text_image_and_instructions_answer_as_chat_does(api, model_name):
    content = [{"type": "input_image", "image_url": URL}, {"type": "input_text", "text": "What is it?"}]
    out = api.responses.create(
        model=model_name,
        instructions="Be brief.",
        input=[{"role": "user", "content": content}],
        max_output_tokens=6,
        **GREEDY,
    )
    text, prompt_tokens = chat(
        api,
        model_name,
        [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": URL}}, {"type": "text", "text": "What is it?"}],
            },
        ],
    )
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output_text == text and out.usage.input_tokens == prompt_tokens
    assert out.status in ("completed", "incomplete") and out.output[0].role == "assistant"
    plain = api.responses.create(model=model_name, input="Hello there", max_output_tokens=6, **GREEDY)
    assert plain.output_text == chat(api, model_name, [{"role": "user", "content": "Hello there"}])[0]


def test_streaming_events(api, model_name):
    whole = api.responses.create(model=model_name, input="Tell me a story", max_output_tokens=8, **GREEDY)
    events = list(
        api.responses.create(model=model_name, input="Tell me a story", max_output_tokens=8, stream=True, **GREEDY)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_previous_response_id_continues_the_conversation(api, model_name):
    first = api.responses.create(model=model_name, input="What is red?", max_output_tokens=6, **GREEDY)
    second = api.responses.create(
        model=model_name, input="And blue?", previous_response_id=first.id, max_output_tokens=6, **GREEDY
    )
    messages = [
        {"role": "user", "content": "What is red?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And blue?"},
    ]
    text, prompt_tokens = chat(api, model_name, messages)
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    assert second.previous_response_id == first.id

    unstored = api.responses.create(model=model_name, input="Hi", max_output_tokens=2, store=False)
    for missing in ("resp_never", unstored.id):
        with pytest.raises(openai.NotFoundError) as info:
            api.responses.create(model=model_name, input="x", previous_response_id=missing, max_output_tokens=2)
        assert info.value.body["param"] == "previous_response_id" and missing in info.value.message


def test_refusals_name_the_field(api, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        api.responses.create(model=model_name, input="x", tools=[{"type": "function", "name": "f", "parameters": {}}])
    assert info.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as info:
        api.responses.create(model=model_name, input=[{"role": "user", "content": [{"type": "input_file"}]}])
    assert info.value.body["param"].startswith("input[0].content[0]")


def test_caller_chosen_uuid_names_the_image_for_the_tenant(api, model_name):
    """A free-form ``uuid`` beside an image names it; later requests send the uuid alone (vLLM's convention); one
    never registered is a 404 naming the field, and mmcast's ``sha256:`` ids keep working beside it."""
    question = {"type": "text", "text": "Describe it."}
    inline = {"type": "image_url", "image_url": {"url": URL}, "uuid": "my-photo.v1"}
    first = chat(api, model_name, [{"role": "user", "content": [inline, question]}])
    by_uuid = {"type": "image_url", "image_url": None, "uuid": "my-photo.v1"}
    assert chat(api, model_name, [{"role": "user", "content": [by_uuid, question]}]) == first
    with pytest.raises(openai.NotFoundError) as info:
        chat(api, model_name, [{"role": "user", "content": [{**by_uuid, "uuid": "never-sent"}, question]}])
    assert info.value.body["param"] == "messages[0].content[0].uuid" and "never-sent" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        chat(api, model_name, [{"role": "user", "content": [{**by_uuid, "uuid": "has space"}, question]}])
    assert "letters, digits" in info.value.message


def test_async_client(serve_local_tp2, api, model_name):
    """The async client: a prompt list on /v1/completions and a streamed response, as the sync client gets them."""
    import asyncio

    whole = api.completions.create(model=model_name, prompt=["a", "b"], max_tokens=4, **GREEDY)
    response = api.responses.create(model=model_name, input="Hello there", max_output_tokens=6, **GREEDY)

    async def run():
        async with openai.AsyncOpenAI(base_url=serve_local_tp2.openai_base_url, api_key="unused", max_retries=0) as c:
            listed = await c.completions.create(model=model_name, prompt=["a", "b"], max_tokens=4, **GREEDY)
            stream = await c.responses.create(
                model=model_name, input="Hello there", max_output_tokens=6, stream=True, **GREEDY
            )
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            return [ch.text for ch in listed.choices], "".join(deltas)

    texts, streamed = asyncio.run(run())
    assert texts == [ch.text for ch in whole.choices] and streamed == response.output_text
