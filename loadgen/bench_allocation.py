"""Benchmark: the paper's Fig. 12 on real processes. `loadgen sweep` against `pagedserve up` with each
allocation policy (paged, orca-oracle, orca-max) and a KV pool small enough that memory binds, then
`loadgen compare` puts the sweeps on the same axes. The ShareGPT-like lengths are scaled to the tiny
model's context by replay's fit; requests carry true_output_len for the Orca policies.

    python -m pagedserve.loadgen.bench_allocation [--rates 1,2,4,8] [--num-requests 48] [--blocks 160]
        [--allocations paged,orca-oracle,orca-max] [--out docs/paper/cpu]   (~15 min on 2 busy cores)
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from pagedserve.loadgen.stack import Stack


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".cache/tiny-llama")
    p.add_argument("--rates", default="1,2,4,8")
    p.add_argument("--num-requests", default="48")
    p.add_argument("--blocks", default="160", help="device KV blocks: few enough that memory binds")
    p.add_argument("--allocations", default="paged,orca-oracle,orca-max")
    p.add_argument("--max-normalized-latency", default="0.05")
    p.add_argument("--out", default="docs/paper/cpu")
    args = p.parse_args()
    loadgen = [sys.executable, "-m", "pagedserve.loadgen.cli"]
    allocations = args.allocations.split(",")
    for alloc in allocations:
        stack = Stack(args.model, "--num-device-blocks", args.blocks, "--allocation", alloc, "--max-num-seqs", "64")
        try:
            subprocess.run(loadgen + ["sweep", "--url", stack.url, "--trace", "sharegpt", "--num-requests",
                                      args.num_requests, "--rates", args.rates, "--send-true-output-len", "--seed",
                                      "11", "--max-normalized-latency", args.max_normalized_latency, "--label", alloc,
                                      "--out", f"{args.out}/{alloc}", "--no-progress"], check=True)
        finally:
            stack.stop()
    for requests in Path(args.out).glob("*/rate_*/requests.jsonl"):
        requests.unlink()   # per-token times of every request: large, and summarized in summary.json
    subprocess.run(loadgen + ["compare", *(f"{args.out}/{a}" for a in allocations), "--out", f"{args.out}/compare"],
                   check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
