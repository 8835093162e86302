"""StoreState: what a BlockStore holds (pools, allocators, prefix indexes, sequence tables, counters)
and every read of it; BlockStore (store.py) adds the operations that change it.

The base of BlockStore and nothing else: its subclass's operations work on these fields directly (the
per-step hot path reads them with no call in between), and the reports and the state as data
(store_report.py, store_snapshot.py) are handed them by the methods here.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Iterable, Sequence

from pagedserve.kvstore import store_report, store_snapshot
from pagedserve.kvstore.allocator import AllocationPolicy, BlockAllocator, PagedPolicy
from pagedserve.kvstore.block_table import DEVICE, HOST, SequenceTable
from pagedserve.kvstore.host_tier import HostTier
from pagedserve.kvstore.prefix_index import PrefixIndex

if TYPE_CHECKING:   # the pools copy themselves: no torch in a pool-less store (the scheduler's mirror)
    from pagedserve.kvstore.pool import BlockPool


class StoreState:
    """The block state of a BlockStore and its reads; construct a BlockStore, not this."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, device_pools: Sequence[BlockPool] = (),
                 host_pools: Sequence[BlockPool] = (), policy: AllocationPolicy | None = None,
                 host_cache_blocks: int = 0):
        """host_cache_blocks: the most host blocks the host tier may keep (capped at the host pool;
        0, or no prefix caching: no host tier)."""
        if block_size <= 0 or num_device_blocks < 0 or num_host_blocks < 0 or host_cache_blocks < 0:
            raise ValueError("block_size must be positive and block counts non-negative")
        _check_pools(num_device_blocks, num_host_blocks, device_pools, host_pools)
        self.block_size = block_size
        self.policy: AllocationPolicy = policy if policy is not None else PagedPolicy()
        self.device_pools = tuple(device_pools)
        self.host_pools = tuple(host_pools)
        self._index = PrefixIndex() if enable_prefix_caching and self.policy.prefix_caching else None
        self.host_cache_blocks = min(host_cache_blocks, num_host_blocks) if self._index is not None else 0
        self._host_index = PrefixIndex() if self.host_cache_blocks else None
        self._device = BlockAllocator(num_device_blocks,
                                      on_evict=self._evict_device if self._index is not None else None)
        self._host = BlockAllocator(num_host_blocks,
                                    on_evict=self._host_index.drop if self._host_index is not None else None)
        self._seqs: dict[int, SequenceTable] = {}
        self._counters = Counter()
        self._peak_device_used = 0
        # The tier changes this store's own host allocator, indexes and counters (handed over, not
        # copied), always inside one of this store's operations: the store alone calls it.
        self._tier = (HostTier(self.host_cache_blocks, self._host_index, self._host, self._index, self.device_pools,
                               self.host_pools, self._counters) if self._host_index is not None else None)

    @property
    def enable_prefix_caching(self) -> bool:
        return self._index is not None

    @property
    def num_free_device_blocks(self) -> int:
        return self._device.num_free

    @property
    def num_free_host_blocks(self) -> int:
        return self._host.num_free

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def _evict_device(self, block: int) -> None:
        """The device LRU hands out a hashed block: its hash leaves the device index; with a host
        tier it waits to be demoted once the allocation that evicted it returns."""
        if self._tier is not None:
            self._tier.hold(block, self._index.hash_of(block))
        self._index.drop(block)

    # ---- queries ---------------------------------------------------------------------------

    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def live_seq_ids(self):
        """A live, read-only view of the sequence ids (set operations on it run in C)."""
        return self._seqs.keys()

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._table(seq_id).blocks)

    def block_table_view(self, seq_id: int) -> list[int]:
        """The live table, uncopied (the per-step hot path): read it now, never change or keep it."""
        t = self._seqs.get(seq_id)
        return t.blocks if t is not None else self._table(seq_id).blocks

    def num_tokens(self, seq_id: int) -> int:
        t = self._seqs.get(seq_id)   # asked per sequence per step: skip _table's call when it exists
        return len(t.token_ids) if t is not None else self._table(seq_id).num_tokens

    def num_tokens_of(self, seq_ids: list[int]) -> list[int]:
        """num_tokens of each, in one call (asked for every running sequence every step)."""
        seqs = self._seqs
        try:
            return [len(seqs[i].token_ids) for i in seq_ids]
        except KeyError as e:
            raise ValueError(f"unknown sequence {e.args[0]}") from None

    def location(self, seq_id: int) -> str:
        return self._table(seq_id).location

    def states_of(self, seq_ids: list[int]) -> list[list | None]:
        """[location, num_tokens] of each of seq_ids, None for one the store does not hold: one
        call for a batch (the kvstore checks every step's op log against them)."""
        return [None if t is None else [t.location, len(t.token_ids)] for t in map(self._seqs.get, seq_ids)]

    def token_ids(self, seq_id: int) -> list[int]:
        return list(self._table(seq_id).token_ids)

    def last_token_ids(self, seq_id: int, n: int) -> list[int]:
        """The sequence's last n token ids (a slice: no copy of the whole list)."""
        return self._table(seq_id).token_ids[-n:] if n else []

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slots (block * B + offset) of token positions start .. end-1 of a sequence."""
        t = self._table(seq_id)
        if not 0 <= start <= end <= t.num_tokens:
            raise ValueError(f"positions {start}..{end} outside sequence {seq_id} "
                             f"of {t.num_tokens} tokens")
        return [t.slot(p, self.block_size) for p in range(start, end)]

    def refcount(self, block: int, location: str = DEVICE) -> int:
        return self._alloc(location).refcount(block)

    def evictable_blocks(self) -> list[int]:
        """Cached free device blocks, the next to be evicted first."""
        return self._device.evictable_blocks()

    def block_hash(self, block: int) -> bytes | None:
        """The prefix key of a device block, None if it has none."""
        return self._index.hash_of(block) if self._index is not None else None

    # ---- reports and the state as data (store_report.py, store_snapshot.py) ------------------

    def stats(self) -> dict:
        """Counts for metrics and tests (store_report.stats says which)."""
        return store_report.stats(self._seqs, self._device, self._host, self._index, self._host_index,
                                  self.block_size, self.host_cache_blocks, self._peak_device_used, self._counters)

    @property
    def host_cache_copies(self) -> int:
        """Blocks copied between the tiers so far, either way (a step that copied any moves bytes)."""
        return self._counters["host_cache_demotions"] + self._counters["host_cache_promotions"]

    def snapshot(self) -> dict:
        """Every piece of block state, no bytes and no counters, in plain lists (msgpack carries
        them unchanged): a store restored from it answers every later operation as this one does."""
        return store_snapshot.snapshot(self._device, self._host, self._index, self._host_index, self._seqs)

    def restore(self, snap: dict) -> None:
        """Take a snapshot() of a store of the same shape (pools, block size, policy, tiers) into
        this one, whose own state it replaces; ValueError (this store unchanged) when it is not
        such a snapshot."""
        before = self.snapshot()
        try:
            self._restore(snap)
            self.check_invariants()
        except (KeyError, TypeError, ValueError, AssertionError, AttributeError) as e:
            self._restore(before)
            raise ValueError(f"not a snapshot of this store: {e!r}") from None

    def _restore(self, snap: dict) -> None:
        self._seqs = store_snapshot.restore(self._device, self._host, self._index, self._host_index, snap)
        if self._tier is not None:
            self._tier.forget_evicted()

    def kv_usage(self, waiting_tokens: int | None = None, waiting_final: int | None = None) -> dict[str, int]:
        """The device pool's token slots split as the paper's Fig. 2 (store_report.kv_usage says how)."""
        return store_report.kv_usage(self._seqs.values(), self._device, self.block_size, self.policy,
                                     waiting_tokens, waiting_final)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent. O(total blocks): for tests."""
        store_report.check_invariants(self._seqs, self._device, self._host, self._index, self._host_index,
                                      self.block_size, self.policy, self.host_cache_blocks)

    # ---- helpers ---------------------------------------------------------------------------

    def _table(self, seq_id: int, location: str | None = None) -> SequenceTable:
        t = self._seqs.get(seq_id)
        if t is None:
            raise ValueError(f"unknown sequence {seq_id}")
        if location is not None and t.location != location:
            raise ValueError(f"sequence {seq_id} is on {t.location}, not {location}")
        return t

    def _tables(self, seq_ids: Iterable[int], location: str) -> list[SequenceTable]:
        ids = list(seq_ids)
        if len(ids) > 1 and len(set(ids)) != len(ids):
            raise ValueError(f"duplicate sequence ids in {ids}")
        return [self._table(s, location) for s in ids]

    def _alloc(self, location: str) -> BlockAllocator:
        if location == DEVICE:
            return self._device
        if location == HOST:
            return self._host
        raise ValueError(f"location must be {DEVICE!r} or {HOST!r}, not {location!r}")

    def _has_hash(self, block: int, location: str) -> bool:
        index = self._index if location == DEVICE else self._host_index
        return index is not None and index.hash_of(block) is not None

    def _note_peak(self) -> None:
        self._peak_device_used = max(self._peak_device_used, self._device.num_used)


def _check_pools(num_device_blocks: int, num_host_blocks: int, device_pools: Sequence[BlockPool],
                 host_pools: Sequence[BlockPool]) -> None:
    if device_pools and host_pools and len(device_pools) != len(host_pools):
        raise ValueError("device_pools[i] swaps with host_pools[i]: give as many of each")
    if (bool(device_pools) != bool(host_pools)) and num_host_blocks > 0 and num_device_blocks > 0:
        raise ValueError("with host blocks, give host pools for the device pools (or neither)")
    for pools, n in ((device_pools, num_device_blocks), (host_pools, num_host_blocks)):
        for p in pools:
            if p.num_blocks < n:
                raise ValueError(f"pool {p.name} has {p.num_blocks} blocks, store needs {n}")
    for dp, hp in zip(device_pools, host_pools):
        if dp.block_bytes != hp.block_bytes:
            raise ValueError(f"pools {dp.name} and {hp.name} differ in block_bytes")
