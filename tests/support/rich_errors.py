"""Reading the ``google.rpc`` details of a failed call, and the error contract of docs/ERRORS.md as one check.

Parsed with ``grpc_status.rpc_status.from_call`` (which also checks that the details' code and message equal the
call's) and unpacked by type, independently of the server's ``common/rich_status.py``.
"""

from __future__ import annotations

import re

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.rpc import error_details_pb2
from grpc_status import rpc_status

DETAIL_TYPES = {
    t.DESCRIPTOR.full_name: t
    for t in (
        error_details_pb2.BadRequest,
        error_details_pb2.RetryInfo,
        error_details_pb2.ResourceInfo,
        error_details_pb2.ErrorInfo,
        error_details_pb2.QuotaFailure,
        error_details_pb2.PreconditionFailure,
        error_details_pb2.DebugInfo,
        error_details_pb2.Help,
        error_details_pb2.LocalizedMessage,
    )
}
_SEGMENT = re.compile(r"([a-z_][a-z0-9_]*)(?:\[(\d+)\])?")


def details_of(err) -> dict[str, object]:
    """``google.rpc`` type name (``"BadRequest"``) -> the unpacked detail; {} when the call carried none. A
    detail of an unexpected type, or two of one type, fails."""
    status = rpc_status.from_call(err)
    if status is None:
        return {}
    out: dict[str, object] = {}
    for packed in status.details:
        name = packed.TypeName()
        assert name in DETAIL_TYPES, f"unexpected detail type {name}"
        short = name.rsplit(".", 1)[1]
        assert short not in out, f"two {short} details"
        message = DETAIL_TYPES[name]()
        assert packed.Unpack(message)
        out[short] = message
    return out


def violations(err) -> list[tuple[str, str]]:
    """(field, description) of every BadRequest field violation, in order."""
    bad = details_of(err).get("BadRequest")
    return [(v.field, v.description) for v in bad.field_violations] if bad is not None else []


def retry_seconds(err) -> float | None:
    info = details_of(err).get("RetryInfo")
    return None if info is None else info.retry_delay.seconds + info.retry_delay.nanos / 1e9


def field_resolves(descriptor: Descriptor, path: str) -> bool:
    """Whether ``path`` (``messages[0].content[1].image``, ``sampling.temperature``) names a field of ``descriptor``:
    every segment a field of the message before it, ``[i]`` only on repeated fields and needed to go inside one."""
    segments = path.split(".")
    for k, segment in enumerate(segments):
        match = _SEGMENT.fullmatch(segment)
        if descriptor is None or match is None or match.group(1) not in descriptor.fields_by_name:
            return False
        field = descriptor.fields_by_name[match.group(1)]
        indexed = match.group(2) is not None
        if indexed != field.is_repeated and (indexed or k + 1 < len(segments)):
            return False
        descriptor = field.message_type if field.type == FieldDescriptor.TYPE_MESSAGE else None
    return True


def check_contract(err, request: Descriptor) -> None:
    """The details docs/ERRORS.md promises for the call's status code (``request``: the method's request type)."""
    code, message = err.code().name, err.details()
    found = details_of(err)
    for path, description in violations(err):
        assert field_resolves(request, path), f"{code}: BadRequest field {path!r} is not a {request.full_name} field"
        assert description == message, (description, message)
    if code == "INVALID_ARGUMENT":
        assert set(found) == {"BadRequest"} and found["BadRequest"].field_violations, (message, found)
    elif code == "RESOURCE_EXHAUSTED":  # load: when to retry; a limit of the request: which field is over it
        assert set(found) in ({"RetryInfo"}, {"BadRequest"}), (message, found)
    elif code == "UNAVAILABLE":
        assert set(found) == {"RetryInfo"} and retry_seconds(err) >= 0.1, (message, found)
    elif code == "NOT_FOUND":
        info = found.get("ResourceInfo")
        assert set(found) == {"ResourceInfo"} and info.resource_type == "mmcast.v1/image", (message, found)
        assert re.fullmatch(r"[0-9a-f]{64}", info.resource_name) and info.description == message, info
    elif code == "ALREADY_EXISTS":
        info = found.get("ResourceInfo")
        assert set(found) == {"ResourceInfo"} and info.resource_type == "mmcast.v1/request", (message, found)
        assert info.resource_name and info.resource_name in message, info
    else:
        assert found == {}, (code, message, found)
