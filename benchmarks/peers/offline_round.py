#!/usr/bin/env python3
"""One offline round, no server: N random prompts of IN token ids, OUT tokens each (greedy, EOS
ignored), through vLLM's `LLM.generate` (`--system vllm`, run with the peer venv's python) or
pagedserve's `Engine.generate` (`--system pagedserve`, run with this checkout's .venv python).

Prints one JSON line: {"system", "output_throughput" (tok/s), "seconds", "output_tokens"}. The
engine is built and a 4-prompt generate runs before the timed one, so neither start-up nor the
first call's one-off costs count. The prompts are the same on both sides for a seed.
loadgen/bench_peer.py --offline alternates rounds of the two.

    python offline_round.py --system vllm|pagedserve --model-dir DIR [--num-prompts 64]
        [--input-len 128] [--output-len 128] [--seed 0]
"""
import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
FIRST_ID = 3   # ids below are the reference tokenizer's special tokens (<pad>, <s>, </s>)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(length)] for _ in range(n)]


def vllm_generate(args, batch: list[list[int]]):
    """-> a function running generate on batch, timed by the caller; the warm-up already run."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=args.model_dir, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch[:4]], params, use_tqdm=False)
    return lambda: llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)


def pagedserve_generate(args, batch: list[list[int]]):
    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig
    from pagedserve.services.sampling_params import SamplingParams
    engine = Engine(EngineConfig(model=args.model_dir))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    engine.generate(batch[:4], params)
    return lambda: engine.generate(batch, params)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=("vllm", "pagedserve"), required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with open(os.path.join(args.model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    batch = prompts(args.num_prompts, args.input_len, vocab, args.seed)
    run = (vllm_generate if args.system == "vllm" else pagedserve_generate)(args, batch)
    started = time.perf_counter()
    outputs = run()
    seconds = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)   # the same shape on both sides
    print(json.dumps({"system": args.system, "output_throughput": tokens / seconds, "seconds": seconds,
                      "output_tokens": tokens}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
