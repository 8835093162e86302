"""Paged vs contiguous attention (the paper's Fig. 18a): `python -m kernels.benchmark [--json OUT]`.

Owns nothing but this measurement. For each batch size and context length it times one decode
step of attention two ways on the same data: the paged kernel reading K/V through shuffled block
tables out of a pool laid out as the worker's (every layer's K and V in one block row), and
scaled_dot_product_attention over ordinary contiguous [S, Hkv, L, D] tensors (flash on CUDA).
Then the same for prefill: every sequence's whole context as causal queries over its own paged
K/V, against causal SDPA on the contiguous copy. On CUDA the paged side is the Triton kernel in
fp16; on CPU it is the PyTorch reference (the server's CPU path), with fewer heads and shorter
prefills so the whole sweep stays under a minute. Both are timed in one process, interleaved,
and the median of the repeats is reported. The paper's kernel was 20-26 % slower than contiguous
in decode; our goal is within 10 %. A figure, not a pass/fail gate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels

BATCH_SIZES = (8, 32)
CONTEXT_LENS = (64, 128, 256, 1024)
PREFILL_CASES = {"cuda": ((1, 4096), (4, 1024), (16, 256)), "cpu": ((1, 256), (4, 64))}  # (batch, context)
NUM_LAYERS = 2  # >1 so each layer's cache view has a block stride larger than one block


@dataclass(frozen=True)
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


# A 7B-class GQA layer on a GPU; a quarter of its heads on CPU, where attention is ~100x slower.
CUDA_SHAPE = Shape(num_q_heads=32, num_kv_heads=8, head_dim=128)
CPU_SHAPE = Shape(num_q_heads=8, num_kv_heads=2, head_dim=64)


def _paged_inputs(batch: int, context: int, block_size: int, shape: Shape, dtype: torch.dtype,
                  device: str, gen: torch.Generator):
    """Random K/V for `batch` sequences of `context` tokens, both paged and contiguous."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    kv = torch.empty(num_blocks, NUM_LAYERS, 2, block_size, shape.num_kv_heads, shape.head_dim,
                     dtype=dtype, device=device)
    kv.normal_(generator=torch.Generator(device=device).manual_seed(batch * context))
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]  # [N, B, Hkv, D], stride(0) spans all layers
    # Shuffled tables: blocks of one sequence are scattered over the pool, as after churn.
    table = torch.randperm(num_blocks, generator=gen, device="cpu").view(batch, blocks_per_seq)
    table = table.to(device=device, dtype=torch.int32)  # [S, blocks_per_seq]
    # The same tokens gathered contiguously: [S, Hkv, L, D].
    k_contig = k_cache[table.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v_contig = v_cache[table.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, generator=gen, device="cpu")
    q = q.to(device=device, dtype=dtype)  # [S, Hq, D]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, table, seq_lens, k_contig, v_contig


def _timer(device: str):
    """A function that times fn() run `inner` times and returns milliseconds per call."""
    if device == "cuda":
        def timed(fn, inner):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / inner
    else:
        def timed(fn, inner):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - start) * 1e3 / inner
    return timed


def run(block_size: int, dtype: torch.dtype, repeats: int, device: str) -> list[dict]:
    shape = CUDA_SHAPE if device == "cuda" else CPU_SHAPE
    impl = kernels.resolve_impl(torch.empty(0, device=device), None)
    timed = _timer(device)
    # A GPU decode step takes microseconds: time several launches per sample to beat timer noise.
    inner = 20 if device == "cuda" else 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    print(f"device={device} impl={impl} dtype={str(dtype).removeprefix('torch.')} "
          f"block_size={block_size} q_heads={shape.num_q_heads} kv_heads={shape.num_kv_heads} "
          f"head_dim={shape.head_dim} repeats={repeats} cpu_threads={torch.get_num_threads()}")
    print(f"{'kind':>7} {'batch':>5} {'context':>7} {'paged ms':>9} {'contig ms':>9} {'ratio':>6} "
          f"{'max|diff|':>9}")
    cases = [("decode", b, c) for b in BATCH_SIZES for c in CONTEXT_LENS]
    cases += [("prefill", b, c) for b, c in PREFILL_CASES[device]]
    rows = []
    for kind, batch, context in cases:
        q, k_cache, v_cache, table, seq_lens, k_contig, v_contig = _paged_inputs(
            batch, context, block_size, shape, dtype, device, gen)
        scale = shape.head_dim ** -0.5
        if kind == "decode":
            def paged():
                return kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale)

            def contiguous():
                return F.scaled_dot_product_attention(
                    q[:, :, None], k_contig, v_contig, scale=scale, enable_gqa=True)[:, :, 0]
        else:
            # Every position of every sequence queries its own prefix: [S * L, Hq, D] ragged.
            qp = torch.randn(batch, shape.num_q_heads, context, shape.head_dim, generator=gen)
            qp = qp.to(device=device, dtype=dtype)  # [S, Hq, L, D]
            q_ragged = qp.transpose(1, 2).reshape(batch * context, shape.num_q_heads, shape.head_dim)
            qsl = torch.arange(0, (batch + 1) * context, context, dtype=torch.int32, device=device)

            def paged():
                return kernels.paged_attention(q_ragged, k_cache, v_cache, table, seq_lens, qsl, scale,
                                               context)

            def contiguous():
                out = F.scaled_dot_product_attention(qp, k_contig, v_contig, scale=scale,
                                                     is_causal=True, enable_gqa=True)  # [S, Hq, L, D]
                return out.transpose(1, 2).reshape(batch * context, shape.num_q_heads, shape.head_dim)

        diff = (paged().float() - contiguous().float()).abs().max().item()  # also warms up
        paged_ms, contig_ms = [], []
        for _ in range(repeats):  # interleaved, so drift in clocks or load hits both
            paged_ms.append(timed(paged, inner))
            contig_ms.append(timed(contiguous, inner))
        row = {"kind": kind, "batch": batch, "context": context, "paged_ms": statistics.median(paged_ms),
               "contiguous_ms": statistics.median(contig_ms), "max_abs_diff": diff}
        row["ratio"] = row["paged_ms"] / row["contiguous_ms"]
        rows.append(row)
        print(f"{kind:>7} {batch:>5} {context:>7} {row['paged_ms']:>9.3f} {row['contiguous_ms']:>9.3f} "
              f"{row['ratio']:>6.2f} {diff:>9.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32))
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                        help="default: float16 on CUDA, float32 on CPU (where half is ~100x "
                             "slower)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed samples per cell (default: 50 on CUDA, 7 on CPU)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's). On a busy machine 1 avoids "
                             "OpenMP workers waiting ~20 ms for a core at every call")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_name = args.dtype or ("float16" if device == "cuda" else "float32")
    repeats = args.repeats or (50 if device == "cuda" else 7)
    rows = run(args.block_size, getattr(torch, dtype_name), repeats, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "dtype": dtype_name, "block_size": args.block_size, "rows": rows}, f)


if __name__ == "__main__":
    main()
