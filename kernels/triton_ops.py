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

import functools
import os

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
# pass, never a new one inside a later step. num_splits is here too: it is static for a captured
# batch size but differs between batch sizes, and == 1 must not become a second compile.
_STEP_VARYING = ["table_s0", "q_blocks_per_seq", "num_splits"]


# Set for the whole process before this module is imported (the @triton.jit decorators read it).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if _INTERPRETED:
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


@triton.jit(do_not_specialize=_STEP_VARYING[:2])
def _paged_attention_kernel(
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
    cols = tl.arange(0, BLOCK_N)  # [N]
    for kv_start in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row,
                                     kv_start, cols, kv_end, q_pos, kv_head, dims, scale_log2,
                                     cache_s0, cache_s1, cache_s2, BLOCK_SIZE, False, True,
                                     DOT_PRECISION)
    # If full_end == 0 the first masked tile holds key 0, visible to every row: m_i is finite.
    for kv_start in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row,
                                     kv_start, cols, kv_end, q_pos, kv_head, dims, scale_log2,
                                     cache_s0, cache_s1, cache_s2, BLOCK_SIZE, True, True,
                                     DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * out_s0 + head[:, None] * out_s1 + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["table_s0", "num_splits"])
def _paged_decode_kernel(
        out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        seq_lens_ptr, scale_log2,
        q_s0, q_s1, out_s0, out_s1, cache_s0, cache_s1, cache_s2, table_s0, num_splits,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Program (sequence s, kv head h, split p): the GROUP query heads of h (padded to BLOCK_G >= 16
    # rows, the smallest tl.dot tile) read each K/V tile once. With num_splits == 1 the program
    # walks the whole context and writes the output; otherwise (flash-decoding) it walks its share
    # of the context's tiles and writes its partial (m, l, acc) for _decode_reduce_kernel.
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
    cols = tl.arange(0, BLOCK_N)  # [N]
    q_pos = g  # unused: decode sees every key below seq_len (CAUSAL=False)
    for kv_start in range(kv_lo, full_end, BLOCK_N):  # whole tiles: no mask
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row,
                                     kv_start, cols, kv_hi, q_pos, kv_head, dims, scale_log2,
                                     cache_s0, cache_s1, cache_s2, BLOCK_SIZE, False, False,
                                     DOT_PRECISION)
    for kv_start in range(full_end, kv_hi, BLOCK_N):  # the sequence's last, partial tile
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row,
                                     kv_start, cols, kv_hi, q_pos, kv_head, dims, scale_log2,
                                     cache_s0, cache_s1, cache_s2, BLOCK_SIZE, True, False,
                                     DOT_PRECISION)

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
def _decode_reduce_kernel(out_ptr, part_acc_ptr, part_ml_ptr, out_s0, out_s1, num_q_heads,
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


_LOG2E = 1.4426950408889634


def _kv_tile(head_dim: int) -> int:
    """Keys per loop iteration of the decode kernel and of the small prefill tile. Independent of
    the cache's block size (each key finds its own block through the table), so a big block never
    means a big tile: a tile of 256 keys at head_dim 128 needs more shared memory than a GPU has.
    >= 16 for tl.dot; smaller for big heads, whose [D, N] + [N, D] tiles would otherwise spill
    registers."""
    return 64 if head_dim <= 64 else 32


# Rows (query tokens x GQA group) of the small prefill tile: 16 is the smallest tl.dot tile.
SMALL_TILE_ROWS = 16


def _prefill_tile(head_dim: int, group: int, num_tokens: int, num_seqs: int) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps) of the ragged prefill kernel.

    The big tile is FlashAttention-2's: 128 query rows against 64-key tiles, so each K/V tile read
    through the table serves 128 rows (32 tokens of a GQA group of 4) and a 4096-token prompt makes
    128 programs per kv head instead of 1024 that each re-read the whole prefix. Its fp32
    accumulator is 128 x D: at D 128 that takes 8 warps (64 registers a thread for acc, 32 for the
    scores); at D 256 the rows halve and the keys too, or it would spill. The small tile (16 rows,
    the decode kernel's key tile) is for batches whose sequences average less than one big tile of
    rows: decode-heavy mixed batches and short chunks over a cached prefix, where a 128-row tile
    would compute mostly padding. Two variants only (each a compile); the rule reads host ints the
    caller already has (q.shape[0], seq_lens.shape[0]), never a tensor's values."""
    big_rows = 128 if head_dim <= 128 else 64
    small_rows = max(SMALL_TILE_ROWS, _next_pow2(group))
    if num_tokens * group >= num_seqs * big_rows and big_rows > small_rows:
        return big_rows, (64 if head_dim <= 128 else 32), (4 if head_dim <= 64 else 8)
    return small_rows, _kv_tile(head_dim), 4


# Flash-decoding (split-KV) rule. One decode program per (sequence, kv head) leaves most of a big
# GPU idle when there are few of them (8 sequences x 8 kv heads = 64 programs on 132 SMs), and each
# walks its whole context alone. Splitting the context into num_splits shares, reduced by a second
# small kernel, multiplies the programs. The rule sees only shapes that are static for a batch
# size (num_seqs, kv heads, the table's width = blocks per sequence at most, the device), so a
# CUDA graph captured for that batch size replays with the same launch whatever the lengths.
MAX_SPLITS = 16          # the reduce kernel's tile over splits (one compile); 16 x 8 heads x 1 seq = 128 programs
MIN_SPLIT_KEYS = 256     # a share reads at least 256 keys (128 KiB of K/V at head_dim 128, fp16), so its
                         # partial (GROUP x D floats + m, l) is < 2 % of its traffic; contexts of at
                         # most 256 keys never split, and so never pay the reduce's extra launch
WAVES = 2                # below one program per SM, aim for two: one 4-warp program cannot keep an
                         # SM's memory pipe busy on its own, and decode is bandwidth-bound
_DEFAULT_SMS = 132       # H100 SXM / H200; used where no CUDA device answers (the interpreter)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(num_seqs: int, num_kv_heads: int, table_width: int, block_size: int,
                  device: torch.device) -> int:
    """How many shares the decode kernel splits each context into (1: no split).

    table_width * block_size bounds every context of the batch; under a CUDA graph it is the
    bucket's capacity rather than today's longest sequence, so a short batch may split where its
    real lengths would not: the shares are cut on the device from seq_lens, and a share past a
    sequence's end exits at once (it writes an empty partial)."""
    programs = num_seqs * num_kv_heads
    sms = _sm_count(device)
    if programs >= sms:  # every SM already has a program: shares would only add partials + reduce
        return 1
    want = triton.cdiv(WAVES * sms, max(1, programs))
    fit = (table_width * block_size) // MIN_SPLIT_KEYS
    return max(1, min(MAX_SPLITS, want, fit))


def _check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    _check_cache(k_cache, v_cache)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    check_attention_shape(k_cache.shape[3], num_q_heads, num_kv_heads)
    if q.shape[2] != k_cache.shape[3] or q.stride(2) != 1:
        raise ValueError("q must be [T, Hq, D] with the caches' D and a unit stride on D")
    return num_q_heads // num_kv_heads


_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}


def _placeholder(device: torch.device) -> torch.Tensor:
    """A float32 tensor standing for the split partials when there is no split. Made once per
    device, outside any graph capture, so a captured launch may name it."""
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = torch.zeros(2, dtype=torch.float32, device=device)
    return _PLACEHOLDERS[device]


# Decode launches, by the shapes and strides of their arguments: a decode step at small batch is
# bound by the host (the GPU work is a few us), so the checks and the launch configuration are
# worked out once per shape rather than at every call, in every layer.
_DECODE_PLANS: dict[tuple, tuple] = {}


def _decode_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table_width: int,
                 num_splits: int | None) -> tuple:
    key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(),
           v_cache.shape, v_cache.stride(), table_width, num_splits)
    plan = _DECODE_PLANS.get(key)
    if plan is not None:
        return plan
    group = _check_attention_args(q, k_cache, v_cache)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_splits is None:
        num_splits = decode_splits(num_seqs, num_kv_heads, table_width, block_size, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    out_stride = (num_q_heads * head_dim, head_dim)  # out is made contiguous
    strides = (q.stride(0), q.stride(1), out_stride[0], out_stride[1],
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), table_width)
    meta = dict(GROUP=group, BLOCK_G=max(16, _next_pow2(group)), BLOCK_N=_kv_tile(head_dim),
                BLOCK_SIZE=block_size, HEAD_DIM=head_dim, DOT_PRECISION=_dot_precision(q.dtype),
                num_warps=4, num_stages=2)
    reduce_meta = dict(MAX_SPLITS=MAX_SPLITS, HEAD_DIM=head_dim,
                       num_warps=4 if head_dim >= 128 else 2)
    plan = ((num_seqs, num_kv_heads, num_splits), (num_seqs, num_q_heads), num_splits, strides,
            out_stride, meta, reduce_meta)
    if len(_DECODE_PLANS) >= 1024:  # batch sizes x layouts seen: bounded all the same
        _DECODE_PLANS.clear()
    _DECODE_PLANS[key] = plan
    return plan


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, num_splits: int | None = None) -> torch.Tensor:
    """q: [S, Hq, D], one query per sequence at position seq_lens[s]-1. Returns [S, Hq, D]; a
    row with seq_lens[s] == 0 (a CUDA-graph batch's padding) gets zeros.

    num_splits: None picks decode_splits(); tests force a value. The launch depends only on
    shapes (see decode_splits), never on the values in seq_lens: safe to capture in a graph."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        _check_attention_args(q, k_cache, v_cache)
        return out
    block_tables = block_tables.contiguous()
    grid, reduce_grid, num_splits, strides, out_stride, meta, reduce_meta = _decode_plan(
        q, k_cache, v_cache, block_tables.shape[1], num_splits)
    if num_splits == 1:  # not written (the kernel stores the output), but float32 like the
        part_acc = part_ml = _placeholder(q.device)  # real ones: one compile serves both paths
    else:  # static shapes: fine inside CUDA-graph capture (the graph's pool keeps them)
        part_acc = torch.empty((*reduce_grid, num_splits, meta["HEAD_DIM"]), dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty((*reduce_grid, num_splits, 2), dtype=torch.float32, device=q.device)
    with on_device(out):
        _paged_decode_kernel[grid](
            out, part_acc, part_ml, q, k_cache, v_cache, block_tables, seq_lens.contiguous(),
            scale * _LOG2E, *strides, num_splits, **meta)
        if num_splits > 1:
            _decode_reduce_kernel[reduce_grid](
                out, part_acc, part_ml, *out_stride, reduce_grid[1], num_splits, **reduce_meta)
    return out


def describe_launch(kind: str, num_tokens: int, num_seqs: int, num_q_heads: int,
                    num_kv_heads: int, head_dim: int, table_width: int, block_size: int,
                    device: torch.device) -> str:
    """The path a call of these shapes takes, for the benchmark's table: "decode" (one program
    per sequence and kv head), "split<n>" (flash-decoding in n shares + reduce), "tile<M>x<N>"
    (ragged prefill, M query rows x N keys per tile)."""
    group = num_q_heads // num_kv_heads
    if kind == "decode":
        n = decode_splits(num_seqs, num_kv_heads, table_width, block_size, device)
        return "decode" if n == 1 else f"split{n}"
    rows, keys, _ = _prefill_tile(head_dim, group, num_tokens, num_seqs)
    return f"tile{rows}x{keys}"


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    max_query_len: int) -> torch.Tensor:
    """Ragged causal attention over the paged cache. q: [T, Hq, D] -> [T, Hq, D].

    A batch of pure decode (one query per sequence) goes to the decode kernel, which needs no idle
    query-tile programs; anything else runs the general kernel with the tile _prefill_tile picks.
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
    # Rows of a program = query tokens x the GQA group (a group that does not divide the rows
    # leaves the last rows idle).
    block_m, block_n, num_warps = _prefill_tile(head_dim, group, num_tokens, num_seqs)
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
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, DOT_PRECISION=_dot_precision(q.dtype),
            num_warps=num_warps, num_stages=2)
    return out


def warm_up_attention(dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int,
                      block_size: int, device: torch.device | str) -> None:
    """Launch every attention variant a model of these heads can take, once, on a few tokens, so
    each compiles now rather than inside a served step: the prefill kernel with the small and the
    big query tile, and the decode kernel without and with split (its reduce kernel too). A
    start-up pass whose own batch takes one path only (its prefill averages under one big tile,
    its decode does not split) leaves the others to the first step that needs them otherwise.
    Strides keep the divisibility of the server's (multiples of 16 at any head_dim allowed), so the
    compiled variants are the ones later calls find."""
    group = num_q_heads // num_kv_heads
    big_rows = _prefill_tile(head_dim, group, 1 << 20, 1)[0]
    tokens = max(2, triton.cdiv(big_rows, group))  # one sequence that fills one big tile
    num_blocks = triton.cdiv(tokens, block_size)
    with on_device(torch.device(device)):
        cache = torch.zeros((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype,
                            device=device)
        q = torch.zeros((tokens, num_q_heads, head_dim), dtype=dtype, device=device)
        table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
        for n in sorted({2, tokens}):   # 2 queries take the small tile, `tokens` the big one
            qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
            lens = torch.full((1,), n, dtype=torch.int32, device=device)
            paged_attention(q[:n], cache[0], cache[1], table, lens, qsl, 1.0, n)
        for num_splits in (1, 2):
            paged_decode_attention(q[:1], cache[0], cache[1], table, lens, 1.0, num_splits=num_splits)


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
