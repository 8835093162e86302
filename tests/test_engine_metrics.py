"""The engine's side of /metrics without processes: which router exports, and the step histogram."""
from __future__ import annotations

from pagedserve.services.scheduler.exporter import ExporterElection
from pagedserve.services.scheduler.step_stats import ITERATION_TOKENS_BUCKETS, StepStats


def test_one_router_exports_and_the_next_takes_over_after_the_window():
    e = ExporterElection(window_s=10)
    assert e.elect("router-b", 0.0)              # alone: it exports
    assert e.elect("router-a", 1.0)              # a smaller id joins: it exports ...
    assert not e.elect("router-b", 2.0)          # ... and b no longer does
    assert not e.elect("router-b", 11.0)         # a last asked at 1.0: still within the window
    assert e.elect("router-b", 11.5)             # a gone for more than the window: b again
    assert e.last_asked == {"router-b": 11.5}    # the stale one is forgotten


def test_step_stats_are_cumulative_with_vllms_buckets():
    s = StepStats()
    for tokens in (1, 8, 9, 300, 20000, 0):
        s.add(tokens, 0.01, 0.001, 0.002, 0.005, 0.004)
    snap = s.snapshot()
    hist = snap["iteration_tokens"]
    assert hist["bounds"] == list(ITERATION_TOKENS_BUCKETS)
    # le=1: 1; le=8: +8; le=16: +9; ... le=512: +300; +Inf: +20000 (a step of 0 tokens ran nothing)
    assert hist["cumulative"][:3] == [1, 2, 3] and hist["cumulative"][7] == 4 and hist["cumulative"][-1] == 5
    assert hist["sum"] == 1 + 8 + 9 + 300 + 20000
    assert snap["steps"] == 6 and abs(snap["seconds"]["kvstore"] - 0.012) < 1e-9
    s.maybe_log(idle=True)                       # the log window resets; the totals do not
    assert s.snapshot()["steps"] == 6
