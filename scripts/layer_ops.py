"""Ops per decode step and per decoder layer, and CPU step time, for the paged models (issue 30, item 2).

    PYTHONPATH=. python scripts/layer_ops.py [--batch 64] [--hidden 256] [--archs llama,qwen2,opt] [--compile]

Builds tiny random-weight models (2 layers), prefills `batch` sequences, then profiles one decode
step of ModelRunner.execute with torch.profiler on CPU: aten ops dispatched from Python (top level)
and all aten events (nested ones included), for the whole step and for one decoder layer. Then
times decode steps. --compile also times the fused small functions eager vs torch.compile'd.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BLOCK = 16
PROMPT = 24


def _aten_counts(prof, scope: str | None = None) -> tuple[int, int]:
    """(top-level aten ops, all aten events) in the profile, or under the record_function `scope`."""
    events = prof.events()
    if scope is not None:
        roots = [e for e in events if e.name == scope]
        keep = set()
        stack = list(roots)
        while stack:
            e = stack.pop()
            for c in e.cpu_children:
                keep.add(id(c))
                stack.append(c)
        events = [e for e in events if id(e) in keep]
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(top), len(aten)


def _scoped(module: torch.nn.Module, name: str) -> None:
    """Wrap module.forward in a record_function range called `name`."""
    forward = module.forward

    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(name):
            return forward(*args, **kwargs)
    module.forward = wrapped


def measure(arch: str, batch: int, hidden: int, root: Path) -> dict:
    from pagedserve.kvstore.store import BlockStore
    from pagedserve.services.steps import SeqStep
    from pagedserve.services.tiny_model import build_tiny_model
    from pagedserve.services.worker.model_loader import load_model
    from pagedserve.services.worker.model_runner import ModelRunner

    folder = build_tiny_model(root / f"{arch}-{hidden}", arch=arch, hidden_size=hidden)
    model, spec = load_model(folder)
    layers = model.model.decoder.layers if arch == "opt" else model.model.layers
    _scoped(layers[0], "layer0")
    blocks = batch * (PROMPT + 64) // BLOCK + batch
    pool = torch.zeros((blocks, spec.block_bytes(BLOCK, torch.float32)), dtype=torch.uint8)
    runner = ModelRunner(model, spec, pool, BLOCK)
    store = BlockStore(blocks, 0, BLOCK, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, spec.vocab_size, (PROMPT,), generator=g).tolist() for _ in range(batch)]
    for i, p in enumerate(prompts):
        assert store.allocate(i, p).ok
    last = runner.execute([SeqStep(i, p, 0, store.block_table(i)) for i, p in enumerate(prompts)]).argmax(-1).tolist()
    pos = [PROMPT] * batch

    def step():
        steps = []
        for i in range(batch):
            assert store.append_slots(i, [last[i]]).ok
            steps.append(SeqStep(i, [last[i]], pos[i], store.block_table(i)))
            pos[i] += 1
        out = runner.execute(steps).argmax(-1).tolist()
        last[:] = out

    step()   # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    step_top, step_all = _aten_counts(prof)
    layer_top, layer_all = _aten_counts(prof, "layer0")
    times = []
    for _ in range(20):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return dict(arch=arch, step_top=step_top, step_all=step_all, layer_top=layer_top, layer_all=layer_all,
                step_ms=1e3 * statistics.median(times))


def compile_table(batch: int, hidden: int) -> None:
    """Each fused function eager vs torch.compile'd on CPU (median of 200 calls, after warm-up)."""
    from pagedserve.services.worker.models import layers as L
    inter = 2 * hidden
    heads, kv_heads, d = 4, 2, hidden // 4
    x = torch.randn(batch, hidden)
    res = torch.randn(batch, hidden)
    w = torch.randn(hidden)
    gu = torch.randn(batch, 2 * inter)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * d)
    cos, sin = torch.randn(batch, 1, d), torch.randn(batch, 1, d)
    qk = qkv.view(batch, heads + 2 * kv_heads, d)[:, :heads + kv_heads]   # q and k, as the layer rotates them

    cases = {
        "add_rms_norm": (L.rms_norm, lambda f: f(x, w, 1e-6, res)),
        "rms_norm": (L.rms_norm, lambda f: f(x, w, 1e-6)),
        "silu_and_mul": (L.silu_and_mul, lambda f: f(gu)),
        "apply_rope_ (q and k)": (L.apply_rope_, lambda f: f(qk, cos, sin)),
    }
    print(f"\n| function (batch {batch}, hidden {hidden}) | eager µs | compiled µs | compile s |")
    print("|---|---|---|---|")
    for name, (fn, call) in cases.items():
        fn = fn.eager                    # the plain function, whatever the device
        t0 = time.perf_counter()
        compiled = torch.compile(fn, dynamic=False)
        with torch.inference_mode():
            call(compiled)
            call(compiled)
        compile_s = time.perf_counter() - t0
        row = []
        for f in (fn, compiled):
            with torch.inference_mode():
                for _ in range(20):
                    call(f)
                ts = []
                for _ in range(200):
                    t = time.perf_counter()
                    call(f)
                    ts.append(time.perf_counter() - t)
            row.append(1e6 * statistics.median(ts))
        print(f"| {name} | {row[0]:.1f} | {row[1]:.1f} | {compile_s:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--archs", default="llama,qwen2,opt")
    ap.add_argument("--compile", action="store_true", help="also time eager vs torch.compile of the fused functions")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(a, args.batch, args.hidden, Path(tmp)) for a in args.archs.split(",")]
    print(f"| model (2 layers, hidden {args.hidden}), decode batch {args.batch} | aten ops / step (top-level, all) "
          f"| aten ops / layer (top-level, all) | step ms (CPU, median of 20) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['arch']} | {r['step_top']}, {r['step_all']} | {r['layer_top']}, {r['layer_all']} | {r['step_ms']:.2f} |")
    if args.compile:
        compile_table(args.batch, args.hidden)
    return 0


if __name__ == "__main__":
    sys.exit(main())
