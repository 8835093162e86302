"""Structured outputs' cost in the batch: 64 JSON-schema requests against the same 64 unconstrained,
side by side, in alternating rounds, on the offline engine (the engine's step is what a grammar
can slow; the router compiles a schema once and caches it).

    python -m pagedserve.loadgen.bench_structured [--model DIR] [--requests 64] [--rounds 3] [--backend xgrammar]

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
import math
import sys
import statistics
import time

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "score"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                         "name": {"type": "string", "maxLength": 16},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
                         "score": {"type": "number"}}}


def loads(text: str):
    """JSON as a validator should see it: a number past a float's range (the grammar allows any
    number, as JSON does: 5E5033) is still a number, not the inf that jsonschema-rs turns into null."""
    def number(s: str) -> float:
        f = float(s)
        return f if math.isfinite(f) else math.copysign(sys.float_info.max, f)
    return json.loads(text, parse_float=number, parse_int=lambda s: int(s) if len(s) < 300 else number(s))


def random_schema(rng, depth: int = 0) -> dict:
    """A fuzzed JSON schema: nested objects, arrays, enums, bounded numbers, strings with patterns."""
    kinds = ["integer", "number", "boolean", "string", "pattern", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 1000}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{2,6}$", "^[0-9]{3}-[0-9]{2}$", "^(ab|cd)+$"])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    props = {f"k{i}": random_schema(rng, depth + 1) for i in range(rng.randint(1, 4))}
    return {"type": "object", "properties": props, "required": sorted(props)[:rng.randint(0, len(props))],
            "additionalProperties": False}


def fuzz(eng, n: int, backend: str, max_tokens: int = 256, seed: int = 0) -> tuple[int, int, int]:
    """n fuzzed object schemas, one sampled request each -> (ended with stop, of those valid, n)."""
    import random

    import jsonschema_rs

    from pagedserve.services.guided import spec as specs
    from pagedserve.services.sampling_params import SamplingParams
    rng = random.Random(seed)
    schemas = []
    while len(schemas) < n:
        s = random_schema(rng)
        if s.get("type") == "object":
            schemas.append(s)
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i,
                             structured_outputs=specs.make("json", s, backend)) for i, s in enumerate(schemas)]
    outs = eng.generate([f"item {i}:" for i in range(n)], params)
    stopped = valid = 0
    for schema, o in zip(schemas, outs):
        if o.outputs[0].finish_reason == "stop":
            stopped += 1
            valid += jsonschema_rs.validator_for(schema).is_valid(loads(o.outputs[0].text))
    return stopped, valid, n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: a tiny model built in a temp dir)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--backend", default="xgrammar")
    p.add_argument("--num-device-blocks", type=int, default=2048)
    p.add_argument("--fuzz", type=int, default=64, help="fuzzed schemas to run after the rounds (0: none)")
    args = p.parse_args(argv)

    import tempfile

    import jsonschema_rs

    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig
    from pagedserve.services.guided import spec as specs
    from pagedserve.services.sampling_params import SamplingParams

    model = args.model
    if model is None:
        from pagedserve.services.tiny_model import build_tiny_model
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
                    valid_count += valid.is_valid(loads(o.outputs[0].text))
            plain = [SamplingParams(max_tokens=n, temperature=1.0, seed=r * 1000 + i, ignore_eos=True)
                     for i, n in enumerate(lens)]
            t = time.perf_counter()
            eng.generate(prompts, plain)
            t_plain = time.perf_counter() - t
            ratios.append(t_guided / t_plain)
            shares.append(share)
            print(f"round {r}: {sum(lens)} tokens; constrained {t_guided:.2f} s, unconstrained {t_plain:.2f} s, "
                  f"ratio {t_guided / t_plain:.2f}x; mask filling {share:.1%} of the constrained round")
        fz = fuzz(eng, args.fuzz, args.backend) if args.fuzz else (0, 0, 0)
    print(f"median ratio {statistics.median(ratios):.2f}x (target <= 1.3x tiny, <= 1.1x 94M); "
          f"mask share {statistics.median(shares):.1%}; {stopped}/{total} ended with stop, "
          f"{valid_count}/{stopped} of those validate")
    if args.fuzz:
        print(f"fuzzed schemas: {fz[0]}/{fz[2]} ended with stop within 256 tokens (target >= 90 %), "
              f"{fz[1]}/{fz[0]} of those validate (target 100 %)")
    return 0 if valid_count == stopped and fz[1] == fz[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
