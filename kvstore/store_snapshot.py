"""A BlockStore's block state as data, and back: a restarted scheduler's mirror is built from it.

Owned by BlockStore (snapshot/restore), which hands these its own allocators, indexes and sequence
tables: writing them back is the store replacing its own state, checked and rolled back by the store.
"""

from __future__ import annotations

from pagedserve.kvstore.allocator import BlockAllocator
from pagedserve.kvstore.block_table import SequenceTable
from pagedserve.kvstore.prefix_index import PrefixIndex


def snapshot(device: BlockAllocator, host: BlockAllocator, index: PrefixIndex | None,
             host_index: PrefixIndex | None, seqs: dict[int, SequenceTable]) -> dict:
    """Every piece of block state, no bytes and no counters, in plain lists (msgpack carries
    them unchanged): a store restored from it answers every later operation as this one does."""
    return {"device": device.snapshot(), "host": host.snapshot(),
            "index": _index_rows(index), "host_index": _index_rows(host_index),
            "seqs": [[seq_id, list(t.blocks), list(t.token_ids), wire_keys(t.extra_keys), t.location,
                      t.reserved_blocks, list(t.hashes), t.num_registered, t.final_tokens]
                     for seq_id, t in seqs.items()]}


def restore(device: BlockAllocator, host: BlockAllocator, index: PrefixIndex | None,
            host_index: PrefixIndex | None, snap: dict) -> dict[int, SequenceTable]:
    """Write snap's allocator and index state into these (in place) -> its sequence tables.
    Unchecked, and a bad snapshot may leave them half written: the store checks and rolls back."""
    device.restore(snap["device"])
    host.restore(snap["host"])
    for any_index, rows in ((index, snap["index"]), (host_index, snap["host_index"])):
        if (any_index is None) != (rows is None):
            raise ValueError("the snapshot's prefix caching or host tier is not this store's")
        if any_index is not None:
            any_index.clear()
            for h, b in rows:
                if not any_index.register(b, bytes(h)):
                    raise ValueError(f"block {b} or its hash is keyed twice")
    seqs = {}
    for seq_id, blocks, tokens, keys, location, reserved, hashes, registered, final in snap["seqs"]:
        seqs[seq_id] = SequenceTable(list(blocks), list(tokens), tuple(keys), location, reserved,
                                     [bytes(h) for h in hashes], registered, final)
    return seqs


def _index_rows(index: PrefixIndex | None) -> list | None:
    return [[h, b] for h, b in index.items()] if index is not None else None


def wire_keys(keys) -> list:
    """Extra keys as msgpack gives them back (tuples become lists; the hash treats both alike)."""
    return [wire_keys(k) if isinstance(k, (tuple, list)) else k for k in keys]
