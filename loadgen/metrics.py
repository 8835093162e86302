"""The figures of a run, with `vllm bench serve`'s definitions and its saved-result field names.

- completed / failed: requests that succeeded / did not (errors by kind in `errors`).
- duration: from the first send to the last end (s). Throughputs divide by it.
- TTFT: send -> first event with text. TPOT: (E2E - TTFT) / (output tokens - 1), only for
  requests with more than one output token. ITL: every gap between consecutive text events, pooled
  over requests (an event may carry several tokens: that is what the server sent). E2EL: send -> end.
- goodput: requests meeting every SLO given (ttft, tpot, e2el in ms; a one-token request's TPOT
  counts as 0), per second.
- normalized latency (the PagedAttention paper's): the mean over requests of E2EL / output tokens.
Means, medians, standard deviations and percentiles as numpy computes them (linear interpolation).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from pagedserve.loadgen.client import RequestRecord

LATENCIES = ("ttft", "tpot", "itl", "e2el")
# Error kinds that mean the server refused the request (queue full, rate limit) rather than failed
# it: a run with any of them did not hold its rate, and its latencies are those of the survivors.
REFUSED = ("http_429", "http_503")


def refused_count(errors: dict[str, int]) -> int:
    """Requests refused, from summarize()'s errors by kind."""
    return sum(errors.get(kind, 0) for kind in REFUSED)


def percentile_key(p: float) -> str:
    return f"p{int(p) if float(p).is_integer() else p}"


def summarize(records: list[RequestRecord], percentiles: list[float],
              slos: dict[str, float] | None = None) -> dict:
    ok = [r for r in records if r.ok]
    started = [r for r in records if r.send is not None]
    duration = (max(r.end for r in started) - min(r.send for r in started)) if started else 0.0
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots, itls, e2els = [], [], []
    for r in ok:
        if r.output_tokens > 1 and r.ttft is not None:
            tpots.append((r.e2el - r.ttft) / (r.output_tokens - 1))
        itls += r.itls
        e2els.append(r.e2el)
    total_in = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(sorted(Counter(r.error for r in records if not r.ok).items())),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(good_count(ok, slos)) if slos else None,
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "max_output_tokens_per_s": max_tokens_per_second(ok),
        "max_concurrent_requests": max_in_flight(started),
        "short_outputs": sum(r.output_tokens < r.output_len for r in ok if not r.usage_missing),
        "usage_missing": sum(r.usage_missing for r in ok),
        "mean_normalized_latency_s_per_token":
            float(np.mean([r.e2el / r.output_tokens for r in ok if r.output_tokens])) if ok else 0.0,
    }
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        arr = np.asarray(xs or [0.0]) * 1000.0
        out[f"mean_{name}_ms"] = float(arr.mean())
        out[f"median_{name}_ms"] = float(np.median(arr))
        out[f"std_{name}_ms"] = float(arr.std())
        for p in percentiles:
            out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def good_count(ok: list[RequestRecord], slos: dict[str, float]) -> int:
    def meets(r: RequestRecord) -> bool:
        tpot = (r.e2el - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 and r.ttft is not None else 0.0
        values = {"ttft": r.ttft, "tpot": tpot, "e2el": r.e2el}
        return all(values[k] is not None and values[k] * 1000.0 <= ms for k, ms in slos.items())
    return sum(meets(r) for r in ok)


def max_tokens_per_second(ok: list[RequestRecord]) -> float:
    """The busiest whole second of output, counting each text event's tokens at its arrival (as
    vLLM's max_output_tokens_per_s, from events rather than from tokens it cannot see)."""
    per_second: Counter = Counter()
    for r in ok:
        if r.token_times:
            share = r.output_tokens / len(r.token_times)
            for t in r.token_times:
                per_second[int(t)] += share
    return float(max(per_second.values())) if per_second else 0.0


def max_in_flight(started: list[RequestRecord]) -> int:
    edges = sorted([(r.send, 1) for r in started] + [(r.end, -1) for r in started], key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def timeline(records: list[RequestRecord], step: float | None = None) -> dict[str, list[float]]:
    """Per `step` seconds (default: about 60 bins over the run, 0.1 s to 10 s each): output tokens
    per second and requests in flight (the plots' series)."""
    started = [r for r in records if r.send is not None and r.end is not None]
    if not started:
        return {"t": [], "tokens_per_s": [], "in_flight": []}
    end = max(r.end for r in started)
    step = step or min(10.0, max(0.1, end / 60))
    bins = int(end / step) + 1
    tokens = np.zeros(bins)
    for r in started:
        if r.ok and r.token_times:
            share = r.output_tokens / len(r.token_times)
            for t in r.token_times:
                tokens[int(t / step)] += share
        elif r.ok:
            tokens[int(r.end / step)] += r.output_tokens
    ts = np.arange(bins) * step
    flight = [sum(r.send <= t + step / 2 < r.end for r in started) for t in ts]
    return {"t": ts.tolist(), "tokens_per_s": (tokens / step).tolist(), "in_flight": flight}
