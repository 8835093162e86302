"""The hostile clients of the attack soak, one coroutine per class (config.ATTACK_CLASSES).

Each sends its requests and returns their answers (raw_http.Answer); what a class finds wrong
beyond one answer (a request of another key cancelled, an internal endpoint in a response, a rate
limit that lets fewer through than it says) goes in `Attacker.problems`. The sizes are the
audit's (issue 28), so that a class reproduces its finding; `cfg.count` scales only how many.

JUDGES says which answers count as clear: most classes must get a 4xx (a request that should be
refused); those marked "served" may also be served (2xx); any may get the overload 503 of a full
queue or offload pool (the queue is shared, and queue_fanout fills it); all within cfg.answer_s. "hold" classes
keep connections open on purpose: their answers are recorded, and their effect shows in the
normal load.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from pagedserve.loadgen.config import AttackSoakConfig
from pagedserve.loadgen.raw_http import Answer, connect, head, http_client_post, json_headers, post_json, send

# Any class may also get the overload 503 of a full queue or offload pool (clear()).
REFUSE, SERVED, HOLD = "4xx", "4xx or served", "hold"


@dataclass
class Attacker:
    port: int
    model: str
    cfg: AttackSoakConfig
    keys: dict[str, str]                  # class name -> its own API key (so one class's rate limit is its own)
    rng: random.Random
    problems: dict[str, list[str]] = field(default_factory=dict)
    last_burst: float = -1e9              # rate_burst: when the last burst ended (monotonic)

    def key(self, cls: str, role: str = "") -> str:
        return self.keys[cls + (f":{role}" if role else "")]

    def problem(self, cls: str, what: str) -> None:
        self.problems.setdefault(cls, []).append(what)

    def chat(self, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}

    def schema_chat(self, schema: dict) -> dict:
        return self.chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


# ---- the audit's findings (issue 28, 1-10) -------------------------------------------------------

async def tokenize_flood(a: Attacker) -> list[Answer]:
    """1: six concurrent /tokenize of a 100,000-message chat (3.4 MB each), without a key."""
    body = {"model": a.model, "messages": [{"role": "user", "content": "hi"}] * 100_000}
    return list(await asyncio.gather(*(post_json(a.port, "/tokenize", body, timeout_s=30) for _ in range(6))))


async def schema_enum(a: Attacker) -> list[Answer]:
    """2: a json_schema string enum of 100,000 values (~1 MB), with a key."""
    schema = {"type": "string", "enum": [f"value-{i:06d}" for i in range(100_000)]}
    return [await post_json(a.port, "/v1/chat/completions", a.schema_chat(schema), a.key("schema_enum"), 30)]


async def schema_props(a: Attacker) -> list[Answer]:
    """2: an object schema of 20,000 properties."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20_000)}}
    return [await post_json(a.port, "/v1/chat/completions", a.schema_chat(schema), a.key("schema_props"), 30)]


async def schema_cache(a: Attacker) -> list[Answer]:
    """3: many distinct ~220 KB schemas, one after another: the grammar caches grow by each."""
    answers = []
    for _ in range(a.cfg.count(12)):
        tag = a.rng.getrandbits(48)
        schema = {"type": "string", "enum": [f"{tag:x}-{i:05d}" for i in range(11_000)]}
        answers.append(await post_json(a.port, "/v1/chat/completions", a.schema_chat(schema),
                                       a.key("schema_cache"), 30))
    return answers


async def cross_key(a: Attacker) -> list[Answer]:
    """4: key B looks up and cancels a request key A is running with X-Request-Id."""
    rid = f"victim-{a.rng.getrandbits(40):x}"
    victim_key, thief_key = a.key("cross_key", "a"), a.key("cross_key", "b")
    body = json.dumps({"model": a.model, "prompt": "def f(x):", "max_tokens": 600, "ignore_eos": True,
                       "stream": True}).encode()
    reader, writer = await connect(a.port)
    writer.write(head("POST", "/v1/completions", {**json_headers(victim_key), "X-Request-Id": rid}, len(body)) + body)
    await writer.drain()
    await reader.readline()                         # the victim's stream has begun
    answers = [await send(a.port, "GET", f"/v1/requests/{rid}", json_headers(thief_key, None)),
               await send(a.port, "POST", f"/v1/requests/{rid}/cancel", json_headers(thief_key, None), b"")]
    for ans in answers:
        if b"replica_endpoint" in ans.body:
            a.problem("cross_key", "another key's lookup shows replica_endpoint (an internal address)")
    try:
        stream = await asyncio.wait_for(reader.read(), 30)
    except asyncio.TimeoutError:
        stream = b""
    finally:
        writer.close()
    if b'"finish_reason":"abort"' in stream.replace(b" ", b"") or b"[DONE]" not in stream:
        a.problem("cross_key", "key B's cancel ended key A's request (finish_reason abort)")
    # The id again, now by key B: A's record must not answer it (a 409 naming A's id is a leak too).
    answers.append(await send(a.port, "GET", f"/v1/requests/{rid}", json_headers(thief_key, None)))
    return answers


async def content_type(a: Attacker) -> list[Answer]:
    """5: text/plain and no Content-Type, as a cross-origin page can send without a preflight."""
    key = a.key("content_type")
    body = json.dumps({"model": a.model, "prompt": "hi", "max_tokens": 4}).encode()
    tok = json.dumps({"model": a.model, "prompt": "hi"}).encode()
    out = []
    for ctype in ("text/plain", None):
        out.append(await send(a.port, "POST", "/v1/completions", json_headers(key, ctype), body))
        out.append(await send(a.port, "POST", "/tokenize", json_headers(None, ctype), tok))
    return out


async def big_body(a: Attacker) -> list[Answer]:
    """6: a 24 MB body through http.client, with and without a key: the 413 must reach it."""
    body = b'{"model": "x", "prompt": "' + b"a" * (24 << 20) + b'"}'
    calls = [("/v1/completions", json_headers(a.key("big_body"))), ("/v1/completions", json_headers()),
             ("/tokenize", json_headers())]
    return [await asyncio.to_thread(http_client_post, a.port, path, body, h) for path, h in calls]


async def surrogate_model(a: Attacker) -> list[Answer]:
    """7: "model": "\\ud800" (a lone surrogate, valid JSON, not valid Unicode)."""
    body = ('{"model": "\\ud800", "prompt": "hi", "max_tokens": 4}').encode()
    return [await send(a.port, "POST", "/v1/completions", json_headers(a.key("surrogate_model")), body)]


async def empty_grammar(a: Attacker) -> list[Answer]:
    """8: a grammar whose language is empty: every token is refused."""
    body = {"model": a.model, "prompt": "hi", "max_tokens": 32, "n": 4, "temperature": 1.0,
            "structured_outputs": {"grammar": 'root ::= x\nx ::= x "a"'}}
    return [await post_json(a.port, "/v1/completions", body, a.key("empty_grammar"), 30)]


async def queue_fanout(a: Attacker) -> list[Answer]:
    """9: one request of 64 prompts x n=128 against a queue of a few requests. Given up after 5 s
    (the disconnect aborts it), so that a served one does not run for minutes."""
    body = {"model": a.model, "prompt": ["hi"] * 64, "n": 128, "max_tokens": 16, "temperature": 1.0}
    return [await post_json(a.port, "/v1/completions", body, a.key("queue_fanout"), timeout_s=5)]


async def rate_burst(a: Attacker) -> list[Answer]:
    """10: a fresh key's burst of limit + 10 tiny requests: exactly the limit must pass."""
    # A window after the last burst (a round of the long form), so that this one starts fresh.
    await asyncio.sleep(max(0.0, a.last_burst + a.cfg.rate_limit_window + 0.5 - time.monotonic()))
    gate = asyncio.Semaphore(4)             # below the queue limit: 503s would blur what the limiter does

    async def one() -> Answer:
        async with gate:
            return await post_json(a.port, "/v1/completions", {"model": a.model, "prompt": "hi", "max_tokens": 1},
                                   a.key("rate_burst"))
    answers = list(await asyncio.gather(*(one() for _ in range(a.cfg.rate_limit + 10))))
    a.last_burst = time.monotonic()
    allowed = sum(1 for x in answers if x.status == 200)
    # A request refused because another class filled the queue (503) gets its quota back.
    if allowed != min(a.cfg.rate_limit, len(answers) - sum(1 for x in answers if x.status == 503)):
        a.problem("rate_burst", f"{allowed} of a fresh window's {a.cfg.rate_limit} requests allowed")
    return answers


async def wrong_key_flood(a: Attacker) -> list[Answer]:
    """10: many requests with wrong keys, 20 at a time (a 401 must stay cheap; 429s are fine too)."""
    answers: list[Answer] = []
    for _ in range(a.cfg.count(10)):
        answers += await asyncio.gather(*(post_json(a.port, "/v1/completions", {"model": a.model, "prompt": "hi"},
                                                    f"wrong-{a.rng.getrandbits(64):x}") for _ in range(20)))
    return answers


# ---- the HTTP layer itself -------------------------------------------------------------------

async def slowloris(a: Attacker) -> list[Answer]:
    """Connections that trickle their headers (and a body) one byte every 2 s, for 20 s. Recorded:
    whether the server closed them (uvicorn has no header timeout)."""
    async def one(with_body: bool) -> Answer:
        t0 = time.perf_counter()
        reader, writer = await connect(a.port)
        data = head("POST", "/v1/completions", json_headers(a.key("slowloris")), 100 if with_body else None)
        data = data if with_body else data[:-2]     # headers that never end
        try:
            writer.write(data[:-1] if not with_body else data)
            for _ in range(10):
                await asyncio.sleep(2)
                writer.write(b"x" if with_body else b"X-A: b\r\n")
                await writer.drain()
                if reader.at_eof():
                    return Answer("closed", time.perf_counter() - t0)
            return Answer("held", time.perf_counter() - t0)
        except (ConnectionResetError, BrokenPipeError):
            return Answer("reset", time.perf_counter() - t0)
        finally:
            writer.close()
    n = a.cfg.count(30)
    return list(await asyncio.gather(*(one(i % 2 == 1) for i in range(n))))


async def idle_connections(a: Attacker) -> list[Answer]:
    """Many connections that send nothing for 20 s (a keep-alive flood)."""
    async def one() -> Answer:
        t0 = time.perf_counter()
        try:
            reader, writer = await connect(a.port)
        except OSError:
            return Answer("refused", time.perf_counter() - t0)
        try:
            data = await asyncio.wait_for(reader.read(1), 20)
            return Answer("closed" if not data else "data", time.perf_counter() - t0)
        except asyncio.TimeoutError:
            return Answer("held", time.perf_counter() - t0)
        except ConnectionResetError:
            return Answer("reset", time.perf_counter() - t0)
        finally:
            writer.close()
    return list(await asyncio.gather(*(one() for _ in range(a.cfg.count(200)))))


async def nested_json(a: Attacker) -> list[Answer]:
    """JSON nested 100,000 deep (a recursion limit, not a size limit, stops a parser)."""
    key = a.key("nested_json")
    deep = b"[" * 100_000 + b"]" * 100_000
    body = b'{"model": "m", "prompt": "hi", "logit_bias": ' + b"{\"a\": " * 50_000 + b"1" + b"}" * 50_000 + b"}"
    return [await send(a.port, "POST", "/v1/completions", json_headers(key), deep),
            await send(a.port, "POST", "/v1/completions", json_headers(key), body),
            await send(a.port, "POST", "/tokenize", json_headers(), deep)]


async def invalid_utf8(a: Attacker) -> list[Answer]:
    """Bodies that are not UTF-8, in a string and in a key."""
    key = a.key("invalid_utf8")
    return [await send(a.port, "POST", "/v1/completions", json_headers(key),
                       b'{"model": "m", "prompt": "\xff\xfe\xc3", "max_tokens": 4}'),
            await send(a.port, "POST", "/v1/chat/completions", json_headers(key),
                       b'{"model": "m", "\xc0\xaf": 1, "messages": []}'),
            await send(a.port, "POST", "/tokenize", json_headers(), b'{"prompt": "\xed\xa0\x80"}')]


async def huge_headers(a: Attacker) -> list[Answer]:
    """One 1 MB header, and 5,000 small ones."""
    key = a.key("huge_headers")
    return [await send(a.port, "GET", "/v1/models", {**json_headers(key, None), "X-Big": "a" * (1 << 20)}),
            await send(a.port, "GET", "/v1/models", {**json_headers(key, None),
                                                     **{f"X-H{i}": "v" for i in range(5000)}})]


async def disconnects(a: Attacker) -> list[Answer]:
    """Streams whose client leaves after the first bytes (the server must free what they held)."""
    async def one() -> Answer:
        t0 = time.perf_counter()
        body = json.dumps({"model": a.model, "prompt": "def f():", "max_tokens": 200, "ignore_eos": True,
                           "stream": True}).encode()
        reader, writer = await connect(a.port)
        try:
            writer.write(head("POST", "/v1/completions", json_headers(a.key("disconnects")), len(body)) + body)
            line = await asyncio.wait_for(reader.readline(), 10)
            status = int(line.split()[1]) if line else "closed"
            return Answer(status, time.perf_counter() - t0)
        except asyncio.TimeoutError:
            return Answer("timeout", time.perf_counter() - t0)
        finally:
            writer.transport.abort()                # a reset, not a polite close
    return list(await asyncio.gather(*(one() for _ in range(a.cfg.count(6)))))


# ---- the audit after the first fixes ------------------------------------------------------------

async def tiny_containers(a: Attacker) -> list[Answer]:
    """Millions of tiny containers, parsed in one call that holds the GIL (11 s for the first, and
    a router restart, with no key): [[1]] x 2M in /detokenize, [{}] x 200k in a field nobody reads."""
    detok = json.dumps({"tokens": [[1]] * 2_000_000}).encode()
    unknown = json.dumps({"model": a.model, "prompt": "hi", "max_tokens": 1, "x": [{}] * 200_000}).encode()
    key = a.key("tiny_containers")
    return list(await asyncio.gather(
        *(send(a.port, "POST", "/detokenize", json_headers(), detok, 30) for _ in range(3)),
        *(send(a.port, "POST", "/v1/completions", json_headers(key), unknown, 30) for _ in range(3))))


async def late_limits(a: Attacker) -> list[Answer]:
    """Limits that were checked only after the costly work: 65 prompts, 16 prompts each far past
    the context (tokenized in full before the first was refused: 4.7 s), 3M ids to detokenize
    (a 39 MB answer), 100,000 stop_token_ids."""
    key = a.key("late_limits")
    # As UTF-8 (8.3 MB): escaped as JSON's \\uXXXX pairs it would pass the body limit (a 413).
    long_prompts = json.dumps({"model": a.model, "prompt": ["\U0001F600" * 130_000] * 16},
                              ensure_ascii=False).encode()
    return [await post_json(a.port, "/v1/completions", {"model": a.model, "prompt": ["hi"] * 65}, key),
            await send(a.port, "POST", "/v1/completions", json_headers(key), long_prompts, 30),
            await post_json(a.port, "/detokenize", {"tokens": [1] * 3_000_000}, None, 30),
            await post_json(a.port, "/v1/completions", {"model": a.model, "prompt": "hi",
                                                        "stop_token_ids": [1] * 100_000}, key)]


ATTACKS = {f.__name__: f for f in (
    tokenize_flood, schema_enum, schema_props, schema_cache, cross_key, content_type, big_body, surrogate_model,
    empty_grammar, queue_fanout, rate_burst, wrong_key_flood,
    slowloris, idle_connections, nested_json, invalid_utf8, huge_headers, disconnects, tiny_containers, late_limits)}
JUDGES = {"tokenize_flood": SERVED, "schema_enum": SERVED, "schema_props": SERVED, "schema_cache": SERVED,
          "rate_burst": SERVED, "disconnects": SERVED, "huge_headers": SERVED,
          "slowloris": HOLD, "idle_connections": HOLD}
# Keys: one per class (each class's rate limit is its own); cross_key has a victim and a thief.
KEYED = ("schema_enum", "schema_props", "schema_cache", "cross_key:a", "cross_key:b", "content_type", "big_body",
         "surrogate_model", "empty_grammar", "queue_fanout", "rate_burst", "slowloris", "nested_json",
         "invalid_utf8", "huge_headers", "disconnects", "tiny_containers", "late_limits")


def judge(cls: str) -> str:
    return JUDGES.get(cls, REFUSE)


def clear(cls: str, ans: Answer, answer_s: float) -> bool:
    """Whether one answer is what the class's judge asks for, in time."""
    rule = judge(cls)
    if rule == HOLD:
        return True
    if not isinstance(ans.status, int) or ans.latency_s > answer_s:
        return False
    if 400 <= ans.status < 500:
        return True
    # A 503 is the server's overload answer (the shared queue, or the offload pool, full; with
    # Retry-After): clear for any class while another (queue_fanout) holds the queue.
    return (rule == SERVED and 200 <= ans.status < 300) or ans.status == 503
