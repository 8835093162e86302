"""`bench_host_cache --workload multi-turn` (issue 27, part 2): the host tier measured on the load it
is for, sized for a 2-core machine.

The same four configurations as the Mooncake replay (bench_host_cache.RUNS), each a fresh stack,
each driven by `loadgen multi-turn` (loadgen.multi_turn_run) with the same script (seed): users
arriving as a Poisson process, each a conversation whose turns resend it all. The model is a tiny
random-weight Llama with a 4k context (built in DEFAULT_MODEL on first use), the device pool a few
hundred 16-token blocks, so that the conversations waiting between turns need several times the
device pool and fit in device + host (4x). The defaults below were picked with short trial runs on
a 2-core VM (README, "The host tier, measured"): one configuration takes about 2.3 minutes,
its stack's start and stop included.

The restart run SIGKILLs the scheduler as the turn half way through the planned ones is sent, and
compares the hit rate (usage.cached_tokens over prompt tokens) of the 50 turns before with the 50
after. `--rounds 2` runs the configurations twice, the second time in reverse order (ABCD DCBA), so
that a drift of the machine over the sitting weighs on each alike.
"""
from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from pagedserve.loadgen.bench_host_cache import (RUNS, around_restart, arm_stop_signals, ignore_stop_signals, pct,
                                                 scheduler_pid)
from pagedserve.loadgen.metrics import REFUSED

DEFAULT_MODEL = Path(".cache/tiny-llama-4k")
HIDDEN = 256                # the tiny Llama's width here: prefill is most of a long turn's TTFT
CONTEXT = 4096
# The workload's defaults (README says how they were picked): ~15 conversations in flight (0.4 users/s
# x ~37 s each), ~880 tokens each on average, ~3x the 256-block device pool and within device + host;
# 2.4 turns/s offered, 80 % of the 3 turns/s a trial held without caching; ~110 s a run.
DEFAULTS = dict(device_blocks=256, users=28, turns=6, user_rate=0.4, think_time=6.0, user_len=192,
                output_len=24, system_len=128)
WINDOW = 50                 # turns compared before and after the restart


def add_arguments(ap) -> None:
    g = ap.add_argument_group("--workload multi-turn (defaults sized for 2 cores; README)")
    g.add_argument("--users", type=int, default=DEFAULTS["users"])
    g.add_argument("--turns", type=int, default=DEFAULTS["turns"])
    g.add_argument("--user-rate", type=float, default=DEFAULTS["user_rate"], help="new users per second (Poisson)")
    g.add_argument("--think-time", type=float, default=DEFAULTS["think_time"], help="mean seconds between turns")
    g.add_argument("--user-len", type=int, default=DEFAULTS["user_len"], help="tokens per user message")
    g.add_argument("--output-len", type=int, default=DEFAULTS["output_len"], help="tokens per answer")
    g.add_argument("--system-len", type=int, default=DEFAULTS["system_len"])
    g.add_argument("--rounds", type=int, default=1, help="2: the configurations again, in reverse order")


def default_model() -> str:
    """The tiny Llama with a 4k context; built once (random weights, a tokenizer trained here)."""
    if not (DEFAULT_MODEL / "config.json").exists():
        from pagedserve.services.tiny_model import build_tiny_model
        print(f"building the tiny model in {DEFAULT_MODEL} (first use only) ...", file=sys.stderr, flush=True)
        build_tiny_model(DEFAULT_MODEL, arch="llama", max_len=CONTEXT, hidden_size=HIDDEN)
    return str(DEFAULT_MODEL)


def ttft_of(records: list, later: bool) -> tuple[float | None, float | None]:
    """TTFT mean and p99 (ms) of the first turns (later=False) or of every turn after the first:
    the first turn of a conversation can only hit the system prompt, the later ones its history."""
    v = [r.ttft * 1000.0 for r in records if r.ok and r.ttft is not None and (r.turn > 0) == later]
    return (float(np.mean(v)), float(np.percentile(v, 99))) if v else (None, None)


def lost_to_the_kill(r) -> bool:
    """A turn in flight when the scheduler died, or sent before the new one was up: the router
    answers it "the engine ... went away" (a stream error, or 503). That is the restart's cost, not
    a refusal of the rate: counted apart."""
    return not r.ok and "went away" in (getattr(r, "error_detail", None) or "")


def row_of(name: str, summary: dict, records: list, cut_at: float | None) -> dict:
    """`cut_at`: the send time of the turn half way (the restart run: the kill) at which the hit
    rates of the WINDOW turns before and after are compared; the host run has the same cut without
    a kill, which tells the restart's cost from the workload's drift (later turns hit more)."""
    pc = summary["prefix_cache"]
    lost = sum(map(lost_to_the_kill, records))
    refused = sum(1 for r in records if r.error in REFUSED and not lost_to_the_kill(r))
    row = {"run": name, "completed": summary["completed"], "failed": summary["failed"], "lost": lost,
           "refused": refused, "interrupted": summary["interrupted"],
           "device_hit_rate": pc["device_hit_rate"], "host_hit_rate": pc["host_hit_rate"], "hit_rate": pc["hit_rate"],
           "bound": pc["infinite_cache_bound"], "bound_with_answers": pc.get("bound_with_answers"),
           "prefill_saved": (pc["device_hit_tokens"] or 0) + (pc["host_hit_tokens"] or 0),
           "turns_per_s": summary["request_throughput"], "output_throughput": summary["output_throughput"]}
    row["first_ttft"], row["later_ttft"] = ttft_of(records, False), ttft_of(records, True)
    if cut_at is not None:
        row["before_restart"], row["after_restart"] = around_restart(records, cut_at, WINDOW)
    return row


def run_one(name: str, args, swap_gib: float, codec) -> dict:
    from pagedserve.loadgen.config import MultiTurnConfig
    from pagedserve.loadgen.multi_turn_report import write_outputs
    from pagedserve.loadgen.multi_turn_run import run_multi_turn
    from pagedserve.loadgen.stack import Stack
    kind = name.split(" ")[0]           # "host (2)": the second round's host run
    stack = Stack(args.model, "--num-device-blocks", str(args.device_blocks), "--swap-space", f"{swap_gib:.9f}",
                  "--max-num-batched-tokens", str(args.max_num_batched_tokens), *RUNS[kind])
    killed: list[float] = []
    half = args.users * args.turns // 2

    def kill_half_way(records: list) -> None:
        # Called as a turn is about to go out: that turn and the ones after it meet the new scheduler.
        if kind in ("host", "restart") and not killed and len(records) > half:
            pid = scheduler_pid(stack)
            if pid is not None:
                killed.append(records[-1].arrival)
                if kind == "restart":
                    os.kill(pid, signal.SIGKILL)
    try:
        out = Path(args.out) / name.replace(" ", "").replace("(", "-").replace(")", "")
        cfg = MultiTurnConfig(url=stack.url, tokenizer=args.model, users=args.users, turns=args.turns,
                              user_rate=args.user_rate, think_time=args.think_time, turn_lengths="fixed",
                              user_len=args.user_len, output_len=args.output_len, system_len=args.system_len,
                              kv_block_size=16, seed=args.seed, out=str(out), progress=False, label=name)
        try:
            result = asyncio.run(run_multi_turn(cfg, codec, kill_half_way))
        finally:
            arm_stop_signals()          # the run took SIGINT/SIGTERM over while it sent
        if result.interrupted:
            ignore_stop_signals()
        encode = (lambda text: codec.tokenizer(text, add_special_tokens=False)["input_ids"])
        summary = write_outputs(result, cfg.out, encode)
    finally:
        stack.stop()
    return row_of(name, summary, result.records, killed[0] if killed else None)


def order(runs: list[str], rounds: int) -> list[str]:
    """ABCD, then DCBA, ...: each configuration's runs sit at the same mean place in the sitting."""
    names = []
    for k in range(rounds):
        names += [n if rounds == 1 else f"{n} ({k + 1})" for n in (runs if k % 2 == 0 else runs[::-1])]
    return names


def ms2(pair) -> str:
    return "-" if pair[0] is None else f"{pair[0]:.0f} / {pair[1]:.0f}"


def table(rows: list[dict]) -> str:
    lines = ["| run | turns done / failed | hits device + host = all | bound: prompts / + answers | prefill tokens "
             "saved | TTFT turn 1 mean / p99 ms | TTFT turns ≥ 2 mean / p99 ms | turns/s, output tok/s | hit rate "
             f"{WINDOW} turns before / after the kill (host: the same cut, no kill) |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in rows:
        mark = " (refused: did not hold)" if r["refused"] else ""
        mark += " (interrupted)" if r["interrupted"] else ""
        if r["refused"]:
            notes.append(f"- **{r['run']}**: {r['refused']} turns refused (503 queue full, 429): it did not hold the "
                         f"rate; its TTFT is that of the turns served, and each refused turn ended its conversation.")
        around = f"{pct(r['before_restart'])} / {pct(r['after_restart'])}" if "before_restart" in r else ""
        if r.get("lost"):
            notes.append(f"- **{r['run']}**: {r['lost']} turns failed with the scheduler (\"went away\": in flight "
                         f"at the kill or sent before the restart was up); each ended its conversation.")
        lines.append(f"| {r['run']}{mark} | {r['completed']} / {r['failed']} | {pct(r['device_hit_rate'])} + "
                     f"{pct(r['host_hit_rate'])} = {pct(r['hit_rate'])} | {pct(r['bound'])} / "
                     f"{pct(r['bound_with_answers'])} | {r['prefill_saved']:.0f} | {ms2(r['first_ttft'])} | "
                     f"{ms2(r['later_ttft'])} | {r['turns_per_s']:.2f}, {r['output_throughput']:.1f} | {around} |")
    return "\n".join(lines + ([""] + notes if notes else []))


def mean_of(rows: list[dict], run: str, get) -> float | None:
    """The mean over a configuration's rounds of one figure (None where no round has it)."""
    v = [get(r) for r in rows if r["run"].split(" ")[0] == run]
    v = [x for x in v if x is not None and not math.isnan(x)]
    return sum(v) / len(v) if v else None


def targets(rows: list[dict]) -> list[str]:
    """Issue 27's targets, each met / missed / n/a; figures over rounds are means of each round's."""
    def verdict(ok) -> str:
        return "n/a" if ok is None else ("met" if ok else "**missed**")
    hit = mean_of(rows, "host", lambda r: r["hit_rate"])
    bound = mean_of(rows, "host", lambda r: r["bound_with_answers"] if r["bound_with_answers"] is not None
                    else r["bound"])
    share = hit / bound if hit is not None and bound else None
    dev_mean, host_mean = (mean_of(rows, n, lambda r: r["later_ttft"][0]) for n in ("device", "host"))
    dev_p99, host_p99 = (mean_of(rows, n, lambda r: r["later_ttft"][1]) for n in ("device", "host"))
    cut = 1 - host_mean / dev_mean if host_mean is not None and dev_mean else None
    before = mean_of(rows, "restart", lambda r: r.get("before_restart"))
    after = mean_of(rows, "restart", lambda r: r.get("after_restart"))
    gap = abs(before - after) if before is not None and after is not None else None
    drift = [mean_of(rows, "host", lambda r: r.get(k)) for k in ("before_restart", "after_restart")]
    refused = sum(r["refused"] for r in rows)      # the restart's "went away" turns are its cost, apart
    f = (lambda v, fmt: "-" if v is None else fmt.format(v))
    return [
        f"- host: hit rate ≥ 90 % of the bound (with answers): {pct(hit)} of {pct(bound)} = "
        f"{f(share and 100 * share, '{:.0f} %')}: {verdict(None if share is None else share >= 0.9)}",
        f"- host: TTFT mean of turns ≥ 2 at least 30 % under device-only: {f(host_mean, '{:.0f}')} vs "
        f"{f(dev_mean, '{:.0f}')} ms, {f(cut and 100 * cut, '{:.0f} %')} lower: {verdict(None if cut is None else cut >= 0.3)}",
        f"- host: TTFT p99 of turns ≥ 2 lower than device-only: {f(host_p99, '{:.0f}')} vs {f(dev_p99, '{:.0f}')} ms: "
        f"{verdict(None if host_p99 is None or dev_p99 is None else host_p99 < dev_p99)}",
        f"- restart: hit rate of the {WINDOW} turns after within 5 points of the {WINDOW} before: {pct(before)} / "
        f"{pct(after)} (host, the same cut: {pct(drift[0])} / {pct(drift[1])}): "
        f"{verdict(None if gap is None else gap <= 0.05)}",
        f"- nothing refused in any run: {refused} refused: {verdict(refused == 0)}",
    ]


def main(args, runs: list[str], swap_gib: float) -> tuple[list[dict], bool]:
    """Every run in order; (rows, stopped). A Stopped leaves the rows of the runs done."""
    from pagedserve.loadgen.bench_host_cache import Stopped
    from pagedserve.loadgen.text_prompts import TextCodec
    codec = TextCodec(args.model, chat=True)
    rows: list[dict] = []
    t0 = time.monotonic()
    try:
        for name in order(runs, args.rounds):
            rows.append(run_one(name, args, swap_gib, codec))
            print(f"bench_host_cache: {name} done ({time.monotonic() - t0:.0f} s in)", file=sys.stderr, flush=True)
            if rows[-1]["interrupted"]:
                return rows, True
    except Stopped as e:
        print(f"bench_host_cache: {e}: stopped; the stack of the run under way is down", flush=True)
        return rows, True
    return rows, False
