"""Triton kernels for paged attention (decode, and ragged prefill over a cached prefix), the K/V
cache write through a slot mapping, and block copies.

This module owns the GPU implementations; their semantics are those of kernels/reference.py and
docs/INTERFACES.md. On a machine without a GPU they run only under TRITON_INTERPRET=1, which must
be set before this module is imported (the @triton.jit decorators read it).

Rules every kernel keeps, because the layout and the interpreter demand them:
- caches are [num_blocks, B, Hkv, D] with an arbitrary stride(0): block ids are cast to int64
  before they are multiplied by a stride (int32 products overflow silently on big pools);
- no unmasked load can leave its tensor (an out-of-bounds load crashes the interpreter process);
- one fixed launch configuration chosen by simple rules below (no autotune: it needs a driver), and
  no specialization on integers that vary per step (_STEP_VARYING);
- every launch runs under the device guard of the tensor it writes (kernels/device.py): Triton
  launches on the current device and its current stream, which need not be the tensor's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.device import on_device
from pagedserve.kernels.limits import check_attention_shape


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _dot_precision(dtype: torch.dtype) -> str:
    # tl.dot on fp32 defaults to tf32 on GPUs (10-bit mantissa); fp32 callers expect fp32 results.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("caches must be [num_blocks, B, Hkv, D] with a unit stride on D")
    if k_cache.stride()[1:] != v_cache.stride()[1:] or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must share shape and inner strides")


# --------------------------------------------------------------------------------------------
# K/V cache write
# --------------------------------------------------------------------------------------------

@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, kv_pos, kv_ok, kv_head, dims,
                  cache_s0, cache_s1, cache_s2, BLOCK_SIZE: tl.constexpr):
    """One tile of keys (transposed, [D, N]) and values ([N, D]) at positions kv_pos ([N]) of a
    sequence, found through its block table; positions outside kv_ok read as zeros."""
    block_id = tl.load(table_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
    kv_off = block_id * cache_s0 + (kv_pos % BLOCK_SIZE) * cache_s1 + kv_head * cache_s2  # [N]
    k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None], mask=kv_ok[None, :], other=0.0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_ok[:, None], other=0.0)
    return k, v


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     key_s0, key_s1, value_s0, value_s1,
                     cache_s0, cache_s1, cache_s2,
                     num_kv_heads, BLOCK_SIZE: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    # One program per token: its [Hkv, D] key and value go to one slot.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, HEAD_DIM)  # [D]
    # A padding slot writes zero heads. (Folding the test into the bound, rather than and-ing a
    # scalar into the mask, also sidesteps the interpreter's rejection of scalar & tensor masks.)
    heads_to_write = tl.where(slot >= 0, num_kv_heads, 0)
    mask = heads[:, None] < heads_to_write  # [BLOCK_H, 1]
    block_id = tl.maximum(slot, 0) // BLOCK_SIZE
    offset = tl.maximum(slot, 0) % BLOCK_SIZE
    dst = block_id * cache_s0 + offset * cache_s1 + heads[:, None] * cache_s2 + dims[None, :]
    k = tl.load(key_ptr + t * key_s0 + heads[:, None] * key_s1 + dims[None, :], mask=mask)
    v = tl.load(value_ptr + t * value_s0 + heads[:, None] * value_s1 + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [T, Hkv, D]; caches [N, B, Hkv, D]; slot_mapping: [T] int64, < 0 skipped."""
    _check_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    check_attention_shape(head_dim, num_kv_heads, num_kv_heads)
    slots = slot_mapping.to(dtype=torch.int64).contiguous()
    with on_device(k_cache):
        _write_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slots,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            num_kv_heads, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
            BLOCK_H=_next_pow2(num_kv_heads), num_warps=4 if num_kv_heads * head_dim >= 1024 else 1)


# --------------------------------------------------------------------------------------------
# Paged attention
# --------------------------------------------------------------------------------------------

# Integers that change from step to step are not specialized on (Triton would otherwise compile a
# variant for == 1 and for multiples of 16): one compile per model, done by the worker's start-up
# pass, never a new one inside a later step.
_STEP_VARYING = ["table_s0", "q_blocks_per_seq"]


@triton.jit(do_not_specialize=_STEP_VARYING)
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
        scale_log2,
        q_s0, q_s1, out_s0, out_s1, cache_s0, cache_s1, cache_s2, table_s0,
        num_q_heads, q_blocks_per_seq,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        DOT_PRECISION: tl.constexpr):
    # Program (sequence s, query block qb, kv head h). Its BLOCK_M rows are BLOCK_Q query tokens
    # times the GROUP query heads sharing kv head h (row r: token r // GROUP, head r % GROUP), so
    # each K/V tile fetched through the block table serves the whole GQA group at once.
    pid = tl.program_id(0)
    seq = pid // q_blocks_per_seq
    q_block = pid % q_blocks_per_seq
    kv_head = tl.program_id(1)

    q_start = tl.load(qsl_ptr + seq).to(tl.int64)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int64) - q_start
    if q_block * BLOCK_Q >= q_len:
        return  # grid is sized by max_query_len; shorter sequences have idle blocks
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    context_len = seq_len - q_len  # tokens cached before this step's queries

    rows = tl.arange(0, BLOCK_M)  # [M]
    token = q_block * BLOCK_Q + rows // GROUP  # [M] query index within the sequence
    head = kv_head * GROUP + rows % GROUP  # [M] query head
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len) & (head < num_q_heads)  # [M]
    q_pos = context_len + token  # [M] absolute position = causal limit
    dims = tl.arange(0, HEAD_DIM)  # [D]

    q = tl.load(q_ptr + (q_start + token)[:, None] * q_s0 + head[:, None] * q_s1 + dims[None, :],
                mask=row_ok[:, None], other=0.0)  # [M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Causal: the last query of this block sees keys up to its own position, no further.
    last_token = tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    kv_end = tl.minimum(context_len + last_token + 1, seq_len)
    table_row = block_tables_ptr + seq.to(tl.int64) * table_s0
    cols = tl.arange(0, BLOCK_N)  # [N]
    for kv_start in range(0, kv_end, BLOCK_N):
        kv_pos = kv_start + cols  # [N]
        kv_ok = kv_pos < kv_end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, kv_pos, kv_ok, kv_head, dims,
                             cache_s0, cache_s1, cache_s2, BLOCK_SIZE)  # [D, N], [N, D]

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [M, N], log2 units
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        # Key 0 is visible to every row, and the first tile holds it, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [M]
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * out_s0 + head[:, None] * out_s1 + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=_STEP_VARYING[:1])
def _paged_decode_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale_log2,
        q_s0, q_s1, out_s0, out_s1, cache_s0, cache_s1, cache_s2, table_s0,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Program (sequence s, kv head h): the GROUP query heads of h (padded to BLOCK_G >= 16 rows,
    # the smallest tl.dot tile) read each K/V tile once while looping over the sequence's blocks.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)

    g = tl.arange(0, BLOCK_G)  # [G]
    head = kv_head * GROUP + g
    g_ok = g < GROUP
    dims = tl.arange(0, HEAD_DIM)  # [D]
    q = tl.load(q_ptr + seq * q_s0 + head[:, None] * q_s1 + dims[None, :], mask=g_ok[:, None],
                other=0.0)  # [G, D]

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    table_row = block_tables_ptr + seq * table_s0
    cols = tl.arange(0, BLOCK_N)  # [N]
    for kv_start in range(0, seq_len, BLOCK_N):
        kv_pos = kv_start + cols  # [N]
        kv_ok = kv_pos < seq_len
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, kv_pos, kv_ok, kv_head, dims,
                             cache_s0, cache_s1, cache_s2, BLOCK_SIZE)  # [D, N], [N, D]

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [G, N]
        s = tl.where(kv_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # the first tile holds key 0: finite
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * out_s0 + head[:, None] * out_s1 + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


_LOG2E = 1.4426950408889634


def _kv_tile(head_dim: int) -> int:
    """Keys per loop iteration. Independent of the cache's block size (each key finds its own
    block through the table), so a big block never means a big tile: a tile of 256 keys at head_dim
    128 needs more shared memory than a GPU has. >= 16 for tl.dot; smaller for big heads, whose
    [D, N] + [N, D] tiles would otherwise spill registers."""
    return 64 if head_dim <= 64 else 32


def _check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    _check_cache(k_cache, v_cache)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    check_attention_shape(k_cache.shape[3], num_q_heads, num_kv_heads)
    if q.shape[2] != k_cache.shape[3] or q.stride(2) != 1:
        raise ValueError("q must be [T, Hq, D] with the caches' D and a unit stride on D")
    return num_q_heads // num_kv_heads


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q: [S, Hq, D], one query per sequence at position seq_lens[s]-1. Returns [S, Hq, D]."""
    group = _check_attention_args(q, k_cache, v_cache)
    out = torch.empty_like(q)
    num_seqs, _, head_dim = q.shape
    if num_seqs == 0:
        return out
    block_size = k_cache.shape[1]
    block_tables = block_tables.contiguous()
    with on_device(out):
        _paged_decode_kernel[(num_seqs, k_cache.shape[2])](
            out, q, k_cache, v_cache, block_tables, seq_lens.contiguous(), scale * _LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            GROUP=group, BLOCK_G=max(16, _next_pow2(group)), BLOCK_N=_kv_tile(head_dim),
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, DOT_PRECISION=_dot_precision(q.dtype),
            num_warps=4, num_stages=2)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    max_query_len: int) -> torch.Tensor:
    """Ragged causal attention over the paged cache. q: [T, Hq, D] -> [T, Hq, D].

    A batch of pure decode (one query per sequence) goes to the decode kernel, which needs no idle
    query-block programs; anything else runs the general kernel.
    """
    group = _check_attention_args(q, k_cache, v_cache)
    num_tokens, _, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return torch.empty_like(q)
    if max_query_len == 1 and num_tokens == num_seqs:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    # Rows of a program = query tokens x the GQA group; at least 16 rows for tl.dot.
    block_m = max(16, _next_pow2(group))
    block_q = block_m // group
    q_blocks_per_seq = triton.cdiv(max_query_len, block_q)
    block_tables = block_tables.contiguous()
    with on_device(out):
        _paged_attention_kernel[(num_seqs * q_blocks_per_seq, k_cache.shape[2])](
            out, q, k_cache, v_cache, block_tables, seq_lens.contiguous(),
            query_start_loc.contiguous(), scale * _LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            q.shape[1], q_blocks_per_seq,
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=_kv_tile(head_dim),
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, DOT_PRECISION=_dot_precision(q.dtype),
            num_warps=4, num_stages=2)
    return out


# --------------------------------------------------------------------------------------------
# Block copy
# --------------------------------------------------------------------------------------------

@triton.jit
def _copy_blocks_kernel(pool_ptr, src_ptr, dst_ptr, row_stride, row_elems,
                        CHUNK: tl.constexpr):
    # Program (pair i, chunk c) copies CHUNK elements of row src[i] into row dst[i].
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    cols = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    ok = cols < row_elems
    data = tl.load(pool_ptr + src * row_stride + cols, mask=ok)
    tl.store(pool_ptr + dst * row_stride + cols, data, mask=ok)


def copy_blocks(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """pool[dst[i]] = pool[src[i]]; pool: [num_blocks, ...] with each row contiguous.

    Unlike the reference, pairs run concurrently: a destination must not also be a source.
    """
    if src.numel() == 0:
        return
    rows = pool.reshape(pool.shape[0], -1)  # [N, row_elems]
    if rows.stride(1) != 1 or rows.data_ptr() != pool.data_ptr():
        raise ValueError("copy_blocks needs a pool whose rows are each contiguous")
    # Byte pools (the kvstore's) move 4 bytes per element when the row size allows it.
    if rows.element_size() < 4 and (rows.shape[1] * rows.element_size()) % 4 == 0 \
            and (rows.stride(0) * rows.element_size()) % 4 == 0 and rows.data_ptr() % 4 == 0:
        rows = rows.view(torch.int32)
    chunk = min(4096, _next_pow2(rows.shape[1]))
    with on_device(pool):   # the pool's device, not the current one (the kvstore holds one per rank)
        src = src.to(device=pool.device, dtype=torch.int64).contiguous()
        dst = dst.to(device=pool.device, dtype=torch.int64).contiguous()
        _copy_blocks_kernel[(src.numel(), triton.cdiv(rows.shape[1], chunk))](
            rows, src, dst, rows.stride(0), rows.shape[1], CHUNK=chunk, num_warps=4)
