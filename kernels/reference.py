"""Plain-PyTorch paged attention, KV-cache write and block copy: the CPU path of the server.

This module owns the reference semantics of the four kernels (docs/INTERFACES.md, "kernels/"); the
Triton versions in triton_ops.py must agree with it. Caches are [num_blocks, B, Hkv, D] views whose
stride(0) may exceed one block's elements (one block holds every layer's K and V), so blocks are
always reached by advanced indexing on dim 0, never by a .view() that spans blocks.

Attention is computed in float32 with torch's scaled_dot_product_attention and an explicit boolean
mask (on CPU that is the fused flash kernel: 2-4x faster than matmul + softmax here and it does not
materialise the score matrix), and returned in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _block_coords(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split slots (block_id * B + offset) into (block ids, offsets)."""
    return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V at its slot; tokens whose slot is negative are padding and skipped.

    key, value: [T, Hkv, D]; k_cache, v_cache: [N, B, Hkv, D]; slot_mapping: [T] int64.
    """
    slots = slot_mapping.to(device=key.device, dtype=torch.int64)  # [T]
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel() == 0:
        return
    block_ids, offsets = _block_coords(slots, k_cache.shape[1])
    # Indexed assignment on the strided view writes through to the pool's storage.
    k_cache[block_ids, offsets] = key.to(k_cache.dtype)
    v_cache[block_ids, offsets] = value.to(v_cache.dtype)


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               num_blocks: int) -> torch.Tensor:
    """Gather the first num_blocks logical blocks of each sequence: [S, num_blocks * B, Hkv, D] f32.

    Table entries past a sequence's last block may be padding (any value, even -1), so they are
    replaced by block 0; the tokens they would supply are masked out by the caller.
    """
    block_size = cache.shape[1]
    table = block_tables[:, :num_blocks].to(device=cache.device, dtype=torch.int64)  # [S, nb]
    blocks_used = (seq_lens.to(table.device, torch.int64) + block_size - 1) // block_size  # [S]
    in_use = torch.arange(num_blocks, device=table.device)[None, :] < blocks_used[:, None]
    table = torch.where(in_use, table, torch.zeros_like(table))
    # index_select copies whole block rows (each contiguous inside the strided pool): ~4x faster
    # on CPU than cache[table], which computes an offset per element.
    gathered = torch.index_select(cache, 0, table.reshape(-1))  # [S * nb, B, Hkv, D], contiguous
    _, b, h, d = gathered.shape
    return gathered.view(table.shape[0], num_blocks * b, h, d).float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            kv_len: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of padded queries over padded keys, GQA by head grouping.

    q: [S, Q, Hq, D] f32; k, v: [S, L, Hkv, D] f32; q_pos: [S, Q] absolute position of each query
    (its causal limit); kv_len: [S] number of valid keys. Returns [S, Q, Hq, D] f32.
    """
    kv_pos = torch.arange(k.shape[1], device=k.device)  # [L]
    mask = ((kv_pos[None, None, :] <= q_pos[:, :, None])
            & (kv_pos[None, None, :] < kv_len[:, None, None]))  # [S, Q, L]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[2] != k.shape[2])  # [S, Hq, Q, D]
    return out.transpose(1, 2)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query per sequence at position seq_lens[s]-1, attending to all seq_lens[s] cached keys.

    q: [S, Hq, D]; block_tables: [S, max_blocks] int32; seq_lens: [S] int32. Returns [S, Hq, D].
    Every sequence is handled in one batched gather + attention call (no loop over sequences).
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    lens = seq_lens.to(device=q.device, dtype=torch.int64)  # [S]
    block_size = k_cache.shape[1]
    num_blocks = (int(lens.max()) + block_size - 1) // block_size
    k = _gather_kv(k_cache, block_tables, lens, num_blocks)  # [S, L, Hkv, D]
    v = _gather_kv(v_cache, block_tables, lens, num_blocks)
    q_pos = (lens - 1)[:, None]  # [S, 1]
    out = _attend(q.float()[:, None], k, v, q_pos, lens, scale)  # [S, 1, Hq, D]
    # A row of length 0 is padding (a CUDA graph bucket's spare row): zeros, as every kernel gives.
    return out[:, 0].masked_fill((lens == 0)[:, None, None], 0.0).to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    max_query_len: int) -> torch.Tensor:
    """Ragged causal attention of this step's queries over each sequence's cached K/V.

    q: [T, Hq, D]; query_start_loc: [S+1] int32; seq_lens: [S] int32 (KV length including this
    step's tokens). Query j of sequence s sits at position seq_lens[s] - q_len + j.
    Decode rows (q_len == 1) are batched together; longer queries (prefill, chunked prefill) are
    handled one sequence at a time so the padded score matrix never spans the whole batch.
    """
    out = torch.empty_like(q)  # [T, Hq, D]
    if q.shape[0] == 0:
        return out
    qsl = query_start_loc.to(device="cpu", dtype=torch.int64)  # [S+1]
    lens = seq_lens.to(device="cpu", dtype=torch.int64)  # [S]
    q_lens = qsl[1:] - qsl[:-1]  # [S]

    decode = torch.nonzero(q_lens == 1).flatten()  # [S_dec] sequences with one query
    if decode.numel() > 0:
        rows = qsl[:-1][decode].to(q.device)  # [S_dec] row of each one's query in q
        decode = decode.to(block_tables.device)
        out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, block_tables[decode],
                                           seq_lens.to(decode.device)[decode], scale)

    block_size = k_cache.shape[1]
    for s in torch.nonzero(q_lens > 1).flatten().tolist():
        start, q_len, kv_len = int(qsl[s]), int(q_lens[s]), int(lens[s])
        num_blocks = (kv_len + block_size - 1) // block_size
        one_len = lens[s:s + 1].to(q.device)  # [1]
        k = _gather_kv(k_cache, block_tables[s:s + 1], one_len, num_blocks)  # [1, L, Hkv, D]
        v = _gather_kv(v_cache, block_tables[s:s + 1], one_len, num_blocks)
        q_pos = (kv_len - q_len + torch.arange(q_len, device=q.device))[None]  # [1, q_len]
        seq_out = _attend(q[start:start + q_len].float()[None], k, v, q_pos, one_len, scale)
        out[start:start + q_len] = seq_out[0].to(q.dtype)
    return out


def copy_blocks(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """pool[dst[i]] = pool[src[i]] for every i; all sources are read before any destination is
    written, so the result is well defined even if a destination is also a source.

    pool: [num_blocks, ...] any dtype; src, dst: [N] int64.
    """
    if src.numel() == 0:
        return
    src = src.to(device=pool.device, dtype=torch.int64)
    dst = dst.to(device=pool.device, dtype=torch.int64)
    pool[dst] = pool[src]
