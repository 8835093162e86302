"""Request-length distributions (prompt tokens, output tokens) for the benchmarks.

Owns the two workloads of the PagedAttention paper (Kwon et al., SOSP 2023, Fig. 11), drawn from
the public traces when they are on disk and from a fitted log-normal otherwise:

- alpaca: prompt mean 19.31, output mean 58.45 tokens (OPT tokenizer). Drawn from alpaca_5000.json,
  a random 5,000-record subset of Alpaca. No OPT/GPT-2 tokenizer is available offline, so a record's
  token count is its character count times one factor per field, chosen so that the file's means
  are the paper's (the shape then follows the text: p90 31 / 131 against GPT-2's 30 / 127).
- sharegpt: prompt mean 161.31, output mean 337.99. The ShareGPT file on disk (Sarathi-Serve's, GPT-4
  conversations, Llama-2 tokenizer) is much longer, so its rows are filtered as vLLM's benchmark
  does (4 <= prompt <= 1024, output >= 4, total <= 2048) and each field scaled to the paper's mean.

The fallback log-normals match each distribution's median and mean (sigma = sqrt(2 ln(mean/median))).
"""
from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TRACES_DIR = Path("/work/shared/traces")
ALPACA_FILE = "alpaca_5000.json"
SHAREGPT_FILE = "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"


@dataclass(frozen=True)
class Workload:
    name: str
    mean_prompt: float
    mean_output: float
    median_prompt: float   # for the fallback fit
    median_output: float


WORKLOADS = {
    # Medians: alpaca from the trace README (GPT-2 BPE); sharegpt from the filtered, scaled file.
    "alpaca": Workload("alpaca", 19.31, 58.45, 14.0, 44.0),
    "sharegpt": Workload("sharegpt", 161.31, 337.99, 126.7, 324.4),
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


def sample_lengths(workload: str, n: int, seed: int = 0, traces_dir: str | Path | None = None) -> Lengths:
    """n (prompt, output) pairs drawn with replacement from the trace (or the fitted fallback)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    rng = random.Random(seed)
    population, source = _population(WORKLOADS[workload], Path(traces_dir or DEFAULT_TRACES_DIR))
    if population:
        return Lengths(workload, source, [rng.choice(population) for _ in range(n)])
    return Lengths(workload, "log-normal fit", _lognormal_pairs(WORKLOADS[workload], n, rng))


def scale_lengths(lengths: Lengths, divisor: float = 1.0, max_total: int | None = None) -> Lengths:
    """Divide every length by `divisor` (at least 1 token each) and cap prompt + output at max_total,
    shortening the output first: a shorter stand-in for a long workload, or a fit to a model's
    context. Capping, unlike redrawing, cannot loop forever on a cap far below the median."""
    if max_total is not None and max_total < 2:
        raise ValueError(f"max_total must leave room for one prompt and one output token, got {max_total}")
    pairs, capped = [], 0
    for p, o in lengths.pairs:
        p, o = max(1, round(p / divisor)), max(1, round(o / divisor))
        short_p = p if max_total is None else min(p, max_total - 1)
        short_o = o if max_total is None else min(o, max_total - short_p)
        capped += (short_p, short_o) != (p, o)
        pairs.append((short_p, short_o))
    source = lengths.source + (f", divided by {divisor:g}" if divisor != 1 else "") \
        + (f", {capped} capped at {max_total} tokens" if capped else "")
    return Lengths(lengths.workload, source, pairs)


def _population(w: Workload, traces_dir: Path) -> tuple[list[tuple[int, int]], str]:
    if w.name == "alpaca" and (traces_dir / ALPACA_FILE).is_file():
        return _alpaca_pairs(w, traces_dir / ALPACA_FILE), f"{ALPACA_FILE} (chars scaled to tokens)"
    if w.name == "sharegpt" and (traces_dir / SHAREGPT_FILE).is_file():
        return _sharegpt_pairs(w, traces_dir / SHAREGPT_FILE), f"{SHAREGPT_FILE} (vLLM filter, scaled)"
    return [], ""


def _alpaca_pairs(w: Workload, path: Path) -> list[tuple[int, int]]:
    records = json.loads(path.read_text())
    prompts = [len(r["instruction"] + ("\n" + r["input"] if r["input"] else "")) for r in records]
    outputs = [len(r["output"]) for r in records]
    return _scaled_to_means(prompts, outputs, w)


def _sharegpt_pairs(w: Workload, path: Path) -> list[tuple[int, int]]:
    with path.open() as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    kept = [(p, o) for p, o in rows if 4 <= p <= 1024 and o >= 4 and p + o <= 2048]   # vLLM's filter
    return _scaled_to_means([p for p, _ in kept], [o for _, o in kept], w)


def _scaled_to_means(prompts: list[int], outputs: list[int], w: Workload) -> list[tuple[int, int]]:
    kp = w.mean_prompt * len(prompts) / sum(prompts)
    ko = w.mean_output * len(outputs) / sum(outputs)
    return [(max(1, round(p * kp)), max(1, round(o * ko))) for p, o in zip(prompts, outputs)]


def _lognormal_pairs(w: Workload, n: int, rng: random.Random) -> list[tuple[int, int]]:
    def draw(mean: float, median: float) -> int:
        sigma = math.sqrt(2 * math.log(mean / median))
        return max(1, round(rng.lognormvariate(math.log(median), sigma)))

    return [(draw(w.mean_prompt, w.median_prompt), draw(w.mean_output, w.median_output)) for _ in range(n)]
