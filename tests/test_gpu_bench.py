"""`make gpu-bench` where no GPU is (its exit 77 is tested beside gpu-check's): with --cpu-smoke,
the same code on CPU at tiny sizes gives the table and the JSON. The parts only a GPU run reaches (the CUDA branch of
the profile figures, the eager/graphs rows and their targets) are fed made-up figures here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_gpu_check import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_bench():
    return load_script("gpu_bench")


def test_cpu_smoke_run_gives_the_table_and_the_json(tmp_path):
    """The whole orchestration (model, profile, offline, served: each a subprocess) at tiny sizes."""
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "scripts/gpu_bench.py", "--cpu-smoke"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, OUT=str(out), CUDA_VISIBLE_DEVICES=""))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].split()[:3] == ["section", "config", "result"]
    assert lines[-1] == f"gpu-bench: every figure in {out / 'gpu-bench.json'}"
    for name in ("profile", "offline", "served"):
        assert any(line.split()[:2] == [name, "section"] and " ok " in line and "finished" in line for line in lines), \
            res.stdout
    data = json.loads((out / "gpu-bench.json").read_text())
    assert data["smoke"] is True
    sections = data["sections"]
    profile = sections["profile"]["runs"]
    assert sorted({r["batch"] for r in profile}) == [1, 2]
    for r in profile:
        assert r["decode_batch"] == r["batch"]
        assert r["step_ms"] > 0 and r["forward_logits_ms"] > 0 and r["busy_ms"] > 0 and r["launches"] > 0
        assert abs(r["schedule_ms"] + r["worker_ms"] + r["update_ms"] - r["step_ms"]) < 0.01
    offline = {r["allocation"] for r in sections["offline"]["runs"]}
    assert offline == {"paged", "orca-oracle"}
    for r in sections["offline"]["runs"]:
        assert "error" not in r and r["output_tokens"] == r["expected"] and r["tok_per_s"] > 0
        assert 0 < r["token_states"] <= 1
    served = sections["served"]["runs"]
    assert len(served) == 1 and served[0]["requests"] == 4 and served[0]["tok_per_s"] > 0
    modes = {r["mode"] for r in profile}
    # Eager and graphs where the checkout has the switch, else one default run and a note saying so.
    assert modes == {"eager", "graphs"} or any("no enforce_eager" in n for n in sections["profile"]["notes"])
    if modes == {"eager", "graphs"}:
        assert served[0]["mode"] == "eager"


def test_union_of_busy_intervals(gpu_bench):
    assert gpu_bench.union_ms([(0, 1000), (500, 1500), (3000, 4000), (3100, 3200)]) == 2.5
    assert gpu_bench.union_ms([]) == 0


def test_cuda_profile_figures(gpu_bench):
    """The CUDA branch: busy = union of the kernels' device time; launches = launch calls, a graph
    replay counted once."""
    from torch.autograd import DeviceType

    def ev(name, start, end, device=DeviceType.CPU):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               cpu_parent=None)
    events = [ev("cudaLaunchKernel", 0, 5), ev("cudaGraphLaunch", 10, 12), ev("aten::mm", 0, 30),
              ev("gemm", 10, 20, DeviceType.CUDA), ev("rms", 15, 30, DeviceType.CUDA), ev("copy", 40, 50, DeviceType.CUDA)]
    figures = gpu_bench.profile_figures(SimpleNamespace(events=lambda: events), 2, "cuda")
    assert figures["busy_ms"] == pytest.approx(0.015) and figures["launches"] == 1.0
    assert figures["graph_launches"] == 0.5 and figures["kernels"] == 1.5


def test_rows_judge_the_issue_targets(gpu_bench):
    """What a GPU run's sections would hand back, eager and graphs: the graphs row at batch 64
    is judged against the step, forward and busy targets; paged vs Orca-Oracle in the same mode;
    served graphs / eager."""
    def prof(mode, batch, step, fwd, busy):
        return dict(mode=mode, batch=batch, decode_batch=batch, step_ms=step, schedule_ms=0.1, worker_ms=step - 0.2,
                    update_ms=0.1, forward_logits_ms=fwd, busy_ms=busy, busy_share=busy / step, launches=3.0)
    profile = {"runs": [prof("eager", 64, 11.6, 11.3, 2.3), prof("graphs", 64, 2.4, 1.5, 1.9),
                        prof("graphs", 256, 3.9, 3.1, 3.0)], "notes": [], "done": True}
    rows = gpu_bench.profile_rows(profile, smoke=False)
    judged = [r for r in rows if r["goal"]]
    assert len(judged) == 1 and judged[0]["config"] == "graphs, batch 64" and judged[0]["ok"] is True
    assert "busy >= 70 %: met" in judged[0]["target"]

    def off(alloc, mode, tps):
        return dict(allocation=alloc, mode=mode, output_tokens=10, expected=10, seconds=1.0, tok_per_s=tps,
                    token_states=0.9, token_states_saturated=0.95, preemptions=3)
    offline = {"runs": [off("paged", "graphs", 13000.0), off("orca-oracle", "graphs", 9000.0),
                        off("paged", "eager", 2800.0)], "workload": {"requests": 400, "kv_bytes": 256 << 20}}
    rows = gpu_bench.offline_rows(offline)
    judged = [r for r in rows if r["goal"]]
    assert len(judged) == 1 and judged[0]["config"] == "paged, graphs" and judged[0]["ok"] is False
    assert "vs Orca >= 1.6: MISSED" in judged[0]["target"] and "1.44x Orca-Oracle" in judged[0]["figures"]

    def srv(mode, tps, tpot):
        return dict(mode=mode, requests=512, ready_s=20.0, output_tokens=1, seconds=2.0, tok_per_s=tps,
                    mean_tpot_ms=tpot, p99_tpot_ms=tpot, mean_ttft_ms=100.0)
    rows = gpu_bench.served_rows({"runs": [srv("graphs", 20000.0, 4.0), srv("eager", 4000.0, 16.0)]})
    assert rows[-1]["config"] == "graphs / eager" and rows[-1]["ok"] is True and rows[-1]["figures"].startswith("5.00x")
    text = gpu_bench.table(rows + judged)
    assert len(text.splitlines()) == 5 and "MISSED" in text.splitlines()[-1]


def test_profile_measure_with_graphs_engaged(gpu_bench, tiny_llama):
    """The profile's measurement on an engine whose decode runs in graphs (recorded on CPU as
    tests/test_cuda_graphs.py does): the forward probe replays the graph of the step's bucket, the
    split adds up, and the engine is left with nothing running for the next batch."""
    from pagedserve.kernels import cpu_ops
    from pagedserve.services.engine import Engine
    from pagedserve.services.worker.cuda_graphs import Recorder
    if not cpu_ops.available():
        pytest.skip("no C++ compiler: the recorded replay needs the CPU kernel")
    s = gpu_bench.sizes(smoke=True)
    with Engine(gpu_bench.engine_config(s, tiny_llama, False, num_device_blocks=256)) as eng:
        eng.runner.capture_graphs(s["max_num_seqs"], Recorder())
        for batch in (2, 3):
            r = gpu_bench.measure_batch(eng, s, batch)
            assert r["decode_batch"] == batch and r["graph_bucket"] == {2: 2, 3: 4}[batch]
            assert r["forward_logits_ms"] > 0 and r["fill_ms"] > 0 and r["launches"] > 0
            assert abs(r["schedule_ms"] + r["worker_ms"] + r["update_ms"] - r["step_ms"]) < 0.01
            assert not eng.scheduler.has_unfinished() and not eng.scheduler.requests
