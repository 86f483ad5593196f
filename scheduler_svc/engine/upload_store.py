"""Byte-bounded LRU stores of the frontend: uploaded encoded images (by sha256) and processed images; and the
accounting of unfinished uploads (bytes received but not yet stored), bounded per tenant and in total.

All are thread-safe (the service runs the frontend in a thread pool while the event loop stores uploads).
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Hashable
from typing import Any

from common.errors import IMAGE_RESOURCE, RETRY_LATER_SECONDS, NotFound, Resource, ResourceExhausted


class ByteLRU:
    """A mapping bounded by the summed sizes of its values; the least recently used entries go first."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._entries: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()
        self.used = 0
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Hashable, value: Any, size: int) -> bool:
        """Stores ``value``; returns False (storing nothing) when it alone exceeds the budget."""
        with self._lock:
            if size > self.budget:
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self.used -= old[1]
            while self.used + size > self.budget:
                _, (_, evicted_size) = self._entries.popitem(last=False)
                self.used -= evicted_size
            self._entries[key] = (value, size)
            self.used += size
            return True

    def discard(self, key: Hashable) -> None:
        """Removes ``key`` if present."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.used -= old[1]

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


class PendingUploads:
    """Bytes held by unfinished uploads, per tenant and in total; ``reserve`` refuses what would pass a bound."""

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total_limit = total
        self.tenant_limit = per_tenant
        self.total = 0
        self._by_tenant: dict[str, int] = {}
        self._lock = threading.Lock()

    def reserve(self, tenant: str, n: int) -> None:
        """Counts ``n`` more bytes for ``tenant``; ``ResourceExhausted`` naming the bound (and nothing counted) when
        it would pass the tenant's or the total bound."""
        with self._lock:
            mine = self._by_tenant.get(tenant, 0) + n
            if mine > self.tenant_limit:
                raise ResourceExhausted(
                    f"unfinished uploads of this tenant would hold {mine} bytes; the limit is {self.tenant_limit} "
                    "(--max-pending-upload-bytes-per-tenant); finish or cancel other uploads first",
                    retry_after=RETRY_LATER_SECONDS,
                )
            if self.total + n > self.total_limit:
                raise ResourceExhausted(
                    f"unfinished uploads would hold {self.total + n} bytes; the server-wide limit is "
                    f"{self.total_limit} (--max-pending-upload-bytes); retry later",
                    retry_after=RETRY_LATER_SECONDS,
                )
            self._by_tenant[tenant] = mine
            self.total += n

    def release(self, tenant: str, n: int) -> None:
        with self._lock:
            left = self._by_tenant.get(tenant, 0) - n
            if left > 0:
                self._by_tenant[tenant] = left
            else:
                self._by_tenant.pop(tenant, None)
            self.total -= n

    def held(self, tenant: str) -> int:
        with self._lock:
            return self._by_tenant.get(tenant, 0)


class UploadStore:
    """Content-addressed store of uploaded encoded images: (tenant, sha256 hex) -> bytes, LRU within a byte budget.

    Entries are scoped per tenant (``""`` when authentication is off): a tenant can reference only its own
    uploads, and ``already_present`` says nothing about another tenant's. The byte budget is shared.
    """

    def __init__(
        self,
        budget_bytes: int,
        max_upload_bytes: int | None = None,
        *,
        pending_total: int = 128 << 20,
        pending_per_tenant: int = 64 << 20,
    ) -> None:
        self.max_upload_bytes = max_upload_bytes if max_upload_bytes is not None else budget_bytes
        self._lru = ByteLRU(budget_bytes)
        self.pending = PendingUploads(pending_total, pending_per_tenant)  # uploads still being received

    @property
    def budget(self) -> int:
        return self._lru.budget

    @property
    def used(self) -> int:
        return self._lru.used

    def put(self, data: bytes, sha256_hex: str | None = None, *, tenant: str = "") -> tuple[str, bool]:
        """Stores ``data`` and returns ``(sha256 hex, already_present)``; a size over a limit names ``data`` (the
        ``UploadImageRequest`` field).

        ``sha256_hex``: the digest when the caller computed it while receiving (it must be sha256 of ``data``),
        so the bytes are not hashed twice.
        """
        if len(data) > self.max_upload_bytes:
            raise ResourceExhausted(
                f"upload has {len(data)} bytes; the limit is {self.max_upload_bytes} (--max-upload-bytes)",
                field="data",
            )
        if len(data) > self._lru.budget:
            raise ResourceExhausted(
                f"upload has {len(data)} bytes; the upload store holds {self._lru.budget} (--upload-store-bytes)",
                field="data",
            )
        sha = sha256_hex or hashlib.sha256(data).hexdigest()
        key = (tenant, sha)
        already = key in self._lru
        if already:
            self._lru.get(key)  # refresh its place in the LRU order
        else:
            self._lru.put(key, bytes(data), len(data))
        return sha, already

    def get(self, sha256_hex: str, field: str = "uploaded_sha256", *, tenant: str = "") -> bytes:
        """The stored bytes; ``NotFound`` naming the hash when never uploaded (by this tenant) or evicted since.

        The message is the same whether or not another tenant holds the hash."""
        data = self._lru.get((tenant, sha256_hex))
        if data is None:
            raise NotFound(
                f"{field}={sha256_hex} is not in the upload store (never uploaded, or evicted: the store keeps the "
                f"most recent {self._lru.budget} bytes, --upload-store-bytes); upload the image again",
                resource=Resource(IMAGE_RESOURCE, sha256_hex),
            )
        return data

    def contains(self, sha256_hex: str, *, tenant: str = "") -> bool:
        return (tenant, sha256_hex) in self._lru

    def __contains__(self, sha256_hex: str) -> bool:
        return self.contains(sha256_hex)
