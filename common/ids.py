"""Distinct names for distinct ids: a request id, an item's content identifier and a block hash are not
interchangeable strings."""

from typing import NewType

RequestId = NewType("RequestId", str)
"""Client-chosen (or server-assigned) id of one generation request, unique among in-flight requests."""

ItemId = NewType("ItemId", str)
"""Content identifier of a multimodal item: hex sha256 of its encoded bytes plus the processor settings."""

BlockHash = NewType("BlockHash", bytes)
"""sha256 digest identifying a full KV block: parent hash, token ids and extra keys."""
