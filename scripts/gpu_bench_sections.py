"""The measuring side of `make gpu-bench` (scripts/gpu_bench.py): the sizes of a run, and the
sections, each run in its own process (`gpu_bench.py --section NAME --json FILE`), writing its
figures to that JSON file as it goes.

  model    the random-weight Llama built once (loadgen/gpu_e2e.py)
  profile  the offline engine decoding at each batch size: the host split of a step, the forward
           probe, the profiler's busy time and launches
  offline  paged vs Orca-Oracle on one batch of ShareGPT-like requests
  served   the whole stack at saturation through loadgen's client
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / ".cache" / "gpu-check-llama-1b"      # gpu-check builds the same model there
SMOKE_MODEL_DIR = REPO / ".cache" / "gpu-bench-smoke-llama"

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


# ------------------------------------------------------------------------------------------------
# Sizes: the GPU run and the CPU smoke run differ only here
# ------------------------------------------------------------------------------------------------

def sizes(smoke: bool) -> dict:
    if smoke:
        return dict(device="cpu", dtype="float32", layers=2, hidden=128, model_dir=SMOKE_MODEL_DIR,
                    batches=(1, 2), prompt_len=16, warm_steps=2, timed_steps=3, profiled_steps=2,
                    probe_reps=2, profile_kv_bytes=50_000_000, max_num_seqs=8, max_tokens_per_step=512,
                    max_model_len=256, offline_n=6, offline_kv_bytes=20 << 13, offline_divisor=8.0,
                    served_n=4, served_prompt=32, served_out=8, served_pool=["--num-device-blocks", "256"],
                    stack_timeout_s=80)
    return dict(device="cuda", dtype="bfloat16", layers=16, hidden=2048, model_dir=MODEL_DIR,
                batches=(1, 16, 64, 256), prompt_len=128, warm_steps=10, timed_steps=30, profiled_steps=5,
                probe_reps=30, profile_kv_bytes=4 << 30, max_num_seqs=256, max_tokens_per_step=8192,
                max_model_len=2048, offline_n=400, offline_kv_bytes=256 << 20, offline_divisor=2.0,
                served_n=512, served_prompt=256, served_out=128, served_pool=["--kv-cache-memory-bytes", "8GiB"],
                stack_timeout_s=150)


def has_enforce_eager() -> dict:
    """Whether this checkout has the eager/graphs switch: {'engine': bool, 'served': bool}."""
    import dataclasses
    from pagedserve.services.engine_config import EngineConfig
    from pagedserve.services.launcher import Config
    return {"engine": "enforce_eager" in {f.name for f in dataclasses.fields(EngineConfig)},
            "served": "enforce_eager" in {f.name for f in dataclasses.fields(Config)}}


def modes(supported: bool) -> list[tuple[str, bool | None]]:
    """(label, enforce_eager) to run; None: the setting does not exist here, leave it out."""
    return [("eager", True), ("graphs", False)] if supported else [("default (no enforce_eager here)", None)]


def engine_config(s: dict, model: str, enforce_eager: bool | None, **kw):
    from pagedserve.services.engine_config import EngineConfig
    extra = {} if enforce_eager is None else {"enforce_eager": enforce_eager}
    return EngineConfig(model=model, device=s["device"], dtype=s["dtype"], max_num_seqs=s["max_num_seqs"],
                        max_num_batched_tokens=s["max_tokens_per_step"], max_model_len=s["max_model_len"],
                        enable_prefix_caching=False, **extra, **kw)



# ------------------------------------------------------------------------------------------------
# Sections (each runs in its own process: `gpu_bench.py --section NAME --json FILE`)
# ------------------------------------------------------------------------------------------------

class Figures(dict):
    """A section's figures, rewritten to its JSON file at each change: a section cut off at its
    time limit still reports what it had measured."""

    def __init__(self, path: Path):
        super().__init__(runs=[], notes=[])
        self.path = path
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self, default=str))

    def run(self, **figures) -> None:
        self["runs"].append(figures)
        self.save()

    def note(self, text: str) -> None:
        self["notes"].append(text)
        self.save()


def sync_fn(device: str):
    import torch
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def section_model(s: dict, fig: Figures) -> None:
    from pagedserve.loadgen.gpu_e2e import build_model
    t = time.perf_counter()
    path = build_model(Path(s["model_dir"]), s["device"], s["layers"], s["hidden"])
    fig.run(model=path, seconds=round(time.perf_counter() - t, 1))


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals given in microseconds -> ms."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3


def profile_figures(prof, steps: int, device: str) -> dict:
    """torch.profiler's events over `steps` engine steps -> busy ms and launches per step. On CUDA:
    the union of the kernels' (and copies') device time, and the launch calls (a graph replay is one
    cudaGraphLaunch). On CPU (the smoke run): the union of the top-level aten ops' time, and their
    count."""
    from torch.autograd import DeviceType
    events = prof.events()
    if device == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        busy = union_ms([(e.time_range.start, e.time_range.end) for e in kernels])
        launches = sum(1 for e in events if e.name in LAUNCHES)
        graphs = sum(1 for e in events if e.name == "cudaGraphLaunch")
        return {"busy_ms": round(busy / steps, 3), "launches": round(launches / steps, 1),
                "graph_launches": round(graphs / steps, 1), "kernels": round(len(kernels) / steps, 1),
                "busy_of": "GPU kernels and copies"}
    ops = [e for e in events if e.name.startswith("aten::") and
           (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    busy = union_ms([(e.time_range.start, e.time_range.end) for e in ops])
    return {"busy_ms": round(busy / steps, 3), "launches": round(len(ops) / steps, 1), "graph_launches": 0,
            "kernels": round(len(ops) / steps, 1), "busy_of": "top-level aten ops on the CPU (smoke run)"}


def measure_batch(eng, s: dict, batch: int) -> dict:
    """`batch` requests decoding at once: the timed split, the forward probe, the profile."""
    import random

    import torch
    from pagedserve.services.sampling_params import SamplingParams
    sync = sync_fn(s["device"])
    rng = random.Random(batch)
    budget = s["warm_steps"] + s["timed_steps"] + s["profiled_steps"] + 64   # prefill steps and slack
    ids = [eng.add_request([rng.randrange(10, 2000) for _ in range(s["prompt_len"])],
                           SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True))
           for _ in range(batch)]
    sched, worker = eng.scheduler, eng.worker

    def one_step(split: dict | None = None):
        a = time.perf_counter()
        sch = sched.schedule()
        b = time.perf_counter()
        res = worker.execute(sch.steps, sch.samples, {}) if sch.steps else []
        sync()
        c = time.perf_counter()
        sched.update(sch, res, {})
        d = time.perf_counter()
        if split is not None:
            split["schedule"] += b - a
            split["worker"] += c - b
            split["update"] += d - c
        return sch

    # Until every request decodes in one step (prefill and chunks done), then the warm-up.
    for _ in range(budget // 2):
        sch = one_step()
        if len(sch.steps) == batch and all(len(st.token_ids) == 1 for st in sch.steps):
            break
    for _ in range(s["warm_steps"]):
        one_step()
    split = {"schedule": 0.0, "worker": 0.0, "update": 0.0}
    n = s["timed_steps"]
    for _ in range(n):
        sch = one_step(split)
    step_ms = sum(split.values()) / n * 1e3
    out = {"batch": batch, "decode_batch": len(sch.steps), "step_ms": round(step_ms, 3),
           **{f"{k}_ms": round(v / n * 1e3, 3) for k, v in split.items()}}
    # Forward + logits on the last step's inputs (the KV it writes is what that step wrote: same
    # tokens, same slots): the filled buffers run again as the engine runs them, a graph's replay
    # where one serves the step. Where the runner has no fill/graphs (an older checkout): its
    # execute less its prepare.
    try:
        out.update(forward_probe(eng.runner, sch.steps, s, sync))
    except Exception as e:   # the runner's API moved: the other figures still count
        out["forward_logits_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    acts = [torch.profiler.ProfilerActivity.CPU]
    if s["device"] == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    steps_p = s["profiled_steps"]
    try:
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(steps_p):
                eng.step()
            sync()
        figures = profile_figures(prof, steps_p, s["device"])
        figures["busy_share"] = round(min(1.0, figures["busy_ms"] / step_ms), 3) if step_ms else None
        out.update(figures)
    except Exception as e:   # the profiler failed: the host figures still count
        out["profiler_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    for rid in ids:   # done with them: free their blocks for the next batch
        if sched.abort(rid) or rid in sched.requests:
            sched.pop_finished(rid)
    while eng.has_work():
        eng.step()
    return out


def forward_probe(runner, steps, s: dict, sync) -> dict:
    import torch
    reps = s["probe_reps"]

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - t) / reps * 1e3

    with torch.inference_mode():
        if hasattr(runner, "fill") and hasattr(runner, "graphs"):
            fill_ms = timed(lambda: runner.fill(steps))
            shape = runner.fill(steps)

            def forward_logits():
                hidden = runner.graphs.replay(shape) if shape.graph else runner.forward(shape)
                return runner.model.compute_logits(hidden[runner.d.logits[:shape.num_logits]])
            return {"fill_ms": round(fill_ms, 3), "forward_logits_ms": round(timed(forward_logits), 3),
                    "graph_bucket": shape.graph}
        prep = timed(lambda: runner.prepare(steps))
        exe = timed(lambda: runner.execute(steps))
        return {"prepare_ms": round(prep, 3), "runner_execute_ms": round(exe, 3),
                "forward_logits_ms": round(max(exe - prep, 0.0), 3), "graph_bucket": None}


def section_profile(s: dict, model: str, fig: Figures) -> None:
    from pagedserve.services.engine import Engine
    supported = has_enforce_eager()["engine"]
    if not supported:
        fig.note("EngineConfig has no enforce_eager on this checkout: one run, its default")
    for label, eager in modes(supported):
        t = time.perf_counter()
        with Engine(engine_config(s, model, eager, kv_cache_memory_bytes=s["profile_kv_bytes"])) as eng:
            start_s = round(time.perf_counter() - t, 1)
            for batch in s["batches"]:
                fig.run(mode=label, engine_start_s=start_s, **measure_batch(eng, s, batch))


def section_offline(s: dict, model: str, fig: Figures) -> None:
    import random

    from pagedserve.loadgen.lengths import sample_lengths, scale_lengths
    from pagedserve.services.engine import Engine
    from pagedserve.services.sampling_params import SamplingParams
    n = s["offline_n"]
    pairs = scale_lengths(sample_lengths("sharegpt", n, seed=11), s["offline_divisor"],
                          max_total=s["max_model_len"]).pairs
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 2000) for _ in range(pl)] for pl, _ in pairs]
    outs = [o for _, o in pairs]
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
    fig["workload"] = {"requests": n, "mean_prompt": round(sum(p for p, _ in pairs) / n, 1),
                       "mean_output": round(sum(outs) / n, 1), "kv_bytes": s["offline_kv_bytes"]}
    supported = has_enforce_eager()["engine"]
    if not supported:
        fig.note("EngineConfig has no enforce_eager on this checkout: one run per allocation, its default")
    default = modes(supported)
    # The figures the targets judge first (graphs where they exist), eager paged last.
    runs = [("paged", default[-1]), ("orca-oracle", default[-1])] + ([("paged", default[0])] if supported else [])
    sync = sync_fn(s["device"])
    for alloc, (label, eager) in runs:
        try:
            t = time.perf_counter()
            with Engine(engine_config(s, model, eager, kv_cache_memory_bytes=s["offline_kv_bytes"],
                                      allocation=alloc)) as eng:
                start_s = time.perf_counter() - t
                eng.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                             true_output_lens=[4])
                sync()
                t = time.perf_counter()
                res = eng.generate(prompts, params, true_output_lens=outs)
                sync()
                dt = time.perf_counter() - t
                toks = sum(len(r.outputs[0].token_ids) for r in res)
                st = eng.stats()
            kv = st.get("kv_breakdown", {})
            sat = kv.get("saturated") or kv
            fig.run(allocation=alloc, mode=label, output_tokens=toks, expected=sum(outs), seconds=round(dt, 2),
                    engine_start_s=round(start_s, 1), tok_per_s=round(toks / dt, 1),
                    token_states=round(kv.get("cache", {}).get("token_states", float("nan")), 4),
                    token_states_saturated=round(sat.get("cache", {}).get("token_states", float("nan")), 4),
                    avg_batched_requests=round(kv.get("avg_batched_requests", float("nan")), 1),
                    preemptions=st.get("preemptions", 0), peak_blocks=st.get("device_blocks_peak_used"))
        except Exception as e:   # one run failing must not hide the others
            fig.run(allocation=alloc, mode=label, error=f"{type(e).__name__}: {str(e)[:300]}")


def section_served(s: dict, model: str, fig: Figures) -> None:
    from pagedserve.loadgen.bench_e2e import drive, make_requests
    from pagedserve.loadgen.metrics import summarize
    from pagedserve.loadgen.stack import Stack
    supported = has_enforce_eager()["served"]
    if not supported:
        fig.note("the launcher has no --enforce-eager on this checkout: one run, its default")
    flags = ["--device", s["device"], "--dtype", s["dtype"], "--max-num-seqs", str(s["max_num_seqs"]),
             "--max-num-batched-tokens", str(s["max_tokens_per_step"]), "--max-model-len", str(s["max_model_len"]),
             "--no-enable-prefix-caching", *s["served_pool"]]
    reqs = make_requests(s["served_n"], s["served_prompt"], s["served_out"], 2000, seed=1)
    warm = make_requests(8, 32, 8, 2000, seed=2)
    runs = list(reversed(modes(supported)))   # graphs first: the figure the target judges
    if s["device"] == "cpu" and len(runs) > 1:
        # No graphs on CPU: the smoke run starts the one stack whose command line differs
        # (--enforce-eager); the default's is the one every other stack test starts.
        runs = [r for r in runs if r[1]]
        fig.note("CPU smoke run: the eager stack only (graphs are never captured on CPU)")
    for label, eager in runs:
        t = time.perf_counter()
        stack = Stack(model, *flags, *(["--enforce-eager"] if eager else []), timeout_s=s["stack_timeout_s"])
        try:
            ready_s = time.perf_counter() - t
            drive(stack.url, model, warm, None, seed=2)
            records, _ = drive(stack.url, model, reqs, None, seed=1)
            m = summarize(records, [99])
            fig.run(mode=label, requests=len(records), ready_s=round(ready_s, 1),
                    output_tokens=m["total_output_tokens"], seconds=round(m["duration"], 2),
                    tok_per_s=round(m["output_throughput"], 1), mean_tpot_ms=round(m["mean_tpot_ms"], 2),
                    p99_tpot_ms=round(m["p99_tpot_ms"], 2), mean_ttft_ms=round(m["mean_ttft_ms"], 1))
        finally:
            stack.stop()


SECTIONS = {"profile": section_profile, "offline": section_offline, "served": section_served}


def run_section(args) -> int:
    s = sizes(args.cpu_smoke)
    fig = Figures(Path(args.json))

    def stop(*_):   # the orchestrator's time limit: leave through the finally blocks (a stack stops)
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    if args.section == "model":
        section_model(s, fig)
    else:
        SECTIONS[args.section](s, args.model, fig)
    fig["done"] = True
    fig.save()
    return 0
