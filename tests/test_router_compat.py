"""What a client written for vLLM expects of the API (issue 16): defaults, nulls, context edges,
echo, validation, request ids, and vLLM's extra endpoints and fields. Real HTTP against the
router, a fake scheduler behind it (tests/router_fakes.py)."""
from __future__ import annotations

import threading

import httpx
import pytest

from router_fakes import RouterServer
from pagedserve.services import protocol
from pagedserve.services.router.app import create_app
from pagedserve.services.router.openai_schema import ChatCompletionRequest, CompletionRequest
from pagedserve.services.router.service import Config
from pagedserve.services.state import MemoryState
# The router and its fake scheduler are test_router's fixtures (fresh instances for this module).
from test_router import client, fake, info, router, script  # noqa: F401
from test_router import JSON, assert_error, expected_text, stream_events, stream_text

CHAT = [{"role": "user", "content": "hi"}]


def last_add(fake) -> protocol.AddRequest:
    return fake.messages(protocol.AddRequest)[-1]


# ---- 1, 2: max_tokens defaults and the context edge --------------------------------------------

def test_completion_max_tokens_null_is_16(client, fake):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": None})
    assert r.status_code == 200, r.text
    assert last_add(fake).params["max_tokens"] == 16
    assert r.json()["usage"]["completion_tokens"] == 16


def test_max_tokens_past_the_context_is_shortened_to_the_room_left(client, fake, info):
    limit = info.max_model_len
    long_prompt = [5] * (limit - 4)
    for body, sent in [({"prompt": long_prompt}, 4),                          # the default 16
                       ({"prompt": long_prompt, "max_tokens": 100}, 4),
                       ({"prompt": long_prompt, "max_tokens": 3}, 3),
                       ({"prompt": [long_prompt, [5, 6]], "max_tokens": 100}, 100)]:  # the engine caps each
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert last_add(fake).params["max_tokens"] == sent
    assert r.json()["choices"][0]["finish_reason"] == "length"
    # Chat: without max_tokens, and with more than fits.
    for extra in ({}, {"max_tokens": limit}, {"max_completion_tokens": limit - 1}):
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 300}], **extra})
        assert r.status_code == 200, r.text
        assert last_add(fake).params["max_tokens"] == limit - len(last_add(fake).prompt_token_ids)
    # A prompt that alone fills the context is still a 400, and (as vLLM) a max_tokens past the
    # whole context.
    assert_error(client.post("/v1/completions", json={"prompt": [5] * limit}), 400, "prompt")
    assert_error(client.post("/v1/completions", json={"prompt": [[5], [5] * limit]}), 400, "prompt")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": limit + 1}), 400, "max_tokens")
    assert_error(client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 10 ** 6}), 400,
                 "max_tokens")


# ---- 3: null means the default -------------------------------------------------------------------

def _all_optional_null(model) -> dict:
    return {name: None for name, f in model.model_fields.items() if not f.is_required()}


def test_every_optional_field_sent_as_null_means_its_default(client, fake):
    body = {**_all_optional_null(CompletionRequest), "prompt": "x"}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert last_add(fake).params["max_tokens"] == 16 and r.json()["choices"][0]["logprobs"] is None
    body = {**_all_optional_null(ChatCompletionRequest), "messages": [{"role": "user", "content": "hi", "name": None}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    # The ones the audit met one by one.
    for path, extra in [("/v1/chat/completions", {"messages": CHAT, "logprobs": None, "n": None, "stream": None}),
                        ("/v1/completions", {"prompt": "x", "stream": None, "echo": None}),
                        ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": None}})]:
        if extra.get("stream"):
            chunks, lines = stream_events(client, path, extra)
            assert lines[-1] == "[DONE]" and "usage" not in chunks[-1]
        else:
            assert client.post(path, json=extra).status_code == 200, extra
    # A required field sent as null is still missing.
    assert_error(client.post("/v1/completions", json={"prompt": None}), 400, "prompt")


# ---- 4: request ids -------------------------------------------------------------------------------

def test_a_finished_request_id_can_be_used_again_a_running_one_cannot(client, fake):
    headers = {"X-Request-Id": "retry-1"}
    first = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
    assert first.status_code == 200 and first.json()["id"] == "retry-1"
    again = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3}, headers=headers)
    assert again.status_code == 200, again.text
    rec = client.get("/v1/requests/retry-1").json()
    assert rec["kind"] == "chat" and rec["status"] == "finished" and rec["num_generated_tokens"] == 3
    # While it runs, the id is taken (a lookup or a cancel by id must name one request).
    fake.token_delay_s = 0.02
    started = threading.Event()
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 400, "stream": True},
                       headers=headers) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                started.set()
                assert_error(client.post("/v1/completions", json={"prompt": "x"}, headers=headers), 409,
                             "X-Request-Id")
                break
    assert started.is_set()


# ---- 5: a deeply nested body ------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [1500, 100])
def test_a_deeply_nested_body_is_a_400(client, fake, depth):
    before = len(fake.messages(protocol.AddRequest))
    nested = "[" * depth + "]" * depth
    for path, body in [("/v1/completions", '{"prompt": "x", "user": %s}' % nested),
                       ("/v1/chat/completions", '{"messages": %s}' % nested),
                       ("/v1/completions", '{"prompt": "x", "guided_json": %s}' % ('{"a":' * depth + "1" + "}" * depth))]:
        assert_error(client.post(path, content=body, headers=JSON), 400)
    assert len(fake.messages(protocol.AddRequest)) == before


# ---- 6: echo ----------------------------------------------------------------------------------------

def test_echo_returns_the_prompt_as_sent(client, info):
    text = "def f(<|user|>):"      # a special token in the text, and a BOS the tokenizer adds
    for skip in (True, False):
        r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 2, "echo": True,
                                                 "skip_special_tokens": skip})
        assert r.json()["choices"][0]["text"].startswith(text), (skip, r.json()["choices"][0]["text"])
    ids = info.tokenizer(text)["input_ids"]
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "echo": True})
    assert r.json()["choices"][0]["text"].startswith(info.tokenizer.bos_token + text)


def test_echo_logprobs_offsets_never_go_back(client, info):
    for stream in (False, True):
        body = {"prompt": "def g(x):", "max_tokens": 6, "echo": True, "logprobs": 1}
        if stream:
            chunks, _ = stream_events(client, "/v1/completions", body)
            offsets = [o for c in chunks for ch in c["choices"] if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]
        else:
            lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
            offsets = lp["text_offset"]
            n_prompt = len(info.tokenizer("def g(x):")["input_ids"])
            assert len(offsets) == n_prompt + 6 and lp["token_logprobs"][0] is None
            assert offsets[n_prompt] == offsets[n_prompt - 1] + len(lp["tokens"][n_prompt - 1])
        assert offsets == sorted(offsets), offsets


def test_echo_with_max_tokens_0_scores_the_prompt(client, fake, info):
    body = {"prompt": "def h(y):", "max_tokens": 0, "echo": True, "logprobs": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert last_add(fake).params["max_tokens"] == 1 and last_add(fake).params["prompt_logprobs"] == 0
    choice = r.json()["choices"][0]
    n_prompt = len(info.tokenizer("def h(y):")["input_ids"])
    assert choice["text"] == "def h(y):" and len(choice["logprobs"]["tokens"]) == n_prompt
    assert r.json()["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    chunks, lines = stream_events(client, "/v1/completions", body)
    assert stream_text(chunks) == "def h(y):" and lines[-1] == "[DONE]"
    assert_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens")


# ---- 7: a character cut off by the end ---------------------------------------------------------------

def test_a_completion_ending_inside_a_character_has_no_replacement_char(client, info, script):
    # The script's fifth token is the first byte of "ö".
    texts = [info.tokenizer.decode([t]) for t in script[:5]]
    assert texts[4] == "\ufffd", texts
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
    assert r.json()["choices"][0]["text"] == "Hello w"
    chunks, _ = stream_events(client, "/v1/completions", {"prompt": "x", "max_tokens": 5})
    assert stream_text(chunks) == "Hello w"
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "logprobs": True,
                                                  "top_logprobs": 0})
    entries = r.json()["choices"][0]["logprobs"]["content"]
    assert r.json()["choices"][0]["message"]["content"] == "Hello w"
    assert entries[4]["bytes"] == ["ö".encode()[0]], entries[4]
    whole = b"".join(bytes(e["bytes"]) for e in expected_entries(client, 6))
    assert whole.decode() == "Hello wö"


def expected_entries(client, n):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": n, "logprobs": True})
    return r.json()["choices"][0]["logprobs"]["content"]


# ---- 8: validation vLLM does ---------------------------------------------------------------------------

BAD = [
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 3}, "temperature"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [5000]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "stop_token_ids": [2048]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": []}, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["x", ""]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "add_special_tokens": False, "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_what_vllm_refuses_is_a_400(client, fake, path, body, param):
    before = len(fake.messages(protocol.AddRequest))
    assert_error(client.post(path, json=body), 400, param)
    assert len(fake.messages(protocol.AddRequest)) == before


def test_what_vllm_accepts_at_the_edges(client):
    assert client.post("/v1/completions", json={"prompt": "x", "temperature": 2, "stop": list("abcd")}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "x", "stop_token_ids": [2047]}).status_code == 200


def test_add_special_tokens(client, fake, info):
    client.post("/v1/completions", json={"prompt": "def", "add_special_tokens": False, "max_tokens": 1})
    assert last_add(fake).prompt_token_ids == info.tokenizer("def", add_special_tokens=False)["input_ids"]
    client.post("/v1/completions", json={"prompt": "def", "max_tokens": 1})
    assert last_add(fake).prompt_token_ids[0] == info.tokenizer.bos_token_id
    # Chat: the template writes the BOS; add_special_tokens asks for the tokenizer's too (as vLLM).
    client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "add_special_tokens": True})
    assert last_add(fake).prompt_token_ids[:2] == [info.tokenizer.bos_token_id] * 2


def test_the_stop_string_limit_is_configurable(info, fake):
    from pagedserve.services.router.service import Config as RouterConfig
    import argparse
    p = argparse.ArgumentParser()
    RouterConfig.add_arguments(p)
    cfg = RouterConfig.from_args(p.parse_args(["--model", info.path, "--scheduler-endpoint", fake.endpoint,
                                         "--max-stop-strings", "8"]))
    with RouterServer(create_app(cfg, info, MemoryState())) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.post("/v1/completions", json={"prompt": "x", "stop": list("abcdefgh")}).status_code == 200
        assert_error(c.post("/v1/completions", json={"prompt": "x", "stop": list("abcdefghi")}), 400, "stop")


# ---- 9: the developer role -------------------------------------------------------------------------------

def test_the_developer_role_is_rendered_as_system(client, fake, info):
    client.post("/v1/chat/completions", json={"messages": [{"role": "developer", "content": "be brief"}, *CHAT],
                                              "max_tokens": 1})
    rendered = info.tokenizer.apply_chat_template([{"role": "system", "content": "be brief"}, *CHAT],
                                                  add_generation_prompt=True, tokenize=False)
    assert last_add(fake).prompt_token_ids == info.tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("messages,expected", [
    # Wherever they stand, developer messages join the leading system message, as vLLM 0.32 renders them.
    ([{"role": "user", "content": "Hi"}, {"role": "developer", "content": "late"}],
     [{"role": "system", "content": "late"}, {"role": "user", "content": "Hi"}]),
    ([{"role": "system", "content": "sys"}, {"role": "user", "content": "Hi"}, {"role": "developer", "content": "late"},
      {"role": "developer", "content": "later"}],
     [{"role": "system", "content": "sys\n\nlate\n\nlater"}, {"role": "user", "content": "Hi"}]),
])
def test_developer_messages_join_the_leading_system_message(client, fake, info, messages, expected):
    client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    rendered = info.tokenizer.apply_chat_template(expected, add_generation_prompt=True, tokenize=False)
    assert last_add(fake).prompt_token_ids == info.tokenizer(rendered, add_special_tokens=False)["input_ids"]


# ---- what else vLLM clients expect -------------------------------------------------------------------

def test_version_ping_and_cors(client):
    from pagedserve.services.router.app import server_version
    assert client.get("/version").json() == {"version": server_version()} and server_version() != "unknown"
    assert client.get("/ping").status_code == 200 and client.post("/ping").status_code == 200
    # vLLM's defaults: every method and header, but no origin (cross-origin browser access is off).
    r = client.options("/v1/completions", headers={"Origin": "http://example.com",
                                                   "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "content-type,authorization"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    assert "POST" in r.headers["access-control-allow-methods"]
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Origin": "http://a.b"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_allows_what_the_flags_allow(info, fake):
    cfg = Config(model=info.path, scheduler_endpoint=fake.endpoint, allowed_origins=["*"])
    with RouterServer(create_app(cfg, info, MemoryState())) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.options("/v1/completions", headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST",
                                                  "Access-Control-Request-Headers": "content-type,authorization"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Origin": "http://a.b"})
        assert r.headers["access-control-allow-origin"] == "*" and "access-control-allow-credentials" not in r.headers


def test_cors_flags_reach_the_router_through_pagedserve_up(info, fake, tmp_path):
    import argparse
    from pagedserve.services import launcher
    from pagedserve.services.router.service import Config as RouterConfig
    p = argparse.ArgumentParser()
    launcher.Config.add_arguments(p)
    flags = ["--allowed-origins", '["http://ok.example"]', "--allowed-methods", '["GET", "POST"]',
             "--allowed-headers", '["content-type"]', "--allow-credentials"]
    up = launcher.config_from_args(p.parse_args(["--model", info.path, *flags]))
    router_argv = dict(launcher.process_commands(up, info.path, str(tmp_path)))["router0"]
    for flag, value in zip(flags[:-1:2], flags[1::2]):   # passed down, each with its value
        assert router_argv[router_argv.index(flag) + 1] == value, flag
    assert "--allow-credentials" in router_argv
    rp = argparse.ArgumentParser()
    RouterConfig.add_arguments(rp)
    cfg = RouterConfig.from_args(rp.parse_args(["--model", info.path, "--scheduler-endpoint", fake.endpoint, *flags]))
    assert cfg.allowed_origins == ["http://ok.example"] and cfg.allow_credentials
    with RouterServer(create_app(cfg, info, MemoryState())) as srv, httpx.Client(base_url=srv.url) as c:
        ok = c.options("/v1/completions", headers={"Origin": "http://ok.example", "Access-Control-Request-Method": "POST"})
        assert ok.headers["access-control-allow-origin"] == "http://ok.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        bad = c.options("/v1/completions", headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    with pytest.raises(ValueError):
        RouterConfig.from_args(rp.parse_args(["--model", info.path, "--allowed-origins", '"*"']))


def test_system_fingerprint_everywhere(client):
    from pagedserve.services.router.app import server_version
    fp = f"pagedserve-{server_version()}"
    for path, body in [("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})]:
        assert client.post(path, json=body).json()["system_fingerprint"] == fp
        chunks, _ = stream_events(client, path, {**body, "stream_options": {"include_usage": True}})
        assert all(c["system_fingerprint"] == fp for c in chunks)


def test_return_token_ids(client, fake, info, script):
    r = client.post("/v1/completions", json={"prompt": ["a", "bc"], "max_tokens": 3, "return_token_ids": True})
    for choice, text in zip(r.json()["choices"], ["a", "bc"]):
        assert choice["prompt_token_ids"] == info.tokenizer(text)["input_ids"]
        assert choice["token_ids"] == script[:3]
    assert "token_ids" not in client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).json()["choices"][0]
    chunks, _ = stream_events(client, "/v1/completions", {"prompt": "a", "max_tokens": 4, "return_token_ids": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == info.tokenizer("a")["input_ids"]
    assert not any("prompt_token_ids" in c["choices"][0] for c in chunks[1:]), "the first chunk has them"
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == script[:4]
    lp = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "echo": True, "logprobs": 1}).json()
    assert lp["choices"][0]["prompt_logprobs"][0] is None, "as vLLM: echo with logprobs gives prompt_logprobs"
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "return_token_ids": True})
    assert r.json()["prompt_token_ids"] == last_add(fake).prompt_token_ids
    assert r.json()["choices"][0]["token_ids"] == script[:3]
    chunks, _ = stream_events(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == last_add(fake).prompt_token_ids
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == script[:3]


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}),
                                       ("/v1/chat/completions", {"messages": CHAT})])
def test_continuous_usage_stats(client, path, body):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks, _ = stream_events(client, path, {**body, "max_tokens": 6, "stream_options": opts})
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert all("usage" in c for c in chunks) and counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    u = chunks[0]["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    if path.endswith("chat/completions"):        # the role chunk goes before any token (vLLM: 0)
        assert chunks[0]["choices"][0]["delta"].get("role") == "assistant" and u["completion_tokens"] == 0
    chunks, _ = stream_events(client, path, {**body, "max_tokens": 3, "stream_options": {"continuous_usage_stats": True}})
    assert not any("usage" in c for c in chunks), "as vLLM: only with include_usage"
