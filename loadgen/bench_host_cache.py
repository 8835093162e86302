"""The host tier of the prefix cache, measured on the Mooncake conversation trace (issue 14), or with
`--workload multi-turn` on chat users resending their conversations (issue 27; bench_host_multi_turn).

One stack (`pagedserve up`), the same device pool, four runs of the same replay:
  none     no prefix caching
  device   device-only prefix caching (--kv-offloading-size 0)
  host     device + host tier, the host pool --host-ratio times the device pool
  restart  as host, with the scheduler SIGKILLed once half the requests have been sent (the
           launcher restarts it; the kvstore keeps the cache)

    python -m pagedserve.loadgen.bench_host_cache --model DIR [--device-blocks 512] [--host-ratio 4] \\
        [--rate 1] [--num-requests 400] [--out bench-host-cache] [--runs none,device,host,restart]

Per run: the server's prefix hit rate per tier (its counters over the run), the infinite-cache
bound of the prompts sent (loadgen.workload.prefix_cache_bound), prefill tokens saved, TTFT mean
and p99, output throughput; for the restart run, the hit rate (each request's usage.cached_tokens)
of the 100 requests sent before the kill and of the first 100 served after it. Each run's full
loadgen report goes to OUT/NAME/. The model wants a context long enough that a scaled trace block
still holds whole KV blocks (4k-8k; README: "The host tier, measured").

A run whose requests the server refused (503 queue full, 429) did not hold its rate: its row says
how many and is marked, since its latencies are those of the survivors. SIGTERM or Ctrl-C stops the
benchmark: the run under way stops sending and writes what it has, its stack is stopped, the runs
after it are not started, and the table holds the runs done (exit 130).
"""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path

from pagedserve.loadgen.metrics import refused_count

RUNS = {"none": ["--no-enable-prefix-caching", "--kv-offloading-size", "0"],
        "device": ["--kv-offloading-size", "0"],
        "host": [], "restart": []}


def scheduler_pid(stack) -> int | None:
    from pagedserve.loadgen.stack import alive, children_of
    for pid in children_of(stack.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pagedserve.services.scheduler.service" in argv and alive(pid):
            return pid
    return None


def window_hit_rate(records: list) -> float | None:
    prompt = sum(r.prompt_tokens or 0 for r in records)
    return sum(r.cached_tokens or 0 for r in records) / prompt if prompt else None


def around_restart(records: list, killed_at: float, n: int = 100) -> tuple[float | None, float | None]:
    """Hit rates of the last n requests sent before the kill and of the first n served after the
    restart (sent after the last request the kill failed)."""
    ok = sorted((r for r in records if r.ok), key=lambda r: r.send)
    cut = max((r.send for r in records if not r.ok), default=killed_at)
    before = [r for r in ok if r.send < killed_at][-n:]
    after = [r for r in ok if r.send > max(cut, killed_at)][:n]
    return window_hit_rate(before), window_hit_rate(after)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT outside a replay (a stack starting, a report being written)."""


_stopping = False      # a stop was asked: later signals are ignored until the teardown is over


def arm_stop_signals() -> None:
    """SIGTERM and SIGINT raise Stopped, so that the `finally` stopping a run's stack runs (SIGTERM's
    default would leave every process of the stack behind). A replay takes both signals over while it
    sends (stop sending, write what it has) and leaves them at their defaults: re-armed after it."""
    def stop(signum, frame):
        ignore_stop_signals()
        raise Stopped(signal.Signals(signum).name)
    if _stopping:
        return ignore_stop_signals()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def ignore_stop_signals() -> None:
    """The benchmark is stopping: the teardown must finish (Stack.stop kills what does not stop)."""
    global _stopping
    _stopping = True
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def run_one(name: str, args, swap_gib: float) -> dict:
    from pagedserve.loadgen.config import ReplayConfig
    from pagedserve.loadgen.replay import replay
    from pagedserve.loadgen.report import write_outputs
    from pagedserve.loadgen.stack import Stack
    stack = Stack(args.model, "--num-device-blocks", str(args.device_blocks), "--swap-space", f"{swap_gib:.9f}",
                  "--max-num-batched-tokens", str(args.max_num_batched_tokens), *RUNS[name])
    killed: list[float] = []
    try:
        cfg = ReplayConfig(url=stack.url, trace="mooncake-conversation", rate=args.rate,
                           num_requests=args.num_requests, seed=args.seed, kv_block_size=16,
                           out=str(Path(args.out) / name), progress=False, label=name)
        timer = None
        if name == "restart":
            start = time.perf_counter()

            def kill() -> None:
                pid = scheduler_pid(stack)
                if pid is not None:
                    killed.append(time.perf_counter() - start)
                    os.kill(pid, signal.SIGKILL)
            timer = threading.Timer(args.num_requests / args.rate / 2, kill)
            timer.start()
        try:
            result = replay(cfg)
        finally:
            arm_stop_signals()
            if timer is not None:
                timer.cancel()
        if result.interrupted:          # the signal went to the replay: the benchmark ends with this run
            ignore_stop_signals()
        summary = write_outputs(result, cfg.out)
    finally:
        stack.stop()
    pc = summary["prefix_cache"]
    row = {"run": name, "completed": summary["completed"], "failed": summary["failed"],
           "device_hit_rate": pc["device_hit_rate"], "host_hit_rate": pc["host_hit_rate"],
           "hit_rate": pc["hit_rate"], "bound": pc["infinite_cache_bound"],
           "prefill_saved": (pc["device_hit_tokens"] or 0) + (pc["host_hit_tokens"] or 0),
           "mean_ttft_ms": summary["mean_ttft_ms"], "p99_ttft_ms": summary["p99_ttft_ms"],
           "output_throughput": summary["output_throughput"], "refused": refused_count(summary["errors"]),
           "interrupted": summary["interrupted"]}
    if killed:
        row["before_restart"], row["after_restart"] = around_restart(result.records, killed[0])
    return row


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def table(rows: list[dict]) -> str:
    """The runs side by side; a run with refused requests (or stopped) is marked in its row and said
    under the table: its latencies are those of the requests that got through, not of the rate."""
    lines = ["| run | done / failed | hits device + host = all | bound (no eviction) | prefill tokens saved "
             "| TTFT mean / p99 ms | output tok/s | hit rate 100 before / after the restart |",
             "|---|---|---|---|---|---|---|---|"]
    warnings = []
    for r in rows:
        around = f"{pct(r['before_restart'])} / {pct(r['after_restart'])}" if "before_restart" in r else ""
        refused, mark = r.get("refused", 0), ""
        if refused:
            mark = " (refused: did not hold)"
            warnings.append(f"- **{r['run']}**: {refused} of {r['completed'] + r['failed']} requests refused (503 "
                            f"queue full, 429): the run did not hold its rate; its TTFT and throughput are the "
                            f"latencies of the {r['completed']} served only.")
        if r.get("interrupted"):
            mark += " (interrupted)"
            warnings.append(f"- **{r['run']}**: stopped by a signal before all its requests were sent.")
        failed = f"{r['failed']}, {refused} refused" if refused else f"{r['failed']}"
        lines.append(f"| {r['run']}{mark} | {r['completed']} / {failed} | {pct(r['device_hit_rate'])} + "
                     f"{pct(r['host_hit_rate'])} = {pct(r['hit_rate'])} | {pct(r['bound'])} | {r['prefill_saved']:.0f} "
                     f"| {r['mean_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} | {r['output_throughput']:.1f} | {around} |")
    return "\n".join(lines + ([""] + warnings if warnings else []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("mooncake", "multi-turn"), default="mooncake",
                    help="mooncake: the conversation trace replayed; multi-turn: chat users (bench_host_multi_turn)")
    ap.add_argument("--model", help="a local model folder (a 4k-8k context); multi-turn: default the tiny Llama "
                                    "with a 4k context, built on first use")
    ap.add_argument("--device-blocks", type=int, help="device pool in 16-token blocks (default: 512; multi-turn 256)")
    ap.add_argument("--host-ratio", type=float, default=4.0, help="host pool / device pool, in blocks")
    ap.add_argument("--rate", type=float, default=1.0, help="mooncake: requests per second (Poisson)")
    ap.add_argument("--num-requests", type=int, default=400, help="mooncake: requests per run")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default="none,device,host,restart")
    ap.add_argument("--out", default=None, help="default: bench-host-cache (multi-turn: bench-host-cache-multi-turn)")
    from pagedserve.loadgen import bench_host_multi_turn as mt
    mt.add_arguments(ap)
    args = ap.parse_args(argv)
    multi = args.workload == "multi-turn"
    runs = args.runs.split(",")
    if not set(runs) <= set(RUNS):
        ap.error(f"--runs: each of {', '.join(RUNS)}")
    if args.model is None:
        if not multi:
            ap.error("--model: required with --workload mooncake")
        args.model = mt.default_model()
    if args.device_blocks is None:
        args.device_blocks = mt.DEFAULTS["device_blocks"] if multi else 512
    args.out = args.out or ("bench-host-cache-multi-turn" if multi else "bench-host-cache")
    import torch
    from pagedserve.services.worker.model_loader import inspect_model_dir
    _, spec = inspect_model_dir(args.model)
    block_bytes = spec.block_bytes(16, torch.float32)
    # The launcher makes int(GiB * 2^30) // block_bytes host blocks: half a block more keeps the count.
    swap_gib = (args.host_ratio * args.device_blocks + 0.5) * block_bytes / (1 << 30)
    arm_stop_signals()
    rows: list[dict] = []
    stopped = False
    if multi:
        rows, stopped = mt.main(args, runs, swap_gib)
    else:
        try:
            for name in runs:
                rows.append(run_one(name, args, swap_gib))
                if rows[-1]["interrupted"]:
                    stopped = True
                    break
        except Stopped as e:
            stopped = True
            print(f"bench_host_cache: {e}: stopped; the stack of the run under way is down", flush=True)
    if rows:
        text = mt.table(rows) + "\n\nTargets (issue 27):\n" + "\n".join(mt.targets(rows)) if multi else table(rows)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "table.md").write_text(text + "\n")
        print(text)
    return 130 if stopped else 0


if __name__ == "__main__":
    raise SystemExit(main())
