"""What a served request's latency holds beside the engine's steps, measured through a real
`pagedserve up` for `loadgen profile`'s "api" entry: the path of one request, and what a served
step costs beyond the engine's.

A client's TTFT is its prompt's prefill step plus the path: the HTTP request and the router's
parsing and tokenizing, the scheduler's admission, the hops between router, scheduler, kvstore and
worker, and the first token's way back as an SSE event. The simulator prices steps; without the
path its TTFT on the tiny model was a third of the measured one (3.6 vs 10.4 ms). Measured here
one request at a time (no queue, no batch: nothing but the path and the step), a short fresh
prompt each (no prefix-cache hit), as the median of `requests`; the path is that TTFT minus the
profile's own step for the same prompt. The simulator adds it to every token time of a request:
the way in delays the whole response, the way out every event of it.

A served step costs more than the offline engine's on the same cores: the router sends each token
as an SSE event and the client reads it, the scheduler plans and the kvstore applies the step's ops
in processes of their own, and on a 2-core machine they all share the cores with the worker (the
tiny model: 2.5 ms a token served against 1.7 ms offline at the same batch), and the more so the
longer the contexts (the step message carries every row's block table). So B streams are sent at
once, each a prompt of C tokens and `output_len` forced tokens, for B along the decode batch axis
and a short and a long C; their mean TPOT is the served step at (B, C), and the step overhead is
that minus the profile's engine step at B and the decode's mean context (its decode grid
interpolated). The simulator adds the overhead, interpolated at a step's rows and their mean
context, to every step.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import math
import random
import statistics
import time
from urllib.parse import urlsplit

from pagedserve.loadgen.config import ReplayConfig
from pagedserve.loadgen.metrics import summarize
from pagedserve.loadgen.replay import run_replay
from pagedserve.loadgen.stack import Stack


def first_event_s(url: str, model: str, prompt: list[int], timeout_s: float = 60.0) -> float:
    """Seconds from sending a streamed completion to its first event carrying text."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "min_tokens": 2, "ignore_eos": True,
                       "temperature": 0, "stream": True})
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"the profiled stack answered {resp.status}: {resp.read()[:300]!r}")
        while line := resp.readline():
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                elapsed = time.perf_counter() - t0
                resp.read()            # the rest of the stream: the next request starts on an idle stack
                return elapsed
        raise RuntimeError("the profiled stack's stream ended without a token")
    finally:
        conn.close()


def served_tpot_s(url: str, batch: int, context: int, output_len: int) -> float:
    """Mean TPOT of `batch` streams sent at once (loadgen replay's client and definition)."""
    cfg = ReplayConfig(url=url, trace="random", input_len=context, output_len=output_len, range_ratio=0.0,
                       num_requests=batch, rate=math.inf, metrics_interval=0, plots=False, progress=False)
    run = asyncio.run(run_replay(cfg))
    figures = summarize(run.records, [50.0])
    if figures["failed"]:
        raise RuntimeError(f"the profiled stack failed {figures['failed']} of {batch} requests")
    return figures["mean_tpot_ms"] / 1000.0


def measure_api(model: str, flags: list[str], prompt_len: int, step_s: float, vocab: int, batches: list[int],
                contexts: list[int], engine_decode_s, output_len: int = 32, requests: int = 20,
                warmup: int = 3) -> dict:
    """The "api" entry. engine_decode_s(batch, context) -> the profile's engine step there."""
    rng = random.Random(1)
    stack = Stack(model, *flags)
    try:
        ttfts = [first_event_s(stack.url, model, [rng.randrange(10, vocab) for _ in range(prompt_len)])
                 for _ in range(warmup + requests)][warmup:]
        served = [[served_tpot_s(stack.url, b, c, output_len) for c in contexts] for b in batches]
    finally:
        stack.stop()
    ttft = statistics.median(ttfts)
    mid = output_len / 2              # the decode steps' mean context is the prompt's plus this
    return {"request_overhead_s": max(0.0, ttft - step_s), "ttft_s": ttft, "engine_step_s": step_s,
            "requests": requests, "prompt_tokens": prompt_len,
            "step_overhead": {"batch": list(batches), "context": [c + mid for c in contexts],
                              "seconds": [[s - engine_decode_s(b, c + mid) for c, s in zip(contexts, row)]
                                          for b, row in zip(batches, served)],
                              "served_step_s": served, "output_len": output_len}}
