"""Read-only reports on a BlockStore's block state: stats, kv_usage and check_invariants.

Owned by BlockStore, whose methods of the same names call these with the store's own parts (its
sequence tables, allocators, indexes, counters): the reports read them, never change them, and the
store's public API stays the one place callers ask.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from pagedserve.kvstore.allocator import AllocationPolicy, BlockAllocator, blocks_for_tokens
from pagedserve.kvstore.block_table import DEVICE, HOST, SequenceTable
from pagedserve.kvstore.prefix_index import PrefixIndex, extend_hashes

COUNTERS = ("prefix_queries_tokens", "prefix_hit_tokens", "host_queries_tokens", "host_hit_tokens",
            "host_cache_demotions", "host_cache_promotions", "cow_copies",
            "swap_outs", "swap_out_blocks", "swap_ins", "swap_in_blocks")


def stats(seqs: dict[int, SequenceTable], device: BlockAllocator, host: BlockAllocator,
          index: PrefixIndex | None, host_index: PrefixIndex | None, block_size: int,
          host_cache_blocks: int, peak_device_used: int, counters: Counter) -> dict:
    """Counts for metrics and tests. Slot counts take each physical block once (shared blocks
    are not double-counted); empty slots are those of used blocks that hold no token yet."""
    filled = {DEVICE: {}, HOST: {}}
    for t in seqs.values():
        per_block = filled[t.location]
        for i, b in enumerate(t.blocks):
            per_block[b] = max(per_block.get(b, 0), t.filled(i, block_size))
    out = {}
    for loc, alloc in ((DEVICE, device), (HOST, host)):
        slots = sum(filled[loc].values())
        out[f"{loc}_blocks_total"] = alloc.num_blocks
        out[f"{loc}_blocks_used"] = alloc.num_used
        out[f"{loc}_blocks_free"] = alloc.num_free
        out[f"{loc}_token_slots_filled"] = slots
        out[f"{loc}_token_slots_empty"] = alloc.num_used * block_size - slots
    out["device_blocks_evictable"] = device.num_evictable
    out["device_blocks_cached"] = len(index) if index is not None else 0
    out["host_blocks_cached"] = len(host_index) if host_index is not None else 0
    out["host_cache_blocks_max"] = host_cache_blocks
    out["device_blocks_peak_used"] = peak_device_used
    out["num_sequences"] = len(seqs)
    for name in COUNTERS:
        out[name] = counters[name]
    return out


def kv_usage(tables: Iterable[SequenceTable], device: BlockAllocator, block_size: int,
             policy: AllocationPolicy, waiting_tokens: int | None,
             waiting_final: int | None) -> dict[str, int]:
    """The device pool's token slots split as the paper's Fig. 2 (they sum to the pool):
    token_states (slots holding a token), reserved (empty slots below the sequence's final
    length: its future tokens will fill them), internal_fragmentation (empty slots of held
    blocks past the final length: never filled), external_fragmentation (free slots in free
    runs too short for the region the waiting request needs; only a contiguous policy has
    any), free (the rest). waiting_*: the head of the scheduler's waiting queue, if any.
    A block shared by several tables counts once, as the most filled of them sees it; the
    extra key table_slots counts it once per table (what the tables would hold unshared).
    (device.refcounts is indexed in C below.)"""
    bs = block_size
    filled = reserved = table_blocks = 0
    shared: dict[int, tuple[int, int]] = {}
    refcount_of = device.refcounts.__getitem__
    for t in tables:
        if t.location != DEVICE:
            continue
        n, final, blocks = len(t.token_ids), max(t.final_tokens, len(t.token_ids)), t.blocks
        table_blocks += len(blocks)
        if max(map(refcount_of, blocks), default=1) == 1:   # no block shared (C-level scan)
            filled += n
            reserved += min(final, len(blocks) * bs) - n
            continue
        for i, b in enumerate(blocks):   # forks and beams: per block, each block once
            f = min(bs, max(0, n - i * bs))
            r = min(bs, max(0, final - i * bs)) - f
            old = shared.get(b)
            shared[b] = (f, r) if old is None or f > old[0] else old
    for f, r in shared.values():
        filled += f
        reserved += r
    held = device.num_used * bs
    runs = device.free_runs() if policy.contiguous and waiting_tokens else []
    if runs:
        need = policy.blocks_to_reserve(waiting_tokens, waiting_final, bs)
        external = sum(r for r in runs if r < need) * bs
    else:
        external = 0
    return {"token_states": filled, "reserved": reserved,
            "internal_fragmentation": held - filled - reserved, "external_fragmentation": external,
            "free": device.num_free * bs - external, "table_slots": table_blocks * bs}


def check_invariants(seqs: dict[int, SequenceTable], device: BlockAllocator, host: BlockAllocator,
                     index: PrefixIndex | None, host_index: PrefixIndex | None, block_size: int,
                     policy: AllocationPolicy, host_cache_blocks: int) -> None:
    """Raise AssertionError if the bookkeeping is inconsistent. O(total blocks): for tests."""
    held = {DEVICE: Counter(), HOST: Counter()}
    for seq_id, t in seqs.items():
        _require(t.location in held, f"seq {seq_id}: bad location {t.location}")
        held[t.location].update(t.blocks)
        _require(len(set(t.blocks)) == len(t.blocks), f"seq {seq_id} holds a block twice")
        # The memory rule: tokens fill blocks front to back, so only the last block holding
        # tokens is partly filled, and a sequence holds no block past it beyond its reservation.
        want = max(blocks_for_tokens(t.num_tokens, block_size), t.reserved_blocks)
        _require(len(t.blocks) == want, f"seq {seq_id}: {len(t.blocks)} blocks for "
                                        f"{t.num_tokens} tokens, expected {want}")
        if policy.contiguous and t.location == DEVICE:
            region = t.blocks[:t.reserved_blocks]
            _require(region == list(range(region[0], region[0] + len(region))),
                     f"seq {seq_id}: its region {region} is not contiguous")
        _require(t.num_registered * block_size <= t.num_tokens,
                 f"seq {seq_id} registered past its tokens")
        if t.location == DEVICE and index is not None:
            _check_hashes(seq_id, t, index, block_size)
    for loc, alloc, loc_index in ((DEVICE, device, index), (HOST, host, host_index)):
        clean, lru = alloc.clean_blocks(), alloc.evictable_blocks()
        free = set(clean) | set(lru)
        _require(len(free) == len(clean) + len(lru), f"{loc}: a block is free twice")
        _require(len(free) + alloc.num_used == alloc.num_blocks, f"{loc}: free + used != total")
        for b in range(alloc.num_blocks):
            rc = alloc.refcount(b)
            _require(rc == held[loc][b], f"{loc} block {b}: refcount {rc}, "
                                         f"held by {held[loc][b]} tables")
            _require((rc == 0) == (b in free), f"{loc} block {b}: refcount {rc} vs free list")
            has_hash = loc_index is not None and loc_index.hash_of(b) is not None
            if b in free:
                _require(has_hash == (b in lru), f"{loc} block {b}: cached iff evictable")
            elif loc == HOST:
                _require(not has_hash, f"host block {b}: held by a sequence and in the host tier")
    for any_index in (index, host_index):
        for h, b in any_index.items() if any_index is not None else ():
            _require(any_index.hash_of(b) == h, f"index maps are not inverse at block {b}")
    if host_index is not None:
        _require(len(host_index) <= host_cache_blocks,
                 f"the host tier holds {len(host_index)} blocks, over its {host_cache_blocks}")
    else:
        _require(host.num_evictable == 0, "host blocks cached without a host tier")


def _check_hashes(seq_id: int, t: SequenceTable, index: PrefixIndex, block_size: int) -> None:
    # A keyed block must hold exactly the tokens (and extras) its key names in this sequence.
    full = t.num_tokens // block_size
    hashes = list(t.hashes[:full])
    extend_hashes(hashes, t.token_ids, block_size, full, t.extra_keys)
    for i, b in enumerate(t.blocks):
        h = index.hash_of(b)
        if h is not None:
            _require(i < full and h == hashes[i], f"seq {seq_id} block {i} ({b}): wrong key")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)
