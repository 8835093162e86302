"""How much the client costs: the most SSE events per second loadgen takes from a server that answers
instantly (loadgen.fake_server with no delays), and its CPU time per streamed token; beside it, the
same for `vllm bench serve` when its command is given. The client shares the cores with the server
it measures, so less CPU per token is less of the client in every figure.

    python -m pagedserve.loadgen.bench_client [--requests 64] [--output-len 256] [--rounds 3]
                                   [--vllm-bench ~/.cache/peer-vllm/venv/bin/vllm --tokenizer DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedserve.loadgen.stack import free_port

REPO = Path(__file__).resolve().parents[1]


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_client(argv: list[str], out_json: Path) -> tuple[float, dict]:
    """CPU seconds the command used, and the JSON it saved."""
    before = children_cpu()
    p = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    if p.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed:\n{p.stderr[-2000:]}")
    return children_cpu() - before, json.loads(out_json.read_text())


def ours(url: str, args, work: Path, output_len: int) -> tuple[float, float, int]:
    out = work / "ours"
    cpu, s = run_client([sys.executable, "-m", "pagedserve.loadgen.cli", "replay", "--url", url, "--trace", "random",
                         "--input-len", "8", "--output-len", str(output_len), "--num-requests",
                         str(args.requests), "--no-progress", "--no-plots", "--metrics-interval", "0",
                         "--out", str(out)], out / "summary.json")
    return cpu, s["duration"], s["total_output_tokens"]


def vllm(url: str, args, work: Path, output_len: int) -> tuple[float, float, int]:
    cpu, s = run_client([args.vllm_bench, "bench", "serve", "--backend", "openai", "--base-url", url,
                         "--model", "fake-model", "--tokenizer", args.tokenizer, "--dataset-name", "random",
                         "--random-input-len", "8", "--random-output-len", str(output_len),
                         "--num-prompts", str(args.requests), "--ignore-eos", "--save-result",
                         "--result-dir", str(work), "--result-filename", "vllm.json"], work / "vllm.json")
    return cpu, s["duration"], s["total_output_tokens"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vllm-bench", default=None, help="the `vllm` command of a vLLM install, to compare")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder vllm bench serve needs")
    args = p.parse_args(argv)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "pagedserve.loadgen.fake_server", "--port", str(port)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    server.stdout.readline()
    url = f"http://127.0.0.1:{port}"
    clients = {"loadgen": ours}
    if args.vllm_bench:
        if not args.tokenizer:
            p.error("--vllm-bench needs --tokenizer")
        clients["vllm bench serve"] = vllm
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.rounds):                 # alternating rounds: the same noise for both
                for name, fn in clients.items():
                    # Four times the tokens, once more: the difference is the CPU per token without
                    # the start-up (vllm's imports alone take ~15 CPU seconds), which would
                    # otherwise be most of a short run.
                    cpu1, _, tokens1 = fn(url, args, Path(tmp), args.output_len)
                    cpu2, duration, tokens2 = fn(url, args, Path(tmp), 4 * args.output_len)
                    rows.append((name, tokens2, duration, cpu2, (cpu2 - cpu1) / (tokens2 - tokens1)))
    finally:
        server.kill()
    print(f"{args.requests} streams of {4 * args.output_len} one-token events from a server with no delays; "
          f"CPU per token = the CPU difference to a run of a quarter of the tokens")
    print(f"{'client':<18} {'events':>7} {'seconds':>8} {'events/s':>9} {'CPU s':>7} {'CPU us/token':>13}")
    for name, tokens, duration, cpu, per_token in rows:
        print(f"{name:<18} {tokens:>7} {duration:>8.2f} {tokens / duration:>9.0f} {cpu:>7.2f} {1e6 * per_token:>13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
