"""BlockStore: the block-store core that the kvstore process wraps (no sockets, no clocks).

Ownership: only the kvstore process, through this core, mutates the device and host pools' block
state: refcounts, free lists, the evictable LRU, per-sequence block tables, the prefix-hash index,
and the bytes moved by copy-on-write and swap copies. The scheduler asks for operations and reads
the results (it may mirror counts); workers read and write K/V only in slots they were handed and
never allocate. The offline engine runs this same class in-process.

Operations either succeed or return ok=False with a reason and change nothing (capacity is checked
before any state is touched). ValueError means a programming error: an unknown or duplicate seq id,
an operation on a sequence in the wrong pool, a range outside a sequence.

Copy-on-write: before new tokens land in a block whose refcount is above 1, the writer gets a fresh
block, the bytes are copied in every device pool, and AppendResult.copies says (old, new). The last
holder of a shared block writes in place, so a partly filled block shared by a fork is copied once.

Prefix caching: a full block gets its chained hash when it is marked computed; a freed hashed block
waits in the allocator's evictable LRU with its index entry until it is reused. Lookups never cover a
prompt's last token, so the model always computes at least one token of a prompt.

The host tier (host_cache_blocks > 0) keeps hashed blocks the device LRU evicts in host blocks no
swapped sequence holds, and gives them back on a device miss: host_tier.py says how.

This module holds the operations that change the block state; what the store holds and every read
of it are its base, store_state.StoreState. The store's other jobs live beside it, each owned by it:
the results it returns (results.py, whose names this module re-exports), its reports
(store_report.py) and its state as data (store_snapshot.py).
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Iterable, Sequence

from pagedserve.kvstore.block_table import DEVICE, HOST, SequenceTable
from pagedserve.kvstore.prefix_index import extend_hashes
# Re-exported: the op log, the services and the tests import these from here.
from pagedserve.kvstore.results import AllocResult, AppendResult, BatchAppendResult, SwapResult
from pagedserve.kvstore.store_snapshot import wire_keys
from pagedserve.kvstore.store_state import StoreState

__all__ = ["AllocResult", "AppendResult", "BatchAppendResult", "BlockStore", "SwapResult", "wire_keys"]

_LOCATION = operator.attrgetter("location")
_TOKEN_IDS = operator.attrgetter("token_ids")


class BlockStore(StoreState):
    """Device + host block pools, refcounts, block tables and the device prefix index."""

    # ---- admission -------------------------------------------------------------------------

    def can_allocate(self, num_tokens: int, max_total_tokens: int | None = None) -> bool:
        """Whether a new sequence of num_tokens fits even with no prefix hit (so a True is a
        promise: hits only lower the need, by at least as many blocks as they take off the LRU)."""
        need = self.policy.blocks_to_reserve(num_tokens, max_total_tokens, self.block_size)
        if self.policy.contiguous:
            return need <= max(self._device.free_runs(), default=0)
        return need <= self._device.num_free

    def allocate(self, seq_id: int, token_ids: Sequence[int], extra_keys: tuple = (),
                 max_total_tokens: int | None = None) -> AllocResult:
        """Admit a sequence: reuse the longest cached prefix, then reserve blocks for the rest.

        max_total_tokens: the request's final length (prompt + its true output length where known,
        else + max_tokens). Reserving policies (Orca) size their region by it; every policy keeps
        it to split empty slots into reserved and internally fragmented (kv_usage)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        if len(token_ids) == 0:
            raise ValueError("a sequence needs at least one token")
        tokens, extras = [int(t) for t in token_ids], tuple(extra_keys)
        reserve = self.policy.blocks_to_reserve(len(tokens), max_total_tokens, self.block_size)
        hashes: list[bytes] = []
        hits: list[tuple[int, bool]] = []   # (block, on the host) of each leading cached block
        if self._index is not None:
            # Only blocks strictly before the last token: its logits must be computed.
            extend_hashes(hashes, tokens, self.block_size, (len(tokens) - 1) // self.block_size, extras)
            hits = self._lookup(hashes)
        on_device = [b for b, host in hits if not host]
        revived_from_lru = sum(1 for b in on_device if self._device.refcount(b) == 0)
        new = reserve - len(on_device)   # promotions take new device blocks too
        if new > self._device.num_free - revived_from_lru:
            return AllocResult(False, 0, f"needs {new} new device blocks, "
                                         f"{self._device.num_free - revived_from_lru} free")
        if self.policy.contiguous:   # no prefix cache under these policies: hits is empty
            blocks = self._device.allocate_run(new)
            if blocks is None:
                return AllocResult(False, 0, f"needs a run of {new} contiguous device blocks, the longest "
                                             f"free run is {max(self._device.free_runs(), default=0)}")
        else:
            # Revive device hits and hold host hits before allocating, else allocation could evict
            # (or a demotion it causes replace) the very blocks we hit.
            for b, host in hits:
                self._alloc(HOST if host else DEVICE).incref(b)
            fresh = iter(self._device_allocate(new))
            blocks = [next(fresh) if host else b for b, host in hits]   # a host hit comes back in a new block
            if self._tier is not None:
                self._tier.promote([(i, b, blocks[i]) for i, (b, host) in enumerate(hits) if host], hashes)
            blocks += fresh
        self._seqs[seq_id] = SequenceTable(blocks=blocks, token_ids=tokens, extra_keys=extras,
                                           location=DEVICE, reserved_blocks=reserve, hashes=hashes,
                                           num_registered=len(hits),
                                           final_tokens=max_total_tokens or len(tokens))
        if self._index is not None:
            promoted = len(hits) - len(on_device)
            self._counters["prefix_queries_tokens"] += len(tokens)
            self._counters["prefix_hit_tokens"] += len(on_device) * self.block_size
            if self._host_index is not None:   # vLLM asks its external tier for what the device missed
                self._counters["host_queries_tokens"] += len(tokens) - len(on_device) * self.block_size
                self._counters["host_hit_tokens"] += promoted * self.block_size
        self._note_peak()
        return AllocResult(True, len(hits) * self.block_size,
                           num_host_cached_tokens=sum(host for _, host in hits) * self.block_size)

    def _lookup(self, hashes: list[bytes]) -> list[tuple[int, bool]]:
        """(block, on the host) for the longest run of leading hashes cached in either tier, the
        device's copy first."""
        hits = []
        for h in hashes:
            block = self._index.block_of(h)
            if block is not None:
                hits.append((block, False))
                continue
            block = self._host_index.block_of(h) if self._host_index is not None else None
            if block is None:
                break
            hits.append((block, True))
        return hits

    # ---- the host tier (host_tier.py; StoreState._evict_device holds what the LRU evicts) ---

    def _device_allocate(self, n: int) -> list[int]:
        """n device blocks (BlockAllocator.allocate), the hashed ones it evicted demoted before
        anyone writes them."""
        blocks = self._device.allocate(n)
        if self._tier is not None:
            self._tier.demote_evicted()
        return blocks

    # ---- growth, copy-on-write, prefix registration ----------------------------------------

    def append_blocks_needed(self, seq_ids: Iterable[int], num_new_tokens: int = 1) -> int:
        """New device blocks that appending num_new_tokens to each of seq_ids (in any order) takes,
        copy-on-write copies included. A block shared by r tables of which w write: w copies when
        w < r, w - 1 when w == r (the last writer owns it by then)."""
        return self._blocks_needed(self._tables(seq_ids, DEVICE), num_new_tokens)

    def _blocks_needed(self, tables: list[SequenceTable], num_new_tokens: int,
                       growing: list[int] | None = None, location: str = DEVICE) -> int:
        """(growing: with one new token each, the indices of the tables that take a new block or
        copy a shared one are appended to it; every other table owns the block its token lands in.
        location: where the tables are now; a swapped group's host refcounts are its in-group ones.)"""
        if num_new_tokens <= 0:
            return 0
        # Called for every running request every step: plain loops, no Counter unless a written
        # block is actually shared (rare outside forks and beams).
        refcounts, bs = self._alloc(location).refcounts, self.block_size
        writers: Counter[int] | None = None
        new = 0
        if num_new_tokens == 1:   # a decode step: one block to look at per table
            for k, t in enumerate(tables):
                i, blocks = len(t.token_ids) // bs, t.blocks
                if i >= len(blocks):
                    new += 1
                elif refcounts[blocks[i]] > 1:
                    writers = writers if writers is not None else Counter()
                    writers[blocks[i]] += 1
                else:
                    continue
                if growing is not None:
                    growing.append(k)
            tables = ()
        for t in tables:
            n, blocks = len(t.token_ids), t.blocks
            lo, hi = n // bs, (n + num_new_tokens - 1) // bs + 1
            for i in range(lo, min(hi, len(blocks))):
                if refcounts[blocks[i]] > 1:
                    writers = writers if writers is not None else Counter()
                    writers[blocks[i]] += 1
            if hi > len(blocks):
                new += hi - len(blocks)
        for block, w in (writers or {}).items():
            new += w if w < refcounts[block] else w - 1
        return new

    def can_append(self, seq_ids: Iterable[int], num_new_tokens: int = 1) -> bool:
        return self.append_blocks_needed(seq_ids, num_new_tokens) <= self._device.num_free

    def append_slots(self, seq_id: int, token_ids: Sequence[int]) -> AppendResult:
        """Grow a device sequence by token_ids: copy shared blocks it will write, add blocks past its
        end. The new tokens' slots are slot_mapping(seq_id, old_len, new_len) afterwards."""
        t = self._seqs.get(seq_id)
        if t is None or t.location != DEVICE:
            t = self._table(seq_id, DEVICE)   # raises the right ValueError
        if len(token_ids) == 0:
            return AppendResult(True)
        n, bs = len(t.token_ids), self.block_size   # blocks [lo, hi) receive the new tokens
        lo, hi = n // bs, (n + len(token_ids) - 1) // bs + 1
        blocks, refcounts = t.blocks, self._device.refcounts
        cow = [i for i in range(lo, min(hi, len(blocks))) if refcounts[blocks[i]] > 1]
        new = hi - len(blocks) if hi > len(blocks) else 0
        if not cow and not new:   # the decode common case: the token lands in a block it owns
            t.token_ids.extend([int(x) for x in token_ids])
            return AppendResult(True)
        free = self._device.num_free
        if len(cow) + new > free:
            return AppendResult(False, [], f"needs {len(cow) + new} device blocks "
                                           f"({len(cow)} copy-on-write), {free} free")
        copies = []
        for i, dst in zip(cow, self._device_allocate(len(cow))):
            src = blocks[i]
            self._device.decref(src, keep_cached=self._has_hash(src, DEVICE))  # others still hold it
            blocks[i] = dst
            copies.append((src, dst))
        if copies:
            for pool in self.device_pools:
                pool.copy_within(copies)
            self._counters["cow_copies"] += len(copies)
        blocks.extend(self._device_allocate(new))
        t.token_ids.extend([int(x) for x in token_ids])
        self._note_peak()
        return AppendResult(True, copies)

    def append_tokens(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> BatchAppendResult:
        """One token onto each of seq_ids, in order (a decode step's growth in one call): the same as
        append_slots(seq_ids[i], [token_ids[i]]) for each i, but all or nothing — a shortage of
        blocks for any of them fails the whole batch before anything changes."""
        if len(seq_ids) != len(token_ids):
            raise ValueError(f"{len(seq_ids)} sequences but {len(token_ids)} tokens")
        tables = list(map(self._seqs.get, seq_ids))   # the per-step hot path: checked in bulk below
        if None in tables or set(map(_LOCATION, tables)) != {DEVICE} or len(set(seq_ids)) != len(seq_ids):
            tables = self._tables(seq_ids, DEVICE)   # raises the right ValueError
        growing: list[int] = []
        need = self._blocks_needed(tables, 1, growing)
        if need > self._device.num_free:
            return BatchAppendResult(False, [], f"needs {need} device blocks, {self._device.num_free} free")
        # Tokens that land in a block their table owns touch nothing shared: append them at once.
        # The rest take new blocks or copies, in order (which writer of a shared block copies
        # depends on it).
        if growing:
            special = set(growing)
            for k, (t, token) in enumerate(zip(tables, token_ids)):
                if k not in special:
                    t.token_ids.append(token)
        else:   # most steps of a small batch, and a C-level pass
            list(map(list.append, map(_TOKEN_IDS, tables), token_ids))
        copies = []
        for k in growing:
            seq_id, token = seq_ids[k], token_ids[k]
            # BlockStore's own, not an override's: the batch is one operation (a recording mirror,
            # replay.RecordingStore, logs it once as append_tokens).
            r = BlockStore.append_slots(self, seq_id, (token,))
            if not r.ok:   # the count above said it fits: a mismatch is a bug, not a shortage
                raise RuntimeError(f"append_tokens: sequence {seq_id} failed after the batch was counted: {r.reason}")
            copies += [(seq_id, src, dst) for src, dst in r.copies]
        return BatchAppendResult(True, copies)

    def mark_computed(self, seq_id: int, num_computed_tokens: int) -> bool:
        """K/V of the first num_computed_tokens tokens is written: key every full block below it.
        -> whether a block was keyed (the op log records only calls that changed the store)."""
        t = self._table(seq_id, DEVICE)
        if not 0 <= num_computed_tokens <= t.num_tokens:
            raise ValueError(f"sequence {seq_id} has {t.num_tokens} tokens, "
                             f"not {num_computed_tokens} computed")
        if self._index is None:
            return False
        full = num_computed_tokens // self.block_size
        if full <= t.num_registered:
            return False
        extend_hashes(t.hashes, t.token_ids, self.block_size, full, t.extra_keys)
        for i in range(t.num_registered, full):
            self._index.register(t.blocks[i], t.hashes[i])
        t.num_registered = full
        return True

    def set_tokens(self, seq_ids: Sequence[int], positions: Sequence[int], token_ids: Sequence[int]) -> None:
        """Write token_ids[i] at positions[i] of seq_ids[i]: a slot appended before its token was
        drawn (async scheduling appends a placeholder) gets the token, before any hash covers it.
        Checked before anything changes."""
        if not len(seq_ids) == len(positions) == len(token_ids):
            raise ValueError(f"{len(seq_ids)} sequences, {len(positions)} positions, {len(token_ids)} tokens")
        tables = [self._table(s) for s in seq_ids]
        bs = self.block_size
        for seq_id, t, pos in zip(seq_ids, tables, positions):
            if not max(len(t.hashes), t.num_registered) * bs <= pos < len(t.token_ids):
                raise ValueError(f"sequence {seq_id}: position {pos} is not an unhashed slot of its "
                                 f"{len(t.token_ids)} tokens")
        for t, pos, token in zip(tables, positions, token_ids):
            t.token_ids[pos] = int(token)

    # ---- sharing and release ---------------------------------------------------------------

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (same pool); nothing is allocated."""
        parent = self._table(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} already exists")
        alloc = self._alloc(parent.location)
        for b in parent.blocks:
            alloc.incref(b)
        self._seqs[child_id] = parent.fork()

    def free(self, seq_id: int) -> None:
        t = self._table(seq_id)
        del self._seqs[seq_id]
        alloc = self._alloc(t.location)
        # Tail first: the LRU then evicts a prefix's last blocks before its first ones, and a
        # prefix with its head evicted is useless while one with its tail evicted still hits.
        for b in reversed(t.blocks):
            alloc.decref(b, keep_cached=self._has_hash(b, t.location))

    # ---- preemption by swapping ------------------------------------------------------------

    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        tables = self._tables(seq_ids, DEVICE)
        return self.policy.swappable and len(self._group_refs(tables)) <= self._host.num_free

    def can_swap_in(self, seq_ids: Iterable[int]) -> bool:
        return len(self._group_refs(self._tables(seq_ids, HOST))) <= self._device.num_free

    def swap_in_blocks_needed(self, seq_ids: Iterable[int], growing_ids: Iterable[int]) -> int:
        """Device blocks that swapping a group in takes, plus one new token on each of growing_ids
        (new blocks and copy-on-write copies, counted as append_blocks_needed counts them)."""
        tables = self._tables(seq_ids, HOST)
        return len(self._group_refs(tables)) + self._blocks_needed(self._tables(growing_ids, HOST), 1,
                                                                   location=HOST)

    def swap_out(self, seq_ids: Iterable[int]) -> SwapResult:
        """Move a group (one request's sequences) to the host pool, all or nothing."""
        tables = self._tables(seq_ids, DEVICE)
        if not self.policy.swappable:
            return SwapResult(False, [], f"{self.policy.name} never swaps")
        return self._swap(tables, DEVICE, HOST)

    def swap_in(self, seq_ids: Iterable[int]) -> SwapResult:
        """Bring a swapped group back to the device pool, all or nothing."""
        return self._swap(self._tables(seq_ids, HOST), HOST, DEVICE)

    def _swap(self, tables: list[SequenceTable], src_loc: str, dst_loc: str) -> SwapResult:
        src, dst = self._alloc(src_loc), self._alloc(dst_loc)
        refs = self._group_refs(tables)  # each shared block moves once, keeping its in-group count
        if len(refs) > dst.num_free:
            return SwapResult(False, [], f"needs {len(refs)} {dst_loc} blocks, {dst.num_free} free")
        new_blocks = self._device_allocate(len(refs)) if dst_loc == DEVICE else dst.allocate(len(refs))
        mapping = list(zip(refs, new_blocks))
        src_pools, dst_pools = ((self.device_pools, self.host_pools) if src_loc == DEVICE
                                else (self.host_pools, self.device_pools))
        for sp, dp in zip(src_pools, dst_pools):
            sp.copy_to(dp, mapping)
        for (old, count), new in zip(refs.items(), new_blocks):
            for _ in range(count - 1):
                dst.incref(new)
            # A device block whose last holder leaves is gone from the device: it keeps no hash.
            if src_loc == DEVICE and src.refcount(old) == count and self._has_hash(old, DEVICE):
                self._index.drop(old)
            for _ in range(count):
                src.decref(old, keep_cached=self._has_hash(old, src_loc))
        moved = dict(mapping)
        for t in tables:
            t.blocks = [moved[b] for b in t.blocks]
            t.location = dst_loc
            t.num_registered = 0  # re-registered by mark_computed once back on the device
        kind = "out" if src_loc == DEVICE else "in"
        self._counters[f"swap_{kind}s"] += 1
        self._counters[f"swap_{kind}_blocks"] += len(mapping)
        self._note_peak()
        return SwapResult(True, mapping)

    @staticmethod
    def _group_refs(tables: list[SequenceTable]) -> Counter[int]:
        """Distinct blocks of a group, in first-seen order, with how many of its tables hold each."""
        refs: Counter[int] = Counter()
        for t in tables:
            refs.update(t.blocks)
        return refs
