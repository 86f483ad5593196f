"""The KV block pool and its prefix cache, as the scheduler sees it (the ranks hold the data; ids must agree).

- A block holds ``block_size`` tokens and a reference count (requests using it).
- A *full* block whose tokens have been computed is registered under its hash (``common.hashing.hash_block``:
  parent hash, token ids, extra keys ``(item identifier, item offset - block start)`` of every item overlapping
  the block, the request's salt in the first block). Registration happens after the step that computed it, so a
  hit always points at KV the ranks have already written.
- A prefix hit walks a request's block hashes from the start while they are registered; it is capped at
  ``num_tokens - 1`` tokens (the last token is recomputed for its logits) and is therefore block aligned.
- Free blocks: never-cached ones are handed out first (lowest id first, then in the order they were freed);
  then cached ones in least-recently-freed order, which evicts their hash. A request's blocks are freed tail
  first, so a prefix outlives its tail. The blocks one allocation takes enter the table in ascending id order:
  blocks freed together (a finished request's, tail first) come back as runs of consecutive ids, which the ranks
  read in place as views of their pools (worker_svc/paged_attention.py); in the order taken, every block of such
  a table was a run of its own, and its reads went through a gathered copy.
- Tables stay runs as they grow. A table's growth first takes the blocks right after its last one while those
  are free and never cached. And when an allocation places blocks elsewhere (an admission, or growth whose next
  block was taken), the free never-cached blocks after the table's new end, as many as its request may still
  grow by (``final_tokens``, at most ``MAX_ROOM_BLOCKS``), move to the back of the free order, so that the next
  request placed does not start there. Without both, two requests decoding side by side took their blocks in
  turn and each table became runs of one block. Nothing is reserved: every free block stays free, the counts
  and the eviction order of cached blocks are unchanged, and a full pool hands out the moved blocks last.
- ``events`` (optional, scheduler_svc/transport/kv_events.py) hears every change of the registered set: blocks stored (with
  their hashes, parent hash and tokens), blocks evicted, everything cleared (a new pool, a reset), so that a
  picker outside the process can mirror the prefix cache. Its calls must not block: they run in the step loop.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from common.hashing import block_extra_keys, hash_block
from common.ids import BlockHash, RequestId
from scheduler_svc.core.request import Request

MAX_ROOM_BLOCKS = 256  # blocks kept clear after a table's end at most (module docstring)


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0  # requests holding this block
        self.block_hash: BlockHash | None = None  # set while registered in the prefix cache

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class KVCacheManager:
    """Block allocation with reference counts, a hash -> block prefix cache and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int, events=None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must both be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free never-cached blocks in the order they are handed out (taking or moving a given one is O(1)).
        self._free_uncached: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        self._req_blocks: dict[RequestId, list[int]] = {}  # the request's block table
        self._req_num_cached: dict[RequestId, int] = {}  # leading blocks of the table that are registered
        self._req_final_blocks: dict[RequestId, int] = {}  # the table's length at most (allocate's final_tokens)
        self.query_tokens = 0  # prompt tokens looked up at admissions
        self.hit_tokens = 0  # of which served from the cache
        self.events = events  # kv_events.KVEventSink or None: told of every registration, eviction and reset
        if events is not None:
            events.cleared()  # a new pool: whatever an earlier pool of this process had registered is gone

    # --- counts ------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_of(self, request_id: RequestId) -> list[int]:
        """The request's block table (a copy)."""
        return list(self._req_blocks.get(request_id, ()))

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- hashing and lookup ----------------------------------------------------------------------------------
    def hash_blocks(self, request: Request) -> list[BlockHash]:
        """Extends ``request.block_hashes`` over every full block of its tokens (work: the new blocks only)."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else None
        for block in range(len(hashes), len(tokens) // bs):
            start = block * bs
            keys, request.hash_item_cursor = block_extra_keys(
                request.mm_features, start, start + bs, request.hash_item_cursor
            )
            parent = hash_block(parent, tokens[start : start + bs], keys, request.cache_salt if block == 0 else None)
            hashes.append(parent)
        return hashes

    def find_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request, capped at ``num_tokens - 1`` tokens."""
        hashes = self.hash_blocks(request)
        limit = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in hashes[:limit]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break  # a chain: nothing after a miss can hit
            hit.append(block_id)
        return hit

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Counts one admission's lookup (called once the admission succeeded)."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    # --- allocation ------------------------------------------------------------------------------------------
    def can_allocate(self, request_id: RequestId, num_total_tokens: int, prefix_blocks: Sequence[int] = ()) -> bool:
        return self._num_new_needed(request_id, num_total_tokens, prefix_blocks) is not None

    def _num_new_needed(self, request_id: RequestId, num_total_tokens: int, prefix_blocks: Sequence[int]) -> int | None:
        have = len(self._req_blocks.get(request_id, ())) + len(prefix_blocks)
        need = max(self.num_blocks_for(num_total_tokens) - have, 0)
        # Touching a free cached prefix block takes it out of the free pool.
        available = self.num_free_blocks - sum(1 for b in prefix_blocks if self.blocks[b].ref_cnt == 0)
        return need if need <= available else None

    def allocate(
        self,
        request_id: RequestId,
        num_total_tokens: int,
        prefix_blocks: Sequence[int] = (),
        final_tokens: int = 0,
    ) -> list[int] | None:
        """Grows the request's table to hold ``num_total_tokens`` tokens, first adopting ``prefix_blocks`` (a hit
        from ``find_prefix``, only on admission). ``final_tokens`` (on admission; 0: unknown): the tokens the
        request may come to hold, whose blocks are kept clear after its table where the pool allows (module
        docstring; nothing is reserved). Returns the ids appended, or None (and changes nothing) when too few
        blocks are free."""
        need = self._num_new_needed(request_id, num_total_tokens, prefix_blocks)
        if need is None:
            return None
        table = self._req_blocks.setdefault(request_id, [])
        if not table:
            self._req_num_cached[request_id] = len(prefix_blocks)
        if final_tokens:
            self._req_final_blocks[request_id] = self.num_blocks_for(final_tokens)
        appended = []
        for block_id in prefix_blocks:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self._free_cached.pop(block_id)
            block.ref_cnt += 1
            appended.append(block_id)
        tail = table[-1] if table else (appended[-1] if appended else None)
        extended = self._take_after(tail, need) if tail is not None else []
        placed = sorted(self._take_free_block() for _ in range(need - len(extended)))  # module docstring
        appended += extended + placed
        table.extend(appended)
        if placed:  # the table's end moved somewhere new: keep its growth's blocks clear there
            room = min(self._req_final_blocks.get(request_id, 0) - len(table), MAX_ROOM_BLOCKS)
            for block_id in range(table[-1] + 1, min(table[-1] + 1 + room, self.num_blocks)):
                if block_id in self._free_uncached:
                    self._free_uncached.move_to_end(block_id)
        return appended

    def _take_after(self, tail: int, need: int) -> list[int]:
        """Up to ``need`` free never-cached blocks right after block ``tail``, in order (a table's run extended)."""
        taken: list[int] = []
        block_id = tail + 1
        while len(taken) < need and block_id in self._free_uncached:
            del self._free_uncached[block_id]
            self.blocks[block_id].ref_cnt = 1
            taken.append(block_id)
            block_id += 1
        return taken

    def _take_free_block(self) -> int:
        if self._free_uncached:
            block_id, _ = self._free_uncached.popitem(last=False)
        else:
            block_id, _ = self._free_cached.popitem(last=False)  # evict the least recently freed cached block
            block = self.blocks[block_id]
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.removed([block.block_hash])
            block.block_hash = None
        self.blocks[block_id].ref_cnt = 1
        return block_id

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's blocks that are full of computed tokens (after the step that computed them)."""
        table = self._req_blocks.get(request.request_id)
        if not table:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        done = self._req_num_cached.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = self.hash_blocks(request)
        stored: list[int] = []  # block indices of the request newly registered here, in order
        for i in range(done, num_full):
            block = self.blocks[table[i]]
            if block.block_hash is not None or hashes[i] in self._cached:
                continue  # already registered (a hit), or the same content was computed into another block
            block.block_hash = hashes[i]
            self._cached[hashes[i]] = block.block_id
            stored.append(i)
        self._req_num_cached[request.request_id] = num_full
        if self.events is not None and stored:
            self._tell_stored(request, hashes, stored)

    def _tell_stored(self, request: Request, hashes: Sequence[BlockHash], stored: list[int]) -> None:
        """One ``stored`` call per run of consecutive block indices (each run's parent is the block before it)."""
        bs, tokens = self.block_size, request.all_token_ids
        start = 0
        for k in range(1, len(stored) + 1):
            if k == len(stored) or stored[k] != stored[k - 1] + 1:
                first, last = stored[start], stored[k - 1]
                self.events.stored(
                    list(hashes[first : last + 1]),
                    hashes[first - 1] if first else None,
                    list(tokens[first * bs : (last + 1) * bs]),
                )
                start = k

    def free(self, request_id: RequestId) -> None:
        """Releases the request's blocks, tail first; cached ones stay findable until evicted."""
        table = self._req_blocks.pop(request_id, None)
        self._req_num_cached.pop(request_id, None)
        self._req_final_blocks.pop(request_id, None)
        for block_id in reversed(table or ()):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._free_cached[block_id] = None
                else:
                    self._free_uncached[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (the ranks' pools are gone). Blocks held by requests stay held."""
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        self._free_cached.clear()
        self._free_uncached = collections.OrderedDict.fromkeys(b.block_id for b in self.blocks if b.ref_cnt == 0)
