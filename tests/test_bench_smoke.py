"""Smoke tests for the benchmarks (loadgen.bench_sharing, bench_throughput, bench_control_plane, bench_e2e) and the
length distributions they draw from: each script's main() runs in --quick mode in a few seconds and
prints the table it promises, so the scripts cannot rot unnoticed."""
from __future__ import annotations

import pytest
import torch

from pagedserve.loadgen import bench_sharing, bench_throughput
from pagedserve.loadgen.lengths import WORKLOADS, Lengths, sample_lengths, scale_lengths
from pagedserve.services.engine import Engine
from pagedserve.services.engine_config import EngineConfig


@pytest.fixture
def one_thread():
    """main() sets torch's thread count for the whole process: one thread is fastest on a busy
    2-core box, and the session's own count comes back afterwards."""
    before = torch.get_num_threads()
    yield "1"
    torch.set_num_threads(before)


def test_sharing_quick_prints_both_tables(tiny_llama, one_thread, capsys):
    results = bench_sharing.main(["--quick", "--model-dir", tiny_llama, "--threads", one_thread])
    out = capsys.readouterr().out
    settings = [f"{m} {'n' if m == 'parallel' else 'w'}={w}" for m in bench_sharing.MODES
                for w in bench_sharing.WIDTHS]
    tables = out.split("== ")[1:]
    assert [t.split(":")[0] for t in tables] == ["alpaca", "sharegpt"]
    for table in tables:
        rows = [line.split()[:2] for line in table.splitlines()[3:] if line.strip()]
        assert [" ".join(r) for r in rows[:len(settings)]] == settings
    assert len(results) == 2 * len(settings)
    for r in results:
        # Every cell forks (n or w >= 2), so some block is shared for at least one step.
        assert 0 < r.blocks_with < r.blocks_without, r
        assert 0 < r.saving < 1


def test_unshared_count_equals_store_without_forks(tiny_llama):
    """With one sequence per request nothing is shared: the two counts must agree exactly."""
    with Engine(EngineConfig(model=tiny_llama, enable_prefix_caching=False, num_device_blocks=256)) as engine:
        r = bench_sharing.measure(engine, [(5, 20), (17, 3), (40, 12)], "parallel", 1, seed=0)
        assert engine.store.stats()["device_blocks_used"] == 0
    assert r.steps >= 20 and r.blocks_with == r.blocks_without > 0


def test_throughput_quick_counts_only_real_tokens(tiny_llama, one_thread, capsys):
    runs = bench_throughput.main(["--quick", "--model-dir", tiny_llama, "--threads", one_thread])
    out = capsys.readouterr().out
    assert {r.system for r in runs} == {bench_throughput.ENGINE, bench_throughput.HF}
    assert len({r.output_tokens for r in runs}) == 1 and runs[0].requests == 8
    rows = [line for line in out.splitlines() if line.startswith(("pagedserve", "transformers"))]
    assert len(rows) == 2
    assert rows[1].split()[-4] == "1.00"   # transformers is the ratio's base


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_fitted_distribution_matches_paper_means_and_tails(workload):
    lengths = sample_lengths(workload, 40000, seed=1)
    w = WORKLOADS[workload]
    assert lengths.mean_prompt == pytest.approx(w.mean_prompt, rel=0.03)
    assert lengths.mean_output == pytest.approx(w.mean_output, rel=0.03)
    assert min(min(p) for p in lengths.pairs) >= 1
    assert max(p + o for p, o in lengths.pairs) < 2048
    for i, median in ((0, w.median_prompt), (1, w.median_output)):
        xs = sorted(pair[i] for pair in lengths.pairs)
        # Long-tailed: the median sits well below the mean and the p99 is several medians out.
        assert xs[len(xs) // 2] == pytest.approx(median, rel=0.08)
        assert xs[int(0.99 * len(xs))] > 4 * xs[len(xs) // 2]


def test_alpaca_fit_has_the_public_samples_shape():
    """The Alpaca sample tokenized with GPT-2's BPE: prompt p90 30, output p90 127 (traces README)."""
    pairs = sample_lengths("alpaca", 40000, seed=2).pairs
    p90 = lambda xs: sorted(xs)[int(0.9 * len(xs))]
    assert 28 <= p90([p for p, _ in pairs]) <= 42
    assert 105 <= p90([o for _, o in pairs]) <= 135


def test_scaling_divides_then_caps_output_first():
    scaled = scale_lengths(Lengths("x", "test", [(100, 50), (3, 1), (90, 400), (500, 9)]), 2, max_total=120)
    assert scaled.pairs == [(50, 25), (2, 1), (45, 75), (119, 1)]
    assert scaled.source == "test, divided by 2, 2 capped at 120 tokens"
    assert scale_lengths(scaled).pairs == scaled.pairs


def test_control_plane_quick_prints_its_table(capsys):
    from pagedserve.loadgen import bench_control_plane
    assert bench_control_plane.main(["--seqs", "1", "4", "--steps", "5"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    table, phases = rows[:2], rows[2:]   # the figures, then the whole step by phase
    assert [r[0] for r in table] == ["1", "4"] and all(len(r) >= 10 for r in table)
    assert [r[0] for r in phases] == ["1", "4"] and all(len(r) == 1 + len(bench_control_plane.PHASES) for r in phases)


def test_e2e_quick_prints_its_table(tiny_llama, capsys):
    from pagedserve.loadgen import bench_e2e
    assert bench_e2e.main(["--model", tiny_llama, "--requests", "3", "--rate", "20", "--prompt-len", "8",
                           "--max-tokens", "4", "--num-device-blocks", "64"]) == 0
    out = capsys.readouterr().out
    assert "API, Poisson" in out and "API, all at once" in out and "stack / offline at saturation" in out
    # Each streamed round: every role's CPU, and the router's per token (in clock ticks of 10 ms:
    # 12 tokens may cost none, so only the figures' presence is checked).
    cpu = [line for line in out.splitlines() if line.startswith("SSE round")]
    assert len(cpu) == 2 and all(f"{role} " in line for line in cpu
                                 for role in ("worker", "kvstore", "scheduler", "router"))
    assert all(int(line.rsplit("router ", 1)[1].split()[0]) >= 0 for line in cpu)


def test_kernel_benchmark_quick_prints_every_cell(capsys, tmp_path):
    import json
    from pagedserve.kernels import benchmark
    benchmark.main(["--repeats", "1", "--batch-sizes", "2", "8", "--contexts", "17", "64",
                    "--json", str(tmp_path / "rows.json")])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["decode"], ["prefill"], ["prefix"])]
    cells = [(kind, b, c) for kind in benchmark.KINDS for b in ("2", "8") for c in ("17", "64")]
    assert [tuple(r[:3]) for r in rows] == cells
    assert all(len(r) == 10 for r in rows)   # on CPU the reference is a third column
    assert {r[-1] for r in rows} <= {"cpu", "reference"}   # the path column: the CPU's kernel
    saved = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [(r["kind"], str(r["batch"]), str(r["context"])) for r in saved] == cells
    assert all(r["max_abs_diff"] < 1e-3 for r in saved)
    assert all(r["path"] in ("cpu", "reference") for r in saved)   # the paged side computes the same attention
