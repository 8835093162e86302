"""Block allocation for one pool: refcounts, the free list, the evictable LRU, and the policy seam.

BlockAllocator owns, for one pool, every block's reference count and where each free block waits:
- `clean`: free blocks that carry no prefix hash; handed out first;
- `evictable`: free blocks that still carry a prefix hash (their bytes can be reused by a later
  request with the same prefix), in the order they were freed; handed out only when no clean block
  is left, least recently freed first, and the owner is told (on_evict) so it drops the hash.
A block is free exactly when its refcount is 0.

AllocationPolicy decides how many blocks a new sequence reserves and where they lie. PagedPolicy (the
default) reserves only the blocks its tokens fill, anywhere in the pool; OrcaPolicy reserves one
contiguous region per request up front (the baselines of the PagedAttention paper), so free memory
split into runs too short for the next region is lost to external fragmentation. The store asks the
policy and never branches on its name: reserved blocks are used before new ones, a contiguous policy
takes a first-fit run of the free map, and a policy that never swaps or caches prefixes says so.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Protocol, Sequence


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class AllocationPolicy(Protocol):
    name: str
    contiguous: bool          # a sequence's reserved blocks form one run of block ids
    swappable: bool           # its sequences may be swapped to the host pool
    prefix_caching: bool      # it may share cached prefix blocks
    needs_final_length: bool  # blocks_to_reserve needs the request's true final length

    def blocks_to_reserve(self, num_tokens: int, max_total_tokens: int | None, block_size: int) -> int:
        """Blocks a new sequence of num_tokens tokens reserves; at least ceil(num_tokens / B)."""
        ...


class PagedPolicy:
    """PagedAttention: a sequence holds only the blocks its tokens need; it grows block by block."""

    name = "paged"
    contiguous, swappable, prefix_caching, needs_final_length = False, True, True, False

    def blocks_to_reserve(self, num_tokens: int, max_total_tokens: int | None, block_size: int) -> int:
        return blocks_for_tokens(num_tokens, block_size)


class OrcaPolicy:
    """The paper's Orca baselines: reserve the request's whole region at admission.

    mode "max": the model's maximum length; "pow2": the next power of two of the request's true
    final length (prompt + output); "oracle": exactly the true final length. Regions are contiguous,
    held until the request finishes and never swapped; Orca had no prefix cache."""

    MODES = ("max", "pow2", "oracle")
    contiguous, swappable, prefix_caching = True, False, False

    def __init__(self, mode: str, max_model_len: int):
        if mode not in self.MODES:
            raise ValueError(f"Orca mode must be one of {self.MODES}, not {mode!r}")
        self.mode = mode
        self.max_model_len = max_model_len
        self.name = f"orca-{mode}"
        self.needs_final_length = mode != "max"

    def blocks_to_reserve(self, num_tokens: int, max_total_tokens: int | None, block_size: int) -> int:
        if self.mode == "max":
            tokens = self.max_model_len
        else:
            if max_total_tokens is None:
                raise ValueError(f"{self.name} needs max_total_tokens (prompt + max output)")
            tokens = max_total_tokens
            if self.mode == "pow2":
                tokens = min(1 << max(0, tokens - 1).bit_length(), self.max_model_len)
        return max(blocks_for_tokens(tokens, block_size), blocks_for_tokens(num_tokens, block_size))


ALLOCATIONS = ("paged", "orca-max", "orca-pow2", "orca-oracle")


def make_policy(allocation: str, max_model_len: int) -> AllocationPolicy:
    """The policy named by --allocation (one of ALLOCATIONS)."""
    if allocation == "paged":
        return PagedPolicy()
    if allocation.startswith("orca-"):
        return OrcaPolicy(allocation[len("orca-"):], max_model_len)
    raise ValueError(f"--allocation must be one of {', '.join(ALLOCATIONS)}, not {allocation!r}")


_FREE, _USED = b"\x01", b"\x00"


class BlockAllocator:
    """Refcounts and free blocks of one pool of num_blocks blocks (ids 0 .. num_blocks-1)."""

    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None):
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        self._clean: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest-freed first
        self._on_evict = on_evict
        # One byte per block, 1 when free: contiguous runs are found and measured by C-level
        # bytes searches (find, split) instead of Python loops over the pool.
        self._free_map = bytearray(_FREE * num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._clean) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    @property
    def refcounts(self) -> Sequence[int]:
        """Every block's refcount, indexed by block id: a live, read-only view (the allocator's own
        list, never replaced, restore() included), for hot loops that index it per block where a
        refcount() call per block would cost. Readers must not write to it."""
        return self._refcounts

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, the next one to be evicted first."""
        return list(self._evictable)

    def clean_blocks(self) -> list[int]:
        return list(self._clean)

    def allocate(self, n: int) -> list[int]:
        """n blocks at refcount 1. The caller checks num_free first: running short is a bug here."""
        if n > self.num_free:
            raise RuntimeError(f"allocator asked for {n} blocks with {self.num_free} free")
        out = []
        for _ in range(n):
            if self._clean:
                block = self._clean.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                if self._on_evict is not None:
                    self._on_evict(block)
            self._refcounts[block] = 1
            self._free_map[block] = 0
            out.append(block)
        return out

    def allocate_run(self, n: int) -> list[int] | None:
        """n consecutive blocks at refcount 1, the lowest-addressed free run that holds them (first
        fit); None when no free run is that long, however many blocks are free in all."""
        if n <= 0:
            return []
        start = self._free_map.find(_FREE * n)
        if start < 0:
            return None
        run = range(start, start + n)
        taken = set(run)
        for block in run:
            if block in self._evictable:
                del self._evictable[block]
                if self._on_evict is not None:
                    self._on_evict(block)
            self._refcounts[block] = 1
        self._clean = deque(b for b in self._clean if b not in taken)
        self._free_map[start:start + n] = _USED * n
        return list(run)

    def free_runs(self) -> list[int]:
        """Lengths of the maximal runs of consecutive free blocks."""
        return [len(r) for r in self._free_map.split(_USED) if r]

    def incref(self, block: int) -> None:
        """One more holder; a cached free block (a prefix hit) comes back out of the LRU."""
        if self._refcounts[block] == 0:
            if block not in self._evictable:
                raise RuntimeError(f"block {block} is free and uncached: nothing to revive")
            del self._evictable[block]
            self._free_map[block] = 0
        self._refcounts[block] += 1

    def decref(self, block: int, keep_cached: bool) -> None:
        """One holder fewer; at zero the block is free, evictable if keep_cached (it has a hash)."""
        if self._refcounts[block] <= 0:
            raise RuntimeError(f"block {block} freed more often than held")
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            self._free_map[block] = 1
            if keep_cached:
                self._evictable[block] = None
            else:
                self._clean.append(block)

    def uncache(self, block: int) -> None:
        """An evictable block loses its hash: it moves to the clean list."""
        del self._evictable[block]
        self._clean.append(block)

    def reuse_oldest(self) -> int:
        """The least recently freed evictable block, at refcount 1, even while clean blocks are
        left (the owner is told, as allocate tells it): a capped cache replaces its own oldest."""
        block, _ = self._evictable.popitem(last=False)
        if self._on_evict is not None:
            self._on_evict(block)
        self._refcounts[block] = 1
        self._free_map[block] = 0
        return block

    def snapshot(self) -> dict:
        """Refcounts and the order of both free lists (plain lists: msgpack carries them)."""
        return {"refcounts": list(self._refcounts), "clean": list(self._clean),
                "evictable": list(self._evictable)}

    def restore(self, snap: dict) -> None:
        """Take the state snapshot() gave, from an allocator of as many blocks; ValueError when it
        is not one (wrong size, a block both free and held, or free twice)."""
        refcounts, clean, evictable = snap["refcounts"], snap["clean"], snap["evictable"]
        if len(refcounts) != self.num_blocks:
            raise ValueError(f"a snapshot of {len(refcounts)} blocks for a pool of {self.num_blocks}")
        free = set(clean) | set(evictable)
        if len(free) != len(clean) + len(evictable) or free != {b for b, r in enumerate(refcounts) if r == 0} \
                or min(refcounts, default=0) < 0:
            raise ValueError("a snapshot whose free lists are not exactly its blocks at refcount 0")
        self._refcounts[:] = [int(r) for r in refcounts]   # in place: refcounts stays a live view
        self._clean = deque(clean)
        self._evictable = OrderedDict.fromkeys(evictable)
        self._free_map = bytearray(_FREE[0] if r == 0 else _USED[0] for r in self._refcounts)
