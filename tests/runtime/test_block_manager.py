"""KVCacheManager accounting: prefix hits, LRU reuse and eviction, no-room results, integrity."""

import pytest

from qkiln.runtime.block_manager import KVCacheManager
from qkiln.runtime.sequence import Sequence

BS = 4


def seq_of(seq_id, tokens):
    return Sequence(seq_id, list(tokens))


def admit_and_compute(kv, seq):
    """Admit `seq` with its prefix hit, then mark all its tokens computed and cache full blocks."""
    computed, num_cached = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - num_cached, computed) is not None
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    kv.check_integrity()
    return num_cached


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = seq_of("a", range(100, 110))  # 10 tokens: blocks [0..4) [4..8) full, [8..10) partial
    assert admit_and_compute(kv, a) == 0
    table_a = kv.block_table("a")
    b = seq_of("b", list(range(100, 109)) + [7, 7, 7])  # shares 9 tokens: 2 full blocks
    computed, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8 and list(computed.block_ids) == table_a[:2]
    kv.allocate_slots(b, b.num_tokens - num_cached, computed)
    assert kv.block_table("b")[:2] == table_a[:2]
    assert kv.blocks[table_a[0]].ref_cnt == 2  # shared while both hold it
    kv.check_integrity()
    assert kv.prefix_cache_queries == a.num_tokens + b.num_tokens
    assert kv.prefix_cache_hits == 8
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.num_free_blocks == 10 and kv.usage == 0.0


def test_the_hit_rate_counts_first_admissions_that_looked_up():
    """A preempted sequence re-admitted finds its own freed blocks: not a hit the cache gave another
    request (4 of 31 'hits' for two requests sharing nothing). A sequence admitted without a lookup
    (prompt logprobs) is not a miss either."""
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = seq_of("a", range(100, 110))
    admit_and_compute(kv, a)
    kv.free(a)
    a.num_preemptions = 1  # back from preemption: its blocks are in the evictable pool
    assert admit_and_compute(kv, a) == 8
    c = seq_of("c", range(200, 206))
    computed, _ = kv.get_computed_blocks(c, lookup=False)
    kv.allocate_slots(c, c.num_tokens, computed)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)


def test_lookup_never_covers_the_whole_sequence():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = seq_of("a", range(8))  # exactly two full blocks
    admit_and_compute(kv, a)
    kv.free(a)
    again = seq_of("again", range(8))
    _, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 4  # the last block is recomputed so the step has logits for token 8


def test_hit_on_freed_block_takes_it_back_from_the_evictable_pool():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = seq_of("a", range(9))
    admit_and_compute(kv, a)
    table_a = kv.block_table("a")
    kv.free(a)
    kv.check_integrity()
    assert kv.usage == 0.0  # evictable blocks count as free
    b = seq_of("b", range(9))
    assert admit_and_compute(kv, b) == 8
    assert kv.block_table("b")[:2] == table_a[:2]
    assert all(kv.blocks[i].ref_cnt == 1 for i in table_a[:2])


def test_hit_blocks_in_the_evictable_pool_are_not_counted_as_room():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = seq_of("a", range(13))  # 3 full blocks cached, 1 partial
    admit_and_compute(kv, a)
    kv.free(a)  # 3 evictable + 1 free
    b = seq_of("b", list(range(12)) + list(range(50, 55)))  # hit 3 blocks, needs 2 more: 5 > 4
    computed, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 12
    assert kv.allocate_slots(b, b.num_tokens - num_cached, computed) is None
    kv.check_integrity()
    assert kv.block_table("b") == [] and kv.num_free_blocks == 4
    _, still_cached = kv.get_computed_blocks(seq_of("c", range(13)))
    assert still_cached == 12  # the failed allocation evicted nothing


def test_lru_eviction_takes_free_blocks_first_then_the_tail_of_the_oldest_freed():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = seq_of("a", range(12))  # 3 blocks, all full -> all hashed once computed
    admit_and_compute(kv, a)
    table_a = kv.block_table("a")
    kv.free(a)  # 3 evictable, 3 free
    filler = seq_of("filler", range(500, 516))  # 4 blocks: 3 free + 1 evicted
    admit_and_compute(kv, filler)
    evicted = set(kv.block_table("filler")) & set(table_a)
    assert evicted == {table_a[2]}  # a's tail goes first; its head stays reusable
    assert kv.blocks[table_a[2]].block_hash is not None  # re-hashed as filler's own content now
    _, num_cached = kv.get_computed_blocks(seq_of("a2", range(13)))
    assert num_cached == 8


def test_no_room_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = seq_of("a", range(10))
    assert kv.allocate_slots(a, 10) is not None  # 3 blocks
    b = seq_of("b", range(40, 42))
    assert kv.allocate_slots(b, 2) is None
    kv.check_integrity()
    assert kv.block_table("b") == [] and kv.usage == 1.0
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) is not None  # slots 10, 11 are in a's partial third block
    assert kv.allocate_slots(a, 3) is None
    kv.check_integrity()


def test_same_prefix_computed_concurrently_keeps_one_cached_copy():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a, b = seq_of("a", range(9)), seq_of("b", range(9))
    for seq in (a, b):  # both admitted before either has computed anything: no hit
        computed, n = kv.get_computed_blocks(seq)
        assert n == 0
        kv.allocate_slots(seq, seq.num_tokens, computed)
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_full_blocks(seq)
    kv.check_integrity()
    hashed = [kv.blocks[i].block_hash is not None for i in kv.block_table("b")]
    assert hashed == [False, False, False]  # duplicates of a's blocks stay unhashed
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    _, num_cached = kv.get_computed_blocks(seq_of("c", range(9)))
    assert num_cached == 8


def test_reset_prefix_cache_and_disabled_caching():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = seq_of("a", range(9))
    admit_and_compute(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    kv.check_integrity()
    assert kv.get_computed_blocks(seq_of("b", range(9)))[1] == 0
    off = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    c = seq_of("c", range(9))
    admit_and_compute(off, c)
    off.free(c)
    off.check_integrity()
    assert off.get_computed_blocks(seq_of("d", range(9)))[1] == 0
    assert all(block.block_hash is None for block in off.blocks)


@pytest.mark.parametrize("corrupt", ["ref_cnt", "held_and_free", "lost_block", "hash_map", "double_free"])
def test_check_integrity_catches_corruption(corrupt):
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = seq_of("a", range(9))
    admit_and_compute(kv, a)
    held = kv.block_table("a")
    kv.check_integrity()
    if corrupt == "ref_cnt":
        kv.blocks[held[0]].ref_cnt += 1
    elif corrupt == "held_and_free":
        kv._free.append(held[2])
    elif corrupt == "lost_block":
        kv._free.popleft()
    elif corrupt == "hash_map":
        kv._hash_to_block[kv.blocks[held[0]].block_hash] = held[1]
    elif corrupt == "double_free":
        kv._free.append(kv._free[0])
    with pytest.raises(AssertionError):
        kv.check_integrity()
