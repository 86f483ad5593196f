"""The conversation key a replica returns (scheduler_svc/engine/affinity_key.py) is the SDK's key of the same conversation."""

from __future__ import annotations

import hashlib

import pytest

from common.errors import InvalidArgument
from mmcast_client._core import request_building
from mmcast_client.affinity import conversation_key, session_key
from mmcast_client.images import ImageStore
from mmcast_client.messages import prepare
from scheduler_svc.engine.affinity_key import MAX_KEY_CHARS, client_key, key_of
from scheduler_svc.engine.request_input import ImageContent, TextContent, Turn

JPEG = b"\xff\xd8\xff\xe0 not really a jpeg, only bytes to hash"
SHA = hashlib.sha256(JPEG).hexdigest()


def turns(*messages) -> list[Turn]:
    return [Turn(role, tuple(parts)) for role, parts in messages]


def test_the_key_is_the_sdks_function_of_the_first_user_message():
    system = ("system", [TextContent("be brief")])
    first = ("user", [ImageContent(JPEG, None, "messages[1].content[0].image"), TextContent("what is this?")])
    later = [("assistant", [TextContent("a cat")]), ("user", [TextContent("and now?")])]
    expected = conversation_key([("image", SHA), "what is this?"])
    assert key_of(turns(system, first), None) == expected
    assert key_of(turns(system, first, *later), None) == expected  # every later turn repeats it
    by_upload = ("user", [ImageContent(None, SHA, "f"), TextContent("what is this?")])
    assert key_of(turns(by_upload), None) == expected  # an uploaded image counts by the sha256 it is named by
    assert key_of(turns(("user", [TextContent("what is this?"), ImageContent(JPEG, None, "f")])), None) != expected
    assert key_of(None, "a plain prompt") == conversation_key(["a plain prompt"])
    assert key_of(turns(("system", [TextContent("only a system message")])), None) == conversation_key(
        ["only a system message"]
    )  # no user message: the first message, as the SDK does


def test_the_sdk_computes_the_same_key_for_the_same_messages():
    messages = [{"role": "user", "content": [{"type": "image", "image": JPEG}, {"type": "text", "text": "hi"}]}]
    prepared = prepare(messages, ImageStore())
    server = key_of(turns(("user", [ImageContent(JPEG, None, "f"), TextContent("hi")])), None)
    assert request_building.affinity_key(prepared, None) == server


def test_client_headers_choose_the_key():
    assert client_key({"x-mmcast-affinity": "abc", "x-session-id": "s"}.get) == "abc"
    assert client_key({"x-session-id": "user-7"}.get) == session_key("user-7")
    assert client_key({}.get) == ""


@pytest.mark.parametrize("name", ["x-mmcast-affinity", "x-session-id"])
def test_a_key_that_could_not_go_back_out_as_a_header_is_refused_naming_it(name):
    with pytest.raises(
        InvalidArgument, match=f"the {name} header has {MAX_KEY_CHARS + 1} characters; the limit is {MAX_KEY_CHARS}"
    ) as err:
        client_key({name: "k" * (MAX_KEY_CHARS + 1)}.get)
    assert err.value.fields == (name,)
    with pytest.raises(InvalidArgument, match="only visible ASCII"):
        client_key({name: "two words"}.get)
