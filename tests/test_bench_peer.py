"""loadgen.bench_peer's pieces that run without the peer: the ratio table, and the offline round
of our side (benchmarks/peers/offline_round.py) on the tiny model."""
import json
import subprocess
import sys
from pathlib import Path

from pagedserve.loadgen.bench_peer import FIGURES, ratios

ROUND = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "offline_round.py"


def test_ratios_take_best_and_median_per_side():
    rounds = {"ours": [{"output_throughput": 300.0, "mean_ttft_ms": 10.0, "mean_tpot_ms": 2.0},
                       {"output_throughput": 100.0, "mean_ttft_ms": 30.0, "mean_tpot_ms": 4.0},
                       {"output_throughput": 200.0, "mean_ttft_ms": 20.0, "mean_tpot_ms": 3.0}],
              "peer": [{"output_throughput": 100.0, "mean_ttft_ms": 40.0, "mean_tpot_ms": 8.0},
                       {"output_throughput": 50.0, "mean_ttft_ms": 20.0, "mean_tpot_ms": 4.0}]}
    table = {name: (best, median) for name, best, median in ratios(rounds)}
    assert table["output tok/s"] == (3.0, 200.0 / 75.0)       # higher is better: the max of each side
    assert table["TTFT mean ms"] == (10.0 / 20.0, 20.0 / 30.0)  # lower is better: the min of each side
    assert table["TPOT mean ms"] == (2.0 / 4.0, 3.0 / 6.0)
    only_throughput = ratios(rounds, FIGURES[:1])
    assert [name for name, _, _ in only_throughput] == ["output tok/s"]


def test_offline_round_of_ours_counts_every_token(tiny_llama):
    p = subprocess.run([sys.executable, str(ROUND), "--system", "pagedserve", "--model-dir", tiny_llama,
                        "--num-prompts", "3", "--input-len", "5", "--output-len", "4"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    assert result["system"] == "pagedserve" and result["output_tokens"] == 3 * 4
    assert result["output_throughput"] == result["output_tokens"] / result["seconds"]


def test_offline_prompts_are_the_same_for_a_seed():
    sys.path.insert(0, str(ROUND.parent))
    try:
        import offline_round
    finally:
        sys.path.remove(str(ROUND.parent))
    a, b = offline_round.prompts(4, 7, 100, seed=3), offline_round.prompts(4, 7, 100, seed=3)
    assert a == b and len(a) == 4 and all(len(p) == 7 and min(p) >= offline_round.FIRST_ID for p in a)
    assert offline_round.prompts(4, 7, 100, seed=4) != a
