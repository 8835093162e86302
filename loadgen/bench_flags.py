"""Two configurations of the served stack side by side: `serve` flags A against flags B, the same
requests through the API, rounds alternating A, B, A, B in one sitting; prints each round and B / A.

    python -m pagedserve.loadgen.bench_flags --b=--no-async-scheduling [--a=""] [--rounds 3]
        [--rate 4] [--requests 48] [--prompt-len 128] [--max-tokens 128]

Both stacks run for the whole sitting (an idle stack blocks on its sockets), each with the same
model and pool; a round is one Poisson run (or all at once, --rate 0) of loadgen's client, greedy,
ignore_eos. Output tok/s, mean TTFT and mean TPOT per round; the ratios are of the medians.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
from pathlib import Path

from pagedserve.loadgen.bench_e2e import REPO, drive, make_requests

FIGURES = (("tok/s", lambda s: s["output_throughput"]), ("TTFT ms", lambda s: s["mean_ttft_ms"]),
           ("TPOT ms", lambda s: s["mean_tpot_ms"]))


def round_figures(records, elapsed: float) -> dict:
    from pagedserve.loadgen.metrics import summarize
    return summarize(records, [99])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default="", help="serve flags of configuration A (default: none)")
    p.add_argument("--b", required=True, help="serve flags of configuration B")
    p.add_argument("--model", default=str(REPO / ".cache" / "bench-tiny-llama"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-device-blocks", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from pagedserve.loadgen.stack import Stack
    from pagedserve.services.tiny_model import build_tiny_model
    from pagedserve.services.worker.model_loader import inspect_model_dir
    if not (Path(args.model) / "config.json").exists():
        build_tiny_model(args.model, arch="llama")
    _, spec = inspect_model_dir(args.model)
    reqs = make_requests(args.requests, args.prompt_len, args.max_tokens, spec.vocab_size, args.seed)
    rate = args.rate or None
    common = ["--num-device-blocks", str(args.num_device_blocks), "--log-level", "WARNING"]
    stacks = {}
    try:
        for name, flags in (("A", args.a), ("B", args.b)):
            stacks[name] = Stack(args.model, *common, *shlex.split(flags))
            drive(stacks[name].url, args.model, reqs[:4], None, args.seed)   # warm-up
        rounds = {"A": [], "B": []}
        for r in range(args.rounds):
            for name in ("A", "B"):
                records, elapsed = drive(stacks[name].url, args.model, reqs, rate, args.seed)
                figures = round_figures(records, elapsed)
                rounds[name].append(figures)
                print(f"round {r + 1} {name}: " + ", ".join(f"{label} {get(figures):.2f}" for label, get in FIGURES),
                      flush=True)
    finally:
        for s in stacks.values():
            s.stop()
    print(f"A = [{args.a}]  B = [{args.b}]; {args.requests} requests, "
          f"{'all at once' if rate is None else f'Poisson {rate}/s'}, medians of {args.rounds} rounds")
    for label, get in FIGURES:
        a, b = (statistics.median(get(f) for f in rounds[n]) for n in ("A", "B"))
        print(f"{label:<8} A {a:9.2f}  B {b:9.2f}  B/A {b / a:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
