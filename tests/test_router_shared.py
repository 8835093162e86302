"""Routers sharing state: two routers on one Redis, replicas picked from leases, API keys and limits."""
from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from router_fakes import FakeScheduler, RouterServer
from pagedserve.services import protocol
from pagedserve.services.router.app import create_app
from pagedserve.services.router.service import Config
from pagedserve.services.state import MemoryState, RedisState
from test_state import REDIS_URL, redis_available


@pytest.fixture(scope="module")
def info(tiny_llama):
    from pagedserve.services.router.model_info import load_model_info
    return load_model_info(tiny_llama)


@pytest.fixture
def fake(info):
    script = info.tokenizer("one two three four five six seven", add_special_tokens=False)["input_ids"]
    f = FakeScheduler(script, token_delay_s=0.02)
    f.start()
    yield f
    f.stop()


@pytest.fixture
def shared_redis():
    if not redis_available():
        pytest.skip("no Redis answers at 127.0.0.1:6379")
    prefix = f"test-router-{uuid.uuid4().hex[:10]}:"
    states = []

    def make() -> RedisState:
        states.append(RedisState(REDIS_URL, prefix=prefix))
        return states[-1]
    yield make
    states[0].clear()
    for s in states:
        s.close()


def _router(info, state, router_id, endpoint, **kw):
    cfg = Config(model=info.path, scheduler_endpoint=endpoint, redis_url=REDIS_URL if endpoint is None else None,
                 router_id=router_id, **kw)
    return RouterServer(create_app(cfg, info, state))


def test_a_cancel_through_the_owning_router_ends_its_stream(info, fake, shared_redis):
    """The cancel and the stream on one router: the stream still hears the abort (the cancel used
    to drop the stream's subscription, and the client hung until its timeout)."""
    with _router(info, shared_redis(), "router-a", fake.endpoint) as a, httpx.Client(timeout=10) as http:
        with http.stream("POST", a.url + "/v1/completions",
                         json={"prompt": "x", "max_tokens": 1000, "stream": True}) as r:
            lines = r.iter_lines()
            rid = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])["id"]
            assert http.post(f"{a.url}/v1/requests/{rid}/cancel").json()["status"] == "cancelled"
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert rest[-1]["choices"][0]["finish_reason"] == "abort"


def test_each_submission_has_backend_ids_of_its_own(info, fake, shared_redis):
    """A retry under the id of a request the engine is still tearing down must not share its
    backend id (it got the old request's last token and its abort)."""
    with _router(info, shared_redis(), "router-a", fake.endpoint) as a, httpx.Client(timeout=10) as http:
        for _ in range(2):
            r = http.post(a.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                          headers={"X-Request-Id": "retry-me"})
            assert r.status_code == 200, r.text
        ids = [m.request_id for m in fake.messages(protocol.AddRequest)][-2:]
        assert ids[0] != ids[1] and all(i.startswith("retry-me#") for i in ids)


def test_a_request_made_through_one_router_is_visible_and_cancellable_through_another(info, fake, shared_redis):
    with _router(info, shared_redis(), "router-a", fake.endpoint) as a, \
            _router(info, shared_redis(), "router-b", fake.endpoint) as b, \
            httpx.Client(timeout=10) as http:
        with http.stream("POST", a.url + "/v1/completions",
                         json={"prompt": "x", "max_tokens": 1000, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            rid = json.loads(first[6:])["id"]
            rec = http.get(f"{b.url}/v1/requests/{rid}").json()
            assert rec["status"] == "running" and rec["router_id"] == "router-a"
            assert "replica_endpoint" not in rec and "backend_ids" not in rec    # internal (issue 28)
            cancelled = http.post(f"{b.url}/v1/requests/{rid}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        # The abort came from router b's socket; the scheduler told the owner, whose stream ended.
        [abort] = fake.wait_for(protocol.AbortRequest)
        assert abort.request_id.startswith(rid + "#") and fake.senders(protocol.AbortRequest) == [b"router-b"]
        assert rest[-1]["choices"][0]["finish_reason"] == "abort"
        assert http.get(f"{a.url}/v1/requests/{rid}").json()["status"] == "cancelled"
        # Cancelling again is harmless and sends nothing more.
        assert http.delete(f"{b.url}/v1/requests/{rid}").json()["status"] == "cancelled"
        assert len(fake.messages(protocol.AbortRequest)) == 1


def test_routers_without_an_endpoint_use_live_replicas_until_the_lease_expires(info, fake, shared_redis):
    scheduler_state = shared_redis()
    with _router(info, shared_redis(), "router-r", None, ping_interval_s=0.1) as r, \
            httpx.Client(base_url=r.url, timeout=10) as http:
        r503 = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r503.status_code == 503 and "replica" in r503.json()["error"]["message"]
        assert http.get("/ready").status_code == 503
        scheduler_state.register_replica("replica-0", fake.endpoint, {"load": 0}, ttl_s=0.6)
        ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert http.get("/ready").json()["ready_replicas"] == ["replica-0"]
        assert http.get("/v1/kv").json() == {"replica-0": fake.stats["kv"]}
        time.sleep(0.8)            # no renewal: the lease lapses and the replica drops out
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 503


def test_api_keys_and_rate_limits_when_required(info, fake):
    state = MemoryState()
    state.add_api_key("sk-good", {"name": "t", "rate_limit": 2})
    with _router(info, state, "router-k", fake.endpoint, require_api_key=True, rate_limit_window_s=3600) as r, \
            httpx.Client(base_url=r.url, timeout=10) as http:
        body = {"prompt": "x", "max_tokens": 1}
        before = len(fake.messages(protocol.AddRequest))
        for headers in ({}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "Basic sk-good"}):
            resp = http.post("/v1/completions", json=body, headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == 401
        assert http.get("/v1/models").status_code == 401
        assert http.get("/health").status_code == 200     # probes need no key
        good = {"Authorization": "Bearer sk-good"}
        assert [http.post("/v1/completions", json=body, headers=good).status_code for _ in range(2)] == [200, 200]
        limited = http.post("/v1/completions", json=body, headers=good)
        assert limited.status_code == 429 and limited.json()["error"]["type"] == "rate_limit_error"
        assert int(limited.headers["retry-after"]) >= 1
        assert http.get("/v1/models", headers=good).status_code == 200     # listing does not count
        assert len(fake.messages(protocol.AddRequest)) == before + 2
