"""Content hashes: prefix-cache block hashes, item identifiers and model fingerprints.

All use sha256. Item identifiers come from the *encoded* image bytes (tens to hundreds of KB) plus the
processor settings, never from ``pixel_values`` (15+ MB, ~8 ms to hash).
"""

from __future__ import annotations

import hashlib
import json
import struct
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
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
_FULL_HASH_WEIGHTS_LIMIT = 64 << 20  # weight files up to this size are hashed whole; larger ones by header


def model_fingerprint(model_dir: str | Path) -> str:
    """Hash of a model folder: its config, processor and tokenizer files, and its weights' identity.

    Weight files up to 64 MiB are hashed whole; larger ones by name, size and safetensors header (hashing
    gigabytes at every start would cost minutes), which still changes with any shape, dtype or file change.
    """
    root = Path(model_dir)
    h = hashlib.sha256()
    for name in _FINGERPRINT_FILES:
        path = root / name
        if path.is_file():
            h.update(name.encode() + b"\x00" + path.read_bytes() + b"\x00")
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(path.name.encode() + struct.pack("<Q", size))
        with path.open("rb") as f:
            if size <= _FULL_HASH_WEIGHTS_LIMIT:
                h.update(f.read())
            else:
                (header_len,) = struct.unpack("<Q", f.read(8))
                h.update(f.read(min(header_len, 100 << 20)))
    return h.hexdigest()
