"""`loadgen sweep` (one replay per request rate, the same workload and seed at each) and
`loadgen compare` (several sweeps or replays on the same axes and in one table).

A sweep folder holds rate_<R>/ (a whole replay each), sweep.json, sweep.md and sweep.png: normalized
latency and p99 TTFT against the rate, the PagedAttention paper's Fig. 12.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

from pagedserve.loadgen.config import CompareConfig, SweepConfig
from pagedserve.loadgen.replay import ReplayError, long_run_line, replay, request_count
from pagedserve.loadgen.report import jsonable, load_summary, write_outputs

PER_RATE = 100     # requests per rate when neither --num-requests nor --duration is given


def auto_rates(saturated_rps: float, points: int) -> list[float]:
    """`points` rates evenly spread up to the saturated request throughput (3 significant digits)."""
    if not saturated_rps > 0:
        raise ReplayError("the saturation run completed no request: no rate to sweep below it")
    return [float(f"{saturated_rps * i / points:.3g}") for i in range(1, points + 1)]


def row_of(summary: dict, rate: float | None, folder: str) -> dict:
    """One rate's line of a sweep; latencies are NaN (no point on a plot) when nothing completed."""
    done = summary["completed"] > 0
    latency = lambda key: float(summary.get(key, math.nan)) if done else math.nan
    return {"rate": rate, "dir": folder, "request_throughput": summary["request_throughput"],
            "output_throughput": summary["output_throughput"],
            "normalized_latency": latency("mean_normalized_latency_s_per_token"),
            "mean_ttft_ms": latency("mean_ttft_ms"), "p99_ttft_ms": latency("p99_ttft_ms"),
            "mean_tpot_ms": latency("mean_tpot_ms"), "p99_e2el_ms": latency("p99_e2el_ms"),
            "completed": summary["completed"], "failed": summary["failed"],
            "interrupted": summary.get("interrupted", False)}


def folder_of(rate: float) -> str:
    """rate_4, rate_0.5, rate_inf: unique per rate (repr, not a rounded %g)."""
    return f"rate_{int(rate)}" if math.isfinite(rate) and rate.is_integer() else f"rate_{rate!r}"


def sweep(cfg: SweepConfig) -> dict:
    out = Path(cfg.out)
    rows: list[dict] = []
    model: list[str] = []                          # the server's, as each run discovered it
    percentiles = sorted(set(cfg.percentiles) | {99.0})      # the plot needs p99

    def point(rate: float) -> SweepConfig:
        one = dataclasses.replace(cfg, rate=rate, trace_times=False, out=str(out / folder_of(rate)),
                                  percentiles=percentiles)
        return dataclasses.replace(one, num_requests=request_count(one, PER_RATE))

    def announce(rates: list[float]) -> None:
        """The whole sweep's length, before its rates run (each replay says its own)."""
        count = point(1.0).num_requests          # None: --duration bounds each rate
        each = f"{count} requests" if count else f"{cfg.duration:g} s"
        seconds = sum(count / r if count else cfg.duration for r in rates)
        print(long_run_line("loadgen sweep", f"{len(rates)} rates x {each}", seconds), file=sys.stderr, flush=True)

    def run(rate: float) -> dict:
        one = point(rate)
        folder = folder_of(rate)
        summary = write_outputs(replay(one), one.out)
        rows.append(row_of(summary, rate, folder))
        model.append(summary["server"]["model"])
        return summary

    failure = None
    try:
        rates = cfg.rate_values()
        if rates is None:
            saturated = run(math.inf)
            rates = [] if saturated["interrupted"] else auto_rates(saturated["request_throughput"], cfg.auto_points)
        announce([r for r in dict.fromkeys(rates) if math.isfinite(r)])
        for rate in dict.fromkeys(rates):           # each rate once, in the order given
            if rows and rows[-1]["interrupted"]:
                break
            run(rate)
    except ReplayError as e:
        failure = str(e)                            # the rates that ran are still written
    label = cfg.label or f"{cfg.url} {cfg.trace}"
    result = {"label": label, "trace": cfg.trace, "model": model[0] if model else cfg.model, "rows": rows,
              "max_normalized_latency": cfg.max_normalized_latency,
              "sustained_rate": sustained_rate(rows, cfg.max_normalized_latency), "error": failure}
    if rows:
        write_sweep(result, out, cfg.plots)
    if failure:
        raise ReplayError(f"{failure} (after {len(rows)} rates; what ran is in {out})" if rows else failure)
    return result


def sustained_rate(rows: list[dict], limit: float | None) -> float | None:
    """The highest finite rate whose normalized latency stays under `limit` with no request failed."""
    if limit is None:
        return None
    held = [r["rate"] for r in rows if r["rate"] is not None and math.isfinite(r["rate"])
            and r["completed"] and not r["failed"] and r["normalized_latency"] <= limit]
    return max(held) if held else None


def write_sweep(result: dict, out: Path, plots: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(jsonable(result), indent=2) + "\n")
    lines = [f"# loadgen sweep: {result['label']}", "", _table({result["label"]: result["rows"]})]
    if result["max_normalized_latency"] is not None:
        held = result["sustained_rate"]
        lines += ["", f"Highest rate with normalized latency <= {result['max_normalized_latency']:g} s/token "
                  "and no request failed: " + (f"**{held:g} req/s**" if held is not None else "none of those tried")]
    if result.get("error"):
        lines += ["", f"The sweep stopped: {result['error']}"]
    if plots:
        from pagedserve.loadgen.plots import rate_plot
        finite = {result["label"]: [r for r in result["rows"] if math.isfinite(r["rate"])]}
        title = f"loadgen sweep: {result['trace']} trace on {result.get('model') or result['label']}"
        lines += ["", f"![sweep]({rate_plot(finite, out / 'sweep.png', title, result['max_normalized_latency'])})"]
    (out / "sweep.md").write_text("\n".join(lines) + "\n")


def _table(series: dict[str, list[dict]]) -> str:
    head = "| run | rate (req/s) | req/s | output tok/s | normalized latency (s/token) | TTFT mean / p99 (ms) " \
           "| TPOT mean (ms) | E2E p99 (ms) | completed / failed |"
    lines = [head, "|---|" + "---|" * 8]
    for label, rows in series.items():
        for r in rows:
            rate = "inf" if r["rate"] is None or not math.isfinite(r["rate"]) else f"{r['rate']:g}"
            lines.append(f"| {label} | {rate} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                         f"{r['normalized_latency']:.4f} | {r['mean_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} | "
                         f"{r['mean_tpot_ms']:.2f} | {r['p99_e2el_ms']:.0f} | {r['completed']} / {r['failed']} |")
    return "\n".join(lines)


def compare(cfg: CompareConfig) -> dict[str, list[dict]]:
    if not cfg.dirs:
        raise ReplayError("compare needs at least one folder")
    if cfg.labels and len(cfg.labels) != len(cfg.dirs):
        raise ReplayError(f"{len(cfg.labels)} labels for {len(cfg.dirs)} folders")
    series: dict[str, list[dict]] = {}
    workloads: dict[str, None] = {}                 # "trace on model" of each run, once each
    for i, folder in enumerate(cfg.dirs):
        label, rows, workload = _read_run(Path(folder))
        label = cfg.labels[i] if cfg.labels else label
        while label in series:
            label += "'"
        series[label] = rows
        workloads[workload] = None
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# loadgen compare", "", _table(series)]
    finite = {k: [r for r in rows if r["rate"] is not None and math.isfinite(r["rate"])] for k, rows in series.items()}
    if any(finite.values()):
        from pagedserve.loadgen.plots import rate_plot
        title = "loadgen compare: " + "; ".join(workloads)
        lines += ["", f"![compare]({rate_plot(finite, out / 'compare.png', title)})"]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    return series


def _read_run(folder: Path) -> tuple[str, list[dict], str]:
    try:
        return _parse_run(folder)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise ReplayError(f"{folder}: not a loadgen sweep or replay ({type(e).__name__}: {e})") from None


def _parse_run(folder: Path) -> tuple[str, list[dict], str]:
    """A run's label, its rows and its workload ("trace on model")."""
    if (folder / "sweep.json").is_file():
        data = load_sweep(folder)
        return str(data["label"]), data["rows"], f"{data['trace']} trace on {data['model']}"
    if (folder / "summary.json").is_file():
        s = load_summary(folder)
        rate = s.get("request_rate")
        rate = float(rate) if rate is not None else None
        return s["label"], [row_of(s, rate, str(folder))], f"{s['trace']} trace on {s['server']['model']}"
    raise ReplayError(f"{folder} holds neither sweep.json nor summary.json")


def load_sweep(folder: Path) -> dict:
    """A sweep's sweep.json with its numbers as floats ("inf" and "nan" are written as strings) and
    its model named."""
    data = json.loads((folder / "sweep.json").read_text())
    numeric = ("rate", "request_throughput", "output_throughput", "normalized_latency", "mean_ttft_ms",
               "p99_ttft_ms", "mean_tpot_ms", "p99_e2el_ms")
    data["rows"] = [{**r, **{k: float(r[k]) for k in numeric}} for r in data["rows"]]
    data["model"] = data.get("model") or _first_model(folder, data["rows"])
    return data


def _first_model(folder: Path, rows: list[dict]) -> str:
    """The model of a sweep written before sweep.json named it: its first rate's summary has it."""
    try:
        return load_summary(folder / rows[0]["dir"])["server"]["model"]
    except (OSError, IndexError, KeyError, ValueError):
        return "a model it does not name"
