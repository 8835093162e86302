"""PNG plots of replays and sweeps (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402

from pagedserve.loadgen.client import RequestRecord  # noqa: E402
from pagedserve.loadgen.metrics import timeline  # noqa: E402


def replay_plots(records: list[RequestRecord], samples: list[dict], out: Path) -> list[str]:
    """latency_cdf.png, throughput.png and, when /metrics was read, server.png; their names."""
    names = [_latency_cdfs(records, out / "latency_cdf.png"), _throughput(records, out / "throughput.png")]
    if samples:
        names.append(_server(samples, out / "server.png"))
    return names


def _cdf(ax, values_ms: list[float], title: str) -> None:
    if values_ms:
        xs = np.sort(values_ms)
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
    else:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def _latency_cdfs(records: list[RequestRecord], path: Path) -> str:
    ok = [r for r in records if r.ok]
    ttft = [1000 * r.ttft for r in ok if r.ttft is not None]
    tpot = [1000 * (r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.ttft is not None and r.output_tokens > 1]
    e2e = [1000 * r.e2el for r in ok]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, values, title in zip(axes, (ttft, tpot, e2e), ("TTFT", "TPOT", "E2E latency")):
        _cdf(ax, values, title)
    axes[0].set_ylabel("fraction of requests")
    return _save(fig, path)


def _throughput(records: list[RequestRecord], path: Path) -> str:
    series = timeline(records)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.plot(series["t"], series["tokens_per_s"], color="tab:blue", label="output tok/s")
    ax.set_xlabel("s since start")
    ax.set_ylabel("output tokens / s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.step(series["t"], series["in_flight"], where="post", color="tab:orange", label="in flight")
    ax2.set_ylabel("requests in flight", color="tab:orange")
    ax.grid(alpha=0.3)
    ax.set_title("Throughput and requests in flight")
    return _save(fig, path)


def _server(samples: list[dict], path: Path) -> str:
    t = [s["t"] for s in samples]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 3.6))
    usage = [s["kv_cache_usage"] for s in samples]
    if any(u is not None for u in usage):
        ax1.plot(t, [100 * u if u is not None else np.nan for u in usage])
    ax1.set_ylim(0, 105)
    ax1.set_title("KV cache usage (%)")
    for key in ("running", "waiting", "swapped"):
        values = [s[key] for s in samples]
        if any(v is not None for v in values):
            ax2.plot(t, [v if v is not None else np.nan for v in values], label=key)
    ax2.set_title("Requests on the server")
    ax2.legend(loc="upper right")
    for ax in (ax1, ax2):
        ax.set_xlabel("s since start")
        ax.grid(alpha=0.3)
    return _save(fig, path)


def rate_plot(series: dict[str, list[dict]], path: Path, limit: float | None = None) -> str:
    """Normalized latency and p99 TTFT against request rate, one line per series (Fig. 12)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for label, rows in series.items():
        rows = sorted((r for r in rows if r["rate"] is not None), key=lambda r: r["rate"])
        rates = [r["rate"] for r in rows]
        ax1.plot(rates, [r["normalized_latency"] for r in rows], marker="o", label=label)
        ax2.plot(rates, [r["p99_ttft_ms"] for r in rows], marker="o", label=label)
    if limit is not None:
        ax1.axhline(limit, color="grey", linestyle="--", linewidth=1)
    ax1.set_ylabel("normalized latency (s/token)")
    ax2.set_ylabel("p99 TTFT (ms)")
    for ax in (ax1, ax2):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def stacked_shares(data: dict[str, dict[str, float]], path: Path) -> str:
    """One stacked bar per label of its parts' shares (0-1): the KV split of Fig. 2."""
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = list(data)
    bottom = np.zeros(len(labels))
    for part in next(iter(data.values())):
        values = np.array([data[label][part] for label in labels])
        ax.bar(labels, values, bottom=bottom, label=part.replace("_", " "))
        bottom += values
    ax.set_ylabel("share of the KV cache")
    ax.legend(fontsize=8)
    return _save(fig, path)


def grouped_bars(data: dict[str, dict[str, float]], path: Path, ylabel: str) -> str:
    """{group: {series: value}} as bars side by side per group (Fig. 13)."""
    fig, ax = plt.subplots(figsize=(9, 4))
    groups = list(data)
    series = list(data[groups[0]])
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        ax.bar([k + i * width for k in range(len(groups))], [data[g][name] for g in groups], width, label=name)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(groups))], groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name
