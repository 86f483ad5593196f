"""The bounded per-tenant stores behind ``previous_response_id`` and caller-chosen media ``uuid``s."""

from __future__ import annotations

import hashlib

import pytest

from scheduler_svc.doors.media_aliases import BadUuid, MediaAliases, parse_uuid
from scheduler_svc.doors.response_store import ResponseStore, as_references, size_of
from scheduler_svc.engine.request_input import ImageContent, TextContent, Turn


def turns(text: str) -> list[Turn]:
    return [Turn("user", (TextContent(text),))]


def test_entries_are_per_tenant_and_least_recently_used_go_first():
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    store.put("a", "r1", turns("one"))
    store.put("a", "r2", turns("two"))
    assert store.get("b", "r1") is None  # another tenant's id reads as unknown
    assert store.get("a", "r1") == turns("one")  # r1 is now the most recent
    store.put("a", "r3", turns("three"))
    assert store.get("a", "r2") is None and store.get("a", "r1") is not None and len(store) == 2


def test_the_byte_bound_evicts_and_refuses_an_entry_over_it():
    one = size_of(turns("x" * 100))
    store = ResponseStore(max_entries=100, max_bytes=2 * one)
    for i in range(3):
        assert store.put("", f"r{i}", turns("x" * 100))
    assert store.get("", "r0") is None and store.used == 2 * one
    assert not store.put("", "big", turns("x" * 3 * one)) and store.get("", "big") is None


def test_kept_media_are_references():
    kept = as_references([Turn("user", (ImageContent(b"png", None, "input[0].content[0]"), TextContent("hi")))])
    image = kept[0].parts[0]
    assert image.data is None and image.uploaded_sha256 == hashlib.sha256(b"png").hexdigest()


def test_media_aliases_are_per_tenant_and_bounded():
    aliases = MediaAliases(max_entries=2)
    aliases.register("a", "cat", "1" * 64)
    aliases.register("a", "dog", "2" * 64)
    assert aliases.lookup("b", "cat") is None and aliases.lookup("a", "cat") == "1" * 64
    aliases.register("a", "owl", "3" * 64)  # evicts dog, the least recently used
    assert aliases.lookup("a", "dog") is None and len(aliases) == 2


@pytest.mark.parametrize(
    ("value", "expected"),
    [("sha256:" + "ab" * 32, ("ab" * 32, None)), ("img-1.v2:x/y", (None, "img-1.v2:x/y"))],
)
def test_uuid_forms(value, expected):
    assert parse_uuid(value) == expected


@pytest.mark.parametrize("value", ["", "a b", "x" * 257, "sha256:ABC", "naïve"])
def test_bad_uuids_are_refused(value):
    with pytest.raises(BadUuid):
        parse_uuid(value)
