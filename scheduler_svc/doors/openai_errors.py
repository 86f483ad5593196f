"""``MmcastError`` → an OpenAI-shaped HTTP error: ``{"error": {"message", "type", "param", "code"}}``.

The HTTP counterpart of common/rich_status.py: the same internal errors, mapped once for this protocol
(docs/ERRORS.md has both tables). The status code follows the gRPC status, except that ``RESOURCE_EXHAUSTED`` is
429 with ``Retry-After`` when load causes it (the error carries a retry delay) and 413 when the request itself is
over a limit (a retry cannot succeed). ``param`` is the field path in the HTTP request body
(``messages[0].content[1].image_url``); ``code`` is the gRPC status name in lower case, or a more specific code
where OpenAI's clients know one (``model_not_found``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from common.errors import MmcastError, Status
from common.rich_status import retry_delay

# gRPC status -> (HTTP status, OpenAI error type)
_HTTP = {
    Status.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Status.FAILED_PRECONDITION: (400, "invalid_request_error"),
    Status.UNAUTHENTICATED: (401, "authentication_error"),
    Status.PERMISSION_DENIED: (403, "permission_error"),
    Status.NOT_FOUND: (404, "not_found_error"),
    Status.ALREADY_EXISTS: (409, "conflict_error"),
    Status.ABORTED: (409, "conflict_error"),
    Status.OUT_OF_RANGE: (400, "invalid_request_error"),
    Status.CANCELLED: (499, "cancelled"),
    Status.INTERNAL: (500, "server_error"),
    Status.UNAVAILABLE: (503, "service_unavailable_error"),
    Status.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class HttpError(Exception):
    """An error that exists only on the HTTP side (a body that is not JSON, a route's method), already shaped."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})


def body(message: str, type: str, param: str | None, code: str | None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()


def http_field(path: str, names: Mapping[str, str]) -> str:
    """The HTTP body's path of a field the shared checks name by its gRPC path: ``sampling.temperature`` ->
    ``temperature``, or the name ``names`` gives it. (Image parts carry their HTTP path, ``...image_url``, into the
    frontend, so its errors name them already.)"""
    if path in names:
        return names[path]
    return path.removeprefix("sampling.")


def from_mmcast(err: MmcastError, names: Mapping[str, str] | None = None) -> HttpError:
    """The HTTP error of ``err``; ``names`` renames gRPC field paths whose HTTP name differs (``sampling.logprobs``
    is ``top_logprobs`` in a chat request)."""
    names = names or {}
    status, kind = _HTTP.get(err.status, (500, "server_error"))
    headers = {}
    delay = retry_delay(err)
    if err.status is Status.RESOURCE_EXHAUSTED:
        status, kind = (429, "rate_limit_error") if delay is not None else (413, "invalid_request_error")
    if delay is not None and status in (429, 503):
        headers["Retry-After"] = str(max(1, math.ceil(delay)))  # whole seconds (RFC 9110)
    message = err.message
    params = [http_field(f, names) for f in err.fields]
    for old, new in zip(err.fields, params, strict=True):
        message = message.replace(old, new)
    code = err.status.value.lower()
    return HttpError(status, message, type=kind, param=params[0] if params else None, code=code, headers=headers)
