"""Prefix cache / block pool: exact block ids, hit lengths, eviction order, salts and image identity."""

from __future__ import annotations

from common.hashing import hash_request_blocks
from scheduler_svc.core.kv_cache import KVCacheManager
from scheduler_svc.core.request import Request
from tests.support.sched_sim import IMG, feature

BS = 4


def req(rid: str, tokens, items=(), salt=None) -> Request:
    return Request(rid, list(tokens), list(items), cache_salt=salt)


def run(kv: KVCacheManager, r: Request, prefix=()) -> list[int]:
    """Admit with ``prefix``, compute every token, register full blocks; returns the block table."""
    assert kv.allocate(r.request_id, r.num_tokens, prefix) is not None
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    return kv.blocks_of(r.request_id)


def test_exact_block_ids_hit_lengths_and_the_last_token_cap():
    kv = KVCacheManager(8, BS)
    r1 = req("r1", range(1, 11))  # 10 tokens: blocks 0, 1 full, block 2 partial
    assert kv.find_prefix(r1) == []
    assert run(kv, r1) == [0, 1, 2]
    assert kv.num_cached_blocks == 2  # the partial block is never cached
    kv.free("r1")

    r2 = req("r2", list(range(1, 11)) + [50, 51, 52])
    assert kv.find_prefix(r2) == [0, 1]  # 8 tokens; block 2's content differs
    r3 = req("r3", range(1, 9))  # exactly the two cached blocks: the hit is capped at 7 tokens -> 1 block
    assert kv.find_prefix(r3) == [0]
    r4 = req("r4", range(1, 10))  # 9 tokens: 8 may hit
    assert kv.find_prefix(r4) == [0, 1]

    # hits first, then the run continued: block 2 (r1's partial block, never cached) is free right after the hit
    assert kv.allocate("r2", 13, [0, 1]) == [0, 1, 2, 3]
    assert kv.blocks[0].ref_cnt == 1 and kv.num_free_blocks == 4
    assert kv.hash_blocks(r2)[:2] == hash_request_blocks(r2.all_token_ids, [], BS)[:2]


def test_eviction_takes_never_cached_blocks_first_then_least_recently_freed_tail_first():
    kv = KVCacheManager(6, BS)
    a = req("a", range(100, 108))  # 2 full blocks
    b = req("b", range(200, 208))
    assert run(kv, a) == [0, 1] and run(kv, b) == [2, 3]
    kv.free("a")  # freed tail first: LRU order 1, 0
    kv.free("b")  # then 3, 2
    assert kv.num_cached_blocks == 4 and kv.num_free_blocks == 6
    # c needs 4 blocks: 4, 5 (never cached), then evicts 1, 0 (least recently freed); its table holds them in id
    # order, so blocks freed together are one run of ids again
    assert kv.allocate("c", 16) == [0, 1, 4, 5]
    assert kv.find_prefix(req("a2", range(100, 109))) == []  # a's prefix is gone: block 0 was evicted
    assert kv.find_prefix(req("b2", range(200, 209))) == [2, 3]  # b's survives
    kv.free("c")


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_free_pool():
    kv = KVCacheManager(3, BS)
    a = req("a", range(1, 9))
    run(kv, a)
    kv.free("a")
    r = req("r", list(range(1, 9)) + [9])
    prefix = kv.find_prefix(r)
    assert prefix == [0, 1]
    assert kv.can_allocate("r", 12, prefix)  # 2 hits + 1 new block
    assert not kv.can_allocate("r", 13, prefix)  # would need 2 new blocks; only block 2 is not a hit
    assert kv.allocate("r", 9, prefix) == [0, 1, 2]
    assert kv.num_free_blocks == 0


def test_salt_isolates_requests():
    kv = KVCacheManager(8, BS)
    run(kv, req("a", range(1, 9), salt="tenant-1"))
    kv.free("a")
    assert kv.find_prefix(req("b", range(1, 10))) == []  # no salt
    assert kv.find_prefix(req("c", range(1, 10), salt="tenant-2")) == []
    assert kv.find_prefix(req("d", range(1, 10), salt="tenant-1")) == [0, 1]


def test_image_moved_or_swapped_behind_identical_placeholders_misses():
    kv = KVCacheManager(16, BS)
    text = [1, 2, 3, 4]
    # X at [4, 8), Y at [8, 12): the placeholder tokens alone are identical in every variant below.
    base = req("base", text + [IMG] * 8 + [5, 6, 7, 8], [feature("X", 4, 4), feature("Y", 8, 4)])
    run(kv, base)
    kv.free("base")
    same = req("same", text + [IMG] * 8 + [5, 6, 7, 8, 9], [feature("X", 4, 4), feature("Y", 8, 4)])
    assert len(kv.find_prefix(same)) == 4
    swapped = req("swapped", text + [IMG] * 8 + [5, 6, 7, 8, 9], [feature("Y", 4, 4), feature("X", 8, 4)])
    assert kv.find_prefix(swapped) == kv.find_prefix(same)[:1]  # only the text block before the images
    other = req("other", text + [IMG] * 8 + [5, 6, 7, 8, 9], [feature("X", 4, 4), feature("Z", 8, 4)])
    assert kv.find_prefix(other) == kv.find_prefix(same)[:2]  # same placeholders, different second image
    # The same image one block later (another image takes its place): misses from that block on.
    moved = req("moved", text + [IMG] * 8 + [5, 6, 7, 8, 9], [feature("Z", 4, 4), feature("X", 8, 4)])
    assert kv.find_prefix(moved) == kv.find_prefix(same)[:1]


def test_generated_tokens_are_cached_and_blocks_are_registered_only_once_computed():
    kv = KVCacheManager(8, BS)
    r = req("r", range(1, 7))
    kv.allocate("r", 6)
    r.num_computed_tokens = 4
    kv.cache_full_blocks(r)
    assert kv.num_cached_blocks == 1
    r.append_output(77)
    r.append_output(78)  # 8 tokens known, 6 computed: block 1 is full but not computed
    kv.cache_full_blocks(r)
    assert kv.num_cached_blocks == 1
    kv.allocate("r", 8)
    r.num_computed_tokens = 8
    kv.cache_full_blocks(r)
    assert kv.num_cached_blocks == 2
    kv.free("r")
    resumed = req("again", [*range(1, 7), 77, 78, 79])
    assert kv.find_prefix(resumed) == [0, 1]


def test_identical_content_computed_twice_registers_one_block():
    kv = KVCacheManager(8, BS)
    a, b = req("a", range(1, 6)), req("b", range(1, 6))
    kv.allocate("a", 5)
    kv.allocate("b", 5)  # both admitted before either computed: no hit possible
    for r in (a, b):
        r.num_computed_tokens = 5
        kv.cache_full_blocks(r)
    assert kv.num_cached_blocks == 1
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8 and kv.find_prefix(req("c", range(1, 6))) == [0]


def test_counters_and_reset():
    kv = KVCacheManager(4, BS)
    kv.record_lookup(10, 8)
    run(kv, req("a", range(1, 9)))
    kv.free("a")
    kv.reset_prefix_cache()
    assert kv.num_cached_blocks == 0 and kv.find_prefix(req("b", range(1, 10))) == []
    assert kv.allocate("b", 16) == [0, 1, 2, 3]
    assert (kv.query_tokens, kv.hit_tokens) == (10, 8)


def test_blocks_a_finished_request_freed_come_back_as_one_run_of_ids():
    """The ranks read a run of consecutive block ids in place (worker_svc/paged_attention.py); a table of the same
    blocks in the order they were freed (tail first, descending) is a run per block, read through a gathered copy."""
    kv = KVCacheManager(24, BS)
    first = run(kv, req("a", range(100, 100 + 12 * BS)))  # 12 blocks, computed and registered
    kv.allocate("pin", 12 * BS)  # the other half of the pool: the next request must take a's blocks
    kv.free("a")
    table = kv.allocate("b", 12 * BS)
    assert table == first == list(range(12))  # each of a's blocks evicted from the prefix cache; one ascending run
    assert kv.num_cached_blocks == 0


def runs(table: list[int]) -> int:
    """Runs of consecutive ids in a block table (what the ranks read in place, one view each)."""
    return 1 + sum(b != a + 1 for a, b in zip(table, table[1:], strict=False))


def test_two_requests_growing_side_by_side_each_stay_one_run():
    """Decodes grow a block at a time, in turn. Taken from the front of the free order, their blocks alternated and
    every table became runs of one block; with room kept after each table, each stays one run."""
    kv = KVCacheManager(64, BS)
    kv.allocate("a", 2 * BS, final_tokens=12 * BS)
    kv.allocate("b", 2 * BS, final_tokens=12 * BS)
    assert kv.blocks_of("b")[0] > kv.blocks_of("a")[-1] + 1  # b was not placed where a grows
    for n in range(3, 12):  # one block each, in turn, as two decodes take them
        kv.allocate("a", n * BS)
        kv.allocate("b", n * BS)
    assert runs(kv.blocks_of("a")) == 1 and runs(kv.blocks_of("b")) == 1, (kv.blocks_of("a"), kv.blocks_of("b"))
    assert kv.num_free_blocks == 64 - 22


def test_without_room_the_same_growth_alternates():
    """The case the room is for (the previous test's setting without it): a's next block is b's first."""
    kv = KVCacheManager(64, BS)
    kv.allocate("a", 2 * BS)
    kv.allocate("b", 2 * BS)
    for n in range(3, 12):
        kv.allocate("a", n * BS)
        kv.allocate("b", n * BS)
    assert runs(kv.blocks_of("a")) > 5


def test_room_is_a_hint_that_neither_reserves_nor_evicts():
    kv = KVCacheManager(8, BS)
    cached = run(kv, req("c", range(1, 1 + 2 * BS)))  # blocks 0, 1, registered
    kv.free("c")
    assert kv.allocate("a", BS, final_tokens=100 * BS) == [2]  # room past the pool's end is fine
    # b needs the rest of the pool: it takes the blocks a's room moved back (3..7), then evicts cached ones
    assert kv.allocate("b", 7 * BS) == [0, 1, 3, 4, 5, 6, 7] and kv.num_free_blocks == 0
    assert kv.find_prefix(req("c2", range(1, 2 + 2 * BS))) == []  # evicted only because the pool ran out
    assert cached == [0, 1]


def test_growth_never_takes_a_cached_block_out_of_its_eviction_order():
    """The block after a table's end holds a cached prefix: growth does not take it (that would evict a prefix
    the LRU order keeps) but a never-cached block elsewhere."""
    kv = KVCacheManager(8, BS)
    kv.allocate("a", BS)  # [0]
    c = req("c", range(1, 1 + 2 * BS))
    assert run(kv, c) == [1, 2]  # registered
    kv.free("c")  # 1, 2: free and cached
    assert kv.allocate("a", 2 * BS) == [3]
    assert kv.find_prefix(req("c2", range(1, 2 + 2 * BS))) == [1, 2]
