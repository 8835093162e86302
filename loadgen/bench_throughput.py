"""Benchmark: output tokens/s of the offline engine against transformers `generate`.

The same requests (ShareGPT-like mixed lengths, divided by a factor so the run is short) on the same
tiny Llama in one process, the two systems run alternately. transformers uses static batching:
batches of `--batch-size` in arrival order, left-padded, greedy, each batch generating until its
longest request is done; the engine uses continuous batching over the paged KV cache. Both ignore
EOS (min_new_tokens = max_new_tokens on the transformers side, ignore_eos on ours) and both are
credited with each request's own max_tokens only, never a padded batch's extra tokens.

    python -m pagedserve.loadgen.bench_throughput [--quick] [--requests 64] [--threads 2] [--profile]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_DIR = ".cache/bench-tiny-llama-h256"
FIRST_ORDINARY_TOKEN = 7   # ids below are the tiny tokenizer's special tokens
ENGINE, HF = "pagedserve engine", "transformers generate"


@dataclass
class Run:
    system: str
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def ensure_model(model_dir: str, hidden_size: int, max_len: int) -> str:
    """A 2-layer Llama of the given width, built once into a cache folder."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        from pagedserve.services.tiny_model import build_tiny_model
        build_tiny_model(path, arch="llama", seed=0, max_len=max_len, hidden_size=hidden_size)
    return str(path)


def make_requests(n: int, divisor: float, max_total: int, vocab: int, seed: int) -> tuple[list[tuple[list[int], int]], str]:
    """n (prompt ids, max_tokens) with ShareGPT-like lengths divided by `divisor`."""
    from pagedserve.loadgen.lengths import sample_lengths, scale_lengths

    lengths = scale_lengths(sample_lengths("sharegpt", n, seed), divisor, max_total)
    rng = random.Random(seed)
    reqs = [([rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(p)], o) for p, o in lengths.pairs]
    return reqs, f"{lengths.source}: mean prompt {lengths.mean_prompt:.0f}, output {lengths.mean_output:.0f}"


def run_engine(engine, reqs: list[tuple[list[int], int]]) -> tuple[Run, list[list[int]]]:
    from pagedserve.services.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in reqs]
    start = time.perf_counter()
    outs = engine.generate([p for p, _ in reqs], params)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    if [len(t) for t in tokens] != [o for _, o in reqs]:
        raise RuntimeError("the engine did not generate exactly max_tokens per request")
    return Run(ENGINE, len(reqs), sum(map(len, tokens)), seconds), tokens


def run_hf(model, reqs: list[tuple[list[int], int]], batch_size: int, pad_id: int) -> tuple[Run, list[list[int]]]:
    import torch

    tokens: list[list[int]] = []
    start = time.perf_counter()
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b:b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)       # [b, width], left-padded
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        longest = max(o for _, o in batch)   # static batching: the batch runs until its longest is done
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=False, num_beams=1, pad_token_id=pad_id)
        tokens += [out[i, width:width + o].tolist() for i, (_, o) in enumerate(batch)]
    seconds = time.perf_counter() - start
    return Run(HF, len(reqs), sum(o for _, o in reqs), seconds), tokens


def format_table(runs: list[Run], source: str) -> str:
    by_system = {s: [r for r in runs if r.system == s] for s in (ENGINE, HF)}
    total = {s: Run(s, rs[0].requests, sum(r.output_tokens for r in rs), sum(r.seconds for r in rs))
             for s, rs in by_system.items()}
    base = total[HF].tokens_per_s
    head = f"{'system':<24}{'requests':>9}{'output tokens':>15}{'seconds':>9}{'tok/s':>9}{'ratio':>7}"
    lines = [f"== {source}", head, "-" * len(head)]
    for s, r in total.items():
        per_round = " ".join(f"{x.seconds:.2f}" for x in by_system[s])
        lines.append(f"{s:<24}{r.requests:>9}{r.output_tokens // len(by_system[s]):>15}"
                     f"{r.seconds / len(by_system[s]):>9.2f}{r.tokens_per_s:>9.0f}"
                     f"{r.tokens_per_s / base:>7.2f}   (rounds: {per_round} s)")
    return "\n".join(lines)


def profile_engine(engine, reqs: list[tuple[list[int], int]], top: int = 25) -> None:
    """Where one engine run spends its time, by function (cProfile, internal time)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run_engine(engine, reqs)
    prof.disable()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR, help="tiny llama folder (built if missing)")
    ap.add_argument("--hidden-size", type=int, default=256, help="width of the model built if missing")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8, help="transformers' static batch size")
    ap.add_argument("--divisor", type=float, default=2.0, help="divide ShareGPT lengths by this")
    ap.add_argument("--max-len", type=int, default=1024, help="cap on prompt + output tokens")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each system")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="also cProfile one engine run")
    ap.add_argument("--quick", action="store_true", help="8 requests of at most 64 tokens, one round")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.rounds, args.divisor, args.max_len = 8, 1, 8.0, min(args.max_len, 64)
    return args


def main(argv: list[str] | None = None) -> list[Run]:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM
    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig

    torch.set_num_threads(args.threads)
    model_dir = ensure_model(args.model_dir, args.hidden_size, max(args.max_len, 1024))
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runs: list[Run] = []
    with Engine(EngineConfig(model=model_dir, max_num_seqs=256, seed=args.seed)) as engine:
        max_total = min(args.max_len, engine.max_model_len)
        reqs, source = make_requests(args.requests, args.divisor, max_total, len(engine.tokenizer),
                                     args.seed)
        pad_id = engine.tokenizer.pad_token_id
        warm = [(p[:8], 4) for p, _ in reqs[:args.batch_size]]   # first calls pay one-off costs
        run_engine(engine, warm)
        run_hf(hf_model, warm, args.batch_size, pad_id)
        same = 0
        for r in range(args.rounds):
            # Alternate which system goes first so drift on a shared machine hits both alike.
            order = ("engine", "hf") if r % 2 == 0 else ("hf", "engine")
            for system in order:
                run, tokens = run_engine(engine, reqs) if system == "engine" else \
                    run_hf(hf_model, reqs, args.batch_size, pad_id)
                runs.append(run)
                if system == "engine":
                    engine_tokens = tokens
                else:
                    hf_tokens = tokens
            same = sum(a == b for a, b in zip(engine_tokens, hf_tokens))
        print(format_table(runs, source))
        print(f"{same}/{len(reqs)} requests generated identical greedy tokens on both; "
              f"{args.threads} torch thread(s), transformers batches of {args.batch_size}; "
              f"load average {os.getloadavg()[0]:.1f} (other work on the box skews both, "
              f"more threads skew more)")
        if args.profile:
            profile_engine(engine, reqs)
    return runs


if __name__ == "__main__":
    main(sys.argv[1:])
