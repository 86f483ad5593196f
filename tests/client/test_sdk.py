"""The SDK against an in-process fake Generation server (no model, no workers)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import subprocess
import sys
import threading
import time

import grpc
import pytest
from PIL import Image

import mmcast_client
from mmcast.v1 import generation_pb2 as pb
from mmcast_client import (
    AlreadyExists,
    AsyncClient,
    Backoff,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    MmcastError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from mmcast_client.testing import FakeGenerationServer

FAST = Backoff(initial=0.01, maximum=0.05)


@pytest.fixture
def fake():
    with FakeGenerationServer() as server:
        yield server


@pytest.fixture
def client(fake):
    with Client(fake.target, backoff=FAST, timeout=30) as c:
        yield c


def png_bytes(colour=(255, 0, 0), size=(8, 6)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def parts(request: pb.GenerateRequest):
    """[(role, [("text", str) | ("data", sha) | ("ref", sha)])] of a request."""
    out = []
    for message in request.messages:
        items = []
        for part in message.content:
            if part.WhichOneof("part") == "text":
                items.append(("text", part.text))
            elif part.image.WhichOneof("source") == "data":
                items.append(("data", hashlib.sha256(part.image.data).hexdigest()))
            else:
                items.append(("ref", part.image.uploaded_sha256))
        out.append((message.role, items))
    return out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- messages -> proto ----------------------------------------------------------------------------------------------
def test_messages_roles_interleaving_and_image_kinds(fake, tmp_path):
    a, b = png_bytes((255, 0, 0)), png_bytes((0, 255, 0))
    path = tmp_path / "a.png"
    path.write_bytes(a)
    pil = Image.new("RGB", (5, 5), (0, 0, 255))
    with Client(fake.target, upload_images=False) as c:
        c.generate(
            [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "first"},
                        {"type": "image", "image": str(path)},
                        {"type": "text", "text": "then"},
                        {"type": "image", "image": b},
                        {"type": "image", "image": pil},
                        "tail",
                    ],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
                {"role": "user", "content": [{"type": "image", "path": path}]},
            ],
            max_tokens=2,
        )
    pil_sha = fake.requests[-1].messages[1].content[4].image.data
    got = parts(fake.requests[-1])
    assert got == [
        (pb.ROLE_SYSTEM, [("text", "be brief")]),
        (
            pb.ROLE_USER,
            [
                ("text", "first"),
                ("data", sha(a)),
                ("text", "then"),
                ("data", sha(b)),
                ("data", sha(pil_sha)),
                ("text", "tail"),
            ],
        ),
        (pb.ROLE_ASSISTANT, [("text", "ok")]),
        (pb.ROLE_USER, [("data", sha(a))]),
    ]
    assert Image.open(io.BytesIO(pil_sha)).format == "PNG"  # PIL images travel as PNG
    assert fake.uploads == []  # inline mode never uploads


def test_path_is_sent_as_is(fake, tmp_path):
    jpeg = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(jpeg, format="JPEG", quality=50)
    path = tmp_path / "x.jpg"
    path.write_bytes(jpeg.getvalue())
    with Client(fake.target, upload_images=False) as c:
        c.generate("hi", images=[path], max_tokens=1)
    assert fake.requests[-1].messages[0].content[0].image.data == jpeg.getvalue()


def test_prompt_shortcut_puts_images_first(client, fake):
    a, b = png_bytes((1, 2, 3)), png_bytes((4, 5, 6))
    client.generate("describe", images=[a, b], max_tokens=1)
    assert parts(fake.requests[-1]) == [(pb.ROLE_USER, [("ref", sha(a)), ("ref", sha(b)), ("text", "describe")])]
    client.generate("plain text", max_tokens=1)
    assert parts(fake.requests[-1]) == [(pb.ROLE_USER, [("text", "plain text")])]


def test_sampling_and_request_fields(client, fake):
    client.generate(
        "x",
        max_tokens=5,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=42,
        stop="END",
        stop_token_ids=[7, 8],
        ignore_eos=True,
        logprobs=3,
        request_id="req-1",
        cache_salt="tenant-a",
    )
    r = fake.requests[-1]
    assert r.request_id == "req-1" and r.cache_salt == "tenant-a" and not r.continue_final_message
    s = r.sampling
    assert (s.max_tokens, s.seed, list(s.stop), list(s.stop_token_ids), s.ignore_eos, s.logprobs) == (
        5, 42, ["END"], [7, 8], True, 3,
    )  # fmt: skip
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9) and s.top_k == 40
    assert s.return_logprobs  # top-k alternatives imply per-token log-probabilities
    client.generate("x", max_tokens=1)
    assert fake.requests[-1].request_id  # the SDK names every request, so retries and logs can refer to it
    assert fake.requests[-1].sampling.top_k == 0  # the default: no top-k cut


def test_top_k_none_and_zero_are_no_cut_and_bad_values_are_refused_locally(client, fake):
    for off in (None, 0):
        client.generate("x", max_tokens=1, top_k=off)
        assert fake.requests[-1].sampling.top_k == 0
    sent = len(fake.requests)
    for bad in (-1, 1.5, True, "5", 2**32):
        with pytest.raises(InvalidArgument, match=f"top_k={bad!r} must be None, 0"):
            client.generate("x", max_tokens=1, top_k=bad)
    assert len(fake.requests) == sent  # refused before any call


def test_cli_generate_sends_top_k(fake, capsys):
    from mmcast_client import cli

    assert cli.main(["generate", "x", "--target", fake.target, "--max-tokens", "1", "--top-k", "5"]) == 0
    assert fake.requests[-1].sampling.top_k == 5
    assert cli.main(["generate", "x", "--target", fake.target, "--max-tokens", "1"]) == 0
    assert fake.requests[-1].sampling.top_k == 0


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([], "messages is empty"),
        ([{"role": "robot", "content": "x"}], "messages[0].role='robot'"),
        ([{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}], "messages[0].content[0].type='audio'"),
        ([{"role": "user", "content": [{"type": "video"}]}], "a video part needs 'video'"),
        ([{"role": "user", "content": [{"type": "video", "video": "v.mp4", "fps": 0}]}], "fps=0 must be a number > 0"),
        ([{"role": "user", "content": [{"type": "image"}]}], "needs 'image'"),
        ([{"role": "user", "content": [{"type": "image", "image": "sha256:xyz"}]}], "64 hex digits"),
        ([{"role": "user", "content": [{"type": "image", "image": "/no/such/file.png"}]}], "cannot read image file"),
        ([{"role": "user", "content": [{"type": "image", "image": "https://x/y.png"}]}], "does not fetch URLs"),
        ([{"role": "user", "content": [{"type": "image", "image": 3.5}]}], "unsupported image of type float"),
    ],
)
def test_bad_messages_raise_invalid_argument_naming_the_field(client, fake, messages, fragment):
    with pytest.raises(InvalidArgument) as info:
        client.generate(messages, max_tokens=1)
    assert fragment in info.value.message
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(info.value, ValueError)
    assert fake.requests == []  # nothing was sent


def test_max_tokens_is_checked_locally(client):
    with pytest.raises(InvalidArgument, match="max_tokens=0"):
        client.generate("x", max_tokens=0)


# -- uploads ----------------------------------------------------------------------------------------------------------
def test_image_uploaded_once_then_referenced_by_hash(client, fake, tmp_path):
    image = png_bytes((9, 9, 9))
    path = tmp_path / "i.png"
    path.write_bytes(image)
    client.generate("one", images=[image], max_tokens=1)
    client.generate("two", images=[path, image], max_tokens=1)  # same bytes from a path: no new upload
    pil = Image.new("RGB", (3, 3))
    client.generate("three", images=[pil], max_tokens=1)
    client.generate("four", images=[pil], max_tokens=1)  # the same PIL object: encoded and uploaded once
    assert fake.uploads == [sha(image), fake.uploads[1]]
    assert parts(fake.requests[1])[0][1][:2] == [("ref", sha(image)), ("ref", sha(image))]
    assert all(item[0] != "data" for r in fake.requests for _, items in parts(r) for item in items)


def test_upload_image_returns_a_reference_usable_in_messages(client, fake):
    image = png_bytes((7, 7, 7))
    ref = client.upload_image(image)
    assert ref == "sha256:" + sha(image)
    client.generate([{"role": "user", "content": [{"type": "image", "image": ref}]}], max_tokens=1)
    assert fake.uploads == [sha(image)]
    assert parts(fake.requests[-1]) == [(pb.ROLE_USER, [("ref", sha(image))])]


def test_large_image_uploads_in_1mib_chunks(client, fake):
    big = bytes(range(256)) * (10 * 1024)  # 2.5 MiB
    client.upload_image(big)
    (chunks,) = fake.upload_chunks
    assert [n for n, _ in chunks] == [1 << 20, 1 << 20, len(big) - (2 << 20)]
    assert [h for _, h in chunks] == [sha(big), "", ""]  # the expected hash rides on the first chunk only


def test_not_found_is_retried_once_with_the_images_inline(client, fake):
    image = png_bytes((1, 1, 1))
    client.generate("a", images=[image], max_tokens=2)
    fake.stored.clear()  # the server lost it (eviction, restart, or another replica served the request)
    result = client.generate("b", images=[image], max_tokens=2)
    assert result.finish_reason == "length"
    # No separate upload RPC (it could land on another replica): the same Generate again, the bytes inline.
    assert fake.uploads == [sha(image)]
    assert [r.messages[0].content[1].text for r in fake.requests] == ["a", "b", "b"]
    assert parts(fake.requests[1])[0][1][0] == ("ref", sha(image))
    assert parts(fake.requests[2])[0][1][0] == ("data", sha(image))
    # The client no longer counts the image as held: the next request uploads it again first.
    client.generate("c", images=[image], max_tokens=2)
    assert fake.uploads == [sha(image), sha(image)]
    assert parts(fake.requests[3])[0][1][0] == ("ref", sha(image))


def test_unknown_hash_without_bytes_raises_not_found_with_server_message(client, fake):
    ref = "sha256:" + "ab" * 32
    with pytest.raises(NotFound) as info:
        client.generate([{"role": "user", "content": [{"type": "image", "image": ref}]}], max_tokens=1)
    assert "ab" * 32 in info.value.message and info.value.code == grpc.StatusCode.NOT_FOUND
    assert len(fake.requests) == 1  # no bytes to resend, so no retry


def test_not_found_twice_is_raised(client, fake):
    image = png_bytes((2, 2, 2))
    client.upload_image(image)
    fake.fail("Generate", grpc.StatusCode.NOT_FOUND, "gone")
    fake.fail("Generate", grpc.StatusCode.NOT_FOUND, "gone again")
    with pytest.raises(NotFound, match="gone again"):
        client.generate("x", images=[image], max_tokens=1)
    assert len(fake.requests) == 2


# -- retries, errors, deadlines ---------------------------------------------------------------------------------------
def test_unavailable_is_retried_before_the_first_token(fake):
    fake.fail("Generate", grpc.StatusCode.UNAVAILABLE, "warming up")
    fake.fail("Generate", grpc.StatusCode.UNAVAILABLE, "warming up")
    with Client(fake.target, backoff=Backoff(initial=0.05, multiplier=2.0)) as c:
        result = c.generate("x", max_tokens=3)
    assert len(result.token_ids) == 3 and len(fake.requests) == 3  # gRPC's retries, one request id throughout
    assert len({r.request_id for r in fake.requests}) == 1


def test_unavailable_retries_are_bounded(fake):
    for _ in range(3):
        fake.fail("Generate", grpc.StatusCode.UNAVAILABLE, "down")
    with Client(fake.target, retries=2, backoff=FAST) as c, pytest.raises(Unavailable, match="down") as info:
        c.generate("x", max_tokens=1)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert len(fake.requests) == 3  # one attempt + two retries


def test_unavailable_after_a_token_is_not_retried(client, fake):
    fake.fail("Generate", grpc.StatusCode.UNAVAILABLE, "rank lost", after_tokens=2)
    stream = client.generate("x", max_tokens=5, stream=True)
    got = []
    with pytest.raises(Unavailable, match="rank lost"):
        for delta in stream:
            got.append(delta)
    assert len(got) == 2 and len(fake.requests) == 1 and stream.result is None


def test_unreachable_server_raises_unavailable_after_retries():
    with Client("127.0.0.1:1", retries=1, backoff=FAST) as c, pytest.raises(Unavailable):
        c.generate("x", max_tokens=1)


@pytest.mark.parametrize(
    "code, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.ALREADY_EXISTS, AlreadyExists),
        (grpc.StatusCode.DATA_LOSS, MmcastError),
    ],
)
def test_status_codes_become_typed_exceptions(client, fake, code, cls):
    fake.fail("Generate", code, "sampling.max_tokens=99999 exceeds max_model_len=4096")
    with pytest.raises(cls) as info:
        client.generate("x", max_tokens=1)
    assert info.value.code == code
    assert info.value.message == "sampling.max_tokens=99999 exceeds max_model_len=4096"
    assert len(fake.requests) == 1  # only UNAVAILABLE is retried


def test_final_error_message_raises(client, fake):
    fake.fail("Generate", grpc.StatusCode.INTERNAL, "rank 1 failed", final_error=True)
    with pytest.raises(mmcast_client.Internal, match="rank 1 failed") as info:
        client.generate("x", max_tokens=2)
    assert info.value.code == grpc.StatusCode.INTERNAL


def test_deadline_exceeded():
    with FakeGenerationServer(token_delay=0.2) as slow, Client(slow.target) as c:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            c.generate("x", max_tokens=20, timeout=0.3)
        assert time.monotonic() - started < 2.0
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(DeadlineExceeded):  # the client-wide setting applies too
            Client(slow.target, timeout=0.3).generate("x", max_tokens=20)
        # Not given, the client bounds unary calls (DEFAULT_TIMEOUT) and the first token, not a whole generation.
        started = time.monotonic()
        assert len(Client(slow.target, first_token_timeout=0.5).generate("x", max_tokens=5).token_ids) == 5
        assert time.monotonic() - started >= 0.9


def test_message_size_limit_is_enforced_on_send(fake):
    with Client(fake.target, upload_images=False, max_message_bytes=1 << 16) as c:
        with pytest.raises(ResourceExhausted):
            c.generate("x", images=[b"\xff" * (100 << 10)], max_tokens=1)


def test_token_is_sent_as_bearer_metadata(fake):
    with Client(fake.target, token="s3cret", metadata=[("x-tenant", "a")]) as c:
        c.get_server_info()
    assert ("authorization", "Bearer s3cret") in fake.metadata[-1] and ("x-tenant", "a") in fake.metadata[-1]


def test_tls_settings_make_a_secure_channel():
    c = Client("127.0.0.1:1", tls=True)
    assert c.settings.credentials is not None
    c.close()
    assert Client("127.0.0.1:1").settings.credentials is None


def test_get_server_info(client):
    info = client.get_server_info()
    assert info.model == "fake" and info.transfer_mode == "lazy" and info.group_ready


# -- results and streaming --------------------------------------------------------------------------------------------
def test_streaming_and_non_streaming_give_the_same_result(client, fake):
    image = png_bytes((3, 3, 3))
    kwargs = dict(images=[image], max_tokens=6, logprobs=1, seed=3)
    whole = client.generate("same", **kwargs)
    stream = client.generate("same", stream=True, **kwargs)
    deltas = list(stream)
    streamed = stream.result
    assert [t for d in deltas for t in d.token_ids] == list(whole.token_ids)
    assert "".join(d.text for d in deltas) == whole.text
    for field in ("token_ids", "text", "logprobs", "finish_reason", "usage"):
        assert getattr(streamed, field) == getattr(whole, field)
    assert whole.token_ids == tuple(fake.servicer.tokens_for(fake.requests[-1]))
    assert len(whole.logprobs) == 6 and whole.logprobs[0].top_logprobs[0].token_id == whole.token_ids[0]
    assert whole.usage.images == 1 and whole.usage.payload_bytes_full == 1000
    assert 0 < whole.ttft_seconds <= whole.total_seconds
    assert whole.finish_reason == "length"


def test_cancel_mid_stream_frees_the_request_on_the_server():
    with FakeGenerationServer(token_delay=0.05) as slow, Client(slow.target) as c:
        stream = c.generate("x", max_tokens=200, stream=True, request_id="to-cancel")
        next(stream)
        next(stream)
        stream.cancel()
        assert list(stream) == [] and stream.result is None and stream.cancelled
        deadline = time.monotonic() + 5
        while ("to-cancel" not in slow.cancelled or slow.active) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "to-cancel" in slow.cancelled and not slow.active


def test_leaving_a_stream_context_early_cancels_it():
    with FakeGenerationServer(token_delay=0.05) as slow, Client(slow.target) as c:
        with c.generate("x", max_tokens=200, stream=True, request_id="abandoned") as stream:
            next(stream)
        deadline = time.monotonic() + 5
        while "abandoned" not in slow.cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "abandoned" in slow.cancelled


def test_context_manager_closes_the_channel(fake):
    with Client(fake.target) as c:
        c.generate("x", max_tokens=1)
    assert c.closed
    with pytest.raises(ValueError, match="closed"):
        c.generate("x", max_tokens=1)


def test_threads_share_one_client(client, fake):
    images = [png_bytes((i, i, i)) for i in range(3)]
    errors = []

    def work(k):
        try:
            for j in range(3):
                r = client.generate(f"q{k}", images=[images[j], images[(j + k) % 3]], max_tokens=3)
                assert len(r.token_ids) == 3
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(fake.requests) == 24
    assert set(fake.uploads) == {sha(i) for i in images}


# -- asyncio ----------------------------------------------------------------------------------------------------------
def test_async_client_parity(fake):
    image = png_bytes((5, 5, 5))

    async def run():
        async with AsyncClient(fake.target, backoff=FAST) as c:
            whole = await c.generate("same", images=[image], max_tokens=4, logprobs=0)
            stream = await c.generate("same", images=[image], max_tokens=4, logprobs=0, stream=True)
            deltas = [d async for d in stream]
            fake.stored.clear()
            resent = await c.generate("again", images=[image], max_tokens=2)
            fake.fail("Generate", grpc.StatusCode.UNAVAILABLE, "blip")
            retried = await c.generate("retry", max_tokens=2, top_k=3)
            assert fake.requests[-1].sampling.top_k == 3
            fake.fail("Generate", grpc.StatusCode.RESOURCE_EXHAUSTED, "too big")
            with pytest.raises(ResourceExhausted, match="too big"):
                await c.generate("x", max_tokens=1)
            info = await c.get_server_info()
            ref = await c.upload_image(image)
            return whole, stream, deltas, resent, retried, info, ref

    whole, stream, deltas, resent, retried, info, ref = asyncio.run(run())
    assert stream.result.token_ids == whole.token_ids and stream.result.text == whole.text
    assert stream.result.logprobs == whole.logprobs and stream.result.usage == whole.usage
    assert [t for d in deltas for t in d.token_ids] == list(whole.token_ids)
    assert resent.finish_reason == "length" and fake.uploads == [sha(image), sha(image)]
    assert len(retried.token_ids) == 2
    assert info.model == "fake" and ref == "sha256:" + sha(image)
    # the same request through both clients gives the same answer
    with Client(fake.target) as c:
        assert c.generate("same", images=[image], max_tokens=4).token_ids == whole.token_ids


def test_async_deadline_and_cancel():
    async def run(target, slow):
        async with AsyncClient(target) as c:
            with pytest.raises(DeadlineExceeded):
                await c.generate("x", max_tokens=50, timeout=0.2)
            stream = await c.generate("x", max_tokens=200, stream=True, request_id="acancel")
            await stream.__anext__()
            stream.cancel()
            assert [d async for d in stream] == [] and stream.result is None
            for _ in range(250):
                if "acancel" in slow.cancelled:
                    break
                await asyncio.sleep(0.02)
        return c

    with FakeGenerationServer(token_delay=0.05) as slow:
        c = asyncio.run(run(slow.target, slow))
        assert c.closed and "acancel" in slow.cancelled


# -- packaging --------------------------------------------------------------------------------------------------------
def test_sdk_import_does_not_pull_torch_or_transformers():
    # Every module of the SDK, imported in a fresh interpreter of the dev environment (where all of these are
    # installed): none may reach the heavy or server-side packages, directly or through a helper. The clean-venv
    # test (tests/client/test_distribution.py) shows the same with nothing but the client distribution installed.
    code = (
        "import importlib, pkgutil, sys, mmcast_client\n"
        "for m in pkgutil.iter_modules(mmcast_client.__path__):\n"
        "    importlib.import_module('mmcast_client.' + m.name)\n"
        "heavy = ('torch', 'transformers', 'accelerate', 'common', 'scheduler_svc', 'worker_svc', 'mmcast_local')\n"
        "print(','.join(sorted(m for m in heavy if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported by the SDK: {out.stdout}"
