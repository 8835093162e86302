"""`loadgen simulate`: the real scheduler and block store against a cost model, in virtual time."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve.loadgen.config import SimulateConfig
from pagedserve.loadgen.cost_model import PRESETS, CostModel, Hardware, ModelShape, Preset
from pagedserve.loadgen.simulate import simulate, summary_of, write_outputs
from pagedserve.services.scheduler import scheduler as scheduler_core


def test_step_time_worked_by_hand():
    # 2 layers, hidden 4, ffn 8, vocab 10, fp16: 2*(2*16 + 2*16 + 2*32) + 10*4 = 296 weights, 592 bytes.
    model = ModelShape("toy", num_layers=2, hidden=4, ffn=8, vocab=10)
    hw = Hardware("toy", 1, flops=1e3, mem_bw=1e3, step_overhead_s=0.5, compute_efficiency=1.0,
                  memory_efficiency=1.0)
    assert (model.num_params, model.weight_bytes, model.kv_bytes_per_token) == (296, 592, 32)
    cost = CostModel(Preset("toy", model, hw, 1 << 20))
    # One decode token at position 2 (3 keys): FLOPs 2*256 (layers) + 2*10*4 (LM head) + 4*4*2*3
    # (attention over 3 keys in 2 layers) = 688 -> 0.688 s; bytes 592 (weights) + 3*32 (KV read)
    # + 32 (KV written) + 16*1*4*2*2 (activations) = 976 -> 0.976 s: memory-bound, + 0.5 s overhead.
    assert cost.step_time([(1, 3)], num_sampled=1) == pytest.approx(1.476)
    # A 4-token prefill chunk after 2 cached tokens: 4*2 + (1+2+3+4) = 18 attended pairs.
    flops = 2 * 256 * 4 + 2 * 10 * 4 + 4 * 4 * 2 * 18
    data = 592 + 32 * 6 + 32 * 4 + 16 * 4 * 4 * 2 * 2
    assert cost.step_time([(4, 6)], num_sampled=1) == pytest.approx(max(flops, data) / 1e3 + 0.5)
    # Swapping 2 blocks of 16 tokens over a 1 kB/s link adds 2*16*32 / 1e3 s.
    slow = CostModel(Preset("toy", model, Hardware("toy", 1, 1e3, 1e3, host_bw=1e3, step_overhead_s=0.5,
                                                   compute_efficiency=1.0, memory_efficiency=1.0), 1 << 20))
    assert slow.step_time([(1, 3)], 1, swap_blocks=2, block_tokens=16) == pytest.approx(1.476 + 1.024)


def test_the_opt_13b_preset_is_the_papers_setup():
    p = PRESETS["opt-13b-a100-40g"]
    assert p.model.kv_bytes_per_token == 800 * 1024
    assert 25e9 < p.model.weight_bytes < 27e9 and 15_500 < p.num_kv_tokens() < 15_800


def small(**kw) -> SimulateConfig:
    base = dict(trace="sharegpt", rate=8.0, num_requests=80, seed=11, kv_cache_gib=2.0)
    return SimulateConfig(**{**base, **kw})


def test_same_seed_same_run_and_every_request_finishes(tmp_path):
    a, b = summary_of(simulate(small())), summary_of(simulate(small()))
    for s in (a, b):
        s.pop("wall_seconds")
    assert a == b
    assert a["completed"] == 80 and a["failed"] == 0 and a["virtual_time"]
    assert a["total_output_tokens"] == sum(r.output_len for r in simulate(small()).plan.requests)
    assert summary_of(simulate(small(seed=12)))["duration"] != a["duration"]


def test_summary_has_replays_fields_and_the_split(tmp_path):
    s = write_outputs(simulate(small(allocation="orca-oracle")), tmp_path)
    saved = json.loads((tmp_path / "summary.json").read_text())
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "mean_normalized_latency_s_per_token", "avg_batched_requests", "kv_token_share", "kv_breakdown"):
        assert key in saved, key
    assert sum(s["kv_breakdown"]["cache"].values()) == pytest.approx(1.0)
    assert 0 < s["kv_token_share"] < 1 and s["num_preemptions"] == 0
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 80


def test_paged_batches_more_than_orca_in_the_same_memory():
    batch = {a: summary_of(simulate(small(allocation=a)))["saturated"]["avg_batched_requests"]
             for a in ("paged", "orca-oracle", "orca-max")}
    assert batch["paged"] > batch["orca-oracle"] > batch["orca-max"]


def test_a_change_in_the_scheduler_core_changes_the_simulation(monkeypatch):
    before = summary_of(simulate(small()))
    admit = scheduler_core.Scheduler._admit

    def admit_at_most_four(self, req):   # a different admission rule in the core itself
        return len(self.running) < 4 and admit(self, req)
    monkeypatch.setattr(scheduler_core.Scheduler, "_admit", admit_at_most_four)
    after = summary_of(simulate(small()))
    assert after["avg_batched_requests"] <= 4 < before["avg_batched_requests"]
    assert after["duration"] > before["duration"]


def test_cli_writes_the_summary(tmp_path):
    out = tmp_path / "sim"
    r = subprocess.run([sys.executable, "-m", "pagedserve.loadgen.cli", "simulate", "--trace", "alpaca", "--rate", "20",
                        "--num-requests", "50", "--allocation", "orca-pow2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "summary.json").read_text())["completed"] == 50
    bad = subprocess.run([sys.executable, "-m", "pagedserve.loadgen.cli", "simulate", "--preset", "custom"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--model-config" in bad.stderr


def test_paper_writes_every_requested_figure_with_the_papers_beside_ours(tmp_path, capsys):
    from pagedserve.loadgen.config import PaperConfig
    from pagedserve.loadgen.paper import PAPER, paper
    report = paper(PaperConfig(out=str(tmp_path), num_requests=20, jobs=1, figures=["2", "13", "16"], plots=True))
    text = (tmp_path / "paper.md").read_text()
    for heading in ("## Fig. 2", "## Fig. 13", "## Fig. 16"):
        assert heading in text
    assert "## Fig. 12" not in text and (tmp_path / "fig2.png").exists() and (tmp_path / "fig13.png").exists()
    assert f"{PAPER['fig13']['sharegpt']['paged']:.2f}" in text       # the paper's figure beside ours
    split = report["figures"]["2"]["paged"]
    assert sum(split.values()) == pytest.approx(1.0)
    # Progress: a line on stderr per run, the last one at n/n, with the time left.
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == report["num_runs"] and lines[-1].startswith(f"loadgen paper: {report['num_runs']}/")
    assert all(" elapsed, ~" in line and " left (" in line for line in lines)


def test_paper_replot_redraws_from_the_saved_runs(tmp_path):
    import dataclasses

    from pagedserve.loadgen.config import PaperConfig
    from pagedserve.loadgen.paper import paper
    from pagedserve.services.flags import ConfigError
    cfg = PaperConfig(out=str(tmp_path), num_requests=20, jobs=1, figures=["2"], plots=False, progress=False)
    paper(cfg)
    first = (tmp_path / "paper.md").read_text()
    (tmp_path / "paper.md").unlink()
    paper(dataclasses.replace(cfg, replot=True, plots=True))
    assert (tmp_path / "paper.md").read_text().split("![fig2]")[0] == first and (tmp_path / "fig2.png").exists()
    with pytest.raises(ConfigError, match="another --num-requests or --seed"):
        paper(dataclasses.replace(cfg, replot=True, seed=12))
