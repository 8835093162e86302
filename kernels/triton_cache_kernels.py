"""The Triton kernels that move K/V without attending: the cache write through a slot mapping, and
the copy of whole block rows. Device code only; kernels/triton_ops.py launches them.

As in kernels/triton_attention_kernels.py: block ids and slots are cast to int64 before they are
multiplied by a stride, no unmasked load can leave its tensor, and on a machine without a GPU they
run only under TRITON_INTERPRET=1, set before this module is imported.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
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


@triton.jit
def copy_blocks_kernel(pool_ptr, src_ptr, dst_ptr, row_stride, row_elems,
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
