"""Workloads as lists of requests: the traces shipped as package data (Azure 2023, Mooncake FAST'25),
the paper's fitted ShareGPT / Alpaca lengths, vLLM's random dataset, and a JSONL file of the user's.

Owns parsing only: what a request *is* in each format. Fitting lengths to a model's context,
arrivals and prompt tokens are loadgen.workload's.
"""
from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from pathlib import Path

from pagedserve.loadgen.lengths import WORKLOADS, sample_lengths

MOONCAKE_BLOCK_TOKENS = 512      # one Mooncake hash id covers this many prompt tokens
MAX_LENGTH = 10**8               # a token count past any context (and past float precision worries)
MAX_TIMESTAMP_MS = 10**12        # about 30 years: NaN, Infinity and the like are refused

# name -> (file in loadgen/traces, format)
SHIPPED = {
    "azure-code": ("AzureLLMInferenceTrace_code.csv", "azure"),
    "azure-conv": ("AzureLLMInferenceTrace_conv.csv", "azure"),
    "mooncake-conversation": ("conversation_trace.jsonl", "jsonl"),
    "mooncake-synthetic": ("synthetic_trace.jsonl", "jsonl"),
}
SYNTHETIC = ("sharegpt", "alpaca", "random")
TRACE_NAMES = (*SYNTHETIC, *SHIPPED)


class TraceError(ValueError):
    """A trace that cannot be read: the message names the file and the line."""


@dataclass
class TraceRequest:
    input_len: int                        # prompt tokens (for a text prompt: an estimate until usage says)
    output_len: int
    timestamp: float | None = None        # seconds since the trace's first request
    hash_ids: list[int] | None = None     # one id per prompt block (Mooncake): equal ids, equal blocks
    prompt: str | None = None             # the user's own text, sent as is


@dataclass
class Trace:
    name: str
    source: str                           # for the report: file or distribution
    requests: list[TraceRequest]
    block_tokens: int | None = None       # tokens per hash id, when requests carry hash_ids
    notes: list[str] = field(default_factory=list)

    @property
    def has_times(self) -> bool:
        return bool(self.requests) and all(r.timestamp is not None for r in self.requests)


def trace_path(name: str) -> Path:
    """The shipped file of a trace, found inside the installed package (any working folder). By
    the package's full name: "loadgen" alone imports only where the working folder is a checkout's
    root, so the installed `loadgen` command could not find its own traces."""
    return Path(str(resources.files("pagedserve.loadgen") / "traces" / SHIPPED[name][0]))


def load_trace(name: str, *, num_requests: int, seed: int = 0, input_len: int = 1024,
               output_len: int = 128, range_ratio: float = 0.0) -> Trace:
    """Up to num_requests requests of the named workload or JSONL file, in trace order."""
    if name in WORKLOADS:
        lengths = sample_lengths(name, num_requests, seed)
        return Trace(name, lengths.source, [TraceRequest(p, o) for p, o in lengths.pairs])
    if name == "random":
        return _random(num_requests, seed, input_len, output_len, range_ratio)
    if name in SHIPPED:
        path, fmt = trace_path(name), SHIPPED[name][1]
    else:
        path, fmt = Path(name), "jsonl"
        if not path.is_file():
            raise TraceError(f"--trace {name!r} is neither a file nor one of {', '.join(TRACE_NAMES)}")
    requests = (_read_azure if fmt == "azure" else _read_jsonl)(path, num_requests)
    block = MOONCAKE_BLOCK_TOKENS if any(r.hash_ids for r in requests) else None
    return Trace(name, f"{path.name} ({len(requests)} requests)", requests, block)


def _random(n: int, seed: int, input_len: int, output_len: int, ratio: float) -> Trace:
    """vLLM's random dataset: lengths uniform in [len * (1 - ratio), len * (1 + ratio)]."""
    rng = random.Random(seed)
    draw = lambda n_: rng.randint(max(1, int(n_ * (1 - ratio))), max(1, int(n_ * (1 + ratio))))
    reqs = [TraceRequest(draw(input_len), draw(output_len)) for _ in range(n)]
    return Trace("random", f"random {input_len} -> {output_len}, range ratio {ratio:g}", reqs)


def _read_azure(path: Path, limit: int) -> list[TraceRequest]:
    """TIMESTAMP (a datetime with 7 decimals), ContextTokens, GeneratedTokens."""
    out, t0 = [], None
    with path.open(newline="") as f:
        for lineno, row in enumerate(csv.DictReader(f), start=2):
            if len(out) >= limit:
                break
            try:
                t = _seconds_of_day(row["TIMESTAMP"])
                req = TraceRequest(int(row["ContextTokens"]), int(row["GeneratedTokens"]))
            except (KeyError, ValueError, TypeError) as e:
                raise TraceError(f"{path}:{lineno}: not an Azure trace row ({e})") from None
            t0 = t if t0 is None else t0
            req.timestamp = t - t0
            out.append(req)
    return out


def _seconds_of_day(stamp: str) -> float:
    """'2023-11-16 18:17:03.9799600' -> seconds since the epoch (the 7th decimal is dropped)."""
    day, _, clock = stamp.strip().partition(" ")
    whole, _, frac = clock.partition(".")
    return datetime.fromisoformat(f"{day} {whole}").timestamp() + float("0." + (frac or "0"))


def _read_jsonl(path: Path, limit: int) -> list[TraceRequest]:
    """One object a line: `prompt` or `input_length`, `output_length`, optional `timestamp` (ms) and
    `hash_ids` (Mooncake's format)."""
    out, t0 = [], None
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                out.append(_jsonl_request(json.loads(line)))
            except (ValueError, TypeError, KeyError) as e:
                raise TraceError(f"{path}:{lineno}: {e}") from None
    stamps = [r.timestamp for r in out if r.timestamp is not None]
    if stamps and len(stamps) != len(out):
        raise TraceError(f"{path}: some requests have a timestamp and some do not")
    if stamps:
        t0 = min(stamps)
        for r in out:
            r.timestamp -= t0
    return out


def _jsonl_request(obj: dict) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    prompt = obj.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError("'prompt' must be a string")
    if "input_length" in obj:
        input_len = _positive_int(obj, "input_length")
    elif prompt is not None:
        input_len = max(1, len(prompt) // 4)     # a first guess; the server's usage says exactly
    else:
        raise ValueError("needs 'prompt' or 'input_length'")
    output_len = _positive_int(obj, "output_length")
    stamp = obj.get("timestamp")
    if stamp is not None and (isinstance(stamp, bool) or not isinstance(stamp, (int, float))
                              or not 0 <= stamp <= MAX_TIMESTAMP_MS):
        raise ValueError(f"'timestamp' must be a number of milliseconds in [0, {MAX_TIMESTAMP_MS:.0e}]")
    hash_ids = obj.get("hash_ids")
    if hash_ids is not None:
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                     for h in hash_ids):
            raise ValueError("'hash_ids' must be a list of integers")
        if prompt is not None:
            raise ValueError("give 'prompt' or 'hash_ids', not both")
        need = -(-input_len // MOONCAKE_BLOCK_TOKENS)
        if len(hash_ids) != need:
            raise ValueError(f"{len(hash_ids)} hash_ids for {input_len} tokens: expected "
                             f"{need} (one per {MOONCAKE_BLOCK_TOKENS} tokens)")
    return TraceRequest(input_len, output_len, None if stamp is None else stamp / 1000.0, hash_ids, prompt)


def _positive_int(obj: dict, key: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LENGTH:
        shown = value if not isinstance(value, int) or abs(value) < 10**12 else f"{str(value)[:12]}..."
        raise ValueError(f"'{key}' must be an integer in [1, {MAX_LENGTH:.0e}], got {shown!r}")
    return value
