"""Paged vs contiguous attention (the paper's Fig. 18a): `python -m pagedserve.kernels.benchmark [--json OUT]`.

Owns nothing but this measurement. For each batch size and context length it times one decode
step of attention two ways on the same data: the paged kernel reading K/V through shuffled block
tables out of a pool laid out as the worker's (every layer's K and V in one block row), and
scaled_dot_product_attention over ordinary contiguous [S, Hkv, L, D] tensors (flash on CUDA).
Then prefill two ways: "prefill", every sequence's whole context as causal queries over its own
paged K/V, against causal SDPA on the contiguous copy; and "prefix", the last PREFIX_QUERIES
tokens of each sequence as queries over the cached rest (a chunked prefill or a prefix-cache hit),
against SDPA with the same bottom-right causal mask. On CUDA the paged side is the Triton kernel in
fp16; on CPU it is the C++ kernel (kernels/cpu_ops.py; the reference where it cannot be built),
with fewer heads so the whole sweep stays short, and with the PyTorch reference (the old CPU path:
a gather of the context, then SDPA) as a third column. All sides are timed in one process, in
alternating rounds, and the median of the rounds is reported. The paper's kernel was 20-26 %
slower than contiguous in decode; our goal is within 10 % on CUDA and 20 % on CPU. A figure, not a
pass/fail gate. `--batch-sizes`, `--contexts` and `--kinds` pick a few cells for a brief run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels import ops

# CUDA: batch 1 and context 4096 show the split-KV decode path (few sequences x kv heads, long
# contexts); 8/32 x 64-1024 are the cells of the 2026-12-04 H200 baseline.
BATCH_SIZES = {"cuda": (1, 8, 32), "cpu": (8, 32, 64)}
CONTEXT_LENS = {"cuda": (64, 128, 256, 1024, 4096), "cpu": (64, 256, 1024, 2048)}
PREFILL_CASES = {"cuda": ((1, 4096), (4, 1024), (16, 256)), "cpu": ((1, 256), (4, 64))}  # (batch, context)
PREFIX_QUERIES = 16  # new tokens per sequence in a "prefix" cell, over context - 16 cached ones
KINDS = ("decode", "prefill", "prefix")
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


def _cell(kind: str, batch: int, context: int, block_size: int, shape: Shape, dtype: torch.dtype,
          device: str, gen: torch.Generator) -> dict:
    """The calls one cell times, by column: "paged" (impl=None: what the server runs), "contiguous"
    (SDPA on the contiguous copy) and, on CPU, "reference" (the PyTorch path)."""
    q, k_cache, v_cache, table, seq_lens, k_contig, v_contig = _paged_inputs(
        batch, context, block_size, shape, dtype, device, gen)
    scale = shape.head_dim ** -0.5
    if kind == "decode":
        def paged(impl=None):
            return ops.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale, impl=impl)

        def contiguous():
            return F.scaled_dot_product_attention(
                q[:, :, None], k_contig, v_contig, scale=scale, enable_gqa=True)[:, :, 0]
    else:
        # "prefill": every position queries its own prefix; "prefix": the last few positions do,
        # over the cached rest. Queries [S, Hq, Q, D], ragged [S * Q, Hq, D] for the paged side.
        num_q = context if kind == "prefill" else min(PREFIX_QUERIES, context)
        qp = torch.randn(batch, shape.num_q_heads, num_q, shape.head_dim, generator=gen)
        qp = qp.to(device=device, dtype=dtype)
        q_ragged = qp.transpose(1, 2).reshape(batch * num_q, shape.num_q_heads, shape.head_dim)
        qsl = torch.arange(0, (batch + 1) * num_q, num_q, dtype=torch.int32, device=device)
        # Query i sits at position context - num_q + i (bottom-right causal): [Q, L]
        mask = (torch.arange(context, device=device)[None, :]
                <= torch.arange(context - num_q, context, device=device)[:, None])

        def paged(impl=None):
            return ops.paged_attention(q_ragged, k_cache, v_cache, table, seq_lens, qsl, scale,
                                           num_q, impl=impl)

        def contiguous():
            out = F.scaled_dot_product_attention(qp, k_contig, v_contig, scale=scale, enable_gqa=True,
                                                 attn_mask=None if kind == "prefill" else mask,
                                                 is_causal=kind == "prefill")  # [S, Hq, Q, D]
            return out.transpose(1, 2).reshape(batch * num_q, shape.num_q_heads, shape.head_dim)
    calls = {"paged": paged, "contiguous": contiguous}
    if device == "cpu" and ops.resolve_impl(q, None) != "reference":
        calls["reference"] = lambda: paged("reference")
    return calls


def _path(kind: str, batch: int, context: int, block_size: int, shape: Shape, impl: str,
          device: str) -> str:
    """The kernel path a cell takes: on Triton, triton_ops.describe_launch ("decode", "split<n>":
    flash-decoding in n shares, "tile<M>x<N>": prefill tile of M query rows x N keys); elsewhere the
    implementation's name."""
    if impl != "triton":
        return impl
    from pagedserve.kernels import triton_ops   # CUDA here: no interpreter to set up first
    num_q = 1 if kind == "decode" else (context if kind == "prefill" else min(PREFIX_QUERIES, context))
    return triton_ops.describe_launch(kind, batch * num_q, batch, shape.num_q_heads,
                                      shape.num_kv_heads, shape.head_dim, -(-context // block_size),
                                      block_size, torch.device(device))


def run(block_size: int, dtype: torch.dtype, repeats: int, device: str,
        cases: list[tuple[str, int, int]] | None = None) -> list[dict]:
    shape = CUDA_SHAPE if device == "cuda" else CPU_SHAPE
    impl = ops.resolve_impl(torch.empty(0, device=device), None)
    timed = _timer(device)
    # A GPU decode step takes microseconds: time several launches per sample to beat timer noise.
    inner = 20 if device == "cuda" else 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    print(f"device={device} impl={impl} dtype={str(dtype).removeprefix('torch.')} "
          f"block_size={block_size} q_heads={shape.num_q_heads} kv_heads={shape.num_kv_heads} "
          f"head_dim={shape.head_dim} repeats={repeats} cpu_threads={torch.get_num_threads()} "
          f"prefix_queries={PREFIX_QUERIES}")
    with_reference = device == "cpu" and impl != "reference"
    print(f"{'kind':>7} {'batch':>5} {'context':>7} {'paged ms':>9} {'contig ms':>9} {'ratio':>6} "
          f"{'max|diff|':>9}" + (f" {'ref ms':>9} {'ref/contig':>10}" if with_reference else "")
          + f" {'path':>10}")
    rows = []
    for kind, batch, context in cases if cases is not None else default_cases(device):
        calls = _cell(kind, batch, context, block_size, shape, dtype, device, gen)
        diff = (calls["paged"]().float() - calls["contiguous"]().float()).abs().max().item()
        for fn in calls.values():
            fn()  # warm-up
        times = {name: [] for name in calls}
        for _ in range(repeats):  # alternating rounds, so drift in clocks or load hits every side
            for name, fn in calls.items():
                times[name].append(timed(fn, inner))
        row = {"kind": kind, "batch": batch, "context": context, "paged_ms": statistics.median(times["paged"]),
               "contiguous_ms": statistics.median(times["contiguous"]), "max_abs_diff": diff,
               "path": _path(kind, batch, context, block_size, shape, impl, device)}
        row["ratio"] = row["paged_ms"] / row["contiguous_ms"]
        line = (f"{kind:>7} {batch:>5} {context:>7} {row['paged_ms']:>9.3f} {row['contiguous_ms']:>9.3f} "
                f"{row['ratio']:>6.2f} {diff:>9.1e}")
        if "reference" in times:
            row["reference_ms"] = statistics.median(times["reference"])
            line += f" {row['reference_ms']:>9.3f} {row['reference_ms'] / row['contiguous_ms']:>10.2f}"
        line += f" {row['path']:>10}"
        rows.append(row)
        print(line, flush=True)
    return rows


def default_cases(device: str, batch_sizes=None, contexts=None, kinds=KINDS) -> list[tuple[str, int, int]]:
    """The sweep: decode and prefix over batch x context, prefill over PREFILL_CASES (or over the
    given batches x contexts when either is given)."""
    batches = batch_sizes or BATCH_SIZES[device]
    lens = contexts or CONTEXT_LENS[device]
    grid = [(b, c) for b in batches for c in lens]
    prefill = grid if batch_sizes or contexts else list(PREFILL_CASES[device])
    cases = []
    for kind in kinds:
        cases += [(kind, b, c) for b, c in (prefill if kind == "prefill" else grid)]
    return cases


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
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help=f"default: {BATCH_SIZES['cpu']} on CPU, {BATCH_SIZES['cuda']} on CUDA")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help=f"default: {CONTEXT_LENS['cpu']} on CPU, {CONTEXT_LENS['cuda']} on CUDA")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_name = args.dtype or ("float16" if device == "cuda" else "float32")
    repeats = args.repeats or (50 if device == "cuda" else 7)
    cases = default_cases(device, args.batch_sizes, args.contexts, args.kinds)
    rows = run(args.block_size, getattr(torch, dtype_name), repeats, device, cases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "dtype": dtype_name, "block_size": args.block_size, "rows": rows}, f)


if __name__ == "__main__":
    main()
