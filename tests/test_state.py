"""The shared router state: the same checks on the in-process store and on the real Redis."""
from __future__ import annotations

import time
import uuid

import pytest

from pagedserve.services.state import MemoryState, RedisState, Replica

REDIS_URL = "redis://127.0.0.1:6379/0"


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def redis_available() -> bool:
    try:
        import redis
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5).ping())
    except Exception:
        return False


@pytest.fixture
def redis_state():
    if not redis_available():
        pytest.skip("no Redis answers at 127.0.0.1:6379")
    state = RedisState(REDIS_URL, prefix=f"test-{uuid.uuid4().hex[:10]}:")
    yield state
    state.clear()
    state.close()


@pytest.fixture(params=["memory", "redis"])
def state(request):
    if request.param == "memory":
        yield MemoryState()
    else:
        yield request.getfixturevalue("redis_state")


def test_request_records_are_created_once_and_updated(state):
    assert state.get_request("r1") is None
    assert state.put_request("r1", "router-a", "tcp://x:1", "running", model="m", n=2)
    assert not state.put_request("r1", "router-b", "tcp://y:1", "running"), "ids are claimed once"
    rec = state.get_request("r1")
    assert rec["router_id"] == "router-a" and rec["replica_endpoint"] == "tcp://x:1"
    assert rec["status"] == "running" and rec["model"] == "m" and rec["n"] == 2
    assert state.update_request_status("r1", "cancelled", finish_reasons=["abort"])
    rec = state.get_request("r1")
    assert rec["status"] == "cancelled" and rec["finish_reasons"] == ["abort"] and rec["n"] == 2
    assert not state.update_request_status("nope", "finished")


def test_a_finished_request_id_can_be_used_again_a_running_one_cannot(state):
    assert state.put_request("r2", "router-a", "tcp://x:1", "running", model="m")
    assert not state.put_request("r2", "router-b", "tcp://y:1", "running")
    assert state.update_request_status("r2", "finished", finish_reasons=["length"])
    assert state.put_request("r2", "router-b", "tcp://y:1", "running", kind="chat"), "a retry reuses the id"
    rec = state.get_request("r2")
    assert rec["router_id"] == "router-b" and rec["status"] == "running" and rec["kind"] == "chat"
    assert "model" not in rec and "finish_reasons" not in rec, "the new record replaces the old one"
    assert not state.put_request("r2", "router-a", "tcp://x:1", "running"), "while it runs, it is taken"


def test_api_keys_are_checked_by_hash(state):
    assert state.check_api_key("sk-1") is None
    state.add_api_key("sk-1", {"name": "alice", "rate_limit": 5})
    assert state.check_api_key("sk-1") == {"name": "alice", "rate_limit": 5}
    assert state.check_api_key("sk-2") is None
    if isinstance(state, RedisState):
        assert not [k for k in state.r.scan_iter(match=state.prefix + "*") if "sk-1" in k]
    state.remove_api_key("sk-1")
    assert state.check_api_key("sk-1") is None


def test_rate_limit_refuses_over_the_limit_without_counting_refusals(state):
    window = 3600.0  # long enough that the test never crosses a window boundary by much
    decisions = [state.hit_rate_limit("k", 3, window) for _ in range(5)]
    assert [d.allowed for d in decisions[:3]] == [True, True, True]
    assert not decisions[3].allowed and not decisions[4].allowed
    assert 0 < decisions[3].retry_after_s <= window
    # Another key has its own counter.
    assert state.hit_rate_limit("other", 3, window).allowed


def test_memory_replica_lease_expires_without_renewal():
    clock = FakeClock()
    state = MemoryState(clock=clock)
    state.register_replica("a", "tcp://a", {"load": 1}, ttl_s=5)
    state.register_replica("b", "tcp://b", {}, ttl_s=5)
    assert [r.id for r in state.live_replicas()] == ["a", "b"]
    clock.now += 4
    assert state.renew_replica("a", ttl_s=5, info={"load": 7})
    clock.now += 2   # b's lease (5 s) is over, a's renewed one is not
    live = state.live_replicas()
    assert live == [Replica("a", "tcp://a", {"load": 7})] and live[0].load == 7
    assert not state.renew_replica("b", ttl_s=5), "an expired lease must be registered again"
    clock.now += 6
    assert state.live_replicas() == []


def test_redis_replica_lease_expires_without_renewal(redis_state):
    redis_state.register_replica("a", "tcp://a", {"load": 2}, ttl_s=0.3)
    redis_state.register_replica("b", "tcp://b", None, ttl_s=0.3)
    assert [r.endpoint for r in redis_state.live_replicas()] == ["tcp://a", "tcp://b"]
    time.sleep(0.2)
    assert redis_state.renew("a", ttl_s=0.6, info={"load": 3})
    time.sleep(0.25)
    assert [(r.id, r.load) for r in redis_state.live_replicas()] == [("a", 3.0)]
    assert not redis_state.renew_replica("b", ttl_s=1), "an expired lease must be registered again"
    redis_state.deregister_replica("a")
    assert redis_state.live_replicas() == []


def test_the_scheduler_keeps_its_lease_through_a_pause_and_a_state_outage():
    """A lease that lapsed (the scheduler was paused past its TTL) is registered again; a state store
    that is down is logged, and the scheduler goes on (it used to die on Redis's ConnectionError)."""
    from pagedserve.services.scheduler.lease import ReplicaLease
    clock = FakeClock()
    state = MemoryState(clock=clock)
    lease = ReplicaLease(state, "r0", "ipc:///x", "m")
    clock.now += 7                                   # paused past the lease
    assert state.live_replicas() == []
    lease.renew(load=0)
    assert [r.id for r in state.live_replicas()] == ["r0"]

    class Down:
        def register_replica(self, *a, **k):
            pass

        def renew_replica(self, *a, **k):
            import redis
            raise redis.exceptions.ConnectionError("Connection refused")
    ReplicaLease(Down(), "r0", "ipc:///x", "m").renew(load=0)   # no exception


def test_rate_limit_is_an_exact_sliding_window(state):
    """Issue 28 finding 10: 20 per 10 s allowed only 14-15 after a quiet window (two fixed windows
    blended). Exact now: after a quiet window the full limit passes, then a refusal, and a slot
    comes back exactly when the oldest request leaves the window; a refund gives its slot back."""
    window = 0.6
    assert all(state.hit_rate_limit("w", 20, window).allowed for _ in range(20))
    refused = state.hit_rate_limit("w", 20, window)
    assert not refused.allowed and 0 < refused.retry_after_s <= window
    assert state.hit_rate_limit("w", 20, window, count=False).allowed is False
    time.sleep(window + 0.05)
    decisions = [state.hit_rate_limit("w", 20, window) for _ in range(21)]
    assert [d.allowed for d in decisions] == [True] * 20 + [False]
    state.refund_rate_limit("w", decisions[0].token)
    assert state.hit_rate_limit("w", 20, window).allowed
    assert not state.hit_rate_limit("w", 20, window).allowed
