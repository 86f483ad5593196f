"""The SDK's conventions: gRPC's own retries and health checking, default deadlines, the token-over-plaintext
warning, one `logprobs` parameter. Against the in-process fake server (mmcast_client/testing.py)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import warnings

import grpc
import pytest
from grpc_health.v1 import health_pb2

from mmcast_client import (
    DEFAULT_TIMEOUT,
    AsyncClient,
    Backoff,
    Client,
    DeadlineExceeded,
    InsecureTokenWarning,
    InvalidArgument,
    Unavailable,
)
from mmcast_client._core import GENERATION_SERVICE, is_loopback_target
from mmcast_client.affinity import AFFINITY_HEADER
from mmcast_client.testing import FakeGenerationServer

FAST = Backoff(initial=0.01, maximum=0.05)


@pytest.fixture
def fake():
    with FakeGenerationServer() as server:
        yield server


def service_config(client: Client) -> dict | None:
    configs = [v for k, v in client.settings.options if k == "grpc.service_config"]
    return json.loads(configs[-1]) if configs else None


# -- retries: the channel's service config -----------------------------------------------------------------------------
def test_the_retry_policy_joins_the_ring_hash_config():
    with Client("127.0.0.1:1", retries=2, backoff=Backoff(initial=0.2, maximum=3.0, multiplier=1.5)) as c:
        config = service_config(c)
    assert config["loadBalancingConfig"] == [{"ring_hash_experimental": {"requestHashHeader": AFFINITY_HEADER}}]
    assert config["healthCheckConfig"] == {"serviceName": GENERATION_SERVICE}
    assert config["methodConfig"] == [
        {
            "name": [{}],
            "retryPolicy": {
                "maxAttempts": 3,
                "initialBackoff": "0.200s",
                "maxBackoff": "3.000s",
                "backoffMultiplier": 1.5,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
    with Client("127.0.0.1:1", retries=0) as c:
        assert "methodConfig" not in service_config(c)  # gRPC needs maxAttempts >= 2: no policy at all
    # A caller's balancing policy keeps the SDK's retries; a caller's whole service config replaces the SDK's.
    with Client("127.0.0.1:1", options=[("grpc.lb_policy_name", "round_robin")]) as c:
        config = service_config(c)
        assert "loadBalancingConfig" not in config and config["methodConfig"][0]["retryPolicy"]["maxAttempts"] == 4
    mine = json.dumps({"loadBalancingConfig": [{"pick_first": {}}]})
    with Client("127.0.0.1:1", options=[("grpc.service_config", mine)]) as c:
        assert service_config(c) == json.loads(mine)


def test_retries_beyond_grpcs_limit_are_refused_naming_the_alternative():
    with pytest.raises(ValueError, match=r"retries=5 must be an integer in \[0, 4\].*wait_for_ready=True"):
        Client("127.0.0.1:1", retries=5)
    with pytest.raises(ValueError, match="backoff initial=0"):
        Backoff(initial=0)
    with pytest.warns(DeprecationWarning, match="jitter"):
        Backoff(jitter=0.1)


def test_a_large_upload_is_retried_by_grpc(fake):
    """gRPC replays a call's request messages only from its retry buffer (256 KiB by default); the SDK sizes it to
    max_message_bytes, so a multi-chunk upload is retried too."""
    fake.fail("UploadImage", grpc.StatusCode.UNAVAILABLE, "restarting")
    image = bytes(range(256)) * (12 << 10)  # 3 MiB: three chunks
    with Client(fake.target, backoff=FAST) as c:
        ref = c.upload_image(image)
    assert fake.uploads == [ref.removeprefix("sha256:")] and len(fake.upload_chunks[-1]) == 3


def test_an_upload_that_arrives_altered_is_sent_once_more_from_the_start(fake):
    """A client stream replayed by gRPC's retry under load once reached the server with other bytes than sent; the
    server's sha256 check refuses it naming expected_sha256, and the SDK sends the upload once more (not twice)."""
    image = random.Random(0).randbytes(3 << 20)  # three distinct 1 MiB chunks
    fake.fail("UploadImage", grpc.StatusCode.OK, "", reorder=True)
    with Client(fake.target, backoff=FAST) as c:
        ref = c.upload_image(image)
    assert fake.uploads == [ref.removeprefix("sha256:")] and len(fake.stored[fake.uploads[0]]) == len(image)
    fake.fail("UploadImage", grpc.StatusCode.OK, "", reorder=True)
    fake.fail("UploadImage", grpc.StatusCode.OK, "", reorder=True)
    with Client(fake.target, backoff=FAST) as c, pytest.raises(InvalidArgument, match="expected_sha256") as info:
        c.upload_image(image[::-1], force=True)
    assert [v.field for v in info.value.field_violations] == ["expected_sha256"] and len(fake.uploads) == 1
    assert len(fake.upload_chunks) == 1  # the refused attempts stored nothing

    async def async_upload():
        async with AsyncClient(fake.target, backoff=FAST) as c:
            return await c.upload_image(image + b"async")

    fake.fail("UploadImage", grpc.StatusCode.OK, "", reorder=True)
    ref = asyncio.run(async_upload())
    assert fake.uploads[-1] == ref.removeprefix("sha256:") and fake.stored[fake.uploads[-1]] == image + b"async"


def test_a_retried_stream_is_not_retried_once_it_answered(fake):
    fake.fail("Generate", grpc.StatusCode.UNAVAILABLE, "blip")
    fake.fail("Generate", grpc.StatusCode.UNAVAILABLE, "lost", after_tokens=1)
    with Client(fake.target, backoff=FAST) as c, pytest.raises(Unavailable, match="lost") as info:
        c.generate("x", max_tokens=3)
    assert len(fake.requests) == 2 and len(info.value.token_ids) == 1


def test_a_not_serving_server_fails_fast_or_is_waited_for(fake):
    """The channel watches grpc.health.v1 for the generation service, as the scheduler reports it (NOT_SERVING
    while its worker group is down or it drains)."""
    fake.health.set(GENERATION_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    with Client(fake.target, retries=1, backoff=FAST) as c:
        with pytest.raises(Unavailable, match="NOT_SERVING.*wait_for_ready=True"):
            c.generate("x", max_tokens=1)
    assert fake.requests == []  # refused by the channel, not sent
    with Client(fake.target, wait_for_ready=True) as c:
        threading.Timer(0.5, fake.health.set, (GENERATION_SERVICE, health_pb2.HealthCheckResponse.SERVING)).start()
        started = time.monotonic()
        assert len(c.generate("x", max_tokens=2).token_ids) == 2
        assert time.monotonic() - started >= 0.4


# -- deadlines ---------------------------------------------------------------------------------------------------------
def test_the_first_token_deadline_cancels_a_silent_stream():
    with FakeGenerationServer(token_delay=1.0) as slow:
        with Client(slow.target, first_token_timeout=0.2) as c:
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="first_token_timeout=0.2") as info:
                c.generate("x", max_tokens=3, request_id="silent")
            assert time.monotonic() - started < 0.9 and info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            # per call: another limit, or none
            with pytest.raises(DeadlineExceeded, match="first_token_timeout=0.1"):
                c.generate("x", max_tokens=3, first_token_timeout=0.1)
            assert len(c.generate("x", max_tokens=1, first_token_timeout=None).token_ids) == 1
        for _ in range(100):
            if "silent" in slow.cancelled:
                break
            time.sleep(0.02)
        assert "silent" in slow.cancelled  # the server freed the request


def test_the_first_token_deadline_async():
    async def run(target):
        async with AsyncClient(target, first_token_timeout=0.2) as c:
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="first_token_timeout=0.2"):
                await c.generate("x", max_tokens=3)
            elapsed = time.monotonic() - started
            stream = await c.generate("x", max_tokens=1, stream=True, first_token_timeout=None)
            return elapsed, [d async for d in stream]

    with FakeGenerationServer(token_delay=1.0) as slow:
        elapsed, deltas = asyncio.run(run(slow.target))
    assert elapsed < 0.9 and len(deltas) == 1


def test_defaults_and_bad_values():
    with Client("127.0.0.1:1") as c:
        assert c.settings.unary_timeout == DEFAULT_TIMEOUT and c.settings.generate_timeout is None
    with Client("127.0.0.1:1", timeout=None) as c:
        assert c.settings.unary_timeout is None
    with pytest.raises(ValueError, match="first_token_timeout=0 must be > 0 seconds, or None"):
        Client("127.0.0.1:1", first_token_timeout=0)
    with Client("127.0.0.1:1") as c, pytest.raises(ValueError, match="timeout=-1"):
        c.generate("x", max_tokens=1, timeout=-1)


def test_get_server_info_honours_its_deadline():
    with Client("127.0.0.1:1", wait_for_ready=True) as c:  # nothing listens: the call waits until its deadline
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.get_server_info(timeout=0.3)
        assert time.monotonic() - started < 2.0


# -- the bearer token over plaintext -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "target, loopback",
    [
        ("127.0.0.1:50051", True),
        ("localhost:50051", True),
        ("ipv4:127.0.0.1:1,127.0.0.2:2", True),
        ("ipv6:[::1]:50051", True),
        ("dns:///localhost:50051", True),
        ("unix:/tmp/mmcast.sock", True),
        ("10.0.0.5:50051", False),
        ("ipv4:127.0.0.1:1,10.0.0.6:2", False),
        ("dns:///mmcast.ns.svc.cluster.local:50051", False),
        ("dns://8.8.8.8/localhost:50051", True),  # the authority is the DNS server; the host is local
        ("mmcast.example.com", False),
    ],
)
def test_loopback_targets(target, loopback):
    assert is_loopback_target(target) is loopback


def test_a_token_over_plaintext_to_another_host_warns():
    with pytest.warns(InsecureTokenWarning, match="plaintext channel.*tls=True") as caught:
        Client("10.0.0.5:50051", token="s3cret").close()
    assert caught[0].filename == __file__  # the warning points at the caller's line
    with pytest.warns(InsecureTokenWarning):
        Client("dns:///mmcast.example.com:443", metadata=[("Authorization", "Bearer x")]).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Client("127.0.0.1:50051", token="s3cret").close()  # loopback: exempt
        Client("10.0.0.5:50051", token="s3cret", tls=True).close()  # encrypted
        Client("10.0.0.5:50051").close()  # nothing secret to send


# -- logprobs ----------------------------------------------------------------------------------------------------------
def test_logprobs_none_zero_and_k(fake):
    with Client(fake.target) as c:
        assert c.generate("x", max_tokens=2).logprobs == ()
        assert not fake.requests[-1].sampling.return_logprobs
        sampled = c.generate("x", max_tokens=2, logprobs=0)
        assert fake.requests[-1].sampling.return_logprobs and fake.requests[-1].sampling.logprobs == 0
        assert len(sampled.logprobs) == 2 and sampled.logprobs[0].top_logprobs == ()
        top = c.generate("x", max_tokens=2, logprobs=1)
        assert fake.requests[-1].sampling.logprobs == 1 and len(top.logprobs[0].top_logprobs) == 1
        with pytest.raises(InvalidArgument, match="logprobs=-1"):
            c.generate("x", max_tokens=1, logprobs=-1)


def test_return_logprobs_still_works_with_a_deprecation_warning(fake):
    with Client(fake.target) as c:
        with pytest.warns(DeprecationWarning, match="return_logprobs= is deprecated") as caught:
            old = c.generate("x", max_tokens=2, return_logprobs=True)
        assert caught[0].filename == __file__  # the warning points at the caller's line
        assert len(old.logprobs) == 2 and fake.requests[-1].sampling.return_logprobs
        with pytest.warns(DeprecationWarning):
            assert c.generate("x", max_tokens=1, return_logprobs=False).logprobs == ()
        with pytest.warns(DeprecationWarning):
            c.generate("x", max_tokens=1, return_logprobs=False, logprobs=2)  # top-k implied them before too
        assert fake.requests[-1].sampling.return_logprobs and fake.requests[-1].sampling.logprobs == 2

    async def run():
        async with AsyncClient(fake.target) as c:
            with pytest.warns(DeprecationWarning) as caught:
                result = await c.generate("x", max_tokens=2, return_logprobs=True)
            return result, caught[0].filename

    result, filename = asyncio.run(run())
    assert len(result.logprobs) == 2 and filename == __file__
