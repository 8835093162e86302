"""Issue 28, the router's part: no single request takes the service down. Each test names the
audit's finding it covers; each failed before the change that made it pass. In-process routers
(tests/router_fakes.py) in front of a fake scheduler."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import httpx
import pytest

from pagedserve.services import protocol
# The model, the fake scheduler and a router in front of it: test_router_limits's fixtures.
from test_router_limits import _router, fake, info  # noqa: F401

BODY = {"prompt": "hello", "max_tokens": 2}
JSON = {"Content-Type": "application/json"}


# ---- 1: heavy bodies run off the event loop, limits before any work ------------------------------

def _chat_body(messages: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hello there"}] * messages}).encode()


def _health_while(url: str, posts: list[tuple[str, bytes]]) -> tuple[float, list]:
    """The slowest /health answer while the posts run concurrently, and the posts' answers."""
    answers: list = []

    def post(path, body):
        with httpx.Client(base_url=url, timeout=60) as http:
            t0 = time.monotonic()
            r = http.post(path, content=body, headers=JSON)
            answers.append((r.status_code, time.monotonic() - t0))
    threads = [threading.Thread(target=post, args=p, daemon=True) for p in posts]
    for t in threads:
        t.start()
    worst = 0.0
    with httpx.Client(base_url=url, timeout=30) as http:
        while any(t.is_alive() for t in threads):
            t0 = time.monotonic()
            assert http.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.02)
    return worst, answers


def test_six_huge_chat_bodies_do_not_stall_health(info, fake):
    """Finding 1: six concurrent /tokenize bodies of 100,000 messages (3.4 MB each) stalled the
    event loop for seconds. Now each is a fast 400 (too many messages, counted before any
    validation or rendering), parsed off the loop, and /health answers meanwhile."""
    huge = _chat_body(100_000)
    assert len(huge) > 3_000_000
    with _router(info, fake) as r:
        worst, answers = _health_while(r.url, [("/tokenize", huge)] * 6)
        assert worst < 1.0, worst
        assert sorted(s for s, _ in answers) == [400] * 6
        assert max(t for _, t in answers) < 5.0
        with httpx.Client(base_url=r.url, timeout=30) as http:
            resp = http.post("/tokenize", content=huge, headers=JSON)
            # 100,000 messages and the list and the body: 100,002 containers, refused by the count of containers, before the shape.
            assert "100002 JSON arrays and objects; at most 65536" in resp.json()["error"]["message"]
            resp = http.post("/tokenize", content=_chat_body(5000), headers=JSON)
            assert resp.json()["error"]["param"] == "messages" and "5000" in resp.json()["error"]["message"]


# The audit after the first fixes: bodies of millions of tiny containers, each parsed and validated
# in one C call holding the GIL (11 s for the first), restarted the router with no key needed.
TINY_CONTAINERS = [
    ("/detokenize", {"tokens": [[1]] * 2_000_000}),                          # 10 MB
    ("/v1/completions", {"prompt": "hi", "unknown": [{}] * 200_000}),         # a field nobody reads
    ("/v1/completions", {"prompt": [["a"]] * 100_000}),                      # a union's every member failed per item
    ("/detokenize", {"tokens": [1] * 3_000_000}),                            # 3M values, a 39 MB answer
]


def test_bodies_of_millions_of_tiny_containers_are_refused_from_their_bytes(info, fake):
    bodies = [(path, json.dumps(b).encode()) for path, b in TINY_CONTAINERS]
    with _router(info, fake) as r:
        worst, answers = _health_while(r.url, bodies * 2)
        assert worst < 0.5, worst
        assert [s for s, _ in answers] == [400] * len(bodies) * 2
        assert max(t for _, t in answers) < 1.0, answers
        with httpx.Client(base_url=r.url, timeout=30) as http:
            messages = [http.post(path, content=body, headers=JSON).json()["error"]["message"] for path, body in bodies]
    assert "2000002 JSON arrays and objects; at most 65536" in messages[0]
    assert "200002 JSON arrays and objects" in messages[1]
    assert "100002 JSON arrays and objects" in messages[2]
    assert "3000001 JSON values; at most 1048576" in messages[3]


def test_json_counts_skip_what_strings_hold():
    """The close count ignores brackets and commas inside strings, escaped quotes included; the
    bound from raw bytes is used only under the threshold."""
    from pagedserve.services.router.openai_schema import json_counts
    text = 'a, [b] {c}, \\"quoted, [x]\\" \\\\'                     # escapes: \\" and \\\\ in the JSON
    raw = json.dumps({"prompt": text * 2000, "stop": ["a", "b"], "n": [[1], {}]}).encode()
    assert raw.count(b",") > 4096                    # over the threshold (_PRECISE_FROM): counted closely
    # Containers: the body, stop, n, [1], {}. Commas: 2 between the fields, 1 in stop, 1 in n.
    assert json_counts(raw) == (5 + 4, 5)
    small = b'{"a": [1, 2, {"b": "[,]"}]}'
    assert json_counts(small) == (4 + 3, 4)          # under the threshold: the raw bound, strings counted


def test_limits_that_used_to_wait_for_costly_work(info, fake):
    """Audit after the first fixes, finding 2: a batch of too many prompts was refused after it was
    parsed and validated; 16 prompts too long for the context after all 16 were tokenized (4.7 s);
    stop_token_ids had no bound."""
    # Each emoji several tokens, far past the context, under the byte bound: it must be tokenized.
    too_long = "\U0001F600" * (info.max_prompt_bytes // 5)
    with _router(info, fake) as r, httpx.Client(base_url=r.url, timeout=30) as http:
        t0 = time.monotonic()
        resp = http.post("/v1/completions", json={"prompt": [too_long] * 16, "max_tokens": 1})
        assert resp.status_code == 400 and "maximum context length" in resp.json()["error"]["message"]
        assert time.monotonic() - t0 < 1.0
        resp = http.post("/v1/completions", json={"prompt": ["hi"] * 65, "max_tokens": 1})
        assert resp.status_code == 400 and resp.json()["error"]["message"] == "at most 64 prompts per request, got 65"
        assert resp.json()["error"]["param"] == "prompt"
        tokens = http.post("/tokenize", json={"prompt": "hi there"}).json()["tokens"]
        resp = http.post("/v1/completions", json={"prompt": tokens * 3, "max_tokens": 1})   # one prompt of ids
        assert resp.status_code == 200, resp.text
        resp = http.post("/v1/completions", json={"prompt": "hi", "stop_token_ids": [1] * 1025})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop_token_ids"
        assert http.post("/v1/completions", json={"prompt": "hi", "stop_token_ids": [1] * 1024}).status_code == 200


def test_large_bodies_within_the_limits_are_served_off_the_loop(info, fake):
    """Bodies under the limits still cost time to validate, render and tokenize: done in the pool."""
    with _router(info, fake, max_chat_messages=100_000) as r:
        worst, answers = _health_while(r.url, [("/tokenize", _chat_body(20_000))] * 3)
        assert worst < 1.0, worst
        assert {s for s, _ in answers} <= {200, 400, 503}, answers


def test_a_full_offload_pool_answers_503(info, fake):
    with _router(info, fake, offload_queue=0) as r:
        gate = threading.Event()
        r.ctx.offload.pool.submit(gate.wait, 10)      # the only thread is busy
        r.ctx.offload.pending += 1
        try:
            with httpx.Client(base_url=r.url, timeout=10) as http:
                big = {"prompt": "x " * 10000, "max_tokens": 1}
                resp = http.post("/v1/completions", json=big)
                assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
                assert "--offload-queue" in resp.json()["error"]["message"]
                assert http.post("/v1/completions", json=BODY).status_code == 200   # small: inline
        finally:
            gate.set()


def test_a_large_answer_is_built_off_the_loop_and_never_refused(info, fake):
    """n choices x top logprobs grows the answer's JSON as fast as any body: built in the pool,
    and queued even when the pool is full (the generation it answers has been paid for)."""
    with _router(info, fake, offload_queue=0) as r, httpx.Client(base_url=r.url, timeout=30) as http:
        jobs = []
        submit = r.ctx.offload.pool.submit
        r.ctx.offload.pool.submit = lambda fn, *a: jobs.append(fn) or submit(fn, *a)
        r.ctx.offload.pending += 1       # as if a body filled the pool's one place
        resp = http.post("/v1/completions", json={"prompt": "x", "n": 64, "max_tokens": 40, "logprobs": 5})
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"]) == 64 and len(jobs) == 1
        r.ctx.offload.pending -= 1
        assert http.post("/v1/completions", json=BODY).status_code == 200 and len(jobs) == 1   # small: inline


# ---- 5: JSON-only bodies --------------------------------------------------------------------------

NOT_JSON = [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]


def test_a_post_that_is_not_json_is_415(info, fake):
    """Finding 5: text/plain and missing Content-Type were accepted, so a web page could POST
    cross-origin without a CORS preflight."""
    bodies = {"/v1/completions": {"prompt": "hi", "max_tokens": 1}, "/tokenize": {"prompt": "hi"},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
              "/detokenize": {"tokens": [1]}}
    with _router(info, fake) as r, httpx.Client(base_url=r.url, timeout=10) as http:
        for path, fields in bodies.items():
            body = json.dumps(fields).encode()
            for content_type in NOT_JSON:
                headers = {"Content-Type": content_type} if content_type else {}
                resp = http.post(path, content=body, headers=headers)
                assert resp.status_code == 415, (path, content_type, resp.text)
                err = resp.json()["error"]
                assert err["code"] == 415 and err["type"] == "invalid_request_error"
                assert err["param"] == "Content-Type"
            for json_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
                ok = http.post(path, content=body, headers={"Content-Type": json_type})
                assert ok.status_code == 200, (path, json_type, ok.text)
    assert len(fake.messages(protocol.AddRequest)) == 4     # only the JSON /v1 posts ran (+json too, as FastAPI and vLLM)


# ---- 6: a 413 (and a 401) every client can read -------------------------------------------------

def _post_with_http_client(port: int, body: bytes, headers: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={**JSON, **headers})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_a_too_large_body_gets_a_413_that_http_client_can_read(info, fake):
    """Finding 6: a 24 MB body (limit 16 MB) met a connection reset 8 times of 8 with http.client:
    the 413 went out with Connection: close while the body was still coming. Now the body is
    drained (within a bound) first; a 401 with a large body is read the same way."""
    big = b'{"prompt": "' + b"x" * (24 << 20) + b'"}'
    with _router(info, fake, api_keys=["sk-k"]) as r:
        for _ in range(3):
            status, body = _post_with_http_client(r.port, big, {"Authorization": "Bearer sk-k"})
            assert status == 413 and body["error"]["code"] == 413
        status, body = _post_with_http_client(r.port, big[: 8 << 20], {})
        assert status == 401 and body["error"]["type"] == "authentication_error"


def test_without_a_key_a_huge_body_is_not_read(info, fake):
    """Finding 6: without a key the server read the whole body (to keep the connection) after its
    401. Now past the drain bound the 401 comes with Connection: close and the reading stops."""
    total, chunk = 512 << 20, b"x" * (1 << 20)
    with _router(info, fake, api_keys=["sk-k"]) as r, socket.create_connection(("127.0.0.1", r.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % total)
        answer = bytearray()

        def read():
            try:
                while data := sock.recv(65536):
                    answer.extend(data)
            except OSError:
                pass
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        sent = 0
        try:
            while sent < total:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:           # the server closed the connection: it reads no more
            pass
        reader.join(10)
        assert answer.startswith(b"HTTP/1.1 401"), bytes(answer[:200])
        assert b"connection: close" in answer.lower()
        assert sent < total // 2, sent


def test_a_client_that_leaves_mid_body_is_no_server_error(info, fake, caplog):
    """A black-box attack (2026-12-07): a client that sent its headers and part of its body, then
    closed, was logged as an unhandled error with a traceback and counted as a 500. It is a 499
    now (nginx's code for a client that left), with no error logged, and the router serves on."""
    body = json.dumps(BODY).encode()
    with _router(info, fake) as r, httpx.Client(base_url=r.url, timeout=10) as http:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", r.port)) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body[:20])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and 'status="499"' not in http.get("/metrics").text:
            time.sleep(0.05)
        errors = {line.split('status="')[1].split('"')[0]: float(line.split()[-1])
                  for line in http.get("/metrics").text.splitlines()
                  if line.startswith("pagedserve:request_errors_total{")}
        assert errors.get("499") == 3 and "500" not in errors, errors
        assert http.post("/v1/completions", json=BODY).status_code == 200
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"], [rec.getMessage() for rec in caplog.records]


# ---- 7: lone surrogates ---------------------------------------------------------------------------

SURROGATES = [
    {"model": "\ud800", "prompt": "x"},
    {"prompt": "x", "user": "\udfff"},
    {"prompt": "x", "stop": ["a\ud800"]},
    {"prompt": "x", "logit_bias": {"\ud800": 1}},
    {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"\udc00": 1}}}},
]


def test_a_lone_surrogate_anywhere_is_a_400(info, fake):
    """Finding 7: "model": "\\ud800" was a 500 with a traceback in the log."""
    with _router(info, fake) as r, httpx.Client(base_url=r.url, timeout=10) as http:
        for body in SURROGATES:
            resp = http.post("/v1/completions", content=json.dumps(body), headers=JSON)
            assert resp.status_code == 400, (body, resp.text)
            assert "surrogate" in resp.json()["error"]["message"]
        # A paired surrogate is a character like any other.
        fine = http.post("/v1/completions", content=json.dumps({"prompt": "\ud83d\ude00", "max_tokens": 1}),
                         headers=JSON)
        assert fine.status_code == 200, fine.text


# ---- 4: requests belong to the key that made them -------------------------------------------------

def test_another_key_cannot_see_cancel_or_take_a_request_id(info, fake):
    """Finding 4: key B could GET and cancel key A's request (read its replica_endpoint too) and
    reuse its id. Now B meets a 404, as for an unknown id, and its own request of that id is its own."""
    fake.token_delay_s = 0.05                  # A's request runs long enough to be looked at
    a, b = {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk-b"}
    with _router(info, fake, api_keys=["sk-a", "sk-b"]) as r, httpx.Client(base_url=r.url, timeout=20) as http:
        body = {"prompt": "x", "max_tokens": 200, "stream": True}
        with http.stream("POST", "/v1/completions", json=body, headers={**a, "X-Request-Id": "mine"}) as s:
            lines = s.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            for method, path in (("GET", "/v1/requests/mine"), ("POST", "/v1/requests/mine/cancel"),
                                 ("DELETE", "/v1/requests/mine")):
                resp = http.request(method, path, headers=b)
                assert resp.status_code == 404, (method, resp.text)
                assert resp.json()["error"]["type"] == "not_found_error"
            # B's request of the same id is its own (no 409 that would tell B the id is taken).
            mine_too = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                 headers={**b, "X-Request-Id": "mine"})
            assert mine_too.status_code == 200, mine_too.text
            assert http.get("/v1/requests/mine", headers=b).json()["status"] == "finished"
            record = http.get("/v1/requests/mine", headers=a).json()
            assert record["status"] == "running" and record["request_id"] == "mine"
            assert not {"replica_endpoint", "backend_ids"} & set(record), record
            assert "tcp://" not in json.dumps(record)
            cancelled = http.post("/v1/requests/mine/cancel", headers=a)
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
            assert "tcp://" not in cancelled.text
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert rest[-1]["choices"][0]["finish_reason"] == "abort"


# ---- 9: the queue counts sequences ---------------------------------------------------------------

def test_the_queue_limit_counts_sequences_not_requests(info, fake):
    """Finding 9: one request of 64 prompts x n=128 put 62 engine requests in the queue past a
    limit of 4. Now a request holds prompts x n places (best_of's and the beam's width too)."""
    fake.silent = True                     # nothing starts: what is admitted stays queued
    with _router(info, fake, max_queued_requests=4, request_timeout_s=3.0) as r, \
            httpx.Client(base_url=r.url, timeout=10) as http:
        held: list = []
        hold = threading.Thread(target=lambda: held.append(http.post(
            "/v1/completions", json={"prompt": ["a", "b"], "n": 1, "best_of": 1, "max_tokens": 2})), daemon=True)
        hold.start()
        fake.wait_for(protocol.AddRequest, 2)                       # 2 sequences queued
        refused = http.post("/v1/completions", json={"prompt": "x", "n": 3, "max_tokens": 2})
        assert refused.status_code == 503 and "max-queued-requests" in refused.json()["error"]["message"]
        best_of = http.post("/v1/completions", json={"prompt": "x", "best_of": 3, "max_tokens": 2})
        assert best_of.status_code == 503
        never = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
        assert never.status_code == 400 and never.json()["error"]["param"] == "n"
        assert len(fake.messages(protocol.AddRequest)) == 2
        hold.join(10)
        assert r.ctx.admission.sequences == 0 and r.ctx.admission.tokens == 0


# ---- 10: rate limits that count what they claim ---------------------------------------------------

def test_the_rate_limit_allows_its_full_count_after_a_quiet_window(info, fake):
    """Finding 10: 20 per 10 s allowed only 14-15 after a quiet window."""
    with _router(info, fake, api_keys=["sk-r"], rate_limit=20, rate_limit_window_s=1.5) as r, \
            httpx.Client(base_url=r.url, timeout=10, headers={"Authorization": "Bearer sk-r"}) as http:
        for _ in range(2):
            codes = [http.post("/v1/completions", json=BODY).status_code for _ in range(21)]
            assert codes == [200] * 20 + [429], codes
            time.sleep(1.6)


def test_requests_refused_as_invalid_do_not_use_the_rate_limit(info, fake):
    """Finding 10: 400s counted against the limit."""
    with _router(info, fake, api_keys=["sk-r"], rate_limit=2, rate_limit_window_s=3600) as r, \
            httpx.Client(base_url=r.url, timeout=10, headers={"Authorization": "Bearer sk-r"}) as http:
        for bad in ({"prompt": "x", "n": 0}, {"prompt": 5}, {"model": "nope", "prompt": "x"}):
            assert http.post("/v1/completions", json=bad).status_code in (400, 404)
        assert http.post("/v1/completions", content=b"{}", headers={"Content-Type": "text/plain"}).status_code == 415
        assert [http.post("/v1/completions", json=BODY).status_code for _ in range(3)] == [200, 200, 429]


def test_wrong_keys_are_throttled_per_client_address(info, fake):
    """Finding 10: a wrong key was never throttled. Past the limit the address gets 429 before its
    key is checked, the right key included (a guesser cannot tell a hit)."""
    with _router(info, fake, api_keys=["sk-right"], auth_failure_limit=3, rate_limit_window_s=1.0) as r, \
            httpx.Client(base_url=r.url, timeout=10) as http:
        right = {"Authorization": "Bearer sk-right"}
        assert http.post("/v1/completions", json=BODY, headers=right).status_code == 200   # not counted
        for guess in ("sk-1", "sk-2"):
            wrong = {"Authorization": f"Bearer {guess}"}
            assert http.post("/v1/completions", json=BODY, headers=wrong).status_code == 401
        assert http.get("/v1/models").status_code == 401            # a missing key counts too
        for headers in ({"Authorization": "Bearer sk-3"}, right):
            resp = http.post("/v1/completions", json=BODY, headers=headers)
            assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1, resp.text
            assert resp.json()["error"]["type"] == "rate_limit_error"
        assert http.get("/health").status_code == 200               # probes are not behind keys
        time.sleep(1.1)
        assert http.post("/v1/completions", json=BODY, headers=right).status_code == 200


# ---- caches bounded in bytes, with their sizes in /metrics ----------------------------------------

def test_token_text_caches_are_bounded_in_bytes(info):
    from pagedserve.services.router.detokenizer import TokenTexts, fast_decoder
    texts = TokenTexts(fast_decoder(info.tokenizer), info.tokenizer, max_bytes=16384)
    for token_id in range(info.vocab_size):
        assert texts.text(token_id) == texts.text(token_id)        # a hit gives what a miss made
        texts.bytes(token_id)
    for cache in (texts.text, texts.bytes):
        assert 0 < cache.bytes <= 8192 and 0 < len(cache) < info.vocab_size


def test_cache_sizes_and_the_offload_pool_are_in_the_metrics(info, fake):
    with _router(info, fake, token_text_cache_mb=0.01) as r, httpx.Client(base_url=r.url, timeout=10) as http:
        assert http.post("/v1/completions", json={**BODY, "logprobs": 3}).status_code == 200
        lines = http.get("/metrics").text.splitlines()
    sizes = {line.split('cache="')[1].split('"')[0]: float(line.split()[-1])
             for line in lines if line.startswith("pagedserve:router_cache_bytes{")}
    assert set(sizes) == {"token_texts", "token_bytes"} and 0 < sizes["token_texts"] <= 0.005 * (1 << 20)
    assert any(line.startswith("pagedserve:router_cache_entries{") for line in lines)
    assert any(line.startswith("pagedserve:router_offload_pending{") for line in lines)


def test_list_lengths_are_read_before_the_body_is_parsed():
    """A 100,000-message body is refused from its shape alone (msgspec, ~12 ms), not after json.loads
    (~70 ms holding the GIL); bodies whose shape does not fit, or nest past msgspec's depth, fall
    through to the full parse and its named 400s."""
    from pagedserve.services.router import openai_schema
    from pagedserve.services.router.errors import APIError

    def refusal(raw: bytes) -> str:
        with pytest.raises(APIError) as e:
            openai_schema.parse_body(raw, openai_schema.TokenizeRequest,
                                     openai_schema.BodyLimits(lists={"messages": 4096}))
        return e.value.body()["error"]["message"]

    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}] * 60_000}).encode()
    t0 = time.perf_counter()
    assert refusal(big) == "messages holds 60000 items; at most 4096 are accepted"
    fast = time.perf_counter() - t0
    t0 = time.perf_counter()
    json.loads(big)
    assert fast < time.perf_counter() - t0          # cheaper than parsing it at all
    assert "valid list" in refusal(b'{"messages": "x"}')
    assert "not valid JSON" in refusal(b"not json")
    assert "nested more than" in refusal(b'{"prompt": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}")
    assert "nested more than" in refusal(b"[" * 60_000 + b"]" * 60_000)
    for not_an_object in (b"null", b"[]", b"3", b'"x"'):
        assert refusal(not_an_object) == "The request body must be a JSON object"
