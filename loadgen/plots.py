"""PNG plots of replays, sweeps and the paper's figures (matplotlib, Agg backend: no display needed).

Read at a glance: a title naming the trace and the model, a log axis where the values span orders
of magnitude (a saturated baseline would squash the others onto zero), plain tick labels (no "1e6"
offset), legends outside the axes, limit lines named in them.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from pagedserve.loadgen.client import RequestRecord  # noqa: E402
from pagedserve.loadgen.metrics import timeline  # noqa: E402

LOG_SPAN = 30          # an axis goes logarithmic when its largest value is this many times its smallest


def replay_plots(records: list[RequestRecord], samples: list[dict], out: Path, title: str) -> list[str]:
    """latency_cdf.png, throughput.png and, when /metrics was read, server.png; their names."""
    names = [_latency_cdfs(records, out / "latency_cdf.png", title), _throughput(records, out / "throughput.png", title)]
    if samples:
        names.append(server_plot(samples, out / "server.png", title))
    return names


def _figure(ncols: int, size: tuple[float, float], title: str):
    """A figure whose layout makes room for legends placed outside the axes."""
    fig, axes = plt.subplots(1, ncols, figsize=size, layout="constrained", squeeze=False)
    fig.suptitle(title)
    return fig, list(axes[0])


def _plain(value: float, _pos=None) -> str:
    """A tick label as written by hand: 1,000,000 and 0.05, never 1e6."""
    if value == 0:
        return "0"
    return f"{value:,.0f}" if abs(value) >= 10 else f"{value:.3g}"


def fit_scale(ax, values, axis: str = "y") -> None:
    """Log when the positive values span LOG_SPAN times or more, else linear from 0; plain labels."""
    positive = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    log = len(positive) >= 2 and max(positive) >= LOG_SPAN * min(positive)
    which = ax.yaxis if axis == "y" else ax.xaxis
    if log:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
        # Under three decades, 1-2-5 ticks: powers of ten alone would leave one or two labels.
        few = max(positive) < 1000 * min(positive)
        which.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if few else (1.0,)))
        which.set_minor_formatter(NullFormatter())
    elif axis == "y":
        ax.set_ylim(bottom=0)
    else:
        ax.set_xlim(left=0)
    which.set_major_formatter(FuncFormatter(_plain))


def _legend_right(ax) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=9)


def _cdf(ax, values_ms: list[float], name: str) -> None:
    if values_ms:
        xs = np.sort(values_ms)
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        fit_scale(ax, xs, "x")
    else:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(name)
    ax.set_xlabel(f"{name} (ms)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def _latency_cdfs(records: list[RequestRecord], path: Path, title: str) -> str:
    ok = [r for r in records if r.ok]
    ttft = [1000 * r.ttft for r in ok if r.ttft is not None]
    tpot = [1000 * (r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.ttft is not None and r.output_tokens > 1]
    e2e = [1000 * r.e2el for r in ok]
    fig, axes = _figure(3, (13, 3.8), f"Latency CDFs: {title}")
    for ax, values, name in zip(axes, (ttft, tpot, e2e), ("TTFT", "TPOT", "E2E latency")):
        _cdf(ax, values, name)
    axes[0].set_ylabel("fraction of requests")
    return _save(fig, path)


def _throughput(records: list[RequestRecord], path: Path, title: str) -> str:
    series = timeline(records)
    fig, (ax,) = _figure(1, (9, 3.8), f"Throughput and requests in flight: {title}")
    ax.plot(series["t"], series["tokens_per_s"], color="tab:blue")
    ax.set_xlabel("s since start")
    ax.set_ylabel("output tokens / s", color="tab:blue")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.step(series["t"], series["in_flight"], where="post", color="tab:orange")
    ax2.set_ylabel("requests in flight", color="tab:orange")
    ax2.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def server_plot(samples: list[dict], path: Path, title: str) -> str:
    """The server's KV pool in use and its queues. The KV axis stops a little above the peak: a pool
    sized for a large model is mostly empty under a tiny one, and 0-100 % would draw a flat line."""
    t = [s["t"] for s in samples]
    fig, (ax1, ax2) = _figure(2, (13, 3.8), f"The server's view (/metrics): {title}")
    usage = [100 * s["kv_cache_usage"] if s.get("kv_cache_usage") is not None else np.nan for s in samples]
    if not all(np.isnan(usage)):
        peak = float(np.nanmax(usage))
        ax1.plot(t, usage)
        ax1.set_ylim(0, min(100.0, max(1.0, 1.25 * peak)))
        ax1.axhline(peak, color="grey", linestyle=":", linewidth=1)
        ax1.set_title(f"KV cache in use (peak {peak:.1f} % of the pool)")     # a title: never on the data
    else:
        ax1.text(0.5, 0.5, "not exported", ha="center", va="center", transform=ax1.transAxes)
        ax1.set_title("KV cache in use")
    ax1.set_ylabel("% of the KV pool")
    for key in ("running", "waiting", "swapped"):
        values = [s.get(key) for s in samples]
        if any(v is not None for v in values):
            ax2.plot(t, [v if v is not None else np.nan for v in values], label=key)
    ax2.set_title("Requests on the server")
    ax2.set_ylabel("requests")
    ax2.set_ylim(bottom=0)
    if ax2.get_lines():
        _legend_right(ax2)
    for ax in (ax1, ax2):
        ax.set_xlabel("s since start")
        ax.grid(alpha=0.3)
    return _save(fig, path)


def rate_plot(series: dict[str, list[dict]], path: Path, title: str, limit: float | None = None) -> str:
    """Normalized latency and p99 TTFT against request rate, one line per series (Fig. 12)."""
    fig, (ax1, ax2) = _figure(2, (12, 4.6), title)
    latencies, ttfts = [], []
    for label, rows in series.items():
        rows = sorted((r for r in rows if r["rate"] is not None), key=lambda r: r["rate"])
        rates = [r["rate"] for r in rows]
        latencies += [r["normalized_latency"] for r in rows]
        ttfts += [r["p99_ttft_ms"] for r in rows]
        ax1.plot(rates, [r["normalized_latency"] for r in rows], marker="o", label=label)
        ax2.plot(rates, [r["p99_ttft_ms"] for r in rows], marker="o", label=label)
    if limit is not None:           # before the scale is set, so that the axis takes it in; named in the legend
        ax1.axhline(limit, color="grey", linestyle="--", linewidth=1, label=f"latency limit {limit:g} s/token")
    fit_scale(ax1, latencies + ([limit] if limit is not None else []))
    fit_scale(ax2, ttfts)
    ax1.set_title("Normalized latency (mean E2E / output tokens)")
    ax1.set_ylabel("normalized latency (s/token)")
    ax2.set_title("p99 time to first token")
    ax2.set_ylabel("p99 TTFT (ms)")
    for ax in (ax1, ax2):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(6, len(handles)))
    return _save(fig, path)


def stacked_shares(data: dict[str, dict[str, float]], path: Path, title: str,
                   marks: dict[str, float] | None = None, mark_label: str = "") -> str:
    """One stacked bar per label of its parts' shares (0-1), each share written on it where there is
    room: the KV split of Fig. 2. `marks`: a value per label drawn as a tick across its bar (the
    paper's token-state share)."""
    fig, (ax,) = _figure(1, (9, 4.4), title)
    labels = list(data)
    bottom = np.zeros(len(labels))
    for part in next(iter(data.values())):
        values = np.array([data[label][part] for label in labels])
        name = part.replace("_", " ")
        if values.max() < 0.02:        # too thin to see: the legend says how thin
            name += f" (at most {100 * values.max():.1f} %)"
        bars = ax.bar(labels, values, bottom=bottom, label=name)
        ax.bar_label(bars, [f"{100 * v:.0f} %" if v >= 0.05 else "" for v in values], label_type="center",
                     fontsize=8, color="white")
        bottom += values
    if marks:
        for i, label in enumerate(labels):
            ax.hlines(marks[label], i - 0.45, i + 0.45, color="black", linewidth=2.5,
                      label=mark_label if i == 0 else None)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of the KV cache")
    _legend_right(ax)
    return _save(fig, path)


def grouped_bars(panels: dict[str, dict[str, dict[str, float]]], path: Path, title: str, ylabel: str,
                 xlabel: str, hatched: tuple[str, ...] = ()) -> str:
    """{panel: {group: {series: value}}}: bars side by side per group, one panel each, each bar's value
    written on it (Fig. 13). A series missing from a group leaves a gap; `hatched` series (the
    paper's) are drawn hatched beside ours."""
    fig, axes = _figure(len(panels), (6.5 * len(panels), 4.6), title)
    series = list(dict.fromkeys(name for groups in panels.values() for got in groups.values() for name in got))
    colors = {name: f"C{i}" for i, name in enumerate(series)}
    for ax, (panel, groups) in zip(axes, panels.items()):
        names = list(groups)
        width = 0.8 / len(series)
        for i, name in enumerate(series):
            xs = [k + (i - (len(series) - 1) / 2) * width for k, g in enumerate(names) if name in groups[g]]
            ys = [groups[g][name] for g in names if name in groups[g]]
            bars = ax.bar(xs, ys, width, label=name, color=colors[name],
                          hatch="//" if name in hatched else None, edgecolor="white" if name in hatched else None)
            ax.bar_label(bars, [f"{v:.0f}" for v in ys], fontsize=8, padding=1)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(panel)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.1)
        ax.grid(alpha=0.3, axis="y")
    handles = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=len(handles))
    return _save(fig, path)


def _save(fig, path: Path) -> str:
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name
