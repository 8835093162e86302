"""The short form of the soak with faults (loadgen/soak.py; `make soak` runs the long one): mixed
traffic through a real stack while processes are killed and paused at random; every request ends
completed or with a clean error, the pool returns to its baseline, nothing is left behind."""
from __future__ import annotations

import pytest

from pagedserve.loadgen.soak import soak
from tests.test_stack import REDIS_URL, redis_available


def test_a_short_soak_with_faults_loses_nothing(tiny_llama):
    if not redis_available():
        pytest.fail("no Redis at 127.0.0.1:6379 (.ci/run starts one)")
    report = soak(tiny_llama, duration_s=15, redis_url=REDIS_URL, seed=1, concurrency=4)
    print(report.figures())
    assert report.faults and sum(report.requests.values()) > 20, report.figures()
    assert not report.problems, report.figures()
