"""Benchmark: KV memory saved by block sharing in parallel sampling and beam search.

Reproduces the PagedAttention paper's Fig. 15 measure: saving = (blocks without sharing - blocks
with sharing) / blocks without sharing, averaged over every engine step of a request stream.

- With sharing: the block store's real `device_blocks_used` after each `engine.step()`.
- Without sharing: the same stream at the same instant if each of a request's sequences held its
  own copy of every block: the sum over live sequences of ceil(tokens in the store / block size).
Prefix caching is off, so only fork sharing (the prompt for parallel samples, common history for
beams) counts; the pool is large enough that nothing is preempted (checked). ignore_eos with
max_tokens drawn from the workload makes the output lengths follow it (a random tiny model would
otherwise stop at random). All requests of a cell arrive at once (an offline batch, not the
paper's Poisson arrivals); ShareGPT cells run fewer requests, beam search fewest, to fit ~90 s.
A random-weight model's beams tend to descend from one recent ancestor, so beam savings here run
above the paper's (OPT-13B on real text keeps more distinct histories).

    python -m pagedserve.loadgen.bench_sharing [--quick] [--requests 96] [--threads 1]   (~90 s on 2 cores)
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_DIR = ".cache/bench-tiny-llama"
WIDTHS = (2, 4, 6)
MODES = ("parallel", "beam")
# The paper's numbers (OPT-13B): Fig. 15 for Alpaca; for ShareGPT §6.3 gives only ranges.
PAPER = {
    "alpaca": {("parallel", 2): "6.1", ("parallel", 4): "8.5", ("parallel", 6): "9.8",
               ("beam", 2): "37.6", ("beam", 4): "53.1", ("beam", 6): "55.2"},
    "sharegpt": {**{("parallel", w): "16.2-30.5" for w in WIDTHS},
                 **{("beam", w): "44.3-66.3" for w in WIDTHS}},
}
FIRST_ORDINARY_TOKEN = 7   # ids below are the tiny tokenizer's special tokens


@dataclass
class SharingResult:
    workload: str
    mode: str            # "parallel" or "beam"
    width: int           # n for parallel sampling, beam width for beam search
    requests: int
    steps: int
    blocks_with: float       # mean over steps of device blocks in use
    blocks_without: float    # mean over steps of blocks if no sequence shared any

    @property
    def saving(self) -> float:
        return 1.0 - self.blocks_with / self.blocks_without if self.blocks_without else 0.0


def unshared_blocks(engine) -> int:
    """Blocks the live sequences would hold if none were shared: one copy per sequence."""
    store, bs = engine.store, engine.store.block_size
    return sum(math.ceil(store.num_tokens(s.seq_id) / bs)
               for req in engine.scheduler.running for s in req.seqs if s.seq_id in store)


def measure(engine, pairs: list[tuple[int, int]], mode: str, width: int, seed: int,
            workload: str = "") -> SharingResult:
    """Run the stream to completion step by step, sampling both block counts after every step."""
    from pagedserve.services.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = len(engine.tokenizer)
    for i, (prompt_len, output_len) in enumerate(pairs):
        prompt = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(prompt_len)]
        kind = dict(n=width, temperature=1.0, seed=seed * 1_000_003 + i) if mode == "parallel" \
            else dict(beam_width=width)
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, ignore_eos=True, **kind))
    total_with = total_without = steps = 0
    while engine.has_work():
        engine.step()
        used = engine.store.stats()["device_blocks_used"]
        unshared = unshared_blocks(engine)
        if used > unshared:   # sharing can only save: anything else is a bookkeeping bug
            raise AssertionError(f"step {steps}: {used} blocks used, {unshared} without sharing")
        total_with += used
        total_without += unshared
        steps += 1
    for rid in list(engine.scheduler.requests):
        engine.scheduler.pop_finished(rid)
    if engine.stats().get("preemptions", 0):
        raise RuntimeError("requests were preempted: give the benchmark a larger pool")
    return SharingResult(workload, mode, width, len(pairs), steps,
                         total_with / max(steps, 1), total_without / max(steps, 1))


def ensure_model(model_dir: str) -> str:
    """The tiny llama the benchmarks run, built once into a cache folder."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        from pagedserve.services.tiny_model import build_tiny_model
        build_tiny_model(path, arch="llama", seed=0, max_len=2048)
    return str(path)


def format_table(workload: str, source: str, results: list[SharingResult]) -> str:
    head = f"{'setting':<14}{'requests':>9}{'steps':>7}{'blocks with':>13}{'blocks without':>16}" \
           f"{'saving %':>10}{'paper %':>11}"
    lines = [f"== {workload}: {source}", head, "-" * len(head)]
    for r in results:
        setting = f"{r.mode} {'n' if r.mode == 'parallel' else 'w'}={r.width}"
        lines.append(f"{setting:<14}{r.requests:>9}{r.steps:>7}{r.blocks_with:>13.1f}"
                     f"{r.blocks_without:>16.1f}{100 * r.saving:>10.1f}{PAPER[workload][(r.mode, r.width)]:>11}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR, help="tiny llama folder (built if missing)")
    ap.add_argument("--requests", type=int, default=96, help="requests per Alpaca cell")
    ap.add_argument("--sharegpt-requests", type=int, default=32,
                    help="requests per ShareGPT cell (10x the tokens of Alpaca's)")
    ap.add_argument("--sharegpt-beam-requests", type=int, default=12,
                    help="requests per ShareGPT beam-search cell, the costliest")
    ap.add_argument("--divisor", type=float, default=1.0, help="divide every length by this")
    ap.add_argument("--max-len", type=int, default=2048, help="cap on prompt + output tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (block counts do not depend on it; 1 is fastest on a busy box)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 2 requests per cell, lengths divided by 4, 64 tokens at most")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests = args.sharegpt_requests = args.sharegpt_beam_requests = 2
        args.divisor, args.max_len = 4.0, min(args.max_len, 64)
    return args


def main(argv: list[str] | None = None) -> list[SharingResult]:
    args = parse_args(argv)
    import torch
    from pagedserve.loadgen.lengths import sample_lengths, scale_lengths
    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig

    torch.set_num_threads(args.threads)
    model_dir = ensure_model(args.model_dir)
    config = EngineConfig(model=model_dir, block_size=args.block_size, enable_prefix_caching=False,
                          num_device_blocks=16384, num_host_blocks=0, seed=args.seed)
    results: list[SharingResult] = []
    started = time.perf_counter()
    with Engine(config) as engine:
        max_total = min(args.max_len, engine.max_model_len)
        for workload in ("alpaca", "sharegpt"):
            table: list[SharingResult] = []
            source = ""
            for mode in MODES:
                for width in WIDTHS:
                    count = args.requests if workload == "alpaca" else \
                        args.sharegpt_beam_requests if mode == "beam" else args.sharegpt_requests
                    lengths = scale_lengths(sample_lengths(workload, count, args.seed),
                                            args.divisor, max_total)
                    source = f"{lengths.source}; mean prompt {lengths.mean_prompt:.0f}, " \
                             f"output {lengths.mean_output:.0f} tokens"
                    table.append(measure(engine, lengths.pairs, mode, width, args.seed, workload))
            print(format_table(workload, source, table), flush=True)
            print()
            results += table
    print(f"block size {args.block_size}, prefix caching off, {time.perf_counter() - started:.0f} s "
          f"with {args.threads} torch thread(s), load average {os.getloadavg()[0]:.1f}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
