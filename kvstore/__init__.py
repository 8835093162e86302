"""The block store: physical KV pools, their allocation, sharing, swapping and prefix caching.

This package is the core the kvstore process wraps; the scheduler and the offline engine call it.
"""

from kvstore.allocator import AllocationPolicy, BlockAllocator, OrcaPolicy, PagedPolicy
from kvstore.pool import BlockPool, unique_pool_name
from kvstore.prefix_index import PrefixIndex, hash_block
from kvstore.store import AllocResult, AppendResult, BlockStore, SwapResult

__all__ = [
    "AllocResult", "AllocationPolicy", "AppendResult", "BlockAllocator", "BlockPool", "BlockStore",
    "OrcaPolicy", "PagedPolicy", "PrefixIndex", "SwapResult", "hash_block", "unique_pool_name",
]
