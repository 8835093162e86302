"""Stream semantics as vLLM's (issue 15 part 4): one SSE chunk per token, a token whose text is not
out yet included (""), --stream-interval N as vLLM paces it, and the merging of a router that fell
behind a stream, counted. Real HTTP against a real stack (launcher, kvstore, worker, scheduler,
router on the tiny model), and against a router with a fake scheduler for the router-side flag."""
from __future__ import annotations

import json
import math

import httpx
import pytest

from pagedserve.loadgen.stack import Stack
from router_fakes import FakeScheduler, RouterServer
from pagedserve.services.router.app import create_app
from pagedserve.services.router.choices import ChoiceEvent
from pagedserve.services.router.pacing import StreamPacer, merge_by_choice
from pagedserve.services.router.service import Config
from pagedserve.services.state import MemoryState

# Byte-level BPE pieces of "€" (E2 82 AC), lifted so that the greedy output holds tokens that are
# part of a character: their text is "" until the character completes (if it ever does).
EURO_BYTES = {"165": 8.0, "231": 8.0, "112": 8.0}
N_TOKENS = 24


@pytest.fixture(scope="module")
def stack(tiny_llama):
    s = Stack(tiny_llama, "--num-device-blocks", "256")
    # This tiny model, its steps planned ahead, draws 24 tokens in ~40 ms; a router's first stream
    # waited tens of ms for its first chunk (what it imports on first use), so its tokens queued
    # and the router, behind, merged them, as it should. The tests below are of a router that keeps
    # up, so one stream goes first.
    with httpx.Client(base_url=s.url, timeout=120) as http:
        sse(http, "/v1/completions", {"prompt": "warm", "max_tokens": 2})
    yield s
    s.stop()


def sse(http, path: str, body: dict) -> list:
    """POST a stream -> its data events, decoded ("[DONE]" kept as the string)."""
    out = []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: "), line
                out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def content(events: list, index: int = 0) -> list[dict]:
    """The choice's chunks that answer for tokens: every chunk of it but the chat role chunk."""
    return [ch for e in events if isinstance(e, dict) for ch in e.get("choices", [])
            if ch["index"] == index and "role" not in ch.get("delta", {})]


BODY = {"prompt": "Hello wörld", "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True,
        "logit_bias": EURO_BYTES}


def test_one_chunk_per_token_including_tokens_without_text(stack, tiny_llama):
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        whole = http.post("/v1/completions", json={**BODY, "return_token_ids": True}).json()
        # Plain: no token ids or logprobs asked, which used to be the case that skipped "" chunks.
        events = sse(http, "/v1/completions", {**BODY, "stream_options": {"include_usage": True}})
        with_ids = content(sse(http, "/v1/completions", {**BODY, "return_token_ids": True}))
    chunks = content(events)
    assert len(chunks) == N_TOKENS == whole["usage"]["completion_tokens"]
    assert [c["token_ids"] for c in with_ids] == [[t] for t in whole["choices"][0]["token_ids"]]
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["text"] for c in chunks] == [c["text"] for c in with_ids]
    assert any(c["text"] == "" for c in chunks[:-1]), "the output holds no token without text: no test"
    # The finish rides on the last token's chunk; then the usage chunk (no choices), then [DONE].
    assert [c["finish_reason"] for c in chunks] == [None] * (N_TOKENS - 1) + ["length"]
    usage = events[-2]
    assert events[-1] == "[DONE]" and usage["choices"] == [] and usage["object"] == "text_completion"
    assert usage["usage"] == whole["usage"] and usage["model"] == tiny_llama


def test_chat_streams_a_role_chunk_then_a_chunk_per_token(stack):
    body = {"messages": [{"role": "user", "content": "Hello wörld"}], "max_tokens": N_TOKENS, "temperature": 0,
            "ignore_eos": True, "logit_bias": EURO_BYTES, "stream_options": {"include_usage": True,
                                                                           "continuous_usage_stats": True}}
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        events = sse(http, "/v1/chat/completions", body)
    first = events[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""} and first["finish_reason"] is None
    chunks = [e for e in events[1:-2]]
    assert len(chunks) == N_TOKENS
    assert any(e["choices"][0]["delta"]["content"] == "" for e in chunks[:-1])
    # continuous usage counts the tokens up to each chunk: one more each time.
    assert [e["usage"]["completion_tokens"] for e in chunks] == list(range(1, N_TOKENS + 1))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == N_TOKENS


def test_n2_streams_a_chunk_per_token_per_choice(stack):
    body = {**BODY, "n": 2, "temperature": 0.8, "seed": 3}
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        events = sse(http, "/v1/completions", body)
    for index in (0, 1):
        chunks = content(events, index)
        assert len(chunks) == N_TOKENS, index
        assert [c["finish_reason"] for c in chunks] == [None] * (N_TOKENS - 1) + ["length"]


def paced(tokens: int, interval: int) -> list[int]:
    """vLLM's pacing: the first token at once, then every `interval` tokens, the rest at the end."""
    rest = tokens - 1
    return [1] + [interval] * (rest // interval) + ([rest % interval] if rest % interval else [])


def test_a_request_stream_interval_paces_as_vllm(stack):
    with httpx.Client(base_url=stack.url, timeout=120) as http:
        whole = http.post("/v1/completions", json={**BODY, "return_token_ids": True}).json()
        events = sse(http, "/v1/completions", {**BODY, "stream_interval": 4, "return_token_ids": True})
    chunks = content(events)
    assert [len(c["token_ids"]) for c in chunks] == paced(N_TOKENS, 4) == [1, 4, 4, 4, 4, 4, 3]
    assert len(chunks) == 1 + math.ceil((N_TOKENS - 1) / 4)
    assert sum((c["token_ids"] for c in chunks), []) == whole["choices"][0]["token_ids"]
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["finish_reason"] for c in chunks][-1] == "length"


def test_a_quiet_server_merges_nothing(stack):
    def merged(http) -> float:
        line = [x for x in http.get("/metrics").text.splitlines()
                if x.startswith("pagedserve:stream_merged_tokens_total")]
        assert line, "no merged-tokens counter"
        return float(line[0].split()[-1])

    with httpx.Client(base_url=stack.url, timeout=30) as http:
        before = merged(http)
        assert len(content(sse(http, "/v1/completions", BODY))) == N_TOKENS
        assert merged(http) == before


# ---- the router's own flag, and the merging of a router behind its stream ------------------------

@pytest.fixture(scope="module")
def info(tiny_llama):
    from pagedserve.services.router.model_info import load_model_info
    return load_model_info(tiny_llama)


@pytest.fixture(scope="module")
def fake(info):
    f = FakeScheduler(info.tokenizer("Hello wörld € and the quick brown fox. ", add_special_tokens=False)["input_ids"])
    f.start()
    yield f
    f.stop()


def router(info, fake, **kw):
    cfg = Config(model=info.path, scheduler_endpoint=fake.endpoint, router_id="router-pace", **kw).validate()
    return RouterServer(create_app(cfg, info, MemoryState()))


@pytest.mark.parametrize("tokens", [1, 4, 5, 9, 23])
def test_the_stream_interval_flag_paces_every_choice(info, fake, tokens):
    with router(info, fake, stream_interval=4) as r, httpx.Client(base_url=r.url, timeout=30) as http:
        events = sse(http, "/v1/completions", {"prompt": "x", "max_tokens": tokens, "n": 2, "return_token_ids": True})
        # A request may raise the server's interval, not lower it.
        low = sse(http, "/v1/completions", {"prompt": "x", "max_tokens": tokens, "stream_interval": 2,
                                            "return_token_ids": True})
    for index in (0, 1):
        assert [len(c["token_ids"]) for c in content(events, index)] == paced(tokens, 4), index
    assert [len(c["token_ids"]) for c in content(low)] == paced(tokens, 4)


def test_what_a_router_behind_merges_it_counts(info):
    # The fake sends its tokens as fast as it can: the router's stream task may find many queued.
    f = FakeScheduler(info.tokenizer("abc def ghi ", add_special_tokens=False)["input_ids"])
    f.start()
    try:
        with router(info, f) as r, httpx.Client(base_url=r.url, timeout=60) as http:
            chunks = 0
            for _ in range(4):
                chunks += len(content(sse(http, "/v1/completions", {"prompt": "x", "max_tokens": 400,
                                                                    "return_token_ids": True})))
            merged = r.ctx.metrics.stream_merged_tokens._value.get()
        # Every token went out in a chunk of its own, or merged and counted.
        assert chunks + merged == 4 * 400
    finally:
        f.stop()


def ev(index: int, tokens: int, text: str = "", finish: str | None = None) -> ChoiceEvent:
    return ChoiceEvent(index, text, [], finish, tokens)


def test_merging_keeps_each_choices_order_and_counts_the_tokens_that_lost_a_chunk():
    out, merged = merge_by_choice([ev(0, 1, "a"), ev(1, 1, "x"), ev(0, 1, "b"), ev(0, 0, "", "stop"), ev(1, 2, "yz")])
    assert [(e.index, e.text, e.num_new_tokens, e.finish_reason) for e in out] == \
        [(0, "ab", 2, "stop"), (1, "xyz", 3, None)]
    assert merged == 1 + 2
    pacer = StreamPacer(1)
    sent, merged = pacer.pace([ev(0, 1, "a"), ev(0, 1, "b")], behind=True)
    assert [(e.text, e.num_new_tokens) for e in sent] == [("ab", 2)] and merged == 1
    sent, merged = pacer.pace([ev(0, 1, "c"), ev(0, 1, "d")])
    assert [e.text for e in sent] == ["c", "d"] and merged == 0
