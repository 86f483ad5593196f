"""The SDK's image bookkeeping stays bounded in a long-running client, and stays correct at its bounds."""

from __future__ import annotations

import hashlib

import pytest

from mmcast_client import Client, ImageStore, NotFound
from mmcast_client.testing import FakeGenerationServer

N_IMAGES = 10_000
BOUND = 200
BLOB_BYTES = 64 << 10


def image_bytes(i: int) -> bytes:
    return b"mmcast-test-image-" + i.to_bytes(4, "little") * 64  # 274 distinct bytes; the fake does not decode


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake():
    with FakeGenerationServer() as server:
        yield server


def test_maps_stay_bounded_over_10000_distinct_images(fake, tmp_path):
    store = ImageStore(resend_cache_bytes=BLOB_BYTES, max_images=BOUND)
    paths = []
    with Client(fake.target, image_store=store) as client:
        # 10,000 distinct images through the client's own bookkeeping, as generate() and upload_image() use it
        # (resolve, load for the upload, record it as held); the first images also through real uploads.
        for i in range(N_IMAGES):
            data = image_bytes(i)
            if i % 2:  # half from files (the file-hash and path maps), half as bytes (the resend cache)
                path = tmp_path / f"{i}.png"
                path.write_bytes(data)
                paths.append(path)
                image = path
            else:
                image = data
            if i < 2 * BOUND:
                assert client.upload_image(image) == "sha256:" + sha(data)
            else:
                ref = store.resolve(image, "image")
                assert ref.sha256 == sha(data) and store.load(ref) == data
                store.mark_held(ref.sha256)
            if i % 1000 == 999:
                sizes = store.sizes()
                assert max(sizes["held"], sizes["file_sha"], sizes["paths"]) <= BOUND, (i, sizes)
                assert sizes["blob_bytes"] <= BLOB_BYTES and sizes["pil"] == 0, (i, sizes)
        assert len(fake.uploads) == 2 * BOUND
        sizes = store.sizes()
        assert sizes["held"] == sizes["file_sha"] == sizes["paths"] == BOUND

        # Recent images are still known: not uploaded again.
        recent = paths[-1]
        client.upload_image(recent)
        client.upload_image(image_bytes(N_IMAGES - 2))
        assert len(fake.uploads) == 2 * BOUND
        # An image that fell out of the record is uploaded again (a server that still has it says already_present).
        client.upload_image(paths[0])
        assert fake.uploads[-1] == sha(paths[0].read_bytes()) and len(fake.uploads) == 2 * BOUND + 1

        # A recent file the server lost is re-sent inline from its path on NOT_FOUND ...
        recent_ref = "sha256:" + sha(recent.read_bytes())
        fake.stored.clear()
        result = client.generate([{"role": "user", "content": [{"type": "image", "image": recent_ref}]}], max_tokens=1)
        assert result.usage.images == 1 and fake.requests[-1].messages[0].content[0].image.data
        # ... while an old bare reference, whose bytes and path fell out of the bounded maps, reaches the caller as
        # the server's NOT_FOUND (the documented limit), rather than the SDK holding every path forever.
        old_ref = "sha256:" + sha(paths[1].read_bytes())
        with pytest.raises(NotFound):
            client.generate([{"role": "user", "content": [{"type": "image", "image": old_ref}]}], max_tokens=1)
    assert max(store.sizes()[k] for k in ("held", "file_sha", "paths")) <= BOUND


def test_lru_order_keeps_what_is_used(tmp_path):
    store = ImageStore(max_images=3)
    for name in "abcd":
        store.mark_held(name)
    assert not store.is_held("a") and store.is_held("b")  # "a" fell out; asking for "b" makes it recent
    store.mark_held("e")
    assert store.is_held("b") and not store.is_held("c")
    store.forget(["b"])
    assert not store.is_held("b") and store.sizes()["held"] == 2
    with pytest.raises(ValueError, match="max_images=0"):
        ImageStore(max_images=0)
