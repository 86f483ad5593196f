"""What every streaming OpenAI endpoint shares: the server-sent-event framing and headers, the signal that the
HTTP client left, and the join of a choice's chunks. The chat endpoint (openai_api.py) and the ones beside it
(openai_choices.py, openai_completions.py, openai_responses.py) import it, so none imports another for these.
"""

from __future__ import annotations

import json

from scheduler_svc.engine.completion import Chunk

# Proxies must pass each event through at once, and nothing may cache the stream.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def sse_event(obj: dict) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def joined_chunks(chunks: list) -> Chunk:
    """All chunks' tokens and log-probabilities as one chunk."""
    return Chunk([t for c in chunks for t in c.token_ids], "", [lp for c in chunks for lp in c.logprobs])
