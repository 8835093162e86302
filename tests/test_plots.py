"""The plots read at a glance: titles naming the trace and the model, log axes where the values span
orders of magnitude, plain tick labels, legends off the data, labelled limit lines, the paper's
values beside ours, a KV panel scaled to what was used. Checked on the figures as drawn."""
from __future__ import annotations

import math

import pytest

from pagedserve.loadgen import plots


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions save (still inspectable after plt.close), laid out."""
    figs = []
    save = plots._save

    def keep(fig, path):
        figs.append(fig)
        return save(fig, path)
    monkeypatch.setattr(plots, "_save", keep)
    return figs


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _legends_clear_of_the_axes(fig) -> None:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends, "no legend"
    for legend in legends:
        for ax in fig.axes:
            assert not _overlap(legend.get_window_extent(), ax.get_window_extent()), legend.get_texts()[0].get_text()


def _tick_labels(axis) -> list[str]:
    return [t.get_text() for t in axis.get_ticklabels() if t.get_text()]


def _rows(rates, latency, ttft):
    return [{"rate": r, "normalized_latency": n, "p99_ttft_ms": t} for r, n, t in zip(rates, latency, ttft)]


def test_a_baseline_orders_of_magnitude_slower_puts_the_axes_on_log(drawn, tmp_path):
    rates = [10, 20, 30]
    series = {"vLLM (paged)": _rows(rates, [0.024, 0.025, 0.03], [48, 50, 60]),
              "FasterTransformer": _rows(rates, [8.4, 9.6, 10.0], [530_000, 610_000, 636_000])}
    plots.rate_plot(series, tmp_path / "fig12.png", "Fig. 12: Alpaca trace on OPT-13B", limit=0.1)
    fig = drawn[0]
    latency, ttft = fig.axes[:2]
    assert fig.get_suptitle() == "Fig. 12: Alpaca trace on OPT-13B"
    assert latency.get_yscale() == ttft.get_yscale() == "log"
    labels = _tick_labels(latency.yaxis) + _tick_labels(ttft.yaxis)
    assert "1,000,000" in labels or "100,000" in labels
    assert not any("e+" in t or "e-" in t or "10^" in t for t in labels)
    assert ttft.yaxis.get_offset_text().get_text() == ""
    assert "latency limit 0.1 s/token" in [t.get_text() for t in fig.legends[0].get_texts()]
    assert latency.get_ylim()[0] < 0.1 < latency.get_ylim()[1]
    _legends_clear_of_the_axes(fig)


def test_close_values_stay_linear_from_zero(drawn, tmp_path):
    series = {"sharegpt": _rows([1, 2, 4, 8], [0.014, 0.011, 0.012, 0.022], [301, 78, 67, 78])}
    plots.rate_plot(series, tmp_path / "sweep.png", "loadgen sweep: sharegpt trace on tiny", limit=0.05)
    latency, ttft = drawn[0].axes[:2]
    assert latency.get_yscale() == ttft.get_yscale() == "linear"
    assert ttft.get_ylim()[0] == 0 and latency.get_ylim()[0] == 0
    assert latency.get_ylim()[1] > 0.05                  # the limit line is inside
    _legends_clear_of_the_axes(drawn[0])


def test_the_kv_panel_is_scaled_to_the_peak_used(drawn, tmp_path):
    samples = [{"t": t, "kv_cache_usage": 0.07 * math.sin(t / 10 * math.pi), "running": 10 * t, "waiting": 1,
                "swapped": 0} for t in range(11)]
    plots.server_plot(samples, tmp_path / "server.png", "sharegpt trace on tiny, 4 req/s")
    fig = drawn[0]
    kv, queues = fig.axes[:2]
    assert 7 <= kv.get_ylim()[1] <= 10                  # 7 % peak: not a flat line at the bottom of 0-100
    assert kv.get_ylabel() and queues.get_ylabel()
    assert "sharegpt" in fig.get_suptitle() and "tiny" in fig.get_suptitle()
    assert "peak 7.0 % of the pool" in kv.get_title()
    _legends_clear_of_the_axes(fig)


def test_fig2_shows_every_part_and_the_papers_share(drawn, tmp_path):
    data = {"vLLM": {"token_states": 0.97, "reserved": 0.02, "free": 0.01},
            "Orca": {"token_states": 0.5, "reserved": 0.5, "free": 0.0}}
    plots.stacked_shares(data, tmp_path / "fig2.png", "Fig. 2", marks={"vLLM": 0.96, "Orca": 0.38},
                         mark_label="paper: token states")
    fig = drawn[0]
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "free (at most 1.0 %)" in labels and "paper: token states" in labels
    _legends_clear_of_the_axes(fig)


def test_fig13_puts_the_papers_bars_beside_ours_with_readable_ticks(drawn, tmp_path):
    panels = {"ShareGPT": {"vLLM": {"ours": 18.3, "paper": 30.4}, "Orca": {"ours": 16.5, "paper": 13.6}},
              "Alpaca": {"vLLM": {"ours": 38.4, "paper": 132.4}, "Orca": {"ours": 38.4, "paper": 72.8}}}
    plots.grouped_bars(panels, tmp_path / "fig13.png", "Fig. 13", "average batched requests", "allocator",
                       hatched=("paper",))
    fig = drawn[0]
    for ax in fig.axes:
        assert ax.get_xlabel() == "allocator" and ax.get_title()
        assert min(t.get_fontsize() for t in ax.get_xticklabels()) >= 9
        assert {t.get_text() for t in ax.texts} >= {"18", "30"} if ax.get_title() == "ShareGPT" else True
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["ours", "paper"]
    _legends_clear_of_the_axes(fig)


def test_sweep_and_compare_titles_name_the_trace_and_the_model(drawn, tmp_path):
    from pagedserve.loadgen.config import CompareConfig
    from pagedserve.loadgen.sweep import compare, write_sweep
    row = {"rate": 2.0, "dir": "rate_2", "request_throughput": 1.9, "output_throughput": 100.0,
           "normalized_latency": 0.02, "mean_ttft_ms": 50.0, "p99_ttft_ms": 90.0, "mean_tpot_ms": 10.0,
           "p99_e2el_ms": 900.0, "completed": 10, "failed": 0, "interrupted": False}
    result = {"label": "paged", "trace": "sharegpt", "model": "tiny-llama", "rows": [row, {**row, "rate": 4.0}],
              "max_normalized_latency": 0.05, "sustained_rate": 4.0, "error": None}
    write_sweep(result, tmp_path / "sw", plots=True)
    compare(CompareConfig(dirs=[str(tmp_path / "sw")], out=str(tmp_path / "cmp")))
    assert [f.get_suptitle() for f in drawn] == ["loadgen sweep: sharegpt trace on tiny-llama",
                                                 "loadgen compare: sharegpt trace on tiny-llama"]
