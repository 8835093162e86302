"""`loadgen fidelity`: the same requests against the real stack and the simulator, and how far the
simulator's figures are from the measured ones.

Per trace (default ShareGPT-like and Mooncake conversation) and rate (default one below the
saturation the simulator predicts and one above it), a fresh `pagedserve up` (so no run inherits
another's prefix cache) is replayed with `loadgen replay`'s own client, then `loadgen simulate`
runs the very plan that was sent (the same lengths, arrivals and shared prefixes) priced by a step
profile taken on this machine (`loadgen profile`), with the stack's pool, block size and batch
limits. The report gives each figure measured and simulated and the error, simulated / measured - 1,
against issue 31's bounds: throughput and mean TPOT within 10 %, mean TTFT within 15 %. Beside them,
no bound, the engine's steps and their mean time: the stack's from its --step-log (each step from
the end of the one before to the end of its update, services/scheduler/step_log.py), the
simulator's as it planned and priced them. Fewer, longer measured steps at the same tokens say the
profile prices a served step too cheap; equal steps with a latency off say the client's side is.
Under each run's row, its logged steps by kind (decode rows only, prefill only, both): how many,
and their mean served time, the worker's compute of them and what the profile prices a step of
that very composition at. Served above worker is the control plane's and the processes' share;
worker above priced, the engine's step as served costs more than as profiled. Beside them, the
simulator's steps of each kind and their mean charge (the priced compute and the admission of the
prompts each takes in): a kind it plans more or fewer of than the stack ran says its schedule
differs, not its prices.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from pathlib import Path

from pagedserve.loadgen.config import FidelityConfig, ReplayConfig, SimulateConfig
from pagedserve.loadgen.cost_model import GiB
from pagedserve.loadgen.metrics import summarize
from pagedserve.loadgen.profiled_cost import ProfiledServer
from pagedserve.loadgen.replay import run_replay
from pagedserve.loadgen.report import jsonable
from pagedserve.loadgen.simulate import simulate, summary_of
from pagedserve.loadgen.stack import Stack
from pagedserve.loadgen.step_profile import ProfileError
from pagedserve.services.scheduler import step_log
from pagedserve.services.tiny_model import resolve_model

# (summary key, name in the table, the bound on |error|; None: reported, no bound)
FIGURES = (("output_throughput", "output tok/s", 0.10), ("mean_ttft_ms", "TTFT mean ms", 0.15),
           ("p99_ttft_ms", "TTFT p99 ms", None), ("mean_tpot_ms", "TPOT mean ms", 0.10),
           ("mean_e2el_ms", "E2E mean ms", None),
           # Where a miss comes from: the engine's steps, as the stack logged them (--step-log) and
           # as the simulator planned and priced them.
           ("num_steps", "steps", None), ("mean_step_ms", "step mean ms", None))


def sim_config(cfg: FidelityConfig, server: ProfiledServer, trace: str, rate: float) -> SimulateConfig:
    """The simulator set as the stack is: its pool (the same blocks, in the profile's model's
    bytes), block size, batch limits, the replay's length fitting."""
    pool_gib = cfg.num_device_blocks * cfg.block_size * server.kv_bytes_per_token / GiB
    return SimulateConfig(profile=cfg.profile, trace=trace, rate=rate, num_requests=cfg.num_requests,
                          kv_cache_gib=pool_gib, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                          max_num_batched_tokens=cfg.max_num_batched_tokens, fit="scale", seed=cfg.seed,
                          async_scheduling="--no-async-scheduling" not in cfg.serve_flags,
                          label=f"simulated {trace} at {rate:g} req/s")


def rates_for(cfg: FidelityConfig, server: ProfiledServer, trace: str) -> list[float]:
    """cfg.rates, or the simulator's saturation throughput (all requests at once) times
    cfg.below and cfg.above: one rate the server keeps up with, one it does not."""
    if cfg.rates:
        return list(cfg.rates)
    saturated = summary_of(simulate(sim_config(cfg, server, trace, math.inf)))["request_throughput"]
    return [round(saturated * cfg.below, 3), round(saturated * cfg.above, 3)]


def stack_flags(cfg: FidelityConfig, server: ProfiledServer) -> list[str]:
    """The stack as the simulator is set; its worker on as many threads as the profile's engine had
    (a profile taken on one thread prices a worker on two wrongly)."""
    threads = server.profile.machine.get("torch_threads") or 0
    return ["--num-device-blocks", str(cfg.num_device_blocks), "--block-size", str(cfg.block_size),
            "--max-num-seqs", str(cfg.max_num_seqs), "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
            *(["--worker-threads", str(threads)] if threads else []), *cfg.serve_flags]


def measure(cfg: FidelityConfig, server: ProfiledServer, trace: str, rate: float, out: Path) -> tuple[dict, dict]:
    """(measured summary, simulated summary) of one trace at one rate."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "steps.jsonl"
    log_path.unlink(missing_ok=True)
    stack = Stack(cfg.model, *stack_flags(cfg, server), "--step-log", str(log_path))
    try:
        replay_cfg = ReplayConfig(url=stack.url, trace=trace, rate=rate, num_requests=cfg.num_requests,
                                  seed=cfg.seed, kv_block_size=cfg.block_size, fit="scale", metrics_interval=0,
                                  plots=False, progress=False, out=str(out / "measured"))
        run = asyncio.run(run_replay(replay_cfg))
    finally:
        stack.stop()
    measured = summarize(run.records, replay_cfg.percentiles)
    steps = step_log.read(str(log_path))
    measured["steps_by_kind"] = steps_by_kind(steps, server, cfg.block_size)
    measured["num_steps"] = len(steps)
    measured["mean_step_ms"] = 1e3 * sum(r[0] for r in steps) / len(steps) if steps else None
    simulated = summary_of(simulate(sim_config(cfg, server, trace, rate), plan=run.plan))
    simulated["mean_step_ms"] = 1e3 * simulated["busy_seconds"] / simulated["num_steps"] if simulated["num_steps"] else None
    return measured, simulated


def steps_by_kind(steps: list[list[float]], server: ProfiledServer, block_size: int) -> dict:
    """The stack's logged steps (step_log records) by kind: decode rows only, prefill rows only,
    or both -> {kind: {steps, served_ms, worker_ms, priced_ms}}, means per step; priced: the
    profile's price of each step's composition (ProfiledCost.priced, as the simulator charges it)."""
    cost = server.cost_model()
    sums: dict[str, list] = {}
    for seconds, worker_s, d, c, q, pc, rows, ctx in steps:
        kind = step_log.step_kind((d, c, q))
        acc = sums.setdefault(kind, [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += seconds
        acc[2] += worker_s
        acc[3] += cost.priced(d, c, q, pc, rows, ctx, block_size)
    out = {}
    for kind in step_log.STEP_KINDS:
        if kind in sums:
            n, served, worker, priced = sums[kind]
            out[kind] = {"steps": n, "served_ms": 1e3 * served / n, "worker_ms": 1e3 * worker / n,
                         "priced_ms": 1e3 * priced / n}
    return out


def steps_table(rows: list[dict]) -> str:
    """Per run, its logged steps by kind (steps_by_kind) beside the simulator's steps of that kind
    (how many it planned, their mean charge with each admitted prompt's admission in it)."""
    lines = ["| trace | rate req/s | kind | steps | served ms | worker ms | priced ms | served / priced "
             "| simulated steps | simulated ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        served, simulated = row.get("steps_by_kind", {}), row.get("simulated_steps_by_kind", {})
        for kind in step_log.STEP_KINDS:
            k, sim = served.get(kind), simulated.get(kind)
            if k is None and sim is None:
                continue
            cells = ["-"] * 5 if k is None else [
                str(k["steps"]), f"{k['served_ms']:.2f}", f"{k['worker_ms']:.2f}", f"{k['priced_ms']:.2f}",
                f"{k['served_ms'] / k['priced_ms']:.2f}" if k["priced_ms"] else "-"]
            cells += ["0", "-"] if sim is None else [str(sim["steps"]), f"{sim['priced_ms']:.2f}"]
            lines.append(f"| {row['trace']} | {row['rate']:g} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def errors(measured: dict, simulated: dict) -> dict:
    out = {}
    for key, _, bound in FIGURES:
        m, s = measured.get(key), simulated.get(key)
        err = None if not m or s is None else s / m - 1.0
        out[key] = {"measured": m, "simulated": s, "error": err, "bound": bound,
                    "ok": None if bound is None or err is None else abs(err) <= bound}
    return out


def table(rows: list[dict]) -> str:
    head = "| trace | rate req/s | " + " | ".join(f"{name}: measured / simulated (error)" for _, name, _ in FIGURES) + " |"
    lines = [head, "|---|---|" + "---|" * len(FIGURES)]
    for row in rows:
        cells = []
        for key, _, bound in FIGURES:
            f = row["figures"][key]
            if f["error"] is None:
                cells.append("-")
                continue
            mark = "" if f["ok"] is None else (" ok" if f["ok"] else " **miss**")
            cells.append(f"{f['measured']:.1f} / {f['simulated']:.1f} ({f['error']:+.1%}{mark})")
        lines.append(f"| {row['trace']} | {row['rate']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check(cfg: FidelityConfig) -> ProfiledServer:
    """Before any stack starts: the profile reads (its model entry too), and was taken on the model
    given. ProfileError: one line, exit 2."""
    server = ProfiledServer.load(cfg.profile)
    cfg.model = resolve_model(cfg.model)
    measured_on = server.profile.model.get("path")
    if measured_on and Path(measured_on).resolve() != Path(cfg.model).resolve():
        raise ProfileError(f"--profile {cfg.profile} was taken on {measured_on}, not on --model {cfg.model}")
    return server


def fidelity(cfg: FidelityConfig) -> dict:
    server = check(cfg)
    out = Path(cfg.out)
    rows = []
    for trace in cfg.traces:
        for rate in rates_for(cfg, server, trace):
            folder = out / f"{Path(trace).stem}-{rate:g}"
            measured, simulated = measure(cfg, server, trace, rate, folder)
            rows.append({"trace": trace, "rate": rate, "figures": errors(measured, simulated),
                         "measured_failed": measured.get("failed", 0), "steps_by_kind": measured["steps_by_kind"],
                         "simulated_steps_by_kind": simulated["steps_by_kind"]})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    report = {"config": dataclasses.asdict(cfg), "rows": rows,
              "met": all(f["ok"] is not False for r in rows for f in r["figures"].values())}
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(json.dumps(jsonable(report), indent=1) + "\n")
    (out / "fidelity.md").write_text(f"# Simulator fidelity: {cfg.model}, profile {cfg.profile}\n\n{table(rows)}\n\n"
                                     "Error: simulated / measured - 1. Bounds (issue 31): output throughput and "
                                     "TPOT mean within 10 %, TTFT mean within 15 %.\n\n"
                                     "The stack's steps by kind (its --step-log): served is each step as the "
                                     "scheduler timed it, worker the worker's compute of it, priced what the "
                                     "profile charges a step of that composition; simulated, the steps "
                                     "of that kind the simulator planned and what it charged them.\n\n"
                                     f"{steps_table(rows)}\n")
    return report
