"""From a trace to what the client sends: lengths fitted to the model's context, arrival times,
and prompt tokens (token ids, or text that tokenizes to the length), with a Mooncake trace's shared
prefixes turned into equal prompt blocks.

Pure functions of (trace, options, seed): the same seed gives the same requests, byte for byte, at
every rate of a sweep.
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

from pagedserve.loadgen.lengths import cap_pair
from pagedserve.loadgen.traces import Trace, TraceRequest

FIT_MODES = ("scale", "filter")
SCALE_QUANTILE = 0.99     # --fit scale shrinks every length so that this quantile of prompt + output fits
FIT_SAMPLE = 10000        # ... of the trace's first this many requests (a fixed set: the same factor
                          # whatever the number of requests sent)


@dataclass
class Fit:
    mode: str
    max_model_len: int
    factor: float                 # every length multiplied by this (1 for filter)
    block_tokens: int | None      # prompt tokens per trace hash id after fitting
    dropped: int = 0              # filter: requests that did not fit
    capped: int = 0               # scale: requests still too long, shortened (output first)

    trace_block: int | None = None   # tokens per hash id in the trace
    # What capped and dropped count over: the requests sent (build_plan) and the trace requests
    # read to find them, or None when they count over the whole trace (fit_to_context alone).
    sent: int | None = None
    read: int | None = None

    def describe(self) -> str:
        of = f" of {self.sent}" if self.sent is not None else ""
        what = f"{self.capped}{of} capped" if self.mode == "scale" else ""
        if self.dropped or self.mode == "filter":
            of = f" of the first {self.read} in the trace" if self.read is not None else ""
            what += (", " if what else "") + f"{self.dropped}{of} dropped"
        blocks = ""
        if self.block_tokens:
            blocks = f", {self.block_tokens} tokens per trace block"
            wanted = self.trace_block * self.factor
            if self.block_tokens > 1.5 * wanted:
                # A trace block is at least one KV block: prompts come out longer than the factor says.
                blocks += f" (the factor alone gives {wanted:.1f}: prompts x{self.block_tokens / wanted:.1f} longer)"
        return f"--fit {self.mode} to {self.max_model_len} tokens: lengths x{self.factor:.4g}, {what}{blocks}"


def fit_to_context(trace: Trace, max_model_len: int, mode: str, kv_block_size: int = 16) -> tuple[list[TraceRequest], Fit]:
    """The trace's requests with prompt + output <= max_model_len; the Fit counts over the whole trace."""
    kept, fit = fit_each(trace, max_model_len, mode, kv_block_size)
    return [r for _, r, _ in kept], fit


def fit_each(trace: Trace, max_model_len: int, mode: str,
             kv_block_size: int = 16) -> tuple[list[tuple[int, TraceRequest, bool]], Fit]:
    """(index in the trace, fitted request, capped) of every request kept, in the trace's order.

    scale: one factor for every length, so that the SCALE_QUANTILE of prompt + output fits; the few
    still too long are shortened, output first. filter: lengths as they are; what does not fit is
    dropped. A trace block (512 tokens in Mooncake) becomes a whole number of the server's KV blocks,
    at least one, so that equal hash ids still mean equal, block-aligned prefixes.
    """
    if mode not in FIT_MODES:
        raise ValueError(f"--fit must be one of {', '.join(FIT_MODES)}, got {mode!r}")
    if max_model_len < 2:
        raise ValueError(f"the model's context ({max_model_len}) leaves no room for a request")
    factor = 1.0
    if mode == "scale" and trace.requests:
        totals = sorted(r.input_len + r.output_len for r in trace.requests[:FIT_SAMPLE])
        p99 = totals[max(0, math.ceil(SCALE_QUANTILE * len(totals)) - 1)]      # nearest rank
        factor = min(1.0, max_model_len / p99)
    block = None
    if trace.block_tokens:
        block = max(kv_block_size, round(trace.block_tokens * factor / kv_block_size) * kv_block_size)
    fit = Fit(mode, max_model_len, factor, block, trace_block=trace.block_tokens)
    out = []
    for i, r in enumerate(trace.requests):
        p = _prompt_len(r, factor, trace.block_tokens, block)
        o = max(1, round(r.output_len * factor))
        capped = p + o > max_model_len
        if capped:
            # The user's own text cannot be shortened: it goes only if the output can make room.
            if mode == "filter" or (r.prompt is not None and p >= max_model_len):
                fit.dropped += 1
                continue
            fit.capped += 1
            p, o = cap_pair(p, o, max_model_len)
        out.append((i, TraceRequest(p, o, r.timestamp, r.hash_ids, r.prompt), capped))
    return out, fit


def _prompt_len(r: TraceRequest, factor: float, trace_block: int | None, block: int | None) -> int:
    if r.prompt is not None:
        return r.input_len                # the user's text is sent as written
    if not r.hash_ids or not block:
        return max(1, round(r.input_len * factor))
    full = len(r.hash_ids) - 1
    last = r.input_len - full * trace_block          # tokens of the last (partial) trace block
    return full * block + max(1, min(block, round(last * block / trace_block)))


def poisson_arrivals(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times (s) of n requests: the first at 0, then gamma gaps with shape `burstiness` and mean
    1/rate (vLLM's definition: burstiness 1 is Poisson, lower is burstier). rate inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


def trace_arrivals(timestamps: list[float], speed: float = 1.0) -> list[float]:
    """The trace's own times, divided by `speed`. A bucketed trace (most requests share their stamp
    with others, as in Mooncake's 3-second buckets) has each bucket's requests spread evenly over the
    gap to the next stamp, instead of arriving in one burst the real traffic never had."""
    n = len(timestamps)
    if n == 0:
        return []
    groups: dict[float, int] = {}
    for t in timestamps:
        groups[t] = groups.get(t, 0) + 1
    bucketed = sum(c for c in groups.values() if c > 1) > n / 2
    stamps = sorted(groups)
    if bucketed and len(stamps) > 1:
        gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
        width = {a: b - a for a, b in zip(stamps, stamps[1:])}
        width[stamps[-1]] = gaps[len(gaps) // 2]
        seen: dict[float, int] = {}
        spread = []
        for t in timestamps:
            i = seen[t] = seen.get(t, -1) + 1
            spread.append(t + i * width[t] / groups[t])
        timestamps = spread
    return [t / speed for t in timestamps]


class Prompts:
    """Prompt token ids drawn from `pool`: fresh ones per request, and one fixed draw per trace hash
    id, so that equal hash ids give equal blocks and different ids (almost surely) different ones."""

    def __init__(self, pool: list[int], seed: int):
        if not pool:
            raise ValueError("no token ids to draw prompts from")
        self.pool, self.seed = pool, seed
        self._blocks: dict[int, list[int]] = {}

    def fresh(self, key: str, n: int) -> list[int]:
        return random.Random(f"{self.seed}:{key}").choices(self.pool, k=n)

    def block(self, hash_id: int, n: int) -> list[int]:
        ids = self._blocks.get(hash_id)
        if ids is None or len(ids) < n:
            ids = self._blocks[hash_id] = random.Random(f"{self.seed}:block:{hash_id}").choices(self.pool, k=n)
        return ids[:n]

    def for_request(self, index: int, r: TraceRequest, block_tokens: int | None, length: int) -> list[int]:
        """`length` ids: the request's hash blocks when it has them, else a fresh draw."""
        if not r.hash_ids or not block_tokens:
            return self.fresh(f"req:{index}", length)
        ids: list[int] = []
        for h in r.hash_ids:
            if len(ids) >= length:
                break
            ids += self.block(h, min(block_tokens, length - len(ids)))
        if len(ids) < length:                       # a prompt longer than its blocks (a user file)
            ids += self.fresh(f"tail:{index}", length - len(ids))
        return ids


@dataclass
class PlannedRequest:
    index: int
    arrival: float                  # seconds after the run starts
    prompt: list[int] | str
    input_len: int                  # tokens the prompt should come to at the server
    output_len: int
    prefix_blocks: int = 0          # leading trace blocks (hash ids) this prompt carries
    messages: list[dict] | None = None   # chat: the whole conversation, sent instead of `prompt`
                                         # as one user message (the multi-turn workload)


@dataclass
class Plan:
    requests: list[PlannedRequest]
    warmup: list[PlannedRequest]
    fit: Fit
    notes: list[str] = field(default_factory=list)
    prefix_bound: float | None = None   # prefix_cache_bound of the requests (token-id prompts only)


def prefix_cache_bound(prompts: list[list[int]], block_size: int) -> float:
    """The prefix-cache hit rate, in prompt tokens, of a cache that never evicts, over these
    prompts in this order, as a vLLM-like server counts it: only full blocks before a prompt's
    last token can hit, and a block hits only if every block before it did (chained keys)."""
    seen: set = set()
    hits = total = 0
    for ids in prompts:
        total += len(ids)
        hits += chained_hits(ids, block_size, seen)
    return hits / total if total else 0.0


def chained_hits(ids: list[int], block_size: int, seen: set, look_up: bool = True) -> int:
    """Tokens of the full blocks before ids' last token that hit in `seen` (chained keys: a block
    hits only if every block before it did); every block not hit is added to `seen`. look_up=False
    only adds (a sequence the cache keeps without it having been a prompt)."""
    key, hitting, hits = None, look_up, 0
    for i in range((len(ids) - 1) // block_size):
        key = (key, tuple(ids[i * block_size:(i + 1) * block_size]))
        if hitting and key in seen:
            hits += block_size
        else:
            hitting = False
            seen.add(key)
    return hits


def sent_fit(fit: Fit, kept: list[tuple[int, TraceRequest, bool]], sent: list[int], trace_len: int) -> Fit:
    """The Fit counted over the requests sent (`sent`: indices into `kept`), not the whole trace: a
    run of 40 requests drawn from 10,000 reports its own capped ones. Dropped counts the trace's
    requests skipped before the last one sent (all of them when none is sent)."""
    read = max(kept[i][0] for i in sent) + 1 if sent else trace_len
    kept_read = sum(1 for source, _, _ in kept if source < read)
    return dataclasses.replace(fit, capped=sum(kept[i][2] for i in sent), dropped=read - kept_read,
                               sent=len(sent), read=read)


def build_plan(trace: Trace, *, max_model_len: int, fit_mode: str, kv_block_size: int, seed: int,
               rate: float, burstiness: float, trace_times: bool, speed: float, duration: float | None,
               num_requests: int | None, warmup: int, pool: list[int], codec=None) -> Plan:
    """The requests of a run, in send order. `codec` (a TextCodec) turns ids into text prompts."""
    kept, fit = fit_each(trace, max_model_len, fit_mode, kv_block_size)
    fitted = [r for _, r, _ in kept]
    notes = list(trace.notes)
    if trace_times:
        if not trace.has_times:
            raise ValueError(f"--trace-times: the {trace.name} trace has no timestamps")
        arrivals = trace_arrivals([r.timestamp for r in fitted], speed)
    else:
        arrivals = poisson_arrivals(len(fitted), rate, burstiness, random.Random(f"{seed}:arrivals"))
    order = sorted(range(len(fitted)), key=lambda i: arrivals[i])
    if duration is not None:
        order = [i for i in order if arrivals[i] < duration]
    if num_requests is not None:
        order = order[:num_requests]
    fit = sent_fit(fit, kept, order, len(trace.requests))
    prompts = Prompts(pool, seed)
    # Text prompts are shorter by what the server adds (BOS, a chat template) so that it sees the
    # planned length; what it adds in front (`lead`) comes out of the first block.
    added, lead = (codec.added, codec.offset) if codec is not None else (0, 0)

    def make(index: int, key: str, r: TraceRequest, arrival: float, shared: bool) -> PlannedRequest:
        if r.prompt is not None:
            return PlannedRequest(index, arrival, r.prompt, r.input_len, r.output_len)
        length = max(1, r.input_len - added)
        if shared:
            ids = prompts.for_request(index, r, fit.block_tokens, length + lead)[lead:]
        else:
            ids = prompts.fresh(key, length)
        blocks = min(len(r.hash_ids or ()), -(-length // fit.block_tokens)) if shared and fit.block_tokens else 0
        prompt = codec.text(ids) if codec is not None else ids
        return PlannedRequest(index, arrival, prompt, length + added, r.output_len, blocks)

    requests = [make(n, f"req:{n}", fitted[i], arrivals[i], True) for n, i in enumerate(order)]
    # Warm-up requests: the first lengths of the workload with prompts of their own, so that they
    # warm the server without filling its prefix cache with the run's prefixes.
    warm = [make(-1 - n, f"warmup:{n}", fitted[i], 0.0, False) for n, i in enumerate(order[:warmup])]
    if codec is not None:
        built = [p for p, i in zip(requests, order) if fitted[i].prompt is None]
        wrong = sum(n != p.input_len for n, p in zip(codec.counts([p.prompt for p in built]), built))
        if wrong:
            notes.append(f"{wrong} of {len(requests)} text prompts do not tokenize to their planned length")
    ids = [p.prompt for p in requests]
    bound = prefix_cache_bound(ids, kv_block_size) if all(type(i) is list for i in ids) else None
    return Plan(requests, warm, fit, notes, bound)
