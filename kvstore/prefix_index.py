"""The prefix-hash index of the device pool: which physical block holds which full, computed block.

A full block is keyed by a chained hash of (parent block's hash, its token ids, extra keys such as a
cache salt or a LoRA/multimodal id), so equal keys mean equal token prefixes and equal extras, and
therefore equal K/V. The hash is blake2b over a stable byte encoding, never Python's hash(), which is
salted per process and would differ between the kvstore, its restarts and any peer that computes
keys itself.

PrefixIndex owns the two maps hash -> block and block -> hash, and nothing else: whether a hashed
block is in use or free (evictable) is the allocator's business.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Sequence

HASH_BYTES = 16


def _encode_key(key: object) -> bytes:
    """A type-tagged, length-prefixed encoding: distinct keys never encode to the same bytes."""
    if isinstance(key, bool) or key is None:
        body, tag = repr(key).encode(), b"o"
    elif isinstance(key, int):
        body, tag = str(key).encode(), b"i"
    elif isinstance(key, str):
        body, tag = key.encode("utf-8"), b"s"
    elif isinstance(key, (bytes, bytearray)):
        body, tag = bytes(key), b"b"
    elif isinstance(key, float):
        body, tag = key.hex().encode(), b"f"
    elif isinstance(key, (tuple, list)):
        body, tag = b"".join(_encode_key(k) for k in key), b"t"
    else:
        raise TypeError(f"extra key of type {type(key).__name__} has no stable encoding")
    return tag + struct.pack("<I", len(body)) + body


_NO_KEYS = _encode_key(())


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """Key of one full block: its parent's key (None for the first block), tokens and extras."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent if parent is not None else b"\x00" * HASH_BYTES)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(_encode_key(tuple(extra_keys)) if extra_keys else _NO_KEYS)
    return h.digest()


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                  num_full_blocks: int, extra_keys: tuple = ()) -> None:
    """Append the keys of full blocks len(hashes) .. num_full_blocks-1 to `hashes` (the chain)."""
    for i in range(len(hashes), num_full_blocks):
        parent = hashes[i - 1] if i > 0 else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys))


class PrefixIndex:
    """hash <-> block for registered device blocks (in use or evictable)."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._block_of)

    def longest_prefix(self, hashes: Iterable[bytes]) -> list[int]:
        """Blocks holding the longest run of leading hashes that are all registered."""
        hits = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def block_of(self, h: bytes) -> int | None:
        return self._block_of.get(h)

    def register(self, block: int, h: bytes) -> bool:
        """Key `block` by h unless h already names another block (a duplicate computed separately
        keeps no hash: first come, first cached) or the block already has a key."""
        if h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        return True

    def drop(self, block: int) -> None:
        h = self._hash_of.pop(block)
        del self._block_of[h]

    def clear(self) -> None:
        self._block_of.clear()
        self._hash_of.clear()

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._block_of.items())
