"""What a served request's latency holds beside the engine's steps, measured through a real
`pagedserve up` for `loadgen profile`'s "api" entry: the path of one request, and what a served
step costs beyond the engine's.

A client's TTFT is its prompt's prefill step plus the path: the HTTP request and the router's
parsing and tokenizing, the scheduler's admission, the hops between router, scheduler, kvstore and
worker, and the first token's way back as an SSE event. The simulator prices steps; without the
path its TTFT on the tiny model was a third of the measured one (3.6 vs 10.4 ms). Measured here
one request at a time (no queue, no batch: nothing but the path and the step), fresh prompts (no
prefix-cache hit) of each of the prefill grid's lengths, as the median of `requests` each; the
path at a length is that TTFT minus the profile's own step for the same prompt, and the line
through them (admission_fit) splits it in two. Its fixed part (request_overhead_s) the simulator
adds to every token time of a request: the way in delays the whole response, the way out every
event of it. Its part per prompt token (admission_s_per_token) is admission: the router parsing
and tokenizing the prompt, the scheduler and the kvstore hashing its blocks, on the cores the
worker shares; the simulator charges it on the step that admits the request. (Fidelity's step
log found it: on the Mooncake trace the prefill-only steps took 2.6 ms more served than the
worker's compute of them, which a path measured on 16-token prompts alone could not price.)

The path is timed with loadgen replay's own client (aiohttp, its TTFT definition), the client
`loadgen fidelity` measures the stack with, one request at a time.

A served step costs more than the offline engine's on the same cores: the router sends each token
as an SSE event and the client reads it, the scheduler plans and the kvstore applies the step's ops
in processes of their own, and on a 2-core machine they all share the cores with the worker (the
tiny model: 2.5 ms a token served against 1.7 ms offline at the same batch), and the more so the
longer the contexts (the step message carries every row's block table). So B streams are sent at
once, each a prompt of C tokens, for B along the decode batch axis and a short and a long C, and
the served decode step at (B, C) is timed over the window in which all B decode together: from the
last stream's first token to the first stream's end. (Their mean TPOT would count the prefills
too: at B = 256, C = 512 the streams admitted first decode their first 64 tokens beside the
others' prompt chunks.) Each stream is forced to
decode_len tokens past the prefill steps of all B prompts (and, measured again, past the spread
of their first tokens), so that the window holds about decode_len steps; events carry text, and a token whose text is not out yet sends none, so the steps
in the window are its events over B and the share of tokens with an event. The step overhead is
that step minus the profile's engine step at B and the window's mean context (its decode grid
interpolated). The simulator adds the overhead, interpolated at a step's rows and their mean
context, to every step.

A step's B tokens leave as B SSE events, one after another: the router writes them and the client
reads them, on a 2-core machine on the core the worker leaves. So the k-th stream of a step sees its
token k events after the step ended: TTFT and E2E grow with the batch, TPOT hardly. event_s is the
router's and the client's CPU per event over the served-step runs (per_event_s), and the simulator
delays each step's tokens by (B + 1) / 2 of it.
"""
from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass

from pagedserve.loadgen.config import ReplayConfig
from pagedserve.loadgen.proc_watch import cpu_seconds
from pagedserve.loadgen.replay import run_replay
from pagedserve.loadgen.soak import role_pids
from pagedserve.loadgen.stack import Stack


def request_ttfts(url: str, model: str, prompt_len: int, count: int, seed: int) -> list[float]:
    """TTFT of `count` streamed requests of fresh `prompt_len`-token prompts, sent one at a time
    (loadgen replay's client: nothing queued, nothing batched)."""
    cfg = ReplayConfig(url=url, model=model, trace="random", input_len=prompt_len, output_len=2, range_ratio=0.0,
                       num_requests=count, rate=math.inf, max_concurrency=1, seed=seed, metrics_interval=0,
                       plots=False, progress=False)
    records = asyncio.run(run_replay(cfg)).records
    failed = [r for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"the profiled stack failed {len(failed)} of {count} requests: {failed[0].error_detail}")
    # A token whose text is not out yet (part of a UTF-8 character) sends no event: a request
    # whose two tokens both sent none has no first-token time and is left out.
    ttfts = [r.ttft for r in records if r.ttft is not None]
    if len(ttfts) < count / 2:
        raise RuntimeError(f"{count - len(ttfts)} of {count} requests of {prompt_len} prompt tokens sent no token's text")
    return ttfts


@dataclass
class Served:
    """One point of the served-step grid: the step, the window's mean context, and what its SSE
    events cost (the router's CPU and this process's, the client's, over the events sent)."""
    step_s: float
    context: float
    cpu_s: float
    events: int


def served_step(stack: Stack, batch: int, context: int, decode_len: int, step_tokens: int,
                max_model_len: int) -> Served:
    """The served decode step at `batch` streams of `context`-token prompts: the module's window,
    every stream forced to decode_len tokens past all B prefills (at most step_tokens prompt tokens
    a step). The streams also reach the scheduler over a while (the router takes their requests one
    at a time): a window shorter than decode_len / 2 steps is measured again, with the outputs
    longer by that spread over a step (the window's step where it has one: a router behind its
    streams merges their events, and a TPOT from merged events can be far too short), never past
    what the model's context holds."""
    prefill_steps = -(-batch * context // step_tokens)
    room = max_model_len - context - 1
    output_len = min(decode_len + prefill_steps, room)
    routers = role_pids(stack.proc.pid, "router")
    tried = []
    for _ in range(4):
        cfg = ReplayConfig(url=stack.url, trace="random", input_len=context, output_len=output_len,
                           range_ratio=0.0, num_requests=batch, rate=math.inf, metrics_interval=0, plots=False,
                           progress=False)
        cpu = cpu_seconds(routers) + time.process_time()
        records = asyncio.run(run_replay(cfg)).records
        cpu = cpu_seconds(routers) + time.process_time() - cpu
        if any(not r.ok or not r.token_times for r in records):
            raise RuntimeError(f"the profiled stack failed a request of {batch} streams of {context} tokens")
        window = window_step(records, decode_len / 2)
        if window is not None:
            step, _ = window
            # The window's mean context: the prompt and half the tokens the streams decoded.
            return Served(step, context + statistics.fmean(r.output_tokens for r in records) / 2, cpu,
                          sum(len(r.token_times) for r in records))
        spread = max(r.token_times[0] for r in records) - min(r.token_times[0] for r in records)
        tpot = statistics.median((r.end - r.first_token) / max(1, r.output_tokens - 1) for r in records)
        short = window_step(records, 0)
        step = short[0] if short is not None else tpot
        tried.append(f"{output_len} tokens: {0 if short is None else short[1]:.1f} steps together, first tokens "
                     f"{1e3 * spread:.0f} ms apart, a step {1e3 * step:.1f} ms")
        # Longer by the first tokens' spread in steps, from the length just tried (the step
        # measured at the next length can differ: the spread must not shrink the ask).
        longer = min(output_len + math.ceil(spread / step), room)
        if longer <= output_len:
            break
        output_len = longer
    raise RuntimeError(f"{batch} streams of {context} tokens never decoded together for {decode_len / 2:g} steps "
                       f"({'; '.join(tried)})")


def window_step(records, least_steps: float = 1) -> tuple[float, float] | None:
    """(the step time, the steps) while every stream decodes (the module's window), from the
    streams' event times and output tokens; None when the window holds fewer than least_steps."""
    start = max(r.token_times[0] for r in records)     # every stream decodes from here ...
    end = min(r.token_times[-1] for r in records)      # ... until the first one ends
    events = sum(1 for r in records for t in r.token_times if start < t <= end)
    with_text = sum(len(r.token_times) for r in records) / sum(r.output_tokens for r in records)
    steps = events / (with_text * len(records))
    if steps < least_steps or events == 0:
        return None
    return (end - start) / steps, steps


def measure_api(model: str, flags: list[str], prompt_lens: list[int], prefill_s: list[float], max_model_len: int,
                batches: list[int], contexts: list[int], engine_decode_s, decode_len: int = 32, requests: int = 20,
                warmup: int = 3, step_tokens: int = 2048) -> dict:
    """The "api" entry. prompt_lens and prefill_s: the profile's prefill grid's token axis and its
    engine step at each with nothing cached; engine_decode_s(batch, context) -> the profile's
    engine decode step there."""
    stack = Stack(model, *flags, "--max-num-batched-tokens", str(step_tokens))
    try:
        request_ttfts(stack.url, model, prompt_lens[0], warmup, seed=1)
        ttfts = [statistics.median(request_ttfts(stack.url, model, n, requests, seed=2 + i))
                 for i, n in enumerate(prompt_lens)]
        served = [[served_step(stack, b, c, decode_len, step_tokens, max_model_len) for c in contexts]
                  for b in batches]
    finally:
        stack.stop()
    fixed, per_token = admission_fit(prompt_lens, [t - s for t, s in zip(ttfts, prefill_s)])
    points = [p for row in served for p in row]
    # The context axis: the prompt and half the window, as a decode step's mean context is read.
    return {"request_overhead_s": fixed, "admission_s_per_token": per_token,
            "prompt": {"tokens": list(prompt_lens), "ttft_s": ttfts, "engine_step_s": list(prefill_s)},
            "requests": requests,
            "step_overhead": {"batch": list(batches), "context": [c + decode_len / 2 for c in contexts],
                              "seconds": [[p.step_s - engine_decode_s(b, p.context) for p in row]
                                          for b, row in zip(batches, served)],
                              "served_step_s": [[p.step_s for p in row] for row in served],
                              "window_context": [[p.context for p in row] for row in served],
                              "decode_len": decode_len, "step_tokens": step_tokens},
            "event_s": per_event_s(points)}


def admission_fit(tokens: list[int], path_s: list[float]) -> tuple[float, float]:
    """(fixed seconds, seconds per prompt token) of a request's path beside its engine step, the
    least-squares line through (prompt tokens, TTFT - the engine's prefill step), both floored at
    0: the fixed part is the HTTP path and the hops, the per-token part what admitting a prompt
    costs outside the worker (the router's parsing and tokenizing, the scheduler's and the
    kvstore's hashing of its blocks). One length: all of it fixed."""
    if len(tokens) < 2:
        return max(0.0, path_s[0]), 0.0
    mx, my = statistics.fmean(tokens), statistics.fmean(path_s)
    slope = sum((x - mx) * (y - my) for x, y in zip(tokens, path_s)) / sum((x - mx) ** 2 for x in tokens)
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


def per_event_s(points: list[Served]) -> float:
    """CPU seconds an event costs: the slope of the points' CPU over their events (each run also
    pays for its requests and the replay's own start, whatever its events), where the events span
    a factor of 2 or more; else their CPU over their events, an upper bound."""
    xs, ys = [p.events for p in points], [p.cpu_s for p in points]
    if min(xs) > 0 and max(xs) >= 2 * min(xs):
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        if slope > 0:
            return slope
    return sum(ys) / sum(xs)
