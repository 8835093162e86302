"""Paged attention as a model layer: write this step's K/V into the cache, then attend over it."""
from __future__ import annotations

import torch

from pagedserve.kernels import ops
from pagedserve.services.worker.attn_metadata import AttentionMetadata


def paged_attention_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                          scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: two [num_blocks, B, Hkv, D] views -> [T, Hq, D]."""
    k_cache, v_cache = kv_cache
    ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.decode_only:
        return ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    return ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                   meta.query_start_loc, scale, meta.max_query_len)
