"""The conversations ``/v1/responses`` keeps for ``previous_response_id``: per tenant, LRU, bounded by entry count
(``--response-store-entries``) and by bytes (``--response-store-bytes``).

An entry is the whole conversation up to and including that response's answer, as turns whose media are references
(``uploaded_sha256``) to the upload store, which keeps the bytes within its own budget; an entry's size is its text
bytes plus a fixed charge per turn and per media item. A tenant reads only its own entries, and the answer for an
id another tenant holds is the same as for an unknown one.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

from scheduler_svc.engine.request_input import ImageContent, TextContent, Turn, VideoContent

_TURN_BYTES = 64  # the charge of a turn's and of a media reference's bookkeeping, beside its text


def as_references(turns: list[Turn]) -> list[Turn]:
    """``turns`` with every inline media item replaced by its upload-store reference (the door stored its bytes)."""
    import hashlib

    out = []
    for turn in turns:
        parts = []
        for part in turn.parts:
            if isinstance(part, ImageContent | VideoContent) and part.data is not None:
                part = dataclasses.replace(part, data=None, uploaded_sha256=hashlib.sha256(part.data).hexdigest())
            parts.append(part)
        out.append(Turn(turn.role, tuple(parts)))
    return out


def size_of(turns: list[Turn]) -> int:
    """The bytes an entry is charged: its text, and a fixed charge per turn and per media reference."""
    total = 0
    for turn in turns:
        total += _TURN_BYTES
        for part in turn.parts:
            total += len(part.text.encode()) if isinstance(part, TextContent) else _TURN_BYTES
    return total


class ResponseStore:
    """(tenant, response id) -> the conversation's turns. Thread-safe."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: collections.OrderedDict[tuple[str, str], tuple[list[Turn], int]] = collections.OrderedDict()
        self.used = 0
        self._lock = threading.Lock()

    def put(self, tenant: str, response_id: str, turns: list[Turn]) -> bool:
        """Keeps the conversation (evicting the least recently used); False when it alone is over the byte bound."""
        size = size_of(turns)
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop((tenant, response_id), None)
            if old is not None:
                self.used -= old[1]
            self._entries[(tenant, response_id)] = (turns, size)
            self.used += size
            while len(self._entries) > self.max_entries or self.used > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.used -= evicted
        return True

    def get(self, tenant: str, response_id: str) -> list[Turn] | None:
        with self._lock:
            entry = self._entries.get((tenant, response_id))
            if entry is None:
                return None
            self._entries.move_to_end((tenant, response_id))
            return list(entry[0])

    def __len__(self) -> int:
        return len(self._entries)
