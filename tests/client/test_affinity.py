"""Replica affinity, uploads through any balancer, replica failure and the channel knobs: the SDK against several
in-process fake Generation servers on one multi-address target (gRPC's own balancers, no model)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import grpc
import pytest
from PIL import Image

from mmcast_client import AsyncClient, Backoff, Client, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from mmcast_client.affinity import AFFINITY_HEADER, RING_HASH_SERVICE_CONFIG, conversation_key, session_key
from mmcast_client.testing import FakeGenerationServer
from mmcast_local.child_processes import free_ports

FAST = Backoff(initial=0.01, maximum=0.05, jitter=0.0)
ROUND_ROBIN = [("grpc.lb_policy_name", "round_robin")]


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (seed % 256, seed // 256 % 256, 7)).save(buffer, format="PNG")
    return buffer.getvalue()


def target_of(servers) -> str:
    return "ipv4:" + ",".join(s.target for s in servers)


def keys_seen(server) -> list[str]:
    """The affinity header of every call `server` received, in order ("" for a call without one)."""
    return [dict(md).get(AFFINITY_HEADER, "") for md in server.metadata]


def backends_of(servers, key: str) -> set[int]:
    return {i for i, s in enumerate(servers) if key in keys_seen(s)}


@pytest.fixture
def replicas():
    servers = [FakeGenerationServer().start() for _ in range(3)]
    yield servers
    for s in servers:
        s.stop()


def conversation(client: Client, n: int, turns: int, **kwargs) -> list:
    """`turns` turns of conversation `n`, a new image each turn; returns the results."""
    history, results = [], []
    for t in range(turns):
        image = png(100 * n + t)
        history.append({"role": "user", "content": [{"type": "image", "image": image}, f"conversation {n} turn {t}"]})
        result = client.generate(history, max_tokens=2, **kwargs)
        history.append({"role": "assistant", "content": result.text})
        results.append(result)
    return results


# -- affinity -------------------------------------------------------------------------------------------------------
def test_a_conversations_calls_land_on_one_replica_and_conversations_spread(replicas):
    with Client(target_of(replicas), backoff=FAST, timeout=30) as client:
        for n in range(24):
            conversation(client, n, turns=3)
    per_key: dict[str, set[int]] = {}
    for i, server in enumerate(replicas):
        for key in keys_seen(server):
            per_key.setdefault(key, set()).add(i)
    keys = set(per_key)
    assert len(keys) == 24 and "" not in keys  # one key per conversation, on every call (uploads included)
    assert all(len(where) == 1 for where in per_key.values()), per_key  # each conversation on one replica
    assert len({next(iter(w)) for w in per_key.values()}) == 3  # and the conversations use every replica
    for server in replicas:  # every upload a replica received is referenced there: nothing was missing
        assert not any(server.cancelled) and len(server.uploads) == len(set(server.uploads))
    assert sum(len(s.requests) for s in replicas) == 24 * 3  # no retries: every image was where it was needed


def test_the_key_is_the_first_user_message_and_session_id_overrides_it(replicas):
    first = {"role": "user", "content": [{"type": "image", "image": png(1)}, "hello"]}
    with Client(target_of(replicas), backoff=FAST) as client:
        a = client.generate([{"role": "system", "content": "be brief"}, first], max_tokens=1, stream=True)
        b = client.generate(
            [first, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}],
            max_tokens=1,
            stream=True,
        )
        c = client.generate([first], max_tokens=1, session_id="user-42", stream=True)
        for s in (a, b, c):
            list(s)
    assert a.affinity_key == b.affinity_key == conversation_key([("image", _sha(png(1))), "hello"])
    assert c.affinity_key == session_key("user-42") != a.affinity_key
    assert len(backends_of(replicas, session_key("user-42"))) == 1


def test_a_header_given_in_metadata_wins(replicas):
    with Client(target_of(replicas), metadata=[(AFFINITY_HEADER, "mine")]) as client:
        client.generate("x", max_tokens=1)
        client.generate("y", max_tokens=1)
    assert len(backends_of(replicas, "mine")) == 1


def test_round_robin_with_uploads_never_shows_not_found(replicas):
    """Uploads and generates of one turn land on different replicas; the missed reference is retried inline."""
    with Client(target_of(replicas), options=ROUND_ROBIN, backoff=FAST, timeout=30) as client:
        for n in range(6):
            results = conversation(client, n, turns=4)
            assert [r.finish_reason for r in results] == ["length"] * 4
    served = [len(s.requests) for s in replicas]
    assert all(served), served  # round robin spread the calls
    assert sum(served) > 24  # some generates missed an upload and were retried with the images inline
    inline = [r for s in replicas for r in s.requests if any(p.image.data for m in r.messages for p in m.content)]
    assert inline


def test_an_inline_retry_too_large_for_the_client_says_which_setting(replicas):
    big = [os.urandom(100_000) for _ in range(2)]  # the fake only stores and references bytes, never decodes them
    with Client(replicas[0].target, backoff=FAST, max_message_bytes=150_000) as client:
        for image in big:  # each upload fits; both images inline in one request would not
            client.upload_image(image)
        replicas[0].stored.clear()
        with pytest.raises(ResourceExhausted) as info:
            client.generate("x", images=big, max_tokens=1)
    assert "max_message_bytes=150000" in info.value.message and "--max-request-bytes" in info.value.message


# -- replica failure ------------------------------------------------------------------------------------------------
def test_a_dead_replicas_conversations_move_on_and_come_back(replicas):
    with Client(target_of(replicas), backoff=FAST, timeout=30) as client:
        streams = [client.generate(f"conversation {n}", max_tokens=1, stream=True) for n in range(12)]
        for s in streams:
            list(s)
        home = {s.affinity_key: backends_of(replicas, s.affinity_key) for s in streams}
        assert all(len(h) == 1 for h in home.values())
        victim = next(iter(home[streams[0].affinity_key]))
        port = replicas[victim].port
        replicas[victim].stop()
        for n in range(len(streams)):  # every conversation continues; the victim's on the ring's next replica
            assert client.generate(f"conversation {n}", max_tokens=1).finish_reason == "length"
        moved = [s.affinity_key for s in streams if home[s.affinity_key] == {victim}]
        assert moved
        for key in moved:
            assert len(backends_of(replicas, key) - {victim}) == 1
        # The replica returns at the same address: once gRPC reconnects, the ring gives its conversations back.
        replicas[victim] = FakeGenerationServer(port=port).start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and set(keys_seen(replicas[victim])) != set(moved):
            for n in range(len(streams)):
                client.generate(f"conversation {n}", max_tokens=1)
            time.sleep(0.2)
        assert set(keys_seen(replicas[victim])) == set(moved)


def test_unavailable_after_the_first_token_carries_the_tokens(replicas):
    replicas[0].fail("Generate", grpc.StatusCode.UNAVAILABLE, "replica lost", after_tokens=2)
    with Client(replicas[0].target, backoff=FAST) as client:
        stream = client.generate("x", max_tokens=5, stream=True)
        got = []
        with pytest.raises(Unavailable) as info:
            for delta in stream:
                got.extend(delta.token_ids)
    assert list(info.value.token_ids) == got and len(got) == 2
    assert info.value.text == "".join(f"t{t} " for t in got) and "after 2 tokens" in info.value.message
    assert len(replicas[0].requests) == 1  # not retried


_SERVE = """
import sys, time
from mmcast_client.testing import FakeGenerationServer
server = FakeGenerationServer(token_delay=0.5).start()
print(server.target, flush=True)
time.sleep(120)
"""


def test_a_replica_killed_mid_stream_raises_unavailable_with_the_tokens_so_far():
    proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, text=True)
    try:
        target = proc.stdout.readline().strip()
        with Client(target, backoff=FAST, timeout=30) as client:
            stream = client.generate("x", max_tokens=20, stream=True)
            got = []
            with pytest.raises(Unavailable) as info:
                for delta in stream:
                    got.extend(delta.token_ids)
                    if len(got) == 1:
                        os.kill(proc.pid, signal.SIGKILL)
        assert list(info.value.token_ids) == got and len(got) >= 1 and stream.result is None
    finally:
        proc.kill()
        proc.wait()


# -- the channel knobs ----------------------------------------------------------------------------------------------
class _Recorder(grpc.UnaryStreamClientInterceptor, grpc.UnaryUnaryClientInterceptor):
    def __init__(self) -> None:
        self.methods: list[str] = []

    def intercept_unary_stream(self, continuation, details, request):
        self.methods.append(details.method)
        return continuation(details, request)

    def intercept_unary_unary(self, continuation, details, request):
        self.methods.append(details.method)
        return continuation(details, request)


def test_interceptors_see_every_call(replicas):
    recorder = _Recorder()
    with Client(replicas[0].target, interceptors=[recorder]) as client:
        client.get_server_info()
        client.generate("x", max_tokens=1)
    assert recorder.methods == ["/mmcast.v1.GenerationService/GetServerInfo", "/mmcast.v1.GenerationService/Generate"]


def test_a_callers_channel_is_used_as_is_and_left_open(replicas):
    channel = grpc.insecure_channel(replicas[1].target)
    with pytest.warns(UserWarning, match="ring_hash"), Client(channel=channel) as client:
        client.generate("x", max_tokens=1)
    assert len(replicas[1].requests) == 1
    grpc.channel_ready_future(channel).result(timeout=5)  # still open: the caller closes it
    channel.close()
    with pytest.raises(ValueError, match="tls"):
        Client(channel=grpc.insecure_channel(replicas[1].target), tls=True)


def test_wait_for_ready_queues_until_a_replica_starts():
    (port,) = free_ports(1)
    started: list[FakeGenerationServer] = []
    threading.Timer(0.5, lambda: started.append(FakeGenerationServer(port=port).start())).start()
    try:
        with Client(f"127.0.0.1:{port}", wait_for_ready=True, retries=0, timeout=20) as client:
            assert client.generate("x", max_tokens=1).finish_reason == "length"
    finally:
        time.sleep(0.6)
        for s in started:
            s.stop()


def test_async_client_has_the_same_knobs(replicas):
    recorded: list[str] = []

    class Recorder(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            recorded.append(details.method.decode() if isinstance(details.method, bytes) else details.method)
            return await continuation(details, request)

    async def run():
        async with AsyncClient(target_of(replicas), interceptors=[Recorder()], wait_for_ready=True) as client:
            keys = []
            for n in range(6):
                s = await client.generate(f"c{n}", max_tokens=1, stream=True)
                async for _ in s:
                    pass
                await client.generate(f"c{n}", max_tokens=1)
                keys.append(s.affinity_key)
            return keys

    keys = asyncio.run(run())
    assert recorded == ["/mmcast.v1.GenerationService/Generate"] * 12
    assert all(len(backends_of(replicas, k)) == 1 for k in keys)


def test_sdk_sets_the_ring_hash_variable_and_warns_when_it_is_off():
    probe = (
        "import os, warnings\n"
        "warnings.simplefilter('error')\n"
        "from mmcast_client import Client\n"
        "try:\n"
        "    Client('127.0.0.1:1')\n"
        "    print('ok', os.environ.get('GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY'))\n"
        "except RuntimeWarning as w:\n"
        "    print('warned', w)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok true"
    env["GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"] = "false"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("warned") and "round-robin" in out.stdout


def test_the_documented_service_config_is_what_grpc_accepts(replicas):
    """The config DEPLOYMENT.md gives for callers' own channels routes one key to one replica."""
    channel = grpc.insecure_channel(target_of(replicas), options=[("grpc.service_config", RING_HASH_SERVICE_CONFIG)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        client = Client(channel=channel)
    for n in range(5):
        client.generate(f"n{n}", max_tokens=1, session_id="one")
    channel.close()
    assert len(backends_of(replicas, session_key("one"))) == 1 and sum(len(s.requests) for s in replicas) == 5


def test_a_missing_image_without_bytes_still_reports_not_found(replicas):
    with Client(target_of(replicas), backoff=FAST) as client, pytest.raises(NotFound):
        client.generate(
            [{"role": "user", "content": [{"type": "image", "image": "sha256:" + "cd" * 32}]}], max_tokens=1
        )


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def test_bad_session_id_and_conflicting_channel_arguments_are_refused(replicas):
    with Client(replicas[0].target) as client, pytest.raises(InvalidArgument, match="session_id"):
        client.generate("x", max_tokens=1, session_id="")

    async def run():
        channel = grpc.aio.insecure_channel(replicas[0].target)
        try:
            with pytest.raises(ValueError, match="interceptors"):
                AsyncClient(channel=channel, interceptors=[object()])
        finally:
            await channel.close()

    asyncio.run(run())


def test_a_server_refusing_the_inline_retry_as_too_large_names_its_limit(replicas):
    image = png(7)
    with Client(replicas[0].target, backoff=FAST) as client:
        client.upload_image(image)
        replicas[0].fail("Generate", grpc.StatusCode.NOT_FOUND, f"uploaded_sha256={_sha(image)} is not in the store")
        limit = "the request carries 9999999 bytes; the limit is 1000 (--max-request-bytes)"
        replicas[0].fail("Generate", grpc.StatusCode.RESOURCE_EXHAUSTED, limit)
        with pytest.raises(ResourceExhausted) as info:
            client.generate("x", images=[image], max_tokens=1)
    message = info.value.message
    assert "lacked an uploaded image" in message and "--max-request-bytes" in message and _sha(image) in message


def test_async_stream_failing_after_tokens_carries_them(replicas):
    replicas[0].fail("Generate", grpc.StatusCode.UNAVAILABLE, "replica lost", after_tokens=3)

    async def run():
        async with AsyncClient(replicas[0].target, backoff=FAST) as client:
            stream = await client.generate("x", max_tokens=6, stream=True)
            got = []
            with pytest.raises(Unavailable) as info:
                async for delta in stream:
                    got.extend(delta.token_ids)
            return got, info.value

    got, error = asyncio.run(run())
    assert len(got) == 3 and list(error.token_ids) == got and len(replicas[0].requests) == 1
