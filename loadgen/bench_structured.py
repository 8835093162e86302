"""Structured outputs' cost in the batch: 64 JSON-schema requests against the same 64 unconstrained,
side by side, in alternating rounds, on the offline engine (the engine's step is what a grammar
can slow; the router compiles a schema once and caches it).

    python -m loadgen.bench_structured [--model DIR] [--requests 64] [--rounds 3] [--backend xgrammar]

Each constrained round runs first and records every choice's output length; the unconstrained
round that follows asks for exactly those lengths (ignore_eos), so both make the same tokens. It
prints each pair's times and their ratio (the issue's target: <= 1.3x on the tiny model, <= 1.1x on
the 94M one), the share of the constrained rounds' time spent filling masks (on the mask thread,
beside the forward pass), and how many outputs ended with "stop" and validated. Not a test: run
it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "score"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                         "name": {"type": "string", "maxLength": 16},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
                         "score": {"type": "number"}}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: a tiny model built in a temp dir)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--backend", default="xgrammar")
    p.add_argument("--num-device-blocks", type=int, default=2048)
    args = p.parse_args(argv)

    import tempfile

    import jsonschema_rs

    from services.engine import Engine
    from services.engine_config import EngineConfig
    from services.guided import spec as specs
    from services.sampling_params import SamplingParams

    model = args.model
    if model is None:
        from services.tiny_model import build_tiny_model
        model = str(build_tiny_model(tempfile.mkdtemp(prefix="bench-structured-"), arch="llama", seed=0))
    prompts = [f"record {i}:" for i in range(args.requests)]
    constraint = specs.make("json", SCHEMA, args.backend)
    valid = jsonschema_rs.validator_for(SCHEMA)
    ratios, shares = [], []
    stopped = valid_count = total = 0
    with Engine(EngineConfig(model=model, num_device_blocks=args.num_device_blocks,
                             max_num_seqs=max(256, args.requests))) as eng:
        eng.generate(prompts[:2], SamplingParams(max_tokens=4, structured_outputs=constraint))   # compile, warm up
        for r in range(args.rounds):
            guided = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=r * 1000 + i,
                                     structured_outputs=constraint) for i in range(args.requests)]
            before = eng.guides.mask_seconds
            t = time.perf_counter()
            outs = eng.generate(prompts, guided)
            t_guided = time.perf_counter() - t
            share = (eng.guides.mask_seconds - before) / t_guided
            lens = [len(o.outputs[0].token_ids) for o in outs]
            for o in outs:
                total += 1
                if o.outputs[0].finish_reason == "stop":
                    stopped += 1
                    valid_count += valid.is_valid(json.loads(o.outputs[0].text))
            plain = [SamplingParams(max_tokens=n, temperature=1.0, seed=r * 1000 + i, ignore_eos=True)
                     for i, n in enumerate(lens)]
            t = time.perf_counter()
            eng.generate(prompts, plain)
            t_plain = time.perf_counter() - t
            ratios.append(t_guided / t_plain)
            shares.append(share)
            print(f"round {r}: {sum(lens)} tokens; constrained {t_guided:.2f} s, unconstrained {t_plain:.2f} s, "
                  f"ratio {t_guided / t_plain:.2f}x; mask filling {share:.1%} of the constrained round")
    print(f"median ratio {statistics.median(ratios):.2f}x (target <= 1.3x tiny, <= 1.1x 94M); "
          f"mask share {statistics.median(shares):.1%}; {stopped}/{total} ended with stop, "
          f"{valid_count}/{stopped} of those validate")
    return 0 if valid_count == stopped else 1


if __name__ == "__main__":
    raise SystemExit(main())
