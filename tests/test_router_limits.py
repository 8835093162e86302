"""The router's guard rails against a fake scheduler: API keys on every /v1 route, the body limit,
the bounded queue and the per-request timeout (each answered in the OpenAI shape)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from router_fakes import FakeScheduler, RouterServer
from pagedserve.services import protocol
from pagedserve.services.router.app import create_app
from pagedserve.services.router.guard import Guard
from pagedserve.services.router.service import Config
from pagedserve.services.state import MemoryState

BODY = {"prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def info(tiny_llama):
    from pagedserve.services.router.model_info import load_model_info
    return load_model_info(tiny_llama)


@pytest.fixture
def fake(info):
    f = FakeScheduler(info.tokenizer("a b c d e f", add_special_tokens=False)["input_ids"])
    f.start()
    yield f
    f.stop()


def _router(info, fake, state=None, **kw):
    cfg = Config(model=info.path, scheduler_endpoint=fake.endpoint, router_id="router-limits", **kw).validate()
    return RouterServer(create_app(cfg, info, state or MemoryState()))


def _v1_routes(app) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        if getattr(route, "path", "").startswith("/v1"):
            for method in sorted(route.methods - {"HEAD"}):
                out.append((method, route.path.replace("{request_id}", "cmpl-x")))
    return out


def test_every_v1_route_needs_the_key_and_probes_do_not(info, fake):
    with _router(info, fake, api_keys=["sk-one", "sk-two"]) as r, httpx.Client(base_url=r.url, timeout=10) as http:
        routes = _v1_routes(r.app)
        assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")} <= set(routes)
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer sk-three"}, {"Authorization": "sk-one"}):
                resp = http.request(method, path, headers=headers, json={})
                assert resp.status_code == 401, (method, path, headers)
                assert resp.json()["error"]["type"] == "authentication_error"
                # Black-box finding: the guard's errors were spaced JSON; every other is compact.
                assert resp.content == json.dumps(resp.json(), separators=(",", ":")).encode(), resp.content
        for path in ("/health", "/ping", "/version", "/metrics", "/ready"):
            assert http.get(path).status_code in (200, 503), path   # public: never 401
        for key in ("sk-one", "sk-two"):
            ok = http.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200, ok.text
        assert http.get("/v1/models", headers={"Authorization": "Bearer sk-two"}).status_code == 200


def test_rate_limit_per_key_gives_429_with_retry_after(info, fake):
    with _router(info, fake, api_keys=["sk-r"], rate_limit=2, rate_limit_window_s=3600) as r, \
            httpx.Client(base_url=r.url, timeout=10, headers={"Authorization": "Bearer sk-r"}) as http:
        assert [http.post("/v1/completions", json=BODY).status_code for _ in range(2)] == [200, 200]
        limited = http.post("/v1/completions", json=BODY)
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        assert limited.json()["error"]["type"] == "rate_limit_error"
        assert http.get("/v1/models").status_code == 200        # listing models does not count


def test_key_comparison_checks_every_key():
    """Constant time: a match on the first key and on the last cost the same comparisons."""
    compared = []
    import pagedserve.services.router.guard as guard_module

    class Counting:
        @staticmethod
        def compare_digest(a, b):
            compared.append(a)
            return a == b
    real = guard_module.hmac
    guard_module.hmac = Counting
    try:
        cfg = Config(model="m", api_keys=["a", "b", "c"])
        g = Guard(None, cfg, MemoryState())
        for key in ("a", "c", "nope"):
            compared.clear()
            g._check(key)
            assert len(compared) == 3
    finally:
        guard_module.hmac = real


def test_a_body_over_the_limit_is_413_before_parsing(info, fake):
    with _router(info, fake, max_request_body_mb=0.01) as r, httpx.Client(base_url=r.url, timeout=10) as http:
        big = b'{"prompt": "' + b"x" * 20000 + b'"}'
        resp = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert resp.status_code == 413 and resp.json()["error"]["code"] == 413

        def chunks():                       # no Content-Length: a chunked body, counted as it comes
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * 2000
            yield b'"}'
        resp = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert resp.status_code == 413
        small = http.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}',
                          headers={"Content-Type": "application/json"})
        assert small.status_code == 200
    assert not fake.messages(protocol.AddRequest)[1:]     # only the small one reached the scheduler


def _hold(url: str, results: list, body=None) -> threading.Thread:
    def run():
        try:
            with httpx.Client(timeout=20) as http:
                results.append(http.post(url + "/v1/completions", json=body or BODY))
        except httpx.HTTPError as e:
            results.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_bounded_queue_refuses_with_503_and_retry_after(info, fake):
    fake.silent = True                     # requests wait for a first token that does not come
    with _router(info, fake, max_queued_requests=2, request_timeout_s=3.0) as r, \
            httpx.Client(base_url=r.url, timeout=10) as http:
        held: list = []
        threads = [_hold(r.url, held) for _ in range(2)]
        fake.wait_for(protocol.AddRequest, 2)
        refused = http.post("/v1/completions", json=BODY)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "max-queued-requests" in refused.json()["error"]["message"]
        assert len(fake.messages(protocol.AddRequest)) == 2          # refused before it was sent
        fake.silent = False
        for t in threads:
            t.join(10)
        assert http.post("/v1/completions", json=BODY).status_code == 200   # room again


def test_queued_tokens_limit(info, fake):
    fake.silent = True
    prompt = "a b c d e f g h"
    n = len(info.tokenizer(prompt)["input_ids"])
    with _router(info, fake, max_queued_tokens=n + 1, request_timeout_s=3.0) as r, \
            httpx.Client(base_url=r.url, timeout=10) as http:
        held: list = []
        t = _hold(r.url, held, {"prompt": prompt, "max_tokens": 2})
        fake.wait_for(protocol.AddRequest, 1)
        refused = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert refused.status_code == 503 and "max-queued-tokens" in refused.json()["error"]["message"]
        fake.silent = False
        t.join(10)
        assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200


def _sample(http, name: str, **labels) -> float:
    """One sample of the router's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_request_timeout_aborts_and_answers_504(info, fake):
    fake.token_delay_s = 0.2               # slow tokens: 50 of them take 10 s
    with _router(info, fake, request_timeout_s=0.8) as r, httpx.Client(base_url=r.url, timeout=10) as http:
        aborts = _sample(http, "vllm:request_success_total", finished_reason="abort")
        t0 = time.monotonic()
        resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 50})
        assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout_error"
        assert time.monotonic() - t0 < 3
        # Black-box finding: counted as a 504 error but not as vLLM's aborted request, which a
        # client that disconnects is (the engine aborts both alike).
        assert _sample(http, "vllm:request_success_total", finished_reason="abort") == aborts + 1
        assert _sample(http, "pagedserve:request_errors_total", status="504") >= 1
        added = fake.messages(protocol.AddRequest)[-1]
        aborted = fake.wait_for(protocol.AbortRequest)
        assert aborted[-1].request_id == added.request_id
        # A stream that has started ends with an SSE error event, then [DONE].
        with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert '"code":504' in lines[-2].replace(" ", "") and lines[-1] == "data: [DONE]"


def test_request_timeout_counts_the_constraints_compile(info, fake):
    """The timer used to start after the compile: a 5 s compile under --request-timeout 3 ended
    after 8 s. The compile goes on for the cache (shielded): the next request finds it done."""
    from pagedserve.services.guided.cache import CompileCache

    class SlowBackend:
        def compile(self, constraint):
            time.sleep(2.0)
            return "compiled"

    with _router(info, fake, request_timeout_s=0.8) as r, httpx.Client(base_url=r.url, timeout=10) as http:
        r.ctx.grammar_cache = CompileCache(lambda name: SlowBackend())
        r.ctx.compiler.ready().result(timeout=120)    # the compile process is up: only the compile is timed
        body = {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "a+"}}
        t0 = time.monotonic()
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 504 and "--request-timeout" in resp.json()["error"]["message"]
        assert time.monotonic() - t0 < 1.8
        time.sleep(1.5)
        assert http.post("/v1/completions", json=body).status_code == 200


def test_a_running_non_streamed_request_leaves_the_queue(info, fake):
    """A buffered request (not streamed, no stop strings) gives its queue place back at its
    first token, as a streamed one does: it runs, it no longer waits (the audit found long
    non-streamed requests refusing every new one with 503)."""
    fake.token_delay_s = 0.05                # 40 tokens: about 2 s of running
    with _router(info, fake, max_queued_requests=1, request_timeout_s=20.0) as r, \
            httpx.Client(base_url=r.url, timeout=20) as http:
        held: list = []
        t = _hold(r.url, held, {"prompt": "x", "max_tokens": 40})
        fake.wait_for(protocol.AddRequest, 1)
        time.sleep(0.5)                      # its first tokens are out
        assert http.post("/v1/completions", json={"prompt": "y", "max_tokens": 2}).status_code == 200
        t.join(20)
        assert held and held[0].status_code == 200
