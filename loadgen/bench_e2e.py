"""End-to-end benchmark through the REST API: the whole stack as real processes vs the offline engine.

1. A Poisson arrival process at a fixed rate: output tokens/s, TTFT and TPOT (streamed, measured
   by loadgen's client with vllm bench serve's definitions).
2. Saturation: every request at once, through the API, against the offline engine (same cores in
   one process) on the same requests: the ratio is the price of the process boundaries. For each
   streamed round, the CPU seconds each process took (from /proc) and the router's per output token:
   one SSE event per token, so what a token costs on its way out.

    python -m pagedserve.loadgen.bench_e2e [--requests 64] [--rate 4] [--prompt-len 128] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from pathlib import Path

from pagedserve.loadgen.metrics import summarize

REPO = Path(__file__).resolve().parents[1]


def make_requests(n: int, prompt_len: int, max_tokens: int, vocab: int, seed: int,
                  spread: bool = True) -> list[tuple[list[int], int]]:
    """Random token ids; lengths in [half, full] with spread, else exactly prompt_len -> max_tokens."""
    rng = random.Random(seed)
    lo_p, lo_o = (prompt_len // 2, max_tokens // 2) if spread else (prompt_len, max_tokens)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(lo_p, prompt_len))],
             rng.randint(lo_o, max_tokens)) for _ in range(n)]


def drive(url: str, model: str, reqs, rate: float | None, seed: int,
          stream: bool = True) -> tuple[list, float]:
    """Send `reqs` through loadgen's client (Poisson at `rate`, or all at once), greedy with
    ignore_eos; the records and the run's duration."""
    from pagedserve.loadgen.config import ReplayConfig
    from pagedserve.loadgen.replay import run_replay
    from pagedserve.loadgen.workload import Fit, Plan, PlannedRequest, poisson_arrivals
    arrivals = poisson_arrivals(len(reqs), rate or math.inf, 1.0, random.Random(seed))
    plan = Plan([PlannedRequest(i, t, prompt, len(prompt), m) for i, ((prompt, m), t) in
                 enumerate(zip(reqs, arrivals))], [], Fit("filter", 0, 1.0, None))
    cfg = ReplayConfig(url=url, model=model, max_model_len=10**9, stream=stream, progress=False,
                       metrics_interval=0, plots=False)
    result = asyncio.run(run_replay(cfg, plan))
    failed = [r for r in result.records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first: {failed[0].error}: {failed[0].error_detail}")
    return result.records, summarize([r for r in result.records], [99])["duration"]


def drive_counted(stack, model: str, reqs, seed: int) -> tuple[list, float, dict[str, float]]:
    """drive() all at once, streamed, with the CPU seconds each role's processes took meanwhile."""
    from pagedserve.loadgen.proc_watch import cpu_seconds
    from pagedserve.loadgen.soak import ROLES, role_pids
    pids = {role: role_pids(stack.proc.pid, role) for role in ROLES}
    before = {role: cpu_seconds(p) for role, p in pids.items()}
    records, elapsed = drive(stack.url, model, reqs, None, seed)
    return records, elapsed, {role: cpu_seconds(p) - before[role] for role, p in pids.items()}


def offline_tokens_per_s(model: str, reqs, config_kw: dict) -> tuple[int, float]:
    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig
    from pagedserve.services.sampling_params import SamplingParams
    with Engine(EngineConfig(model=model, **config_kw)) as engine:
        params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
        start = time.perf_counter()
        outs = engine.generate([p for p, _ in reqs], params)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed


def summary(name: str, records: list, elapsed: float) -> str:
    s = summarize(records, [99])
    return (f"{name:<22} {len(records):>4} {s['total_output_tokens']:>7} {elapsed:>8.1f} "
            f"{s['total_output_tokens'] / elapsed:>9.1f} {s['mean_ttft_ms']:>8.1f} {s['p99_ttft_ms']:>8.1f} "
            f"{s['mean_tpot_ms']:>8.1f} {s['p99_tpot_ms']:>8.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / ".cache" / "bench-tiny-llama"))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-device-blocks", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fixed-lengths", action="store_true",
                   help="every request exactly --prompt-len -> --max-tokens (vLLM's random dataset, range 0)")
    p.add_argument("--hidden-size", type=int, default=128, help="hidden size of the tiny model built if missing")
    p.add_argument("--log-level", default="WARNING", help="INFO shows the scheduler's step timing")
    p.add_argument("--rounds", type=int, default=2, help="saturation rounds (offline, SSE, JSON each)")
    p.add_argument("--worker-threads", type=int, default=0, help="the launcher's --worker-threads (0: auto)")
    args = p.parse_args(argv)

    from pagedserve.loadgen.stack import Stack
    from pagedserve.services.tiny_model import build_tiny_model
    if not (Path(args.model) / "config.json").exists():
        build_tiny_model(args.model, arch="llama", hidden_size=args.hidden_size)
    from pagedserve.services.worker.model_loader import inspect_model_dir
    _, spec = inspect_model_dir(args.model)
    reqs = make_requests(args.requests, args.prompt_len, args.max_tokens, spec.vocab_size, args.seed,
                         spread=not args.fixed_lengths)

    stack = Stack(args.model, "--num-device-blocks", str(args.num_device_blocks), "--log-level", args.log_level,
                  "--worker-threads", str(args.worker_threads))
    offline, streamed, unstreamed = [], [], []
    try:
        drive(stack.url, args.model, reqs[:4], None, args.seed)        # warm-up
        poisson = drive(stack.url, args.model, reqs, args.rate, args.seed)
        # Saturation, in alternating rounds so that a noisy neighbour hits all three alike; the
        # stack idles (blocked on its sockets) while the offline engine runs in this process. One
        # untimed round of each first: the first run at a new batch size pays for warming up.
        offline_tokens_per_s(args.model, reqs, {"num_device_blocks": args.num_device_blocks})
        drive(stack.url, args.model, reqs, None, args.seed, stream=False)
        for _ in range(args.rounds):
            offline.append(offline_tokens_per_s(args.model, reqs, {"num_device_blocks": args.num_device_blocks}))
            streamed.append(drive_counted(stack, args.model, reqs, args.seed))
            unstreamed.append(drive(stack.url, args.model, reqs, None, args.seed, stream=False))
        time.sleep(1.5)   # the scheduler logs its step timing once it has been idle a heartbeat
    finally:
        stack.stop()
        timing = [line.split("INFO ", 1)[-1].strip() for line in stack.lines if "mean ms" in line]
    print(f"model {args.model}, {args.requests} requests, prompt <= {args.prompt_len}, "
          f"output <= {args.max_tokens} tokens, greedy, ignore_eos; saturation: best of {args.rounds} rounds")
    print(f"{'run':<22} {'reqs':>4} {'tokens':>7} {'seconds':>8} {'tok/s':>9} {'TTFT ms':>8} {'p99':>8} "
          f"{'TPOT ms':>8} {'p99':>8}")
    print(summary(f"API, Poisson {args.rate}/s", *poisson))
    best = lambda runs: min(runs, key=lambda r: r[1])
    print(summary("API, all at once, SSE", *best(streamed)[:2]))
    print(summary("API, all at once, JSON", *best(unstreamed)))
    tokens, elapsed = best(offline)
    print(f"{'offline engine':<22} {args.requests:>4} {tokens:>7} {elapsed:>8.1f} {tokens / elapsed:>9.1f}")
    rate = lambda run: sum(r.output_tokens for r in run[0]) / run[1]
    for i, (records, _, cpu) in enumerate(streamed, 1):
        tokens_out = sum(r.output_tokens for r in records)
        print(f"SSE round {i}, CPU s by process: " + ", ".join(f"{role} {s:.2f}" for role, s in cpu.items())
              + f"; router {cpu['router'] / tokens_out * 1e6:.0f} us per output token (one event each)")
    print("tok/s per round: offline " + " ".join(f"{t / e:.0f}" for t, e in offline)
          + " | SSE " + " ".join(f"{rate(r):.0f}" for r in streamed)
          + " | JSON " + " ".join(f"{rate(r):.0f}" for r in unstreamed))
    ref = tokens / elapsed
    med = lambda runs: statistics.median(rate(r) for r in runs)
    ref_med = statistics.median(t / e for t, e in offline)
    print(f"stack / offline at saturation (goal >= 0.85), best / median of rounds: non-streamed "
          f"{rate(best(unstreamed)) / ref:.2f} / {med(unstreamed) / ref_med:.2f}, streamed "
          f"{rate(best(streamed)) / ref:.2f} / {med(streamed) / ref_med:.2f} "
          f"(the client reads every SSE event on the same cores)")
    for line in timing:    # with --log-level INFO: the scheduler's per-step breakdown per run
        print("scheduler:", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
