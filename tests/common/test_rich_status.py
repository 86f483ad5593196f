"""Which ``google.rpc`` details an error carries (common/rich_status.py), and that the client-API checks name the
field their message names. Pure: no gRPC server (tests/service/test_rich_errors_process.py checks the wire)."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from common import rich_status
from common.errors import (
    IMAGE_RESOURCE,
    InvalidArgument,
    MmcastError,
    NotFound,
    Resource,
    ResourceExhausted,
    Status,
    Unavailable,
)
from mmcast.v1 import generation_pb2 as g
from scheduler_svc.doors import request_parsing
from tests.support.rich_errors import field_resolves


def unpacked(status: status_pb2.Status) -> dict[str, object]:
    out = {}
    for packed in status.details:
        name = packed.TypeName().rsplit(".", 1)[1]
        message = getattr(error_details_pb2, name)()
        packed.Unpack(message)
        out[name] = message
    return out


def test_code_and_message_are_the_plain_status_and_travel_in_the_trailer():
    err = InvalidArgument("sampling.top_p=0.0 must be in (0, 1]", field="sampling.top_p")
    status = rich_status.to_grpc_status(err)
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT and status.details == err.message
    ((key, value),) = status.trailing_metadata
    assert key == "grpc-status-details-bin"
    proto = status_pb2.Status.FromString(value)
    assert (proto.code, proto.message) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], err.message)


def test_bad_request_lists_every_field_in_order_with_the_message():
    err = InvalidArgument("prompt and max_tokens exceed the context", field=("messages", "sampling.max_tokens"))
    details = unpacked(rich_status.status_proto(err))
    assert list(details) == ["BadRequest"]
    assert [(v.field, v.description) for v in details["BadRequest"].field_violations] == [
        ("messages", err.message),
        ("sampling.max_tokens", err.message),
    ]


@pytest.mark.parametrize(
    "err, delay",
    [
        (Unavailable("draining"), rich_status.UNAVAILABLE_RETRY_SECONDS),  # no better delay known
        (Unavailable("group down", retry_after=1.75), 1.75),  # computed by the raiser
        (Unavailable("group down", retry_after=0.0), rich_status.MIN_RETRY_SECONDS),  # never below a step
        (ResourceExhausted("queue full", retry_after=1.0), 1.0),  # load
        (ResourceExhausted("image over --max-upload-bytes", field="messages[0].content[0].image"), None),  # a limit
        (NotFound("no such upload", resource=Resource(IMAGE_RESOURCE, "ab" * 32)), None),
        (MmcastError("internal"), None),
    ],
)
def test_retry_info_only_where_a_retry_can_succeed(err, delay):
    details = unpacked(rich_status.status_proto(err))
    if delay is None:
        assert "RetryInfo" not in details
    else:
        d = details["RetryInfo"].retry_delay
        assert d.seconds + d.nanos / 1e9 == pytest.approx(delay)


def test_resource_info_names_the_missing_image():
    err = NotFound(
        "messages[0].content[0].image.uploaded_sha256=... is not in the upload store",
        resource=Resource(IMAGE_RESOURCE, "cd" * 32),
    )
    status = rich_status.status_proto(err)
    info = unpacked(status)["ResourceInfo"]
    assert (info.resource_type, info.resource_name, info.description) == ("mmcast.v1/image", "cd" * 32, err.message)
    assert status.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert rpc_status.to_status(status).code == grpc.StatusCode.NOT_FOUND


def test_every_status_maps_to_its_grpc_code():
    for status in Status:
        assert rich_status.grpc_code(MmcastError("x", status)).name == status.value


# Bad client-API inputs -> the field path their error must name (the path the message starts with).
SAMPLING = dict(max_tokens_limit=64, max_logprobs=5, vocab_size=100)
BAD_SAMPLING = {
    "sampling.max_tokens": g.SamplingParams(max_tokens=0),
    "sampling.max_tokens=": g.SamplingParams(max_tokens=65),
    "sampling.temperature": g.SamplingParams(max_tokens=1, temperature=2.5),
    "sampling.top_p": g.SamplingParams(max_tokens=1, top_p=0.0),
    "sampling.top_k": g.SamplingParams(max_tokens=1, top_k=101),  # the vocabulary is 100
    "sampling.logprobs": g.SamplingParams(max_tokens=1, logprobs=6),
    "sampling.stop": g.SamplingParams(max_tokens=1, stop=["s"] * 17),
    "sampling.stop[1]": g.SamplingParams(max_tokens=1, stop=["ok", ""]),
    "sampling.stop_token_ids[0]": g.SamplingParams(max_tokens=1, stop_token_ids=[100]),
}


def text(t):
    return g.ContentPart(text=t)


def msg(*parts, role=g.ROLE_USER):
    return g.ChatMessage(role=role, content=list(parts))


BAD_MESSAGES = {
    "messages": [],
    "messages[0].role": [msg(text("x"), role=g.ROLE_UNSPECIFIED)],
    "messages[1].content[0]": [msg(text("x")), msg(g.ContentPart())],
    "messages[0].content[1].image.data": [msg(text("x"), g.ContentPart(image=g.ImageInput(data=b"")))],
    "messages[0].content[0].image.uploaded_sha256": [msg(g.ContentPart(image=g.ImageInput(uploaded_sha256="AB")))],
    "messages[0].content[0].image": [msg(g.ContentPart(image=g.ImageInput()))],
    "messages[0].content[2]": [msg(*[g.ContentPart(image=g.ImageInput(data=b"i"))] * 3)],
}


@pytest.mark.parametrize("path", list(BAD_SAMPLING))
def test_sampling_errors_name_their_field(path):
    with pytest.raises(InvalidArgument) as info:
        request_parsing.parse_sampling(BAD_SAMPLING[path], **SAMPLING)
    field = path.rstrip("=")
    assert info.value.fields == (field,) and info.value.message.startswith(field), info.value.message
    assert field_resolves(g.GenerateRequest.DESCRIPTOR, field)


def test_top_k_is_bounded_by_the_vocabulary():
    def top_k(**kwargs):
        return request_parsing.parse_sampling(g.SamplingParams(max_tokens=1, **kwargs), **SAMPLING).top_k

    assert (top_k(), top_k(top_k=1), top_k(top_k=100)) == (0, 1, 100)  # unset is 0: no cut; the whole vocabulary
    for bad in (101, 2**32 - 1):
        with pytest.raises(InvalidArgument) as info:
            top_k(top_k=bad)
        assert (
            info.value.message
            == f"sampling.top_k={bad} exceeds the model's vocabulary of 100 tokens (0 = no top-k cut)"
        )


@pytest.mark.parametrize("path", list(BAD_MESSAGES))
def test_message_errors_name_their_field(path):
    with pytest.raises(InvalidArgument) as info:
        request_parsing.parse_messages(BAD_MESSAGES[path], max_images=2)
    assert info.value.fields == (path,) and info.value.message.startswith(path), info.value.message
    assert field_resolves(g.GenerateRequest.DESCRIPTOR, path)


@pytest.mark.parametrize(
    "check, value, field",
    [
        (request_parsing.check_request_id, "r" * 129, "request_id"),
        (request_parsing.check_request_id, "a b", "request_id"),
        (request_parsing.check_cache_salt, "s" * 257, "cache_salt"),
    ],
)
def test_id_errors_name_their_field(check, value, field):
    with pytest.raises(InvalidArgument) as info:
        check(value)
    assert info.value.fields == (field,) and info.value.message.startswith(field)


def test_field_paths_resolve_only_in_the_request_message():
    d = g.GenerateRequest.DESCRIPTOR
    assert field_resolves(d, "messages[3].content[0].image.uploaded_sha256")
    assert field_resolves(d, "sampling.stop_token_ids[2]")
    for wrong in ("sampling.temprature", "messages.content", "sampling[0]", "request_id.x", "data", ""):
        assert not field_resolves(d, wrong), wrong
    assert field_resolves(g.UploadImageRequest.DESCRIPTOR, "data")
