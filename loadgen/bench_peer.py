"""pagedserve beside vLLM's CPU build, through the API, in one sitting (issue 11).

The same client (`vllm bench serve`, vLLM's own, from the peer venv), the same model, the same
random workload; rounds alternate peer, ours, peer, ours... so that the machine's noise falls on
both. Each round starts its server, runs the client, and stops the server
(benchmarks/peers/vllm_cpu_bench.sh and ours_bench.sh do one round each). Prints every round, then
ours / peer for output tok/s, TTFT and TPOT: the best round of each side and the medians.

    python -m pagedserve.loadgen.bench_peer [--rounds 2] [--request-rate inf] [--num-prompts 64]
        [--model-dir DIR] [--extra "pagedserve up flags"] [--offline] [--json FILE]

`--offline` compares the offline engines instead, no server and no client: vLLM's `LLM.generate`
and pagedserve's `Engine.generate` on the same prompts (benchmarks/peers/offline_round.py, one
process per round); only output tok/s is compared there.

Needs the peer venv once: `bash benchmarks/peers/vllm_cpu_setup.sh` (~2.5 GB, 5-10 minutes). The
model defaults to the peer's reference model (2 layers, hidden 256, vocab 2048), built on first use
by make_tiny_model.py; `--model-dir` takes another (make_tiny_model.py with PEER_HIDDEN=1024
PEER_LAYERS=8 PEER_HEADS=16 PEER_KV_HEADS=4 PEER_FFN=2816 builds the 94M one).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
PEER_DIR = Path(os.environ.get("PEER_DIR", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "peer-vllm"))
FIGURES = (("output tok/s", "output_throughput", True), ("TTFT mean ms", "mean_ttft_ms", False),
           ("TPOT mean ms", "mean_tpot_ms", False))


def offline_round(who: str, args) -> dict:
    """One offline_round.py run of one side -> {"output_throughput", "seconds", ...}."""
    model = args.model_dir or str(PEER_DIR / "tiny-llama")
    if not (Path(model) / "config.json").exists():
        subprocess.run([str(PEER_DIR / "venv" / "bin" / "python"), str(PEERS / "make_tiny_model.py"), model],
                       check=True, capture_output=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if who == "peer":   # as vllm_cpu_bench.sh sets up the server
        python = PEER_DIR / "venv" / "bin" / "python"
        for d in ("tmp", "hf-home", "vllm-cache", "vllm-config"):
            (PEER_DIR / d).mkdir(parents=True, exist_ok=True)
        env.update(TMPDIR=str(PEER_DIR / "tmp"), HF_HOME=str(PEER_DIR / "hf-home"),
                   VLLM_RPC_BASE_PATH=str(PEER_DIR / "tmp"), VLLM_CACHE_ROOT=str(PEER_DIR / "vllm-cache"),
                   VLLM_CONFIG_ROOT=str(PEER_DIR / "vllm-config"), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1")
    else:
        python = Path(sys.executable)
    cmd = [str(python), str(PEERS / "offline_round.py"), "--system", "vllm" if who == "peer" else "pagedserve",
           "--model-dir", model, "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.round_timeout, env=env)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{who} offline round failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(lines[-1])


def one_round(who: str, args, work: Path) -> dict:
    """Run one side's script once -> vllm bench serve's saved JSON."""
    if args.offline:
        return offline_round(who, args)
    out = work / f"{who}-{len(list(work.iterdir()))}"
    out.mkdir()
    common = ["--request-rate", str(args.request_rate), "--num-prompts", str(args.num_prompts),
              "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--result-dir", str(out)]
    if args.model_dir:
        common += ["--model-dir", args.model_dir]
    if who == "peer":
        cmd = ["bash", str(PEERS / "vllm_cpu_bench.sh"), *common]
    else:
        cmd = ["bash", str(PEERS / "ours_bench.sh"), *common] + (["--extra", args.extra] if args.extra else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.round_timeout)
    results = sorted(out.glob("bench-*.json"))
    if p.returncode != 0 or not results:
        raise RuntimeError(f"{who} round failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(results[-1].read_text())


def ratios(rounds: dict[str, list[dict]], figures=FIGURES) -> list[tuple[str, float, float]]:
    """(figure, best ours / best peer, median ours / median peer); above 1 is better for us in
    throughput, below 1 in latency."""
    out = []
    for name, key, higher in figures:
        ours, peer = [r[key] for r in rounds["ours"]], [r[key] for r in rounds["peer"]]
        best = max if higher else min
        out.append((name, best(ours) / best(peer), statistics.median(ours) / statistics.median(peer)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds per side, alternating (peer first)")
    ap.add_argument("--request-rate", default="inf", help="requests/s of the client ('inf': all at once)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--model-dir", default="", help="default: the peer's reference model")
    ap.add_argument("--extra", default="", help="flags for pagedserve up")
    ap.add_argument("--offline", action="store_true",
                    help="the offline engines (LLM.generate vs Engine.generate) rather than the servers")
    ap.add_argument("--round-timeout", type=float, default=900.0)
    ap.add_argument("--json", default="", help="write every round and the ratios here")
    args = ap.parse_args(argv)
    if not (PEER_DIR / "venv" / "bin" / "vllm").exists():
        print(f"bench_peer: no peer venv at {PEER_DIR / 'venv'}: run bash {PEERS / 'vllm_cpu_setup.sh'} once",
              file=sys.stderr)
        return 2
    figures = FIGURES[:1] if args.offline else FIGURES
    rounds: dict[str, list[dict]] = {"peer": [], "ours": []}
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        for i in range(args.rounds):
            for who in ("peer", "ours"):
                r = one_round(who, args, Path(tmp))
                rounds[who].append(r)
                print(f"round {i + 1} {who:4}: " + ", ".join(f"{name} {r[key]:.1f}" for name, key, _ in figures),
                      flush=True)
    table = ratios(rounds, figures)
    how = "offline engines" if args.offline else f"rate {args.request_rate}"
    print(f"\nours / vLLM CPU, {how}, {args.num_prompts} x {args.input_len} -> {args.output_len}, "
          f"{args.rounds} rounds each:")
    print("| figure | best | median |\n|---|---|---|")
    for name, best, median in table:
        print(f"| {name} | {best:.2f}x | {median:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds,
                                               "ratios": {n: {"best": b, "median": m} for n, b, m in table}},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
