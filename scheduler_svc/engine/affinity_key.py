"""The conversation key the scheduler returns on every answer, so that a client without the SDK can route by it.

A proxy in front of several replicas (deploy/envoy/envoy.yaml: Envoy, consistent hash) keeps a conversation on one
replica only if every turn carries the same key. The SDK computes that key itself (mmcast_client/affinity.py);
any other client gets it back here, as the response header ``x-mmcast-affinity`` (gRPC: initial metadata; HTTP:
a response header) and sends it on its later turns. The key is the SDK's own, from the same function, so an SDK
client and a plain client of one conversation land on the same replica:

- the request's ``x-mmcast-affinity``, when it sent one (echoed as is: the client chose it);
- else ``session_key(x-session-id)`` when it sent that header (the SDK's key for ``session_id=``);
- else ``conversation_key`` of the first user message (the first message when none is from the user): its texts as
  sent, its images by the sha256 of their encoded bytes (an uploaded image by the sha256 it was referenced with),
  which every later turn of the conversation repeats. A plain text prompt (``/v1/completions``) is one text part.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence

from common.errors import InvalidArgument
from mmcast_client.affinity import AFFINITY_HEADER, conversation_key, session_key
from scheduler_svc.engine.request_input import ImageContent, Turn, VideoContent

SESSION_HEADER = "x-session-id"  # a client's own conversation id (the name proxies and gateways commonly hash on)
MAX_KEY_CHARS = 256  # longest x-mmcast-affinity / x-session-id value accepted (the SDK's keys have 32)
# Visible ASCII only: the key goes back out as a header value, and a proxy hashes the bytes it sees.
_TOKEN = re.compile(r"[\x21-\x7e]+")

__all__ = ["AFFINITY_HEADER", "SESSION_HEADER", "client_key", "key_of"]


def _checked(name: str, value: str) -> str:
    if len(value) > MAX_KEY_CHARS:
        raise InvalidArgument(
            f"the {name} header has {len(value)} characters; the limit is {MAX_KEY_CHARS}", field=name
        )
    if not _TOKEN.fullmatch(value):
        raise InvalidArgument(
            f"the {name} header {value[:80]!r} may contain only visible ASCII characters (0x21-0x7e), no spaces",
            field=name,
        )
    return value


def client_key(header: Callable[[str], str | None]) -> str:
    """The key the client chose through its headers (``header(name)`` -> value or None), or "" when it chose none.
    Raises ``InvalidArgument`` naming the header for a value that could not go back out as a header."""
    given = header(AFFINITY_HEADER)
    if given:
        return _checked(AFFINITY_HEADER, given)
    session = header(SESSION_HEADER)
    if session:
        return session_key(_checked(SESSION_HEADER, session))
    return ""


def key_of(turns: Sequence[Turn] | None, prompt: str | None) -> str:
    """The key of a conversation from its parsed request (sha256 over inline image bytes the door has not hashed
    already: call it off the loop)."""
    if turns is None:
        return conversation_key([prompt or ""])
    first = next((t.parts for t in turns if t.role == "user"), turns[0].parts if turns else ())
    parts: list[str | tuple[str, str]] = []
    for part in first:
        if isinstance(part, ImageContent | VideoContent):  # a video keys like an image of the same file (the SDK's)
            sha = part.uploaded_sha256 or part.data_sha256 or hashlib.sha256(part.data or b"").hexdigest()
            parts.append(("image", sha))
        else:
            parts.append(part.text)
    return conversation_key(parts)
