"""Per-sequence block tables: the logical-to-physical map of one sequence and what it needs to hash.

A SequenceTable owns one sequence's list of physical block ids (logical block i lives in blocks[i],
in the pool named by `location`), its token ids (the kvstore must know them to key full blocks for
prefix caching), and how far its chain of block hashes has been computed and registered.

Tokens fill blocks front to back, so only the block holding the last token can be partly filled:
block i holds min(B, max(0, num_tokens - i*B)) tokens. Blocks past that one are reserved and empty
(only under a reserving policy such as Orca's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEVICE = "device"
HOST = "host"


# eq=False: a table is one sequence's, compared by identity. (A generated __eq__ made the store's
# bulk `None in tables` check call Python once per running sequence, on both mirror and replica.)
@dataclass(eq=False)
class SequenceTable:
    blocks: list[int]
    token_ids: list[int]
    extra_keys: tuple
    location: str = DEVICE
    reserved_blocks: int = 0            # what the policy reserved at admission
    hashes: list[bytes] = field(default_factory=list)  # chained keys of full blocks, computed lazily
    num_registered: int = 0             # leading full blocks already offered to the prefix index
    final_tokens: int = 0               # the length it is expected to reach (splits empty slots)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def filled(self, i: int, block_size: int) -> int:
        """Tokens held by logical block i."""
        return min(block_size, max(0, self.num_tokens - i * block_size))

    def slot(self, position: int, block_size: int) -> int:
        return self.blocks[position // block_size] * block_size + position % block_size

    def fork(self) -> "SequenceTable":
        return SequenceTable(blocks=list(self.blocks), token_ids=list(self.token_ids),
                             extra_keys=self.extra_keys, location=self.location,
                             reserved_blocks=self.reserved_blocks, hashes=list(self.hashes),
                             num_registered=self.num_registered, final_tokens=self.final_tokens)
