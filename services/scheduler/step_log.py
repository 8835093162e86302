"""One line per engine step, for whoever sets the served steps beside a model of them (`loadgen fidelity`).

`pagedserve up --step-log FILE` makes the scheduler append, after each step's update, a JSON list:

    [seconds, worker_s, D, C, Q, P, R, S]

seconds   the step, as the pagedserve:engine_step_seconds{phase="step"} counter adds it (from the
          end of the step before, or from its planning if later, to the end of its update)
worker_s  the worker's own compute of it
D, C      its decode rows (one new token each) and their context summed, the new token included
Q, P      its prefill rows' tokens summed, and sum(q * cached) over them (the tokens weighted by
          the context already in the cache before them)
R         its rows, decode and prefill
S         the contexts of all its rows summed

The same composition `loadgen simulate` prices a step by (loadgen/profiled_cost.py), so a step the
simulator plans and a step the stack ran are described alike. Torch-free; written through a
buffer, flushed when the engine goes idle and when the process ends.
"""
from __future__ import annotations

import json


def composition(rows) -> tuple[int, int, int, int, int, int]:
    """(D, C, Q, P, R, S) of a step from its rows, each (q, ctx): q tokens computed, ctx the context
    including them."""
    d = c = q_sum = p = s = 0
    for q, ctx in rows:
        s += ctx
        if q == 1:
            d += 1
            c += ctx
        else:
            q_sum += q
            p += q * (ctx - q)
    return d, c, q_sum, p, len(rows), s


STEP_KINDS = ("decode", "prefill", "mixed")


def step_kind(comp: tuple) -> str:
    """A step's kind from its composition (D, C, Q, ...): decode rows only, prefill only, or both."""
    d, q = comp[0], comp[2]
    return STEP_KINDS[0] if not q else STEP_KINDS[1] if not d else STEP_KINDS[2]


class StepLog:
    def __init__(self, path: str):
        self.file = open(path, "a", encoding="utf-8", buffering=1 << 16)

    def add(self, scheduled, seconds: float, worker_s: float) -> None:
        rows = [(len(s.token_ids), s.start_pos + len(s.token_ids)) for s in scheduled.steps]
        if rows:
            self.file.write(json.dumps([round(seconds, 7), round(worker_s, 7), *composition(rows)]) + "\n")

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read(path: str) -> list[list[float]]:
    """The records of a step log, each [seconds, worker_s, D, C, Q, P, R, S]; a line cut short by a
    process that was killed is skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, list) and len(rec) == 8:
                out.append(rec)
    return out
