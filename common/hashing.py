"""Content hashes: prefix-cache block hashes, item identifiers and model fingerprints.

All use sha256. Item identifiers come from the *encoded* image bytes (tens to hundreds of KB) plus the
processor settings, never from ``pixel_values`` (15+ MB, ~8 ms to hash).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.ids import BlockHash, ItemId
from common.multimodal import MultiModalFeatureSpec

ExtraKey = tuple[str, int]  # (item identifier, item offset - block start); the offset may be negative


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] = (),
    salt: str | None = None,
) -> BlockHash:
    """Hash of one full block: chains the parent hash, the token ids and the extra keys.

    ``salt`` is given for the first block of a request only; it separates requests that must not share blocks.
    """
    h = hashlib.sha256()
    h.update(parent or b"\x00" * 32)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(_pack_tokens(token_ids))
    for identifier, rel_offset in extra_keys:
        encoded = identifier.encode()
        h.update(struct.pack("<Iq", len(encoded), rel_offset))
        h.update(encoded)
    if salt:
        encoded = salt.encode()
        h.update(b"salt" + struct.pack("<I", len(encoded)) + encoded)
    return BlockHash(h.digest())


def block_extra_keys(
    mm_features: Sequence[MultiModalFeatureSpec], block_start: int, block_end: int, start_index: int = 0
) -> tuple[list[ExtraKey], int]:
    """Extra keys of the block ``[block_start, block_end)`` and the index to resume from for the next block.

    ``mm_features`` must be sorted by offset. Work is proportional to the items overlapping the block, so
    hashing a prompt block by block stays O(blocks + items).
    """
    keys: list[ExtraKey] = []
    index = start_index
    while index < len(mm_features) and mm_features[index].mm_position.end <= block_start:
        index += 1  # items wholly before this block can overlap no later block either
    resume = index
    while index < len(mm_features) and mm_features[index].mm_position.offset < block_end:
        feature = mm_features[index]
        keys.append((feature.identifier, feature.mm_position.offset - block_start))
        index += 1
    return keys, resume


def hash_request_blocks(
    token_ids: Sequence[int],
    mm_features: Sequence[MultiModalFeatureSpec],
    block_size: int,
    *,
    salt: str | None = None,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks from ``start_block`` on (a trailing partial block is not hashed).

    ``parent`` must be the hash of block ``start_block - 1`` when ``start_block > 0``; this lets a caller extend
    a request's hashes as tokens arrive without rehashing earlier blocks.
    """
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    item_index = 0
    for block in range(start_block, num_full):
        start, end = block * block_size, (block + 1) * block_size
        keys, item_index = block_extra_keys(mm_features, start, end, item_index)
        parent = hash_block(parent, token_ids[start:end], keys, salt if block == 0 else None)
        hashes.append(parent)
    return hashes


def item_identifier(encoded: bytes | memoryview, processor_settings: Mapping[str, Any], *, scope: str = "") -> ItemId:
    """Identifier of an item: sha256 of its encoded bytes and of the processor settings that shape its tensors.

    ``scope`` (the tenant, when authentication is on) makes the same bytes a different item per tenant, so the
    prefix cache and the ranks' payload/encoder caches, which are keyed by identifier, are never shared across
    tenants. The empty scope gives the unscoped identifier.
    """
    h = hashlib.sha256()
    if scope:
        h.update(b"scope\x00" + scope.encode() + b"\x00")
    h.update(json.dumps(processor_settings, sort_keys=True, default=str).encode())
    h.update(b"\x00")
    h.update(encoded)
    return ItemId(h.hexdigest())


# Files whose content defines how a model folder tokenizes, preprocesses and computes.
_FINGERPRINT_FILES = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
_WEIGHT_GLOB = "*.safetensors"  # the only weight format the ranks load (no pickled checkpoints)
_DIGEST_CACHE_FILE = "weight-digests.json"
_digests: dict[str, str] = {}  # in-process digest cache, same keys as the sidecar file
_digests_lock = threading.Lock()


def digest_cache_dir() -> Path:
    """Where weight digests persist across starts: ``$MMCAST_CACHE_DIR``, else ``$XDG_CACHE_HOME/mmcast``, else
    ``~/.cache/mmcast``."""
    if os.environ.get("MMCAST_CACHE_DIR"):
        return Path(os.environ["MMCAST_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmcast"


_RACY_SECONDS = 2.0  # a file modified this recently is always hashed: a second write within the timestamp
# granularity of the filesystem (a clock tick, up to seconds on some) could keep its size and mtime (git's "racy
# clean" problem), so its digest is neither taken from nor put into the cache.


def _digest_key(path: Path) -> str | None:
    """The file's identity as the filesystem reports it (any later rewrite changes size, mtime or inode); None
    when it was modified too recently to be trusted."""
    st = path.stat()
    if time.time_ns() - st.st_mtime_ns < _RACY_SECONDS * 1e9:
        return None
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_dev}"


def _load_digest_cache(cache_dir: Path | None) -> dict[str, str]:
    if cache_dir is None:
        return {}
    try:
        data = json.loads((cache_dir / _DIGEST_CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return (
        {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}
    )


def _store_digest_cache(cache_dir: Path | None, entries: Mapping[str, str]) -> None:
    """Best effort (a read-only home only costs the next start a full hash); atomic, so readers never see half."""
    if cache_dir is None or not entries:
        return
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        merged = {**_load_digest_cache(cache_dir), **entries}
        tmp = cache_dir / f".{_DIGEST_CACHE_FILE}.{os.getpid()}.{threading.get_ident()}"
        tmp.write_text(json.dumps(merged, sort_keys=True))
        os.replace(tmp, cache_dir / _DIGEST_CACHE_FILE)
    except OSError:
        pass


def _file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # releases the GIL: files hash in parallel


def weight_digests(paths: Sequence[Path], cache_dir: Path | None = None, workers: int = 0) -> list[str]:
    """sha256 of each file's whole content, reused from the in-process cache or the sidecar in ``cache_dir``
    while the file's (path, size, mtime_ns, inode, device) are unchanged; the others are hashed in parallel
    (``workers`` threads; 0: the CPUs available)."""
    keys = [_digest_key(p) for p in paths]
    known = dict(_load_digest_cache(cache_dir))
    with _digests_lock:
        known.update(_digests)
    digests = [known.get(k) if k is not None else None for k in keys]
    missing = [i for i, d in enumerate(digests) if d is None]
    if missing:
        from concurrent.futures import ThreadPoolExecutor

        from common.process import available_cpus

        n = min(len(missing), workers or available_cpus())
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="mmcast-fingerprint") as pool:
            for i, digest in zip(missing, pool.map(_file_sha256, (paths[i] for i in missing)), strict=True):
                digests[i] = digest
        fresh = {keys[i]: digests[i] for i in missing if keys[i] is not None}
        _store_digest_cache(cache_dir, fresh)
        with _digests_lock:
            _digests.update(fresh)
    return digests  # type: ignore[return-value]  (every entry is set)


def model_fingerprint(model_dir: str | Path, *, persist: bool = True) -> str:
    """Hash of a model folder: the content of its config, processor and tokenizer files and of every weight file.

    Guarantee: two folders share a fingerprint only if those files have identical bytes (up to sha256
    collisions) — so two fine-tunes of one shape differ. Weight files are hashed whole; their digests are cached
    (in-process, and in ``digest_cache_dir()`` when ``persist``) keyed by path, size, mtime_ns,
    inode and device, so a restart re-reads only files that changed; files modified in the last 2 s are always
    hashed. The cache trusts that metadata: a file rewritten in place with its size and mtime restored (``touch
    -d``) keeps its old digest until the cache file is removed.
    Cost without the cache: sha256 at ~0.85 GiB/s per core on the reference machine (files hash in parallel),
    ~5 s for 4 GiB of weights on one core; with it, a ``stat`` per file (docs/DEPLOYMENT.md, "Model fingerprint").
    """
    root = Path(model_dir)
    store = digest_cache_dir() if persist else None
    h = hashlib.sha256()
    for name in _FINGERPRINT_FILES:
        path = root / name
        if path.is_file():
            h.update(name.encode() + b"\x00" + path.read_bytes() + b"\x00")
    weights = sorted(root.glob(_WEIGHT_GLOB))
    for path, digest in zip(weights, weight_digests(weights, store), strict=True):
        h.update(path.name.encode() + b"\x00" + struct.pack("<Q", path.stat().st_size) + bytes.fromhex(digest))
    return h.hexdigest()
