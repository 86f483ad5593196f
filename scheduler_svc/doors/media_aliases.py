"""Caller-chosen media ids of the OpenAI API: a ``uuid`` beside an ``image_url`` / ``video_url`` names that file for
the tenant's later requests, which may then send the ``uuid`` alone (vLLM accepts any caller-chosen string there).

mmcast's own ids, ``sha256:<hex>`` of the file's bytes, need no entry: they name the upload store's key directly. A
free-form id maps (tenant, id) -> that sha256; the bytes stay in the upload store, within its byte budget, so an
alias whose file was evicted answers as a file never sent. The map is bounded by entry count (LRU), ids are bounded
in length and charset (``UUID_RULE``), and a refused request registers nothing (the door registers at admission).
"""

from __future__ import annotations

import collections
import re
import threading

MAX_UUID_CHARS = 256
_FREE_FORM = re.compile(rf"[A-Za-z0-9._:/+=@~-]{{1,{MAX_UUID_CHARS}}}")
_SHA256 = re.compile(r"sha256:([0-9a-f]{64})")
UUID_RULE = f"1 to {MAX_UUID_CHARS} letters, digits and ._:/+=@~- (or 'sha256:' and the file's 64 hex digits)"
DEFAULT_MAX_ALIASES = 65_536  # entries of all tenants; ~100 bytes each


class BadUuid(ValueError):
    """A ``uuid`` outside ``UUID_RULE``; the message says which rule it breaks."""


def parse_uuid(value: str) -> tuple[str | None, str | None]:
    """``(sha256 hex, None)`` for mmcast's content id, ``(None, value)`` for a free-form one; ``BadUuid`` else."""
    if value.startswith("sha256:"):
        match = _SHA256.fullmatch(value)
        if match is None:
            raise BadUuid("starts with 'sha256:' but is not followed by 64 lowercase hex digits (the file's sha256)")
        return match.group(1), None
    if not _FREE_FORM.fullmatch(value):
        raise BadUuid(f"must be {UUID_RULE}")
    return None, value


class MediaAliases:
    """(tenant, caller's id) -> sha256 hex of the file, LRU within ``max_entries``. Thread-safe."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ALIASES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries} must be >= 1")
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def register(self, tenant: str, alias: str, sha256_hex: str) -> None:
        with self._lock:
            self._entries.pop((tenant, alias), None)
            self._entries[(tenant, alias)] = sha256_hex
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def lookup(self, tenant: str, alias: str) -> str | None:
        """The sha256 the tenant's ``alias`` names, or None (never registered by this tenant, or evicted)."""
        with self._lock:
            sha = self._entries.get((tenant, alias))
            if sha is not None:
                self._entries.move_to_end((tenant, alias))
            return sha

    def __len__(self) -> int:
        return len(self._entries)
