"""Triton paged attention (decode, and ragged prefill over a cached prefix), the K/V cache write
through a slot mapping, and block copies: the host-side calls that launch the kernels.

This module owns the GPU implementations; their semantics are those of kernels/reference.py and
docs/INTERFACES.md. The kernels themselves are in kernels/triton_attention_kernels.py and
kernels/triton_cache_kernels.py, the launch configuration in kernels/triton_launch.py; every name
they hold that callers use is importable from here too. On a machine without a GPU the kernels run
only under TRITON_INTERPRET=1, which must be set before this module is imported (the @triton.jit
decorators read it).

Rules every launch keeps:
- one fixed launch configuration chosen by simple rules (kernels/triton_launch.py; no autotune: it
  needs a driver);
- every launch runs under the device guard of the tensor it writes (kernels/device.py): Triton
  launches on the current device and its current stream, which need not be the tensor's.
"""

from __future__ import annotations

import importlib
import os

import torch
import triton

from pagedserve.kernels import triton_attention_kernels, triton_cache_kernels
from pagedserve.kernels.device import on_device
from pagedserve.kernels.limits import check_attention_shape

# @triton.jit chose interpreted or compiled when the kernel modules were first imported. If that was
# before TRITON_INTERPRET was set (tests/test_kernels.py reloads this module to recover from it),
# decorate them again now, so that this module's kernels always follow the current setting.
if triton_attention_kernels.INTERPRETED != (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")):
    importlib.reload(triton_attention_kernels)
    importlib.reload(triton_cache_kernels)

# Looked up in this module's namespace at each launch (tests put fakes here).
from pagedserve.kernels.triton_attention_kernels import (  # noqa: E402
    decode_reduce_kernel, paged_attention_kernel, paged_decode_kernel)
from pagedserve.kernels.triton_cache_kernels import copy_blocks_kernel, write_kv_kernel  # noqa: E402
from pagedserve.kernels.triton_launch import (  # noqa: E402,F401  (re-exported: the launch rules)
    MAX_SPLITS, MIN_SPLIT_KEYS, SMALL_TILE_ROWS, WAVES, check_attention_args, check_cache,
    decode_plan, decode_splits, describe_launch, dot_precision, kv_tile, next_pow2, prefill_tile)

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# K/V cache write
# --------------------------------------------------------------------------------------------

def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [T, Hkv, D]; caches [N, B, Hkv, D]; slot_mapping: [T] int64, < 0 skipped."""
    check_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    check_attention_shape(head_dim, num_kv_heads, num_kv_heads)
    slots = slot_mapping.to(dtype=torch.int64).contiguous()
    with on_device(k_cache):
        write_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slots,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            num_kv_heads, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
            BLOCK_H=next_pow2(num_kv_heads), num_warps=4 if num_kv_heads * head_dim >= 1024 else 1)


# --------------------------------------------------------------------------------------------
# Paged attention
# --------------------------------------------------------------------------------------------

_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}


def _placeholder(device: torch.device) -> torch.Tensor:
    """A float32 tensor standing for the split partials when there is no split. Made once per
    device, outside any graph capture, so a captured launch may name it."""
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = torch.zeros(2, dtype=torch.float32, device=device)
    return _PLACEHOLDERS[device]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, num_splits: int | None = None) -> torch.Tensor:
    """q: [S, Hq, D], one query per sequence at position seq_lens[s]-1. Returns [S, Hq, D]; a
    row with seq_lens[s] == 0 (a CUDA-graph batch's padding) gets zeros.

    num_splits: None picks decode_splits(); tests force a value. The launch depends only on
    shapes (see decode_splits), never on the values in seq_lens: safe to capture in a graph."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        check_attention_args(q, k_cache, v_cache)
        return out
    block_tables = block_tables.contiguous()
    grid, reduce_grid, num_splits, strides, out_stride, meta, reduce_meta = decode_plan(
        q, k_cache, v_cache, block_tables.shape[1], num_splits)
    if num_splits == 1:  # not written (the kernel stores the output), but float32 like the
        part_acc = part_ml = _placeholder(q.device)  # real ones: one compile serves both paths
    else:  # static shapes: fine inside CUDA-graph capture (the graph's pool keeps them)
        part_acc = torch.empty((*reduce_grid, num_splits, meta["HEAD_DIM"]), dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty((*reduce_grid, num_splits, 2), dtype=torch.float32, device=q.device)
    with on_device(out):
        paged_decode_kernel[grid](
            out, part_acc, part_ml, q, k_cache, v_cache, block_tables, seq_lens.contiguous(),
            scale * _LOG2E, *strides, num_splits, **meta)
        if num_splits > 1:
            decode_reduce_kernel[reduce_grid](
                out, part_acc, part_ml, *out_stride, reduce_grid[1], num_splits, **reduce_meta)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    max_query_len: int) -> torch.Tensor:
    """Ragged causal attention over the paged cache. q: [T, Hq, D] -> [T, Hq, D].

    A batch of pure decode (one query per sequence) goes to the decode kernel, which needs no idle
    query-tile programs; anything else runs the general kernel with the tile prefill_tile picks.
    """
    group = check_attention_args(q, k_cache, v_cache)
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
    block_m, block_n, num_warps = prefill_tile(head_dim, group, num_tokens, num_seqs)
    block_q = block_m // group
    q_blocks_per_seq = triton.cdiv(max_query_len, block_q)
    block_tables = block_tables.contiguous()
    with on_device(out):
        paged_attention_kernel[(num_seqs * q_blocks_per_seq, k_cache.shape[2])](
            out, q, k_cache, v_cache, block_tables, seq_lens.contiguous(),
            query_start_loc.contiguous(), scale * _LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            q.shape[1], q_blocks_per_seq,
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, DOT_PRECISION=dot_precision(q.dtype),
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
    big_rows = prefill_tile(head_dim, group, 1 << 20, 1)[0]
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
    chunk = min(4096, next_pow2(rows.shape[1]))
    with on_device(pool):   # the pool's device, not the current one (the kvstore holds one per rank)
        src = src.to(device=pool.device, dtype=torch.int64).contiguous()
        dst = dst.to(device=pool.device, dtype=torch.int64).contiguous()
        copy_blocks_kernel[(src.numel(), triton.cdiv(rows.shape[1], chunk))](
            rows, src, dst, rows.stride(0), rows.shape[1], CHUNK=chunk, num_warps=4)
