"""End-to-end benchmark through the REST API: the whole stack as real processes vs the offline engine.

1. A Poisson arrival process at a fixed rate: output tokens/s, TTFT and TPOT (streamed, measured
   by the client from the first and the following SSE chunks).
2. Saturation: every request at once, through the API, against the offline engine (same cores in
   one process) on the same requests: the ratio is the price of the process boundaries.

    python -m loadgen.bench_e2e [--requests 64] [--rate 4] [--prompt-len 128] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_requests(n: int, prompt_len: int, max_tokens: int, vocab: int, seed: int,
                  spread: bool = True) -> list[tuple[list[int], int]]:
    """Random token ids; lengths in [half, full] with spread, else exactly prompt_len -> max_tokens."""
    rng = random.Random(seed)
    lo_p, lo_o = (prompt_len // 2, max_tokens // 2) if spread else (prompt_len, max_tokens)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(lo_p, prompt_len))],
             rng.randint(lo_o, max_tokens)) for _ in range(n)]


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int,
                      stream: bool = True) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    start = time.perf_counter()
    if not stream:
        r = await client.post(url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        end = time.perf_counter()
        return {"ttft": float("nan"), "tpot": float("nan"), "latency": end - start,
                "tokens": r.json()["usage"]["completion_tokens"]}
    # The client shares the 2 cores with the stack, so it reads the stream as bytes: the time of
    # the first event (TTFT) and of the end (TPOT) is all it needs, and only the last event (the
    # usage) is parsed. Parsing every event as JSON cost it ~0.9 core-seconds per saturation run.
    body["stream_options"] = {"include_usage": True}
    first, tail = None, b""
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for chunk in r.aiter_bytes():
            if first is None and b"data: {" in chunk:
                first = time.perf_counter()
            tail = (tail + chunk)[-8192:]
    end = time.perf_counter()
    events = [e[6:] for e in tail.split(b"\n\n") if e.startswith(b"data: {")]
    last = json.loads(events[-1]) if events else {}
    if "error" in last:
        raise RuntimeError(f"the stream ended with an error: {last['error']}")
    tokens = (last.get("usage") or {}).get("completion_tokens", 0)
    ttft = first - start if first is not None else float("nan")
    tpot = (end - first) / max(1, tokens - 1) if first is not None else float("nan")
    return {"ttft": ttft, "tpot": tpot, "latency": end - start, "tokens": tokens}


async def drive(url: str, model: str, reqs, rate: float | None, seed: int,
                stream: bool = True) -> tuple[list[dict], float]:
    import httpx
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(reqs) + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in reqs:
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, max_tokens, stream)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def offline_tokens_per_s(model: str, reqs, config_kw: dict) -> tuple[int, float]:
    from services.engine import Engine
    from services.engine_config import EngineConfig
    from services.sampling_params import SamplingParams
    with Engine(EngineConfig(model=model, **config_kw)) as engine:
        params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs]
        start = time.perf_counter()
        outs = engine.generate([p for p, _ in reqs], params)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed


def summary(name: str, results: list[dict], elapsed: float) -> str:
    toks = sum(r["tokens"] for r in results)
    ms = lambda xs, q: 1000 * sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results]
    return (f"{name:<22} {len(results):>4} {toks:>7} {elapsed:>8.1f} {toks / elapsed:>9.1f} "
            f"{1000 * statistics.mean(ttft):>8.1f} {ms(ttft, 0.99):>8.1f} {1000 * statistics.mean(tpot):>8.1f} "
            f"{ms(tpot, 0.99):>8.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / ".cache" / "bench-tiny-llama"))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-device-blocks", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fixed-lengths", action="store_true",
                   help="every request exactly --prompt-len -> --max-tokens (vLLM's random dataset, range 0)")
    p.add_argument("--hidden-size", type=int, default=128, help="hidden size of the tiny model built if missing")
    p.add_argument("--log-level", default="WARNING", help="INFO shows the scheduler's step timing")
    p.add_argument("--rounds", type=int, default=2, help="saturation rounds (offline, SSE, JSON each)")
    p.add_argument("--worker-threads", type=int, default=0, help="the launcher's --worker-threads (0: auto)")
    args = p.parse_args(argv)

    from loadgen.stack import Stack
    from services.tiny_model import build_tiny_model
    if not (Path(args.model) / "config.json").exists():
        build_tiny_model(args.model, arch="llama", hidden_size=args.hidden_size)
    from services.worker.model_loader import inspect_model_dir
    _, spec = inspect_model_dir(args.model)
    reqs = make_requests(args.requests, args.prompt_len, args.max_tokens, spec.vocab_size, args.seed,
                         spread=not args.fixed_lengths)

    stack = Stack(args.model, "--num-device-blocks", str(args.num_device_blocks), "--log-level", args.log_level,
                  "--worker-threads", str(args.worker_threads))
    offline, streamed, unstreamed = [], [], []
    try:
        asyncio.run(drive(stack.url, args.model, reqs[:4], None, args.seed))        # warm-up
        poisson = asyncio.run(drive(stack.url, args.model, reqs, args.rate, args.seed))
        # Saturation, in alternating rounds so that a noisy neighbour hits all three alike; the
        # stack idles (blocked on its sockets) while the offline engine runs in this process. One
        # untimed round of each first: the first run at a new batch size pays for warming up.
        offline_tokens_per_s(args.model, reqs, {"num_device_blocks": args.num_device_blocks})
        asyncio.run(drive(stack.url, args.model, reqs, None, args.seed, stream=False))
        for _ in range(args.rounds):
            offline.append(offline_tokens_per_s(args.model, reqs, {"num_device_blocks": args.num_device_blocks}))
            streamed.append(asyncio.run(drive(stack.url, args.model, reqs, None, args.seed)))
            unstreamed.append(asyncio.run(drive(stack.url, args.model, reqs, None, args.seed, stream=False)))
        time.sleep(1.5)   # the scheduler logs its step timing once it has been idle a heartbeat
    finally:
        stack.stop()
        timing = [line.split("INFO ", 1)[-1].strip() for line in stack.lines if "mean ms" in line]
    print(f"model {args.model}, {args.requests} requests, prompt <= {args.prompt_len}, "
          f"output <= {args.max_tokens} tokens, greedy, ignore_eos; saturation: best of {args.rounds} rounds")
    print(f"{'run':<22} {'reqs':>4} {'tokens':>7} {'seconds':>8} {'tok/s':>9} {'TTFT ms':>8} {'p99':>8} "
          f"{'TPOT ms':>8} {'p99':>8}")
    print(summary(f"API, Poisson {args.rate}/s", *poisson))
    best = lambda runs: min(runs, key=lambda r: r[1])
    print(summary("API, all at once, SSE", *best(streamed)))
    print(summary("API, all at once, JSON", *best(unstreamed)))
    tokens, elapsed = best(offline)
    print(f"{'offline engine':<22} {args.requests:>4} {tokens:>7} {elapsed:>8.1f} {tokens / elapsed:>9.1f}")
    rate = lambda run: sum(r["tokens"] for r in run[0]) / run[1]
    print("tok/s per round: offline " + " ".join(f"{t / e:.0f}" for t, e in offline)
          + " | SSE " + " ".join(f"{rate(r):.0f}" for r in streamed)
          + " | JSON " + " ".join(f"{rate(r):.0f}" for r in unstreamed))
    ref = tokens / elapsed
    med = lambda runs: statistics.median(rate(r) for r in runs)
    ref_med = statistics.median(t / e for t, e in offline)
    print(f"stack / offline at saturation (goal >= 0.85), best / median of rounds: non-streamed "
          f"{rate(best(unstreamed)) / ref:.2f} / {med(unstreamed) / ref_med:.2f}, streamed "
          f"{rate(best(streamed)) / ref:.2f} / {med(streamed) / ref_med:.2f} "
          f"(the client reads every SSE event on the same cores)")
    for line in timing:    # with --log-level INFO: the scheduler's per-step breakdown per run
        print("scheduler:", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
