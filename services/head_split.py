"""How attention heads split over tensor-parallel ranks: arithmetic only, no torch, so that every
process that sizes a KV pool (launcher, scheduler, kvstore, worker) computes it the same way.
services/worker/tp.py has the layers that use it."""
from __future__ import annotations

from dataclasses import dataclass


class TPConfigError(ValueError):
    """The model cannot be split over this many ranks (the message says which dimension)."""


def split(total: int, tp_size: int, what: str) -> int:
    """total / tp_size, or TPConfigError naming the dimension that does not divide."""
    if total % tp_size:
        raise TPConfigError(f"{what} ({total}) is not divisible by tp_size {tp_size}")
    return total // tp_size


@dataclass(frozen=True)
class HeadShard:
    """Which attention heads one rank holds: query heads [q_start, q_start + num_heads),
    KV heads [kv_start, kv_start + num_kv_heads)."""
    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, tp) -> HeadShard:
    """The heads rank tp.rank of tp.size holds (tp: a worker.tp.TensorParallel, or anything with
    rank and size)."""
    per_rank = split(num_heads, tp.size, "num_attention_heads")
    if num_kv_heads >= tp.size:
        kv_per_rank = split(num_kv_heads, tp.size, "num_key_value_heads")
        kv_start = tp.rank * kv_per_rank
    else:
        # Fewer KV heads than ranks: replicate. Ranks r*k .. r*k+k-1 (k = tp/Hkv) share KV head r;
        # their query heads are exactly that KV head's GQA group, so the mapping stays local.
        replicas = split(tp.size, num_kv_heads, "tp_size over num_key_value_heads (for KV-head replication)")
        kv_per_rank, kv_start = 1, tp.rank // replicas
    return HeadShard(tp.rank * per_rank, per_rank, kv_start, kv_per_rank)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank's pool holds (replicated heads count once per rank)."""
    return num_kv_heads // tp_size if num_kv_heads >= tp_size else 1
