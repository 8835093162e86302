"""BlockStore unit tests: one operation at a time, with hand-checked block ids and bytes."""

import pytest
import torch

from pagedserve.kvstore.allocator import OrcaPolicy
from pagedserve.kvstore.pool import BlockPool, unique_pool_name
from pagedserve.kvstore.store import BlockStore

B = 4          # tokens per block
SLOT = 2       # bytes per token slot in the test pools


@pytest.fixture
def pools():
    made = []

    def make(num_device, num_host, n_workers=1):
        dev = [BlockPool.create(unique_pool_name(f"d{i}"), num_device, B * SLOT) for i in range(n_workers)]
        host = [BlockPool.create(unique_pool_name(f"h{i}"), num_host, B * SLOT) for i in range(n_workers)]
        made.extend(dev + host)
        return dev, host

    yield make
    for p in made:
        p.close()
        p.unlink()


def store_with_pools(pools, num_device=8, num_host=8, n_workers=1, **kw):
    dev, host = pools(num_device, num_host, n_workers)
    return BlockStore(num_device, num_host, B, device_pools=dev, host_pools=host, **kw)


def slot_view(pool):
    return pool.blocks.view(pool.num_blocks, B, SLOT)


def write_tokens(store, pool, seq_id, start, end, value_of):
    """Write value_of(pos) into every byte of positions start..end-1 of a sequence's slots."""
    for pos, slot in zip(range(start, end), store.slot_mapping(seq_id, start, end)):
        assert store.refcount(slot // B, store.location(seq_id)) == 1, "write into a shared block"
        slot_view(pool)[slot // B, slot % B] = value_of(pos)


def read_tokens(store, pool, seq_id):
    return [int(slot_view(pool)[s // B, s % B, 0])
            for s in store.slot_mapping(seq_id, 0, store.num_tokens(seq_id))]


def snapshot(store):
    """Everything observable about the store's state, to prove a failed call changed nothing."""
    seqs = {s: (store.block_table(s), store.token_ids(s), store.location(s)) for s in store.seq_ids()}
    refs = [(store.refcount(b), store.block_hash(b)) for b in range(store.stats()["device_blocks_total"])]
    host = [store.refcount(b, "host") for b in range(store.stats()["host_blocks_total"])]
    return seqs, refs, host, store.evictable_blocks(), store.stats()


# ---- allocation and growth ------------------------------------------------------------------

def test_allocate_reserves_blocks_the_tokens_need():
    s = BlockStore(8, 0, B)
    r = s.allocate(1, list(range(9)))
    assert r.ok and r.num_cached_tokens == 0
    assert s.block_table(1) == [0, 1, 2]
    assert s.num_tokens(1) == 9 and s.location(1) == "device"
    assert s.slot_mapping(1, 7, 9) == [1 * B + 3, 2 * B + 0]
    st = s.stats()
    assert (st["device_blocks_used"], st["device_blocks_free"]) == (3, 5)
    assert (st["device_token_slots_filled"], st["device_token_slots_empty"]) == (9, 3)
    s.check_invariants()


def test_append_adds_a_block_only_when_the_last_is_full():
    s = BlockStore(8, 0, B)
    s.allocate(1, [1, 2, 3])
    assert s.append_slots(1, [4]).ok and s.block_table(1) == [0]
    assert s.append_slots(1, [5]).ok and s.block_table(1) == [0, 1]
    assert s.append_slots(1, [6, 7, 8, 9, 10]).ok and s.block_table(1) == [0, 1, 2]
    assert s.token_ids(1) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert s.append_slots(1, []).ok and s.num_tokens(1) == 10
    s.check_invariants()


def test_failed_allocate_and_append_change_nothing():
    s = BlockStore(3, 0, B)
    s.allocate(1, list(range(8)))
    assert not s.can_allocate(9) and s.can_allocate(4)
    before = snapshot(s)
    r = s.allocate(2, list(range(9)))
    assert not r.ok and r.reason
    assert 2 not in s and snapshot(s) == before
    s.allocate(3, [0])
    before = snapshot(s)
    r = s.append_slots(1, [8])
    assert not r.ok and "free" in r.reason and snapshot(s) == before
    assert not s.can_append([1])


def test_programming_errors_raise():
    s = BlockStore(4, 2, B)
    s.allocate(1, [1, 2])
    with pytest.raises(ValueError):
        s.allocate(1, [3])
    with pytest.raises(ValueError):
        s.allocate(2, [])
    for call in (lambda: s.append_slots(9, [1]), lambda: s.free(9), lambda: s.block_table(9),
                 lambda: s.fork(9, 10), lambda: s.fork(1, 1), lambda: s.swap_out([1, 1]),
                 lambda: s.swap_in([1]), lambda: s.slot_mapping(1, 0, 3),
                 lambda: s.mark_computed(1, 3)):
        with pytest.raises(ValueError):
            call()
    assert s.swap_out([1]).ok
    with pytest.raises(ValueError):
        s.append_slots(1, [3])  # a swapped-out sequence cannot grow


# ---- fork and copy-on-write ------------------------------------------------------------------

def test_fork_shares_every_block_and_allocates_nothing():
    s = BlockStore(8, 0, B)
    s.allocate(1, list(range(6)))
    s.fork(1, 2)
    assert s.block_table(2) == s.block_table(1) == [0, 1]
    assert s.refcount(0) == s.refcount(1) == 2
    assert s.stats()["device_blocks_used"] == 2
    assert s.stats()["device_token_slots_filled"] == 6  # shared blocks counted once
    s.check_invariants()


def test_partly_filled_shared_block_is_copied_exactly_once(pools):
    s = store_with_pools(pools, n_workers=2)
    s.allocate(1, list(range(6)))
    for pool in s.device_pools:
        write_tokens(s, pool, 1, 0, 6, lambda pos: 10 + pos)
    s.fork(1, 2)
    assert s.append_blocks_needed([1, 2]) == 1
    r = s.append_slots(1, [6])
    assert r.ok and r.copies == [(1, 2)]
    assert s.block_table(1) == [0, 2] and s.block_table(2) == [0, 1]
    for pool in s.device_pools:  # the copy ran in every worker's pool
        assert read_tokens(s, pool, 1)[:6] == list(range(10, 16))
        write_tokens(s, pool, 1, 6, 7, lambda pos: 99)
    r = s.append_slots(2, [60])  # now the sole holder of block 1: writes in place
    assert r.ok and r.copies == []
    for pool in s.device_pools:
        write_tokens(s, pool, 2, 6, 7, lambda pos: 77)
        assert read_tokens(s, pool, 1) == list(range(10, 16)) + [99]
        assert read_tokens(s, pool, 2) == list(range(10, 16)) + [77]
    assert s.stats()["cow_copies"] == 1
    s.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy():
    s = BlockStore(8, 0, B)
    s.allocate(1, list(range(4)))
    s.fork(1, 2)
    r = s.append_slots(1, [4])
    assert r.ok and r.copies == [] and s.block_table(1) == [0, 1] and s.block_table(2) == [0]


def test_append_blocks_needed_counts_group_copy_on_write_exactly():
    s = BlockStore(16, 0, B)
    s.allocate(1, list(range(5)))          # blocks [0, 1], block 1 partly filled
    s.fork(1, 2)
    s.fork(1, 3)
    s.allocate(4, list(range(4)))          # full last block: a fresh block
    assert s.append_blocks_needed([1, 2]) == 2        # refcount 3, two writers: both copy
    assert s.append_blocks_needed([1, 2, 3]) == 2     # three writers: the last owns it
    assert s.append_blocks_needed([1, 2, 3, 4]) == 3
    assert s.append_blocks_needed([4], num_new_tokens=5) == 2
    free = s.stats()["device_blocks_free"]
    for seq in (3, 1, 4, 2):
        assert s.append_slots(seq, [0]).ok
    assert free - s.stats()["device_blocks_free"] == 3
    s.check_invariants()


def test_failed_copy_on_write_changes_nothing():
    s = BlockStore(2, 0, B)
    s.allocate(1, list(range(6)))
    s.fork(1, 2)
    before = snapshot(s)
    r = s.append_slots(1, [6])
    assert not r.ok and "copy-on-write" in r.reason and snapshot(s) == before


def test_free_returns_blocks_once_the_last_holder_goes():
    s = BlockStore(4, 0, B, enable_prefix_caching=False)
    s.allocate(1, list(range(6)))
    s.fork(1, 2)
    s.free(1)
    assert s.stats()["device_blocks_used"] == 2 and s.refcount(0) == 1
    s.free(2)
    assert s.stats()["device_blocks_free"] == 4 and s.evictable_blocks() == []
    s.check_invariants()


# ---- prefix caching -------------------------------------------------------------------------

def test_prefix_hit_reuses_computed_full_blocks():
    s = BlockStore(8, 0, B)
    s.allocate(1, list(range(10)))
    s.mark_computed(1, 10)
    s.free(1)
    assert s.evictable_blocks() == [1, 0]  # tail first; block 2 was not full: no key
    r = s.allocate(2, list(range(9)) + [500, 501])
    assert r.ok and r.num_cached_tokens == 8
    assert s.block_table(2)[:2] == [0, 1] and s.evictable_blocks() == []
    st = s.stats()
    assert (st["prefix_queries_tokens"], st["prefix_hit_tokens"]) == (21, 8)
    s.check_invariants()


def test_prefix_hit_never_covers_the_last_token():
    s = BlockStore(8, 0, B)
    s.allocate(1, list(range(8)))
    s.mark_computed(1, 8)
    s.fork(1, 3)
    r = s.allocate(2, list(range(8)))  # whole prompt cached: the hit stops one block early
    assert r.ok and r.num_cached_tokens == 4
    assert s.block_table(2)[0] == s.block_table(1)[0] and s.block_table(2)[1] != s.block_table(1)[1]
    assert s.refcount(s.block_table(1)[0]) == 3
    assert s.allocate(4, list(range(4))).num_cached_tokens == 0
    assert s.allocate(5, list(range(5))).num_cached_tokens == 4


def test_only_computed_full_blocks_are_keyed():
    s = BlockStore(8, 0, B)
    s.allocate(1, [1, 2, 3])
    s.append_slots(1, [4, 5, 6, 7, 8, 9])
    assert s.block_hash(s.block_table(1)[0]) is None  # append_slots registers nothing
    s.mark_computed(1, 7)                             # blocks 0 only: block 1 ends at token 8
    t = s.block_table(1)
    assert s.block_hash(t[0]) is not None and s.block_hash(t[1]) is None
    s.mark_computed(1, 9)
    assert s.block_hash(t[1]) is not None and s.block_hash(t[2]) is None
    assert s.allocate(2, [1, 2, 3, 4, 5, 6, 7, 8, 0]).num_cached_tokens == 8
    s.check_invariants()


def test_extra_keys_separate_caches():
    s = BlockStore(8, 0, B)
    s.allocate(1, list(range(9)), extra_keys=("salt-a",))
    s.mark_computed(1, 9)
    assert s.allocate(2, list(range(9)), extra_keys=("salt-b",)).num_cached_tokens == 0
    assert s.allocate(3, list(range(9))).num_cached_tokens == 0
    assert s.allocate(4, list(range(9)), extra_keys=("salt-a",)).num_cached_tokens == 8


def test_duplicate_prefix_computed_twice_keys_the_first_only():
    s = BlockStore(8, 0, B)
    s.allocate(1, list(range(5)))
    s.allocate(2, list(range(5)))  # admitted before 1 was computed: no hit, its own block
    s.mark_computed(1, 5)
    s.mark_computed(2, 5)
    assert s.block_hash(s.block_table(1)[0]) is not None
    assert s.block_hash(s.block_table(2)[0]) is None
    s.free(2)
    s.free(1)
    assert s.evictable_blocks() == [0]
    s.check_invariants()


def test_lru_evicts_least_recently_freed_and_clean_blocks_go_first():
    s = BlockStore(6, 0, B)
    s.allocate(1, list(range(9)))           # blocks 0, 1 full, 2 partly filled
    s.allocate(2, list(range(100, 109)))    # blocks 3, 4 full, 5 partly filled
    s.mark_computed(1, 9)
    s.mark_computed(2, 9)
    s.free(1)
    s.free(2)
    assert s.evictable_blocks() == [1, 0, 4, 3]
    assert s.stats()["device_blocks_evictable"] == 4
    assert s.allocate(3, [7]).ok and s.block_table(3) == [2]      # clean blocks first
    assert s.allocate(4, [7, 7]).ok and s.block_table(4) == [5]
    assert s.allocate(5, [7] * 6).ok and s.block_table(5) == [1, 0]  # then oldest freed
    assert s.evictable_blocks() == [4, 3]
    assert s.stats()["device_blocks_cached"] == 2  # evicted blocks lost their keys
    assert s.block_hash(0) is None and s.block_hash(1) is None
    s.free(3)                                   # block 2 clean again; 4 and 3 still cached
    r = s.allocate(7, list(range(100, 108)) + [9])
    assert r.ok and r.num_cached_tokens == 8    # 3 free, 2 of them are the hits: 1 left for the tail
    assert s.block_table(7) == [3, 4, 2] and s.evictable_blocks() == []
    s.check_invariants()


def test_hit_blocks_are_revived_before_new_blocks_are_taken():
    s = BlockStore(3, 0, B)
    s.allocate(1, list(range(5)))
    s.mark_computed(1, 5)
    s.free(1)                       # block 0 evictable; clean list is [2, 1]
    s.allocate(9, [0])
    assert s.block_table(9) == [2]  # a clean block, not the cached one
    r = s.allocate(2, list(range(4)) + [50, 51, 52, 53, 54])  # hit on 0, needs 2 new: only 1 free
    assert not r.ok and s.evictable_blocks() == [0]
    r = s.allocate(3, list(range(4)) + [50])                  # hit on 0 + 1 new block
    assert r.ok and r.num_cached_tokens == 4 and s.block_table(3) == [0, 1]
    s.check_invariants()


def test_allocation_never_evicts_the_block_it_just_hit():
    s = BlockStore(4, 0, B)
    s.allocate(1, list(range(5)))
    s.allocate(2, [7] * 5)
    s.mark_computed(1, 5)
    s.mark_computed(2, 5)
    s.free(1)
    s.free(2)
    s.allocate(3, [9] * 5)                   # takes the two clean blocks
    assert s.evictable_blocks() == [0, 2]    # the block about to be hit is the oldest
    r = s.allocate(4, list(range(4)) + [8])  # hit on 0 and one new block: must evict 2, not 0
    assert r.ok and r.num_cached_tokens == 4 and s.block_table(4) == [0, 2]
    s.check_invariants()


def test_prefix_caching_disabled_never_hits():
    s = BlockStore(8, 0, B, enable_prefix_caching=False)
    s.allocate(1, list(range(9)))
    s.mark_computed(1, 9)
    s.free(1)
    assert s.evictable_blocks() == []
    assert s.allocate(2, list(range(9))).num_cached_tokens == 0
    assert s.stats()["prefix_queries_tokens"] == 0


# ---- swapping -------------------------------------------------------------------------------

def test_swap_out_and_in_moves_a_group_and_its_bytes(pools):
    s = store_with_pools(pools, num_device=8, num_host=8)
    dev, host = s.device_pools[0], s.host_pools[0]
    s.allocate(1, list(range(6)))
    write_tokens(s, dev, 1, 0, 6, lambda pos: 30 + pos)
    s.fork(1, 2)
    s.append_slots(2, [6])
    write_tokens(s, dev, 2, 6, 7, lambda pos: 88)
    s.allocate(3, [5])
    assert s.can_swap_out([1, 2])
    r = s.swap_out([1, 2])
    assert r.ok and len(r.mapping) == 3                # blocks 0 (shared), 1, 2: each once
    assert s.location(1) == s.location(2) == "host"
    shared = s.block_table(1)[0]
    assert s.block_table(2)[0] == shared and s.refcount(shared, "host") == 2
    assert s.stats()["device_blocks_used"] == 1 and s.stats()["host_blocks_used"] == 3
    assert read_tokens(s, host, 1) == list(range(30, 36))
    assert read_tokens(s, host, 2) == list(range(30, 36)) + [88]
    s.allocate(4, [1] * 16)                            # overwrite the device blocks they left
    write_tokens(s, dev, 4, 0, 16, lambda pos: 0)
    s.free(4)
    r = s.swap_in([2, 1])
    assert r.ok and len(r.mapping) == 3 and s.location(1) == "device"
    assert read_tokens(s, dev, 1) == list(range(30, 36))
    assert read_tokens(s, dev, 2) == list(range(30, 36)) + [88]
    assert s.refcount(s.block_table(1)[0]) == 2
    st = s.stats()
    assert (st["swap_outs"], st["swap_out_blocks"], st["swap_ins"], st["swap_in_blocks"]) == (1, 3, 1, 3)
    assert st["host_blocks_used"] == 0
    s.check_invariants()


def test_swap_is_all_or_nothing():
    s = BlockStore(8, 2, B)
    s.allocate(1, list(range(12)))
    assert not s.can_swap_out([1])
    before = snapshot(s)
    r = s.swap_out([1])
    assert not r.ok and r.reason and snapshot(s) == before
    s.free(1)
    s.allocate(1, list(range(8)))
    assert s.swap_out([1]).ok
    s.allocate(2, [0] * 29)  # 8 blocks: device now full
    assert not s.can_swap_in([1])
    before = snapshot(s)
    assert not s.swap_in([1]).ok and snapshot(s) == before


def test_swap_out_drops_device_keys_but_keeps_blocks_others_still_hold():
    s = BlockStore(10, 8, B)
    s.allocate(1, list(range(9)))
    s.mark_computed(1, 9)
    s.allocate(2, list(range(8)) + [77])     # shares blocks 0 and 1 through the prefix cache
    s.allocate(3, list(range(4)) + [55] * 5)  # shares block 0 only
    s.free(2)
    r = s.swap_out([1])
    assert r.ok
    assert s.block_hash(0) is not None       # still held (and keyed) by sequence 3
    assert s.block_hash(1) is None and 1 not in s.evictable_blocks()
    assert s.allocate(4, list(range(9))).num_cached_tokens == 4
    s.check_invariants()
    assert s.swap_in([1]).ok
    s.mark_computed(1, 9)                     # computed bytes are back: keyed again
    assert s.allocate(5, list(range(9))).num_cached_tokens == 8
    s.check_invariants()


# ---- policies and stats ---------------------------------------------------------------------

def test_orca_policies_reserve_up_front_and_grow_into_the_reservation():
    s = BlockStore(32, 0, B, policy=OrcaPolicy("pow2", max_model_len=64))
    r = s.allocate(1, list(range(5)), max_total_tokens=9)     # next power of two: 16 -> 4 blocks
    assert r.ok and len(s.block_table(1)) == 4
    st = s.stats()
    assert (st["device_token_slots_filled"], st["device_token_slots_empty"]) == (5, 11)
    table = s.block_table(1)
    assert s.append_slots(1, list(range(11))).ok and s.block_table(1) == table
    assert s.append_slots(1, [0]).ok and len(s.block_table(1)) == 5  # past it: paged growth
    s.check_invariants()
    assert OrcaPolicy("max", 64).blocks_to_reserve(5, None, B) == 16
    assert OrcaPolicy("oracle", 64).blocks_to_reserve(5, 9, B) == 3
    with pytest.raises(ValueError):
        OrcaPolicy("oracle", 64).blocks_to_reserve(5, None, B)
    assert s.allocate(2, [1], max_total_tokens=64).ok                # 16 blocks: 11 left
    assert not s.can_allocate(5, max_total_tokens=64) and s.can_allocate(5, max_total_tokens=32)  # pow2: 8 blocks


def test_peak_and_slot_stats():
    s = BlockStore(8, 4, B)
    s.allocate(1, list(range(10)))
    s.allocate(2, [1])
    s.free(1)
    st = s.stats()
    assert st["device_blocks_peak_used"] == 4 and st["device_blocks_used"] == 1
    assert st["num_sequences"] == 1
    s.swap_out([2])
    st = s.stats()
    assert (st["host_token_slots_filled"], st["host_token_slots_empty"]) == (1, 3)


def test_pool_shapes_are_checked(pools):
    dev, host = pools(4, 4)
    with pytest.raises(ValueError):
        BlockStore(8, 4, B, device_pools=dev, host_pools=host)   # pool smaller than the store
    with pytest.raises(ValueError):
        BlockStore(4, 4, B, device_pools=dev)                   # swaps would lose the bytes
    with pytest.raises(ValueError):
        BlockStore(4, 4, B, device_pools=dev, host_pools=host + host)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_pool_copies_on_write_and_swaps_through_host_memory(pools):
    dev = BlockPool.create("cuda-test-device", 8, B * SLOT, device="cuda")
    _, host = pools(0, 8)
    try:
        assert dev.blocks.is_cuda and tuple(dev.blocks.shape) == (8, B * SLOT)
        s = BlockStore(8, 8, B, device_pools=[dev], host_pools=host)
        dev.blocks.zero_()
        s.allocate(1, list(range(6)))
        write_tokens(s, dev, 1, 0, 6, lambda pos: 40 + pos)
        s.fork(1, 2)
        assert s.append_slots(2, [6]).copies == [(1, 2)]   # runs kernels.copy_blocks on the GPU
        write_tokens(s, dev, 2, 6, 7, lambda pos: 9)
        assert s.swap_out([1, 2]).ok and s.swap_in([1, 2]).ok
        assert read_tokens(s, dev, 2) == list(range(40, 46)) + [9]
        assert read_tokens(s, dev, 1) == list(range(40, 46))
    finally:
        dev.close()
