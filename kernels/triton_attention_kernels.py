"""The Triton paged-attention kernels: ragged prefill over a cached prefix, decode (whole or in
flash-decoding shares) and the reduce of those shares. Device code only; kernels/triton_ops.py
launches them with the configuration kernels/triton_launch.py picks.

Rules every kernel keeps, because the layout and the interpreter demand them:
- caches are [num_blocks, B, Hkv, D] with an arbitrary stride(0): block ids are cast to int64
  before they are multiplied by a stride (int32 products overflow silently on big pools);
- no unmasked load can leave its tensor (an out-of-bounds load crashes the interpreter process);
- no specialization on integers that vary per step (_STEP_VARYING).
On a machine without a GPU they run only under TRITON_INTERPRET=1, which must be set before this
module is imported (the @triton.jit decorators read it).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Integers that change from step to step are not specialized on (Triton would otherwise compile a
# variant for == 1 and for multiples of 16): one compile per model, done by the worker's start-up
# pass, never a new one inside a later step. num_splits is here too: it is static for a captured
# batch size but differs between batch sizes, and == 1 must not become a second compile.
_STEP_VARYING = ["table_s0", "q_blocks_per_seq", "num_splits"]


# Set for the whole process before this module is imported (the @triton.jit decorators read it).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if INTERPRETED:
    @triton.jit
    def _mma(a, b, DOT_PRECISION: tl.constexpr):
        """tl.dot, for the interpreter: its tl.dot multiplies bf16 operands as their raw 16-bit
        patterns (triton 3.9; fp16 and fp32 are right), so bf16 operands are widened to fp32
        first. They hold bf16 values either way (p is rounded to bf16 before it gets here), so the
        products are those a GPU's bf16 MMA makes, accumulated in fp32 as there."""
        if a.dtype == tl.bfloat16:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b, input_precision=DOT_PRECISION)
else:
    @triton.jit
    def _mma(a, b, DOT_PRECISION: tl.constexpr):
        """tl.dot (a GPU's: the interpreter has its own definition above)."""
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_start, cols, kv_end,
                 q_pos, kv_head, dims, scale_log2, cache_s0, cache_s1, cache_s2,
                 BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One online-softmax step (FlashAttention-2): rows q ([M, D], any M >= 16) over the K/V tile
    at positions kv_start + cols of one sequence, found through its block table. Returns the new
    (m_i, l_i, acc); scores are in log2 units (scale_log2 folds log2(e) in), acc is unnormalized.

    MASKED=False is the hot path: the caller guarantees every key of the tile is < kv_end and
    visible to every row, so no load is masked and no score is. MASKED=True masks keys >= kv_end
    (their loads too: positions past the sequence may have junk or -1 in the table) and, when
    CAUSAL, keys after a row's own position q_pos ([M]). Caller's invariant: each row has seen a
    visible key by its first tile (key 0 is visible to every row), so m_new stays finite."""
    kv_pos = kv_start + cols  # [N]
    if MASKED:
        kv_ok = kv_pos < kv_end
        block_id = tl.load(table_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
    else:
        block_id = tl.load(table_row + kv_pos // BLOCK_SIZE).to(tl.int64)
    kv_off = block_id * cache_s0 + (kv_pos % BLOCK_SIZE) * cache_s1 + kv_head * cache_s2  # [N]
    if MASKED:
        k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None], mask=kv_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_ok[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None])  # [D, N]
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :])  # [N, D]

    s = _mma(q, k, DOT_PRECISION) * scale_log2  # [M, N]
    if MASKED:
        if CAUSAL:
            visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        else:
            visible = kv_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [M]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_span(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_lo, full_end, kv_end,
                 q_pos, kv_head, dims, scale_log2, cache_s0, cache_s1, cache_s2,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """The K/V tiles of one sequence from kv_lo to kv_end, BLOCK_N keys each, through
    _attend_tile: those below full_end unmasked (the caller guarantees they are whole tiles below
    kv_end that every row sees), the rest masked. The loop both kernels walk; returns the new
    (m_i, l_i, acc)."""
    cols = tl.arange(0, BLOCK_N)  # [N]
    for kv_start in range(kv_lo, full_end, BLOCK_N):  # whole tiles: no mask
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row,
                                     kv_start, cols, kv_end, q_pos, kv_head, dims, scale_log2,
                                     cache_s0, cache_s1, cache_s2, BLOCK_SIZE, False, CAUSAL,
                                     DOT_PRECISION)
    for kv_start in range(full_end, kv_end, BLOCK_N):  # the diagonal, or the last partial tile
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row,
                                     kv_start, cols, kv_end, q_pos, kv_head, dims, scale_log2,
                                     cache_s0, cache_s1, cache_s2, BLOCK_SIZE, True, CAUSAL,
                                     DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=_STEP_VARYING[:2])
def paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
        scale_log2,
        q_s0, q_s1, out_s0, out_s1, cache_s0, cache_s1, cache_s2, table_s0,
        num_q_heads, q_blocks_per_seq,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        DOT_PRECISION: tl.constexpr):
    # Program (sequence s, query tile qt, kv head h), FlashAttention-2 style: its BLOCK_M rows are
    # BLOCK_Q query tokens times the GROUP query heads sharing kv head h (row r: token r // GROUP,
    # head r % GROUP), so each K/V tile fetched through the block table serves the whole GQA group
    # and BLOCK_Q tokens at once. Tiles are walked last-first within a sequence: the last tiles of
    # a causal prompt have the most keys, and starting them first shortens the tail of the launch.
    pid = tl.program_id(0)
    seq = pid // q_blocks_per_seq
    q_block = q_blocks_per_seq - 1 - pid % q_blocks_per_seq
    kv_head = tl.program_id(1)

    q_start = tl.load(qsl_ptr + seq).to(tl.int64)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int64) - q_start
    if q_block * BLOCK_Q >= q_len:
        return  # grid is sized by max_query_len; shorter sequences have idle tiles
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

    # Keys up to the tile's first query position are visible to every row: those whole K/V tiles
    # run unmasked. Only the tiles from there to the last query's position (the diagonal; at most
    # cdiv(BLOCK_Q, BLOCK_N) + 1 of them) pay for the causal mask.
    first_pos = context_len + q_block * BLOCK_Q
    last_token = tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    kv_end = tl.minimum(context_len + last_token + 1, seq_len)
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # <= first_pos + 1 <= seq_len
    table_row = block_tables_ptr + seq.to(tl.int64) * table_s0
    # If full_end == 0 the first masked tile holds key 0, visible to every row: m_i is finite.
    m_i, l_i, acc = _attend_span(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, 0,
                                 full_end, kv_end, q_pos, kv_head, dims, scale_log2, cache_s0,
                                 cache_s1, cache_s2, BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * out_s0 + head[:, None] * out_s1 + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["table_s0", "num_splits"])
def paged_decode_kernel(
        out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        seq_lens_ptr, scale_log2,
        q_s0, q_s1, out_s0, out_s1, cache_s0, cache_s1, cache_s2, table_s0, num_splits,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Program (sequence s, kv head h, split p): the GROUP query heads of h (padded to BLOCK_G >= 16
    # rows, the smallest tl.dot tile) read each K/V tile once. With num_splits == 1 the program
    # walks the whole context and writes the output; otherwise (flash-decoding) it walks its share
    # of the context's tiles and writes its partial (m, l, acc) for decode_reduce_kernel.
    # The shares come from seq_lens on the device (tiles of a sequence split evenly), never from
    # the host, so the launch is the same for any lengths: what a CUDA graph needs.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
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
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    kv_lo = split * tiles_per_split * BLOCK_N
    kv_hi = tl.minimum(kv_lo + tiles_per_split * BLOCK_N, seq_len)  # <= kv_lo: nothing to do
    full_end = kv_lo + tl.maximum(kv_hi - kv_lo, 0) // BLOCK_N * BLOCK_N
    table_row = block_tables_ptr + seq * table_s0
    q_pos = g  # unused: decode sees every key below seq_len (CAUSAL=False)
    # Whole tiles unmasked, then the sequence's last, partial tile (if this share holds it).
    m_i, l_i, acc = _attend_span(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_lo,
                                 full_end, kv_hi, q_pos, kv_head, dims, scale_log2, cache_s0,
                                 cache_s1, cache_s2, BLOCK_N, BLOCK_SIZE, False, DOT_PRECISION)

    if num_splits == 1:
        # A row with seq_len == 0 (padding of a CUDA-graph batch) saw no key: l == 0, acc == 0,
        # and it writes zeros rather than 0/0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * out_s0 + head[:, None] * out_s1 + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        # Partials are [S, Hq, num_splits, D] (acc) and [S, Hq, num_splits, 2] (m, l), float32.
        # An empty split writes m = -inf, l = 0, acc = 0, which the reduce weighs as nothing.
        row = (seq * (tl.num_programs(1) * GROUP) + head) * num_splits + split  # [G]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=g_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_ok)


@triton.jit(do_not_specialize=["num_splits"])
def decode_reduce_kernel(out_ptr, part_acc_ptr, part_ml_ptr, out_s0, out_s1, num_q_heads,
                         num_splits, MAX_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    # Program (sequence s, query head h): merges the num_splits partials of that row. With M the
    # largest partial max, out = sum(acc_p * 2^(m_p - M)) / sum(l_p * 2^(m_p - M)); zeros when no
    # split saw a key (seq_len == 0).
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p = tl.arange(0, MAX_SPLITS)  # [P]
    p_ok = p < num_splits
    row = (seq * num_q_heads + head) * num_splits + p  # [P]
    m = tl.load(part_ml_ptr + row * 2, mask=p_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=p_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: weights 2^-inf = 0
    w = tl.exp2(m - m_max)  # [P]
    dims = tl.arange(0, HEAD_DIM)  # [D]
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=p_ok[:, None],
                  other=0.0)  # [P, D]
    total = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # [D]
    tl.store(out_ptr + seq * out_s0 + head * out_s1 + dims, out.to(out_ptr.dtype.element_ty))
