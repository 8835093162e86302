"""Request-length distributions (prompt tokens, output tokens) of the PagedAttention paper's two
workloads (Kwon et al., SOSP 2023, Fig. 11), fitted, not copied: the Alpaca sample is
non-commercial and the ShareGPT text has no clear license, so neither is shipped.

Each field is an independent log-normal, and a pair is redrawn until prompt + output < 2048 (the
paper's filter). The medians below were calibrated (a 400k-draw Monte Carlo, 8 fixed-point rounds of
`median *= target_mean / truncated_mean`) so that the *truncated, rounded* means are the paper's:

- sharegpt: prompt mean 161.31, output mean 337.99. Sigmas 1.0 and 0.8 give the long tails of
  Fig. 11a (prompt p99 ~945, output p99 ~1,400 tokens).
- alpaca: prompt mean 19.31, output mean 58.45. The sigmas are those of the public Alpaca sample
  tokenized with GPT-2's BPE (median 14 / 44, p90 30 / 127), so the shape is Alpaca's, not a guess.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

MAX_TOTAL = 2048          # the paper keeps sequences shorter than this


@dataclass(frozen=True)
class Workload:
    name: str
    mean_prompt: float       # the paper's figures: what a draw must reproduce
    mean_output: float
    median_prompt: float     # the fitted log-normals
    sigma_prompt: float
    median_output: float
    sigma_output: float


WORKLOADS = {
    "alpaca": Workload("alpaca", 19.31, 58.45, 13.97, 0.802, 44.10, 0.754),
    "sharegpt": Workload("sharegpt", 161.31, 337.99, 101.6, 1.0, 256.0, 0.8),
}


@dataclass
class Lengths:
    workload: str
    source: str                      # where the pairs came from, for the benchmark's header
    pairs: list[tuple[int, int]]     # (prompt tokens, output tokens), each >= 1

    @property
    def mean_prompt(self) -> float:
        return sum(p for p, _ in self.pairs) / len(self.pairs)

    @property
    def mean_output(self) -> float:
        return sum(o for _, o in self.pairs) / len(self.pairs)


def sample_lengths(workload: str, n: int, seed: int = 0) -> Lengths:
    """n (prompt, output) pairs from the workload's fitted distribution."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    w, rng = WORKLOADS[workload], random.Random(seed)
    return Lengths(workload, f"{workload} (log-normal fit to the paper's means)", [_draw(w, rng) for _ in range(n)])


def _draw(w: Workload, rng: random.Random) -> tuple[int, int]:
    while True:
        p = max(1, round(rng.lognormvariate(math.log(w.median_prompt), w.sigma_prompt)))
        o = max(1, round(rng.lognormvariate(math.log(w.median_output), w.sigma_output)))
        if p + o < MAX_TOTAL:
            return p, o


def scale_lengths(lengths: Lengths, divisor: float = 1.0, max_total: int | None = None) -> Lengths:
    """Divide every length by `divisor` (at least 1 token each) and cap prompt + output at max_total,
    shortening the output first: a shorter stand-in for a long workload, or a fit to a model's
    context. Capping, unlike redrawing, cannot loop forever on a cap far below the median."""
    if max_total is not None and max_total < 2:
        raise ValueError(f"max_total must leave room for one prompt and one output token, got {max_total}")
    pairs, capped = [], 0
    for p, o in lengths.pairs:
        p, o = max(1, round(p / divisor)), max(1, round(o / divisor))
        short = cap_pair(p, o, max_total)
        capped += short != (p, o)
        pairs.append(short)
    source = lengths.source + (f", divided by {divisor:g}" if divisor != 1 else "") \
        + (f", {capped} capped at {max_total} tokens" if capped else "")
    return Lengths(lengths.workload, source, pairs)


def cap_pair(prompt: int, output: int, max_total: int | None) -> tuple[int, int]:
    """(prompt, output) shortened to fit max_total, output first, at least one token each."""
    if max_total is None:
        return prompt, output
    prompt = min(prompt, max_total - 1)
    return prompt, min(output, max_total - prompt)
