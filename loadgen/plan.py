"""`loadgen plan`: the most requests per second one replica sustains within an SLO, per (KV pool,
block size) candidate, from simulated runs priced by a step profile; and for the best candidate how
many replicas a target rate needs.

A candidate's rate is found by bisection on the Poisson rate of `loadgen simulate --profile` runs,
all with the same seed (so the same requests, their gaps scaled by the rate). A rate meets the SLO
when every request completes and every limit holds (p99 TTFT, p99 TPOT, ...). The search starts at
the throughput of the saturated run (every request at once), doubles until a rate misses and halves
until one meets, then narrows until the two are within --tolerance; the answer is the highest rate
that met (a lower bound of the true one), beside the lowest that missed.

A rate is judged by its run's percentiles alone, so the run must be long enough for an overload to
show: past a replica's capacity the queue grows by the excess, and the last requests' TTFT with it,
which a TTFT limit catches once --num-requests arrivals have piled up. (The saturated run's
throughput is no capacity bound: with fewer requests than a full batch it is set by the longest
request, not by the replica.) If even every request at once meets the SLO, the runs are too short
to find a limit, and the plan says so.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Callable

from pagedserve.loadgen.config import PlanConfig, SimulateConfig
from pagedserve.loadgen.cost_model import GiB
from pagedserve.loadgen.metrics import percentile_key
from pagedserve.loadgen.profiled_cost import ProfiledServer
from pagedserve.loadgen.report import jsonable
from pagedserve.loadgen.simulate import simulate, summary_of

MAX_STEPS = 12     # doublings (or halvings) of the start rate before the search stops looking for a bound


def slo_keys(cfg: PlanConfig) -> dict[str, float]:
    """The summary fields the SLO limits (p99_ttft_ms, ...) -> their limits in ms."""
    return {f"{percentile_key(p)}_{metric}_ms": ms for metric, p, ms in cfg.slos}


def meets(summary: dict, limits: dict[str, float]) -> bool:
    every_one = summary["num_prompts"] > 0 and summary["completed"] == summary["num_prompts"]
    return every_one and all(summary[key] <= ms for key, ms in limits.items())


def bisect_rate(run: Callable[[float], dict], limits: dict[str, float], tolerance: float) -> dict:
    """The highest rate found that meets the limits ("rate"; 0 if none did, inf if every request at
    once did) and the lowest that misses ("misses_at"; None if none did), with every run tried."""
    tried = []

    def ok(rate: float) -> bool:
        s = run(rate)
        tried.append({"rate": rate, "meets": meets(s, limits), "request_throughput": s["request_throughput"],
                      "completed": s["completed"], **{key: s[key] for key in limits}})
        return tried[-1]["meets"]
    if ok(math.inf):
        return {"rate": math.inf, "misses_at": None, "runs": tried}
    lo, hi = 0.0, tried[0]["request_throughput"] or 1.0
    for _ in range(MAX_STEPS):            # upward until a rate misses
        if not ok(hi):
            break
        lo, hi = hi, 2 * hi
    else:
        return {"rate": lo, "misses_at": None, "runs": tried}
    if lo == 0.0:                         # downward until a rate meets
        for _ in range(MAX_STEPS):
            if ok(hi / 2):
                lo = hi / 2
                break
            hi /= 2
        else:
            return {"rate": 0.0, "misses_at": hi, "runs": tried}
    while hi > lo * (1 + tolerance):
        mid = math.sqrt(lo * hi)          # geometric: the bracket's width is a ratio
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return {"rate": lo, "misses_at": hi, "runs": tried}


def run_config(cfg: PlanConfig, kv_cache_gib: float | None, block_size: int, rate: float) -> SimulateConfig:
    percentiles = sorted({50.0, 90.0, 99.0} | {p for _, p, _ in cfg.slos})
    return SimulateConfig(profile=cfg.profile, trace=cfg.trace, num_requests=cfg.num_requests, seed=cfg.seed,
                          kv_cache_gib=kv_cache_gib, block_size=block_size, rate=rate, percentiles=percentiles,
                          max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                          async_scheduling=True)    # a replica as pagedserve serves it (its default)


def candidate(cfg: PlanConfig, kv_cache_gib: float | None, block_size: int) -> dict:
    limits = slo_keys(cfg)
    summaries = {}

    def run(rate: float) -> dict:
        summaries[rate] = summary_of(simulate(run_config(cfg, kv_cache_gib, block_size, rate)))
        return _with_requests(summaries[rate], cfg.trace)
    found = bisect_rate(run, limits, cfg.tolerance)
    first = next(iter(summaries.values()))
    at = summaries.get(found["rate"])
    return {"kv_cache_gib": kv_cache_gib if kv_cache_gib is not None
            else first["num_kv_token_slots"] * first["profile"]["model"]["kv_bytes_per_token"] / GiB,
            "num_kv_token_slots": first["num_kv_token_slots"], "block_size": block_size, **found,
            "at_rate": {key: at[key] for key in limits} if at else None}


def _with_requests(summary: dict, trace: str) -> dict:
    """The run's summary; ValueError where it sent no request, which no rate changes: a plan of it
    said 0 req/s and exited 0, as if a replica could serve nothing."""
    if summary["num_prompts"] == 0:
        fit = summary["fit"]
        if not fit["read"]:
            raise ValueError(f"the trace {trace} holds no requests: nothing to plan for")
        raise ValueError(f"none of the {fit['read']} requests read from the trace {trace} fits the model's "
                         f"context ({fit['max_model_len']} tokens): nothing to plan for")
    return summary


def replicas_for(target: float | None, rate: float) -> int | None:
    """Replicas of `rate` req/s each that serve `target` req/s (None: no target, or no rate met)."""
    if target is None or rate <= 0 or math.isinf(rate):
        return None
    return math.ceil(target / rate)


def plan(cfg: PlanConfig) -> dict:
    ProfiledServer.load(cfg.profile)      # a bad profile stops here, before any run
    rows = []
    pools = cfg.kv_cache_gib or [None]
    for kv in pools:
        for bs in cfg.block_size:
            rows.append(candidate(cfg, kv, bs))
            print(f"loadgen plan: {len(rows)}/{len(pools) * len(cfg.block_size)} candidates, "
                  f"{_candidate_line(rows[-1])}", file=sys.stderr, flush=True)
    best = max(rows, key=lambda r: r["rate"])    # of equals, the first in the order given
    report = {"profile": cfg.profile, "slo": slo_keys(cfg), "trace": cfg.trace, "num_requests": cfg.num_requests,
              "seed": cfg.seed, "candidates": rows, "best": best, "target_rate": cfg.target_rate,
              "replicas": replicas_for(cfg.target_rate, best["rate"])}
    out = Path(cfg.out)
    (out / "plan.json").write_text(json.dumps(jsonable(report), indent=1) + "\n")
    (out / "plan.md").write_text(markdown(report) + "\n")
    return report


def _candidate_line(row: dict) -> str:
    return f"{row['kv_cache_gib']:.4g} GiB, block {row['block_size']}: {_rate(row['rate'])} req/s"


def _rate(rate: float) -> str:
    return "no limit found" if math.isinf(rate) else f"{rate:.3g}"


def table(report: dict) -> list[str]:
    keys = list(report["slo"])
    lines = ["| KV pool (GiB) | token slots | block size | max rate (req/s) | SLO missed at | "
             + " | ".join(f"{k} at max" for k in keys) + " | runs |",
             "|---|---|---|---|---|" + "---|" * len(keys) + "---|"]
    for r in report["candidates"]:
        at = r["at_rate"] or {}
        lines.append(f"| {r['kv_cache_gib']:.4g} | {r['num_kv_token_slots']} | {r['block_size']} | {_rate(r['rate'])} | "
                     f"{'-' if r['misses_at'] is None else format(r['misses_at'], '.3g')} | "
                     + " | ".join(f"{at[k]:.1f}" if k in at else "-" for k in keys) + f" | {len(r['runs'])} |")
    return lines


def markdown(report: dict) -> str:
    slo = ", ".join(f"{k} <= {ms:g}" for k, ms in report["slo"].items())
    best = report["best"]
    lines = ["# Capacity plan", "",
             f"Profile {report['profile']}; SLO {slo}; trace {report['trace']}, {report['num_requests']} requests a "
             f"run, seed {report['seed']}. Max rate: the highest a bisection found to meet the SLO (every request "
             "completed, every limit held), a lower bound; 'SLO missed at': the lowest rate that did not meet it.",
             "", *table(report), "",
             f"Best: {best['kv_cache_gib']:.4g} GiB of KV, block size {best['block_size']}: {_rate(best['rate'])} "
             "req/s a replica."]
    if math.isinf(best["rate"]):
        lines.append(f"Every request at once met the SLO: {report['num_requests']} requests are too few to load "
                     "a replica. Raise --num-requests.")
    if report["target_rate"] is not None and not math.isinf(best["rate"]):
        if report["replicas"] is None:
            lines.append(f"No rate met the SLO, so no number of replicas serves {report['target_rate']:g} req/s.")
        else:
            lines.append(f"For {report['target_rate']:g} req/s: {report['replicas']} replicas "
                         f"(ceil({report['target_rate']:g} / {best['rate']:.3g})).")
    return "\n".join(lines)
