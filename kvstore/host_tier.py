"""HostTier: the prefix cache's second level, in host blocks no swapped sequence holds.

The host tier (host_cache_blocks > 0): a hashed device block that the LRU evicts is demoted, its
bytes copied into a free host block that keeps its hash in a host index and waits in the host
allocator's LRU, at most host_cache_blocks of them (the oldest makes room for the next). A lookup
that misses on the device and hits there promotes the block: a fresh device block, the bytes copied
back, the hash registered again; the host copy stays (a later demotion of the same hash copies
nothing). Swapping comes first: a swap-out allocates host blocks as any allocation does, evicting
host-tier blocks when no clean one is left, and a demotion never takes a block a sequence holds, so
the tier lives only in host blocks no swapped request needs. Both copies happen inside the operation
that causes them (before the evicted device block is written again), so they are part of the same
deterministic log that a mirror and its replica replay.

Owned by BlockStore, which alone calls it: the store hands it the very allocator, indexes, pools and
counters it keeps (not copies), because a demotion or promotion is a change to the store's own block
state, made inside one of the store's operations.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Sequence

from pagedserve.kvstore.allocator import BlockAllocator
from pagedserve.kvstore.prefix_index import PrefixIndex

if TYPE_CHECKING:   # the pools copy themselves: no torch in a pool-less store (the scheduler's mirror)
    from pagedserve.kvstore.pool import BlockPool


class HostTier:
    """Demotes evicted hashed device blocks into host blocks and promotes host hits back."""

    def __init__(self, host_cache_blocks: int, host_index: PrefixIndex, host: BlockAllocator,
                 device_index: PrefixIndex, device_pools: Sequence[BlockPool], host_pools: Sequence[BlockPool],
                 counters: Counter):
        """host_index: the tier's keys, which the host allocator drops as its LRU hands blocks out."""
        self.host_cache_blocks = host_cache_blocks
        self._host_index, self._host, self._device_index = host_index, host, device_index
        self._pools = list(zip(device_pools, host_pools))   # (device pool, host pool): each copy's two ends
        self._counters = counters
        self._evicted: list[tuple[int, bytes]] = []   # (device block, its hash) evicted, not yet demoted

    def hold(self, block: int, h: bytes) -> None:
        """The device LRU handed out hashed `block`: demote it once the allocation that evicted it
        returns (demote_evicted)."""
        self._evicted.append((block, h))

    def demote_evicted(self) -> None:
        """Copy the blocks held since the last call to the host, before anyone writes them."""
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            self._demote(evicted)

    def forget_evicted(self) -> None:
        """Drop the blocks held and not demoted (the store's state was replaced by a snapshot)."""
        self._evicted = []

    def _demote(self, evicted: list[tuple[int, bytes]]) -> None:
        pairs = []   # (device block, host block)
        for block, h in evicted:
            if self._host_index.block_of(h) is not None:
                continue   # its bytes are on the host already (it was promoted from there)
            host = self._host_block_for_cache()
            if host is None:
                break      # every host block is held by a swapped sequence
            self._host_index.register(host, h)
            self._host.decref(host, keep_cached=True)   # free, the newest in the host LRU
            pairs.append((block, host))
        for dp, hp in self._pools:
            dp.copy_to(hp, pairs)
        self._counters["host_cache_demotions"] += len(pairs)

    def _host_block_for_cache(self) -> int | None:
        """A host block for the next demoted block (refcount 1), or None. A full tier replaces its
        own oldest block; below its cap it takes a clean block, else the oldest cached one."""
        if len(self._host_index) >= self.host_cache_blocks:
            return self._host.reuse_oldest() if self._host.num_evictable else None
        return self._host.allocate(1)[0] if self._host.num_free else None

    def promote(self, moves: list[tuple[int, int, int]], hashes: list[bytes]) -> None:
        """moves: (logical index, host block, new device block) of each host hit; the host blocks
        are held (refcount 1) by the caller. Copy each back, key it on the device, let the host
        block go (the newest in the host LRU: it was just used)."""
        pairs = [(host, dev) for _, host, dev in moves]
        for dp, hp in self._pools:
            hp.copy_to(dp, pairs)
        for i, host, dev in moves:
            self._device_index.register(dev, hashes[i])
            self._host.decref(host, keep_cached=True)
        self._counters["host_cache_promotions"] += len(moves)
