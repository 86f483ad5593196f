"""The scheduler service end to end against recording fake ranks: bytes on the wire per transfer mode,
recovery without repeated tokens, cancellation and deadlines, and the client-facing error codes."""

import threading
import time

import grpc
import pytest

from common import codec
from mmcast.v1 import generation_pb2 as g
from mmcast.v1 import generation_pb2_grpc as gg
from mmcast.v1 import worker_pb2
from tests.support.chat import IMG_A, IMG_B, IMG_C, generate, image, request, text, user
from tests.support.fake_rank import expected_tokens
from tests.support.service_harness import FakeGroupScheduler


def frames_of(rank, kind):
    return [f for f in rank.frames if worker_pb2.StepRequest.FromString(f).WhichOneof("frame") == kind]


@pytest.fixture
def harness(tiny_model_dir, request):
    opts = getattr(request, "param", {})
    h = FakeGroupScheduler(tiny_model_dir, **opts).start()
    yield h
    h.stop()


def conversation():
    turn1 = [user(image(IMG_A), image(IMG_B), text("describe both"))]
    answer = g.ChatMessage(role=g.ROLE_ASSISTANT, content=[text("a red and a green square")])
    turn2 = turn1 + [answer, user(image(IMG_C), text("and this one?"))]
    return turn1, turn2


@pytest.mark.parametrize("mode", ["full", "strip", "lazy"])
def test_wire_bytes_match_the_core_decisions_in_every_mode(tiny_model_dir, mode):
    h = FakeGroupScheduler(tiny_model_dir, n_ranks=2, transfer_mode=mode, encoder_placement="replicated").start()
    try:
        with grpc.insecure_channel(h.target) as ch:
            stub = gg.GenerationServiceStub(ch)
            turn1, turn2 = conversation()
            _, final1 = generate(stub, request(turn1))
            plans_turn1 = len(h.plans)
            _, final2 = generate(stub, request(turn2))
    finally:
        h.stop()
    # the same control bytes reached every rank
    assert frames_of(h.ranks[0], "control") == frames_of(h.ranks[1], "control")
    # each rank received exactly the payload frames of the items the core chose for it, in order
    for r, rank in enumerate(h.ranks):
        expected = []
        for _, _, rank_payloads in h.plans:
            for send in rank_payloads[r]:
                for name, tensor in send.fields:
                    expected += codec.payload_frames(send.identifier, name, tensor, chunk_size=1 << 20)
        assert frames_of(rank, "payload") == expected
    # the scheduler's counters equal what the ranks received, kind by kind
    sent = h.server.group.bytes
    for kind in ("payload", "metadata", "control"):
        assert getattr(sent, kind) == sum(rank.bytes_by_kind[kind] for rank in h.ranks), kind
    assert final2.usage.cached_tokens > 0 and final2.usage.images == 3
    turn2_sends = [s.identifier for _, _, rp in h.plans[plans_turn1:] for s in rp[0]]
    if mode == "full":
        assert len(turn2_sends) == 3  # every image again, cached or not
        assert final2.usage.images_sent == 6 and final2.usage.images_stripped == 0
    else:
        assert len(turn2_sends) == 1  # only the new image: the cached ones cost zero payload bytes
        assert final2.usage.images_sent == 2 and final2.usage.images_stripped == 4
        assert final2.usage.payload_bytes_saved > 0


def prompt_of(h, request_id):
    for rank in h.ranks[:1]:
        for raw in frames_of(rank, "control"):
            for req in worker_pb2.StepRequest.FromString(raw).control.new_requests:
                if req.request_id == request_id and req.num_output_tokens == 0:
                    return list(req.prompt_token_ids)
    raise AssertionError(f"{request_id} never admitted")


@pytest.mark.parametrize("harness", [{"rank_kw": {"step_delay": 0.01}}], indirect=True)
def test_recovery_after_a_dropped_stream_continues_without_repeats(harness):
    h = harness
    h.ranks[1].cfg.drop_once_after_steps = h.ranks[1].steps_answered + 4
    with grpc.insecure_channel(h.target) as ch:
        tokens, final = generate(
            gg.GenerationServiceStub(ch), request([user(image(IMG_A), text("hi"))], 12, request_id="rec-1")
        )
    assert h.server.metrics.group_recoveries._value.get() == 1
    assert len(h.ranks[0].handshakes) == 2  # reconnected under a new epoch
    assert tokens == expected_tokens(prompt_of(h, "rec-1"), 12)
    assert final.finish_reason == g.FINISH_REASON_LENGTH and final.usage.completion_tokens == 12
    # the fresh group needed the image again: sent once more, to its owner rank (sharded placement)
    assert final.usage.images_sent == 2 and final.usage.encoder_runs == 2, final.usage
    assert final.usage.preemptions == 1  # requeued once by the recovery


def gauges(h):
    stats = h.call(lambda: h.server.engine.core.stats)
    return stats.num_running, stats.num_waiting, stats.kv_blocks_used, len(h.server.engine.handles)


def wait_for(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.parametrize("harness", [{"rank_kw": {"step_delay": 0.02}}], indirect=True)
def test_cancellation_and_deadline_free_the_request(harness):
    h = harness
    with grpc.insecure_channel(h.target) as ch:
        stub = gg.GenerationServiceStub(ch)
        call = stub.Generate(request([user(image(IMG_A), text("long"))], 400))
        next(call)
        call.cancel()
        assert wait_for(lambda: gauges(h) == (0, 0, 0, 0)), gauges(h)
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, request([user(text("slow one"))], 400), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda: gauges(h) == (0, 0, 0, 0)), gauges(h)
        assert h.server.metrics.requests_running._value.get() == 0
        assert h.server.metrics.kv_blocks_used._value.get() == 0


@pytest.mark.parametrize(
    "harness",
    [{"rank_kw": {"step_delay": 0.02}, "max_waiting": 1, "max_num_seqs": 1, "max_images_per_request": 2}],
    indirect=True,
)
def test_error_codes_while_others_are_served(harness):
    h = harness
    results = {}
    with grpc.insecure_channel(h.target) as ch:
        stub = gg.GenerationServiceStub(ch)

        def good(name, rid):
            results[name] = generate(stub, request([user(text("a good request"))], 30, request_id=rid))

        first = threading.Thread(target=good, args=("first", "dup-1"))
        first.start()
        assert wait_for(lambda: gauges(h)[0] == 1)
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, request([user(text("same id"))], 3, request_id="dup-1"))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup-1" in err.value.details()
        second = threading.Thread(target=good, args=("second", "q-2"))
        second.start()
        assert wait_for(lambda: gauges(h)[1] == 1)
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, request([user(text("no room"))], 3))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-waiting" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, request([user(image(IMG_A), image(IMG_B), image(IMG_C), text("3 images"))], 3))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max-images-per-request" in err.value.details() and "content[2]" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, request([user(text("too long"))], 10**6))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, request([g.ChatMessage(role=g.ROLE_UNSPECIFIED, content=[text("x")])], 3))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].role" in err.value.details()
        ref = g.ContentPart(image=g.ImageInput(uploaded_sha256="0" * 64))
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, request([user(ref, text("unknown upload"))], 3))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "0000000000" in err.value.details()
        first.join(30)
        second.join(30)
    for name in ("first", "second"):
        tokens, final = results[name]
        assert len(tokens) == 30 and final.finish_reason == g.FINISH_REASON_LENGTH


@pytest.mark.parametrize(
    "harness", [{"group_deadline_seconds": 0.5, "reconnect_backoff_max_seconds": 0.2}], indirect=True
)
def test_group_down_past_the_deadline_fails_requests_with_unavailable(harness):
    h = harness
    for rank in h.ranks:
        rank.cfg.drop_once_after_steps = 0
        rank.cfg.refuse_handshake = "rank restarting"
    with grpc.insecure_channel(h.target) as ch:
        with pytest.raises(grpc.RpcError) as err:
            generate(gg.GenerationServiceStub(ch), request([user(text("anyone there?"))], 5))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "group" in err.value.details()
    for rank in h.ranks:
        rank.cfg.refuse_handshake = None
    assert wait_for(lambda: h.server.engine.ready, 10)
    with grpc.insecure_channel(h.target) as ch:
        tokens, final = generate(gg.GenerationServiceStub(ch), request([user(text("back again"))], 5))
    assert len(tokens) == 5


def test_grpcurl_lists_services_by_reflection_and_health_is_serving(harness):
    import pathlib
    import subprocess
    import sys

    grpcurl = pathlib.Path(sys.executable).parent / "grpcurl"
    assert grpcurl.exists(), "grpcurl missing: run scripts/install-tools.sh (make tools)"
    listed = subprocess.run([grpcurl, "-plaintext", harness.target, "list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert {"mmcast.v1.GenerationService", "grpc.health.v1.Health"} <= set(listed.stdout.split())
    for service in ("", "mmcast.v1.GenerationService"):
        health = subprocess.run(
            [grpcurl, "-plaintext", "-d", f'{{"service": "{service}"}}', harness.target, "grpc.health.v1.Health/Check"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert health.returncode == 0, health.stderr
        assert '"status": "SERVING"' in health.stdout
    described = subprocess.run(
        [grpcurl, "-plaintext", harness.target, "describe", "mmcast.v1.GenerationService"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "rpc Generate" in described.stdout and "rpc UploadImage" in described.stdout


def test_an_idle_group_notices_a_lost_rank_at_once(harness):
    h = harness
    assert h.server.engine.ready
    h.lt.run(h.ranks[1].stop())
    # keepalive_seconds is 10: readiness must drop because the stream ended, not because a keepalive was missed
    assert wait_for(lambda: not h.server.engine.ready, 5.0)
    assert h.server.metrics.group_up._value.get() == 0
