"""What a replay leaves in --out: summary.json (flat, vLLM's saved-result names plus ours),
requests.jsonl (one record per request), metrics.jsonl (the scraped /metrics series), report.md
and the PNG plots."""
from __future__ import annotations

import dataclasses
import json
import math
import signal
import threading
from pathlib import Path

from pagedserve.loadgen.metrics import LATENCIES, percentile_key, summarize
from pagedserve.loadgen.replay import RunResult

LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def summary_of(result: RunResult) -> dict:
    cfg = result.config
    figures = summarize(result.records, cfg.percentiles, cfg.slos or None)
    return {
        **figures,
        "label": cfg.label or f"{result.server.model} @ {result.server.url}, {cfg.trace}",
        "interrupted": result.interrupted,
        "num_prompts": len(result.plan.requests),
        "request_rate": cfg.rate if not cfg.trace_times else None,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "trace": cfg.trace,
        "fit": dataclasses.asdict(result.plan.fit),
        "prefix_cache": prefix_cache_of(result.samples, result.plan.prefix_bound),
        "server": dataclasses.asdict(result.server),
        "metrics_available": result.metrics_available,
        "started_at": result.started_at,
        "notes": result.notes,
        "options": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "api_key"},
    }


def prefix_cache_of(samples: list[dict], bound: float | None) -> dict:
    """The server's prefix-cache hit rates over the run, in prompt tokens, from its counters at the
    first and the last /metrics reading: the device's (vllm:prefix_cache_*), the host tier's
    (vllm:external_prefix_cache_hits) and both, each as a share of all prompt tokens looked up,
    beside `bound`, the rate a cache that never evicts would reach on the prompts sent
    (workload.prefix_cache_bound)."""
    def delta(series: str) -> float | None:
        values = [s[series] for s in samples if s.get(series) is not None]
        return values[-1] - values[0] if len(values) >= 2 else None
    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    external = delta("external_prefix_cache_hits")
    rate = (lambda n: n / queries if n is not None and queries else None)
    return {"queries_tokens": queries, "device_hit_tokens": hits, "host_hit_tokens": external,
            "device_hit_rate": rate(hits), "host_hit_rate": rate(external),
            "hit_rate": rate((hits or 0) + (external or 0)) if hits is not None else None,
            "infinite_cache_bound": bound}


def write_run(out: Path, summary: dict, records: list) -> None:
    """summary.json and requests.jsonl of a run (a replay's, or a simulation's in virtual time)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(jsonable(summary), indent=2, allow_nan=False) + "\n")
    with (out / "requests.jsonl").open("w") as f:
        for rec in records:
            f.write(json.dumps(rec.to_json(), separators=(",", ":")) + "\n")


def write_outputs(result: RunResult, out: str | Path) -> dict:
    """Every file of the run. Ctrl-C is held off meanwhile (a few seconds, mostly plotting): an
    interrupted run's report must come out whole, not stop halfway through its plots."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        return _write(result, Path(out))
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _write(result: RunResult, out: Path) -> dict:
    summary = summary_of(result)
    write_run(out, summary, result.records)
    with (out / "metrics.jsonl").open("w") as f:
        for sample in result.samples:
            f.write(json.dumps(sample, separators=(",", ":")) + "\n")
    plots = []
    if result.config.plots and result.records:
        from pagedserve.loadgen import plots as plotting
        plots = plotting.replay_plots(result.records, result.samples, out, run_title(summary))
    (out / "report.md").write_text(markdown(summary, result, plots))
    return summary


def run_title(s: dict) -> str:
    """What a run's plots show, from its summary: the trace, the model, the arrivals (and the label
    when the user gave one)."""
    rate = s.get("request_rate")
    arrivals = "the trace's times" if rate is None else \
        ("all at once" if math.isinf(float(rate)) else f"{float(rate):g} req/s")
    title = f"{s['trace']} trace on {s['server']['model']}, {arrivals}"
    label = s.get("options", {}).get("label")
    return f"{label}: {title}" if label else title


def jsonable(obj):
    """inf and nan are not JSON: they are written as strings ("inf")."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def markdown(s: dict, result: RunResult, plots: list[str]) -> str:
    cfg = result.config
    arrivals = ("the trace's own times" + (f" / {cfg.speed:g}" if cfg.speed != 1 else "")) if cfg.trace_times \
        else ("all at once" if math.isinf(cfg.rate) else f"{cfg.rate:g} req/s, burstiness {cfg.burstiness:g}")
    lines = [
        f"# loadgen replay: {s['label']}", "",
        f"- server: {result.server.url}, model `{result.server.model}`, context {result.server.max_model_len}",
        f"- workload: `{cfg.trace}`, {s['num_prompts']} requests, {arrivals}"
        + (f", at most {cfg.max_concurrency} in flight" if cfg.max_concurrency else ""),
        f"- {result.plan.fit.describe()}",
        f"- {cfg.endpoint}, {'streamed' if cfg.stream else 'not streamed'}, seed {cfg.seed}"
        + (", interrupted (Ctrl-C)" if result.interrupted else ""),
        "",
        "| figure | value |", "|---|---|",
        f"| completed / failed | {s['completed']} / {s['failed']} |",
        f"| duration | {s['duration']:.2f} s |",
        f"| input / output tokens | {s['total_input_tokens']} / {s['total_output_tokens']} |",
        f"| request throughput | {s['request_throughput']:.2f} req/s |",
        f"| output token throughput | {s['output_throughput']:.1f} tok/s |",
        f"| total token throughput | {s['total_token_throughput']:.1f} tok/s |",
        f"| normalized latency | {s['mean_normalized_latency_s_per_token']:.4f} s/token |",
    ]
    pc = s["prefix_cache"]
    share = (lambda v: "-" if v is None else f"{100 * v:.1f} %")
    if pc["hit_rate"] is not None:
        lines.append(f"| prefix-cache hits, share of prompt tokens | {share(pc['hit_rate'])} "
                     f"(device {share(pc['device_hit_rate'])}, host {share(pc['host_hit_rate'])}) |")
    if pc["infinite_cache_bound"] is not None:
        lines.append(f"| prefix-cache hits a cache that never evicts would get | {share(pc['infinite_cache_bound'])} |")
    if s["request_goodput"] is not None:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in cfg.slos.items())
        lines.append(f"| goodput ({slos}) | {s['request_goodput']:.2f} req/s |")
    lines += ["", "| latency (ms) | mean | median | std | " + " | ".join(percentile_key(p) for p in cfg.percentiles)
              + " |", "|---|" + "---|" * (3 + len(cfg.percentiles))]
    for name in LATENCIES:
        row = [s[f"mean_{name}_ms"], s[f"median_{name}_ms"], s[f"std_{name}_ms"]] + \
              [s[f"{percentile_key(p)}_{name}_ms"] for p in cfg.percentiles]
        lines.append(f"| {LATENCY_NAMES[name]} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
    if s["errors"]:
        lines += ["", "Errors by kind: " + ", ".join(f"{k} {v}" for k, v in s["errors"].items())]
    if s["short_outputs"]:
        lines += ["", f"{s['short_outputs']} requests got fewer output tokens than asked (the server's usage)."]
    if not cfg.stream:
        lines += ["", "Not streamed: TTFT, TPOT and ITL cannot be measured and read 0."]
    if result.metrics_available is False:
        lines += ["", "The server has no /metrics: no KV or queue series."]
    if result.notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in result.notes]
    lines += ["", "Definitions: `vllm bench serve`'s (TTFT send -> first text event; TPOT (E2E - TTFT) / "
              "(output tokens - 1); ITL gaps between text events; normalized latency mean E2E / output tokens)."]
    if plots:
        lines += [""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def load_summary(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "summary.json").read_text())

