"""The Step stream's rules on an in-process rank: handshake checks, epochs, protocol errors (the rank reports,
drops the stream's state and keeps serving), keepalives, and received-byte counters that equal the sender's."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common import codec, item_proto
from common.multimodal import PayloadState
from mmcast.v1 import tensor_pb2, worker_pb2
from tests.support.worker_driver import (
    MiniScheduler,
    StreamClient,
    handshake,
    next_epoch,
    noise_image,
    serves_a_request,
)
from worker_svc.step_errors import code

CODE = worker_pb2.ProtocolErrorCode


@pytest.fixture
def env(worker_env_q2):
    return worker_env_q2


@pytest.fixture
def prompt(env):
    return env.prompt([noise_image(3, 112, 84), "What is this?"])


def control_frame(control: worker_pb2.StepControl) -> bytes:
    return worker_pb2.StepRequest(control=control).SerializeToString()


def new_request(prompt, rid="r", *, state=PayloadState.DEFERRED, computed=0, scheduled=None, blocks=None):
    n = len(prompt.token_ids)
    msg = worker_pb2.NewRequest(
        request_id=rid,
        prompt_token_ids=prompt.token_ids,
        block_ids=blocks if blocks is not None else list(range(-(-n // 16))),
        num_computed_tokens=computed,
        num_scheduled_tokens=n - computed if scheduled is None else scheduled,
        sampling=worker_pb2.WorkerSampling(return_logprobs=True),
    )
    for f in prompt.features:
        msg.mm_items.append(item_proto.feature_to_proto(f, payload_state=state))
    return msg


def refused(stream: StreamClient, frames: list[bytes]) -> worker_pb2.ProtocolError:
    for frame in frames:
        stream.send(frame)
    reply = stream.recv()
    assert reply.WhichOneof("frame") == "error", reply
    return reply.error


def test_missing_payload_is_a_protocol_error_and_the_rank_keeps_serving(env, prompt):
    errors_before = env.rank.metrics.protocol_errors.labels(code="MISSING_PAYLOAD")._value.get()
    stream = env.rank.stream(env.model_dir)
    ident = prompt.features[0].identifier
    control = worker_pb2.StepControl(step_id=1, new_requests=[new_request(prompt)])
    control.encoder_inputs.add(item_identifier=ident)  # ... but no payload frames were sent
    error = refused(stream, [control_frame(control)])
    assert error.code == CODE.Value("PROTOCOL_ERROR_CODE_MISSING_PAYLOAD")
    assert error.item_identifier == ident and ident[:16] in error.message and "pixel_values" in error.message
    assert error.step_id == 1 and error.rank == 0
    stream.close()
    assert env.rank.metrics.protocol_errors.labels(code="MISSING_PAYLOAD")._value.get() == errors_before + 1
    serves_a_request(env, prompt)  # a new handshake (newer epoch) works


def test_forward_needing_an_encoder_output_not_held_is_refused(env, prompt):
    stream = env.rank.stream(env.model_dir)
    control = worker_pb2.StepControl(step_id=1, new_requests=[new_request(prompt, state=PayloadState.RANK_CACHED)])
    error = refused(stream, [control_frame(control)])
    assert error.code == code.MISSING_PAYLOAD and error.request_id == "r"
    assert "encoder output" in error.message and "[0, " in error.message
    stream.close()


@pytest.mark.parametrize(
    ("mutate", "expected", "needle"),
    [
        (lambda c: c.running.add(request_id="ghost", num_scheduled_tokens=1), "UNKNOWN_REQUEST", "ghost"),
        (lambda c: c.finished_request_ids.append("ghost"), "UNKNOWN_REQUEST", "ghost"),
        (lambda c: setattr(c.new_requests[0], "num_computed_tokens", 5), "STATE_MISMATCH", "num_computed_tokens=5"),
        (lambda c: c.new_requests[0].block_ids.__setitem__(0, 999), "OUT_OF_RANGE", "block id 999"),
        (lambda c: c.new_requests[0].prompt_token_ids.__setitem__(3, 5000), "OUT_OF_RANGE", "token id 5000"),
        (lambda c: setattr(c.new_requests[0], "num_scheduled_tokens", 500), "STATE_MISMATCH", "num_scheduled_tokens"),
        (lambda c: c.new_requests[0].ClearField("block_ids"), "STATE_MISMATCH", "block table holds 0"),
    ],
    ids=["unknown-running", "unknown-finish", "unaligned-hit", "block-range", "token-range", "overrun", "no-blocks"],
)
def test_invalid_steps_are_refused_with_a_named_field(env, prompt, mutate, expected, needle):
    stream = env.rank.stream(env.model_dir)
    control = worker_pb2.StepControl(step_id=1, new_requests=[new_request(prompt)])
    for f in prompt.features:
        control.encoder_inputs.add(item_identifier=f.identifier)
    mutate(control)
    frames = [
        b
        for f in prompt.features
        for b in codec.payload_frames(f.identifier, "pixel_values", f.data["pixel_values"].data)
    ]
    error = refused(stream, [*frames, control_frame(control)])
    assert CODE.Name(error.code) == f"PROTOCOL_ERROR_CODE_{expected}", error.message
    assert needle in error.message
    stream.close()


def test_state_of_a_refused_stream_is_dropped(env, prompt):
    stream = env.rank.stream(env.model_dir)
    sched = MiniScheduler([stream])
    req = sched.add(prompt, "kept", max_new_tokens=1)
    sched.step([req])
    bad = worker_pb2.StepControl(step_id=sched.step_id + 1)
    bad.running.add(request_id="kept", num_computed_tokens=3, num_scheduled_tokens=1)  # wrong count
    assert refused(stream, [control_frame(bad)]).code == code.STATE_MISMATCH
    stream.close()
    session = env.rank.worker.active
    assert session is None or not session.session.requests


@pytest.mark.parametrize(
    ("header", "chunks", "needle"),
    [
        (tensor_pb2.TensorHeader(dtype=1, shape=[4, 4], byte_size=60, num_chunks=1, chunk_size=64), [b"x" * 60], "60"),
        (tensor_pb2.TensorHeader(dtype=0, shape=[4], byte_size=16, inline_data=b"x" * 16), [], "unknown dtype"),
        (
            tensor_pb2.TensorHeader(dtype=1, shape=[4], byte_size=16, num_chunks=2, chunk_size=8),
            [b"x" * 8, b"y"],
            "chunk 1",
        ),
        (
            tensor_pb2.TensorHeader(dtype=6, shape=[1 << 27], byte_size=1 << 27, num_chunks=128, chunk_size=1 << 20),
            [],
            "max_tensor_bytes",
        ),
    ],
    ids=["size-vs-shape", "dtype", "short-chunk", "over-limit"],
)
def test_malformed_payloads_are_bad_tensor(env, prompt, header, chunks, needle):
    stream = env.rank.stream(env.model_dir)
    frames = [
        worker_pb2.StepRequest(
            payload=worker_pb2.PayloadFrame(item_identifier="it", field_name="pixel_values", header=header)
        )
    ]
    for index, data in enumerate(chunks):
        frames.append(
            worker_pb2.StepRequest(
                payload=worker_pb2.PayloadFrame(
                    item_identifier="it",
                    field_name="pixel_values",
                    chunk=tensor_pb2.TensorChunk(index=index, data=data),
                )
            )
        )
    error = refused(
        stream, [f.SerializeToString() for f in frames] + [control_frame(worker_pb2.StepControl(step_id=1))]
    )
    assert error.code == code.BAD_TENSOR and needle in error.message, error.message
    stream.close()


def test_superseding_epoch_drops_all_state_of_the_old_stream(env, prompt):
    epoch, newer_epoch, newest_epoch = next_epoch(), next_epoch(), next_epoch()
    old = StreamClient(env.rank.target, handshake(env.model_dir, epoch=epoch))
    sched = MiniScheduler([old])
    req = sched.add(prompt, "old", max_new_tokens=1)
    sched.step([req])  # the rank now holds the request, its payload and its encoder output
    new = StreamClient(env.rank.target, handshake(env.model_dir, epoch=newer_epoch))
    with pytest.raises(grpc.RpcError) as info:
        old.recv()
    assert info.value.code() == grpc.StatusCode.ABORTED and str(newer_epoch) in info.value.details()
    # the request is gone ...
    delta = worker_pb2.StepControl(step_id=1)
    delta.running.add(request_id="old", num_computed_tokens=req.computed, num_scheduled_tokens=1)
    assert refused(new, [control_frame(delta)]).code == code.UNKNOWN_REQUEST
    new.close()
    # ... and so are the payload and encoder caches
    newer = StreamClient(env.rank.target, handshake(env.model_dir, epoch=newest_epoch))
    control = worker_pb2.StepControl(step_id=1, new_requests=[new_request(prompt, state=PayloadState.RANK_CACHED)])
    control.encoder_inputs.add(item_identifier=prompt.features[0].identifier)
    assert refused(newer, [control_frame(control)]).code == code.MISSING_PAYLOAD
    newer.close()
    old.close()


def test_equal_or_older_epoch_while_active_is_refused(env):
    epoch = next_epoch()
    active = StreamClient(env.rank.target, handshake(env.model_dir, epoch=epoch))
    for stale in (epoch, epoch - 1):
        with pytest.raises(grpc.RpcError) as info:
            StreamClient(env.rank.target, handshake(env.model_dir, epoch=stale))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert str(stale) in info.value.details() and str(epoch) in info.value.details()
    active.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("protocol_version", 7),
        ("model_fingerprint", "f" * 64),
        ("rank", 1),
        ("world_size", 2),
        ("block_size", 32),
        ("scheduler_id", "someone-else"),
    ],
)
def test_handshake_mismatch_names_the_field(env, field, value):
    with pytest.raises(grpc.RpcError) as info:
        StreamClient(env.rank.target, handshake(env.model_dir, **{field: value}))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert field in info.value.details() and str(value) in info.value.details()


def test_ack_keepalive_and_health(env):
    stream = env.rank.stream(env.model_dir)
    ack = stream.ack.handshake_ack
    assert (ack.kv_blocks, ack.world_size, ack.device) == (256, 1, "cpu")
    assert ack.max_tensor_bytes == 64 << 20 and ack.max_model_len > 0 and ack.model_fingerprint
    stream.send(worker_pb2.StepRequest(keepalive=worker_pb2.Keepalive(sent_unix_nanos=42)).SerializeToString())
    assert stream.recv().keepalive.sent_unix_nanos == 42
    stream.close()
    with grpc.insecure_channel(env.rank.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "mmcast.v1.WorkerService"):
            assert (
                stub.Check(health_pb2.HealthCheckRequest(service=service)).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
        assert {"mmcast.v1.WorkerService", "grpc.health.v1.Health"} <= names


def test_received_bytes_equal_sent_bytes_and_gauges_follow(env, prompt):
    def received():
        return {
            k: env.rank.metrics.received_bytes.labels(kind=k)._value.get() for k in ("payload", "metadata", "control")
        }

    before = received()
    stream = env.rank.stream(env.model_dir)
    sched = MiniScheduler([stream], mode="full", chunk_size=64 << 10)
    req = sched.add(prompt, "count", max_new_tokens=3)
    sched.run([req])
    stream.send(worker_pb2.StepRequest(keepalive=worker_pb2.Keepalive(sent_unix_nanos=1)).SerializeToString())
    sched.sent_by_rank[0]["control"] += len(
        worker_pb2.StepRequest(keepalive=worker_pb2.Keepalive(sent_unix_nanos=1)).SerializeToString()
    )
    stream.recv()
    after = received()
    assert {k: after[k] - before[k] for k in after} == sched.sent
    assert sched.sent["payload"] > prompt.features[0].data["pixel_values"].data.numel() * 4
    first = sched.results[0][0].step_result.stats
    assert first.received_payload_bytes == sched.sent["payload"] and first.encoder_items == 1
    assert first.payload_cache_items == 1 and first.encoder_cache_tokens == prompt.features[0].mm_position.length
    assert env.rank.metrics.payload_cache_items._value.get() == 1
    stream.close()
    text = __import__("prometheus_client").generate_latest(env.rank.metrics.registry).decode()
    assert (
        'grpc_server_started_total{grpc_method="Step",grpc_service="mmcast.v1.WorkerService",grpc_type="bidi_stream"}'
        in text
    )
    assert 'grpc_server_handled_total{grpc_code="OK",grpc_method="Step"' in text
    assert "mmcast_worker_encoder_seconds_count" in text and "mmcast_worker_step_seconds_bucket" in text


def test_sampling_is_reproducible_per_seed_and_index(env, prompt):
    def run(seed):
        stream = env.rank.stream(env.model_dir)
        sched = MiniScheduler([stream])
        sampling = worker_pb2.WorkerSampling(temperature=1.5, top_p=0.9, seed=seed, return_logprobs=True, logprobs=3)
        req = sched.add(prompt, f"s{seed}", max_new_tokens=6, sampling=sampling)
        sched.run([req])
        stream.close()
        return req

    a, b, c = run(1), run(1), run(2)
    assert a.outputs == b.outputs and a.outputs != c.outputs
    assert all(len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] for top in a.top)
    assert all(lp <= top[0][1] + 1e-6 for lp, top in zip(a.logprobs, a.top, strict=True))
    _ = torch  # noqa: F841


def test_top_k_travels_in_the_step_and_cuts_the_draw(env, prompt):
    """At temperature 2 a top-k of one repeats the greedy tokens, with the model's own log-probabilities; the same
    seed without the cut leaves the greedy path (so the first check is not passing by luck)."""

    def run(rid, sampling):
        stream = env.rank.stream(env.model_dir)
        sched = MiniScheduler([stream])
        req = sched.add(prompt, rid, max_new_tokens=6, sampling=sampling)
        sched.run([req])
        stream.close()
        return req

    greedy = run("greedy", worker_pb2.WorkerSampling(temperature=0.0, return_logprobs=True))
    cut = run("k1", worker_pb2.WorkerSampling(temperature=2.0, top_k=1, seed=5, return_logprobs=True))
    free = run("free", worker_pb2.WorkerSampling(temperature=2.0, seed=5, return_logprobs=True))
    assert cut.outputs == greedy.outputs
    assert cut.logprobs == pytest.approx(greedy.logprobs, abs=1e-6)
    assert free.outputs != greedy.outputs


def encoded(prompt, index: int, data: bytes):
    """The prompt's item ``index`` as an ENCODED item carrying ``data`` (the file) and the item's own grid."""
    import dataclasses as dc

    from common.multimodal import ENCODED_FIELD, FieldKind, MultiModalFieldElem, MultiModalKwargsItem, PayloadEncoding

    old = prompt.features[index]
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    fields = MultiModalKwargsItem(
        {ENCODED_FIELD: MultiModalFieldElem(payload, kind=FieldKind.FLAT), "image_grid_thw": old.data["image_grid_thw"]}
    )
    return dc.replace(old, data=fields, encoding=PayloadEncoding.ENCODED, payload_nbytes=len(data))


def encoded_step(prompt, feature) -> list[bytes]:
    from common.multimodal import ENCODED_FIELD

    msg = new_request(prompt)
    msg.ClearField("mm_items")
    msg.mm_items.append(item_proto.feature_to_proto(feature, payload_state=PayloadState.DEFERRED))
    control = worker_pb2.StepControl(step_id=1, new_requests=[msg])
    control.encoder_inputs.add(item_identifier=feature.identifier)
    return [
        *codec.payload_frames(feature.identifier, ENCODED_FIELD, feature.data[ENCODED_FIELD].data),
        control_frame(control),
    ]


def png_bytes(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_an_owner_rank_outside_the_group_is_out_of_range(env, prompt):
    stream = env.rank.stream(env.model_dir)
    control = worker_pb2.StepControl(step_id=1, new_requests=[new_request(prompt)])
    control.encoder_inputs.add(item_identifier=prompt.features[0].identifier, owner_rank=3)
    error = refused(stream, [control_frame(control)])
    assert error.code == code.OUT_OF_RANGE and "owner_rank=3" in error.message and "1 ranks" in error.message
    stream.close()


def test_an_encoded_payload_needs_formats_from_the_handshake(env):
    image = noise_image(3, 112, 84)
    prompt = env.prompt([image, "What is this?"])
    stream = env.rank.stream(env.model_dir)  # no image_formats: this scheduler never sends encoded payloads
    error = refused(stream, encoded_step(prompt, encoded(prompt, 0, png_bytes(image))))
    assert error.code == code.BAD_TENSOR and "allowed no image format" in error.message
    stream.close()


def test_an_encoded_file_is_decoded_by_the_rank_and_a_corrupt_one_fails_its_item_alone(env):
    """The file (lossless PNG of the prompt's image) gives the tokens the pixel path gives; a cut copy of it fails
    as an item failure in the step's result (no protocol error), its request samples nothing, the stream goes on."""
    image = noise_image(3, 112, 84)
    prompt = env.prompt([image, "What is this?"])
    data = png_bytes(image)
    limits = {"image_formats": ["PNG", "JPEG"], "max_image_pixels": 1 << 24}

    stream = env.rank.stream(env.model_dir, **limits)
    for frame in encoded_step(prompt, encoded(prompt, 0, data)):
        stream.send(frame)
    served = stream.recv().step_result
    stream.close()
    stream = env.rank.stream(env.model_dir)
    control = worker_pb2.StepControl(step_id=1, new_requests=[new_request(prompt)])
    control.encoder_inputs.add(item_identifier=prompt.features[0].identifier)
    frames = codec.payload_frames(
        prompt.features[0].identifier, "pixel_values", prompt.features[0].data["pixel_values"].data
    )
    for frame in [*frames, control_frame(control)]:
        stream.send(frame)
    reference = stream.recv().step_result
    stream.close()
    assert [(s.request_id, s.token_id) for s in served.sampled] == [
        (s.request_id, s.token_id) for s in reference.sampled
    ]
    assert abs(served.sampled[0].logprob - reference.sampled[0].logprob) < 1e-5
    assert served.stats.encoder_runs == 1 and served.stats.preprocess_time.ToNanoseconds() > 0

    stream = env.rank.stream(env.model_dir, **limits)
    for frame in encoded_step(prompt, encoded(prompt, 0, data[: len(data) // 2])):
        stream.send(frame)
    reply = stream.recv()
    assert reply.WhichOneof("frame") == "step_result", reply
    result = reply.step_result
    assert not result.sampled and not result.failures
    (failure,) = result.item_failures
    assert failure.item_identifier == prompt.features[0].identifier and "could not be decoded" in failure.message
    stream.close()
    serves_a_request(env, prompt)


@pytest.mark.parametrize("mode", ["lazy", "full"])
def test_cache_lookups_and_hits_follow_the_windows(env, mode):
    """Encoder cache: one lookup per (window, item it overlaps), a hit when the output was computed in an earlier
    step. Payload cache: one lookup per item encoded, a hit when the payload arrived in an earlier step (full
    mode sends it at admission; lazy with the encode step). Expected values come from the windows alone."""
    prompt = env.prompt([noise_image(41, 112, 84), "then this one", noise_image(42, 56, 56), "what changed?"])
    chunk = 10
    windows = [(s, min(s + chunk, len(prompt.token_ids))) for s in range(0, len(prompt.token_ids), chunk)]
    spans = [(f.mm_position.offset, f.mm_position.end) for f in prompt.features]
    overlaps = [[(a < e and s < b) for a, b in spans] for s, e in windows]
    queries = sum(map(sum, overlaps))
    first_windows = len(spans)  # each item's first overlapping window encodes it: the miss
    assert queries > first_windows, "the chunking must reuse at least one encoder output"

    def counts():
        m = env.rank.metrics
        return {
            (c, kind): getattr(m, f"cache_{kind}").labels(cache=c)._value.get()
            for c in ("payload", "encoder")
            for kind in ("queries", "hits")
        }

    before = counts()
    stream = env.rank.stream(env.model_dir)
    sched = MiniScheduler([stream], mode=mode)
    req = sched.add(prompt, f"lookups-{mode}", chunk=chunk, max_new_tokens=2)
    sched.run([req])
    stream.close()
    after = counts()
    encoded_later = sum(1 for a, _ in spans if a >= chunk)  # items whose encode step is not the admission step
    assert {k: after[k] - before[k] for k in after} == {
        ("encoder", "queries"): queries,
        ("encoder", "hits"): queries - first_windows,
        ("payload", "queries"): len(spans),
        ("payload", "hits"): encoded_later if mode == "full" else 0,
    }
