"""`loadgen`: replay traces against any OpenAI-compatible server (`replay`), chat conversations of
several turns (`multi-turn`), sweep request rates (`sweep`), put runs side by side (`compare`), and
run the project's own scheduler and block store against a GPU cost model in virtual time
(`simulate`), measure what one engine step costs on this machine (`profile`), size a deployment
from a machine's step profile (`plan`), and check the simulator against the real stack
(`fidelity`). Options:
loadgen.config; `loadgen CMD --help`.

A run that cannot start (server down, bad trace, bad flag) is one line on stderr and exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pagedserve.loadgen.config import (CompareConfig, FidelityConfig, MultiTurnConfig, PaperConfig, PlanConfig,
                                       ProfileConfig, ReplayConfig, SimulateConfig, SweepConfig)
from pagedserve.services.flags import ConfigError, add_flags, from_args

COMMANDS = {
    "replay": (ReplayConfig, "replay a workload once and write its report"),
    "multi-turn": (MultiTurnConfig, "chat conversations: users arrive, each sends T turns with the whole "
                                    "conversation so far, think time between them"),
    "sweep": (SweepConfig, "one replay per request rate, and latency against rate"),
    "compare": (CompareConfig, "several sweeps or replays on the same axes and in one table"),
    "simulate": (SimulateConfig, "the real scheduler and block store against a GPU cost model, in virtual time"),
    "paper": (PaperConfig, "the PagedAttention paper's figures on the simulator, beside the paper's"),
    "profile": (ProfileConfig, "what one engine step costs here (decode, prefill, block size, swaps, copies), "
                               "measured on a real model: a step profile for simulate"),
    "plan": (PlanConfig, "from a step profile: the highest request rate a replica sustains within an SLO, per KV "
                         "pool and block size, and the replicas a target rate needs"),
    "fidelity": (FidelityConfig, "the same requests against a real stack and the simulator (with a step profile "
                                 "of this machine): each figure's error"),
}
FILE_OUT = {"profile"}    # commands whose --out is one file, not a folder


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, (cls, help_text) in COMMANDS.items():
        add_flags(sub.add_parser(name, help=help_text, description=help_text), cls)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cls, _ = COMMANDS[args.command]
    from pagedserve.loadgen.replay import ReplayError
    from pagedserve.loadgen.traces import TraceError
    try:
        cfg = from_args(cls, {k: v for k, v in vars(args).items() if k != "command"})
        cfg.out = os.path.normpath(cfg.out)     # `--out r/` names r/report.md, not r//report.md
        if args.command in FILE_OUT and os.path.isdir(cfg.out):
            raise ConfigError(f"--out {cfg.out} is a folder: give the file to write")
        writable_folder((os.path.dirname(cfg.out) or ".") if args.command in FILE_OUT else cfg.out)
        return _run(args.command, cfg)
    except (ConfigError, ReplayError, TraceError) as e:
        print(f"loadgen {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:             # before the run (start-up, discovery) or after it
        print(f"loadgen {args.command}: interrupted", file=sys.stderr)
        return 130


def writable_folder(path: str) -> None:
    """--out is checked before anything is sent: a run's results must have somewhere to go."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".loadgen-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--out {path}: cannot write there ({e.strerror or e})") from None


def _run(command: str, cfg) -> int:
    from pagedserve.loadgen import sweep as sweeps
    if command == "replay":
        from pagedserve.loadgen.replay import replay
        from pagedserve.loadgen.report import write_outputs
        summary = write_outputs(replay(cfg), cfg.out)
        print(_one_line(summary) + f"; report in {cfg.out}/report.md")
        return 130 if summary["interrupted"] else 0
    if command == "multi-turn":
        from pagedserve.loadgen.multi_turn_report import write_outputs as write_turns
        from pagedserve.loadgen.multi_turn_run import multi_turn
        s = write_turns(multi_turn(cfg), cfg.out)
        pc = s["prefix_cache"]
        share = (lambda v: "-" if v is None else f"{100 * v:.1f} %")
        print(_one_line(s) + f"; {s['refused']} refused; prefix hits device {share(pc['device_hit_rate'])}, "
              f"host {share(pc['host_hit_rate'])}, bound {share(pc['infinite_cache_bound'])}; report in {cfg.out}/report.md")
        return 130 if s["interrupted"] else 0
    if command == "simulate":
        from pagedserve.loadgen.simulate import simulate, write_outputs as write_sim
        try:
            s = write_sim(simulate(cfg), cfg.out)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        print(f"{s['completed']} completed in {s['duration']:.1f} simulated s ({s['wall_seconds']:.1f} s here): "
              f"{s['request_throughput']:.2f} req/s, normalized latency {s['mean_normalized_latency_s_per_token']:.3f} "
              f"s/token, {s['avg_batched_requests']:.2f} requests batched, token states "
              f"{100 * s['kv_token_share']:.1f} % of the KV cache (while saturated: {s['saturated']['avg_batched_requests']:.2f}"
              f" and {100 * s['saturated']['kv_token_share']:.1f} %){_priced_by(s)}; summary in {cfg.out}/summary.json")
        return 0
    if command == "paper":
        from pagedserve.loadgen.paper import paper
        report = paper(cfg)
        done = f"{report['num_runs']} runs redrawn from {cfg.out}/runs.json" if cfg.replot else \
            f"{report['num_runs']} simulated runs in {report['wall_seconds']:.0f} s"
        print(f"{done}; report in {cfg.out}/paper.md")
        return 0
    if command == "profile":
        from pagedserve.loadgen.profile import profile
        from pagedserve.loadgen.step_profile import save
        raw = profile(cfg)
        save(raw, cfg.out)
        print(f"step profile of {raw['model']['name']} on {raw['machine']['device']} in {raw['took_s']:.0f} s: "
              f"{cfg.out}" + (f" ({len(raw['notes'])} notes in it)" if raw["notes"] else ""))
        return 0
    if command == "fidelity":
        from pagedserve.loadgen.fidelity import fidelity
        from pagedserve.loadgen.step_profile import ProfileError
        try:
            report = fidelity(cfg)
        except ProfileError as e:
            raise ConfigError(str(e)) from None
        print(f"{'every bound met' if report['met'] else 'a bound missed'}; report in {cfg.out}/fidelity.md")
        return 0
    if command == "plan":
        from pagedserve.loadgen.plan import plan, table
        try:
            report = plan(cfg)
        except ValueError as e:           # a profile it cannot use (step_profile.ProfileError)
            raise ConfigError(str(e)) from None
        print("\n".join(table(report)))
        if report["replicas"] is not None:
            print(f"{report['replicas']} replicas for {report['target_rate']:g} req/s")
        print(f"plan in {cfg.out}/plan.md")
        return 0
    if command == "sweep":
        result = sweeps.sweep(cfg)
        for row in result["rows"]:
            print(f"rate {row['rate']:g}: {row['request_throughput']:.2f} req/s, normalized latency "
                  f"{row['normalized_latency']:.4f} s/token, p99 TTFT {row['p99_ttft_ms']:.1f} ms")
        print(f"sweep in {cfg.out}/sweep.md")
        return 130 if any(r["interrupted"] for r in result["rows"]) else 0
    sweeps.compare(cfg)
    print(f"comparison in {cfg.out}/compare.md")
    return 0


def _priced_by(s: dict) -> str:
    """Which profile priced a simulated run (nothing for the roofline's)."""
    p = s["profile"]
    if p is None:
        return ""
    machine = p["machine"].get("device") or p["machine"].get("hostname")
    return f"; steps priced by the profile {p['path']} ({p['model']['name'] or p['model']['path']} on {machine})"


def _one_line(s: dict) -> str:
    errors = ", ".join(f"{k} {v}" for k, v in s["errors"].items())
    return (f"{s['completed']} completed, {s['failed']} failed{f' ({errors})' if errors else ''} in "
            f"{s['duration']:.1f} s: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
            f"TTFT mean {s['mean_ttft_ms']:.1f} ms, TPOT mean {s['mean_tpot_ms']:.2f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
