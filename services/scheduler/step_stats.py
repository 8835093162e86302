"""Where the engine's steps go: tokens per step and time per phase, since the engine started.

The scheduler process adds one record per step; `snapshot()` goes into its StatsReply, and the
routers render it as Prometheus series (vLLM's `iteration_tokens_total` histogram, our phase
counters). A log line every `every_s` while busy gives the same phases as means over the window.
Torch-free, no I/O but the log.
"""
from __future__ import annotations

import bisect
import logging
import time

log = logging.getLogger("pagedserve.scheduler")

# vLLM's buckets for tokens per engine step (vllm/v1/metrics/buckets.py, 0.32).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepStats:
    PHASES = ("step", "schedule", "kvstore", "worker round trip", "worker compute")

    def __init__(self, every_s: float = 10.0):
        self.every_s, self.last_log = every_s, time.monotonic()
        self.window, self.window_steps = [0.0] * len(self.PHASES), 0
        self.totals, self.steps = [0.0] * len(self.PHASES), 0
        # Per bucket, the steps whose token count is at most its bound (not yet cumulative);
        # the last slot is +Inf.
        self.token_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.tokens = 0

    def add(self, num_tokens: int, *seconds: float) -> None:
        """One step that ran `num_tokens` through the model; `seconds` per phase, as PHASES."""
        self.steps += 1
        self.window_steps += 1
        self.totals = [a + b for a, b in zip(self.totals, seconds)]
        self.window = [a + b for a, b in zip(self.window, seconds)]
        if num_tokens:
            self.token_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
            self.tokens += num_tokens

    def snapshot(self) -> dict:
        """Cumulative since start: {"steps", "seconds": {phase: s}, "iteration_tokens": histogram}."""
        cumulative, running = [], 0
        for c in self.token_counts:
            running += c
            cumulative.append(running)
        return {"steps": self.steps, "seconds": dict(zip(self.PHASES, self.totals)),
                "iteration_tokens": {"bounds": list(ITERATION_TOKENS_BUCKETS), "cumulative": cumulative,
                                     "sum": self.tokens}}

    def maybe_log(self, idle: bool = False) -> None:
        """Every every_s while busy, and once when the work runs out."""
        if self.window_steps and (idle or time.monotonic() - self.last_log >= self.every_s):
            log.info("%d steps, mean ms: %s", self.window_steps, ", ".join(
                f"{n} {1000 * s / self.window_steps:.2f}" for n, s in zip(self.PHASES, self.window)))
            self.window, self.window_steps, self.last_log = [0.0] * len(self.PHASES), 0, time.monotonic()
