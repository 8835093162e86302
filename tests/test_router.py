"""The router on its own: real HTTP (uvicorn on a free port) against a fake scheduler on ZeroMQ."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from router_fakes import FakeScheduler, RouterServer
from pagedserve.services import protocol
from pagedserve.services.router.app import create_app
from pagedserve.services.router.service import Config
from pagedserve.services.state import MemoryState

SCRIPT_TEXT = "Hello wörld € The quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def info(tiny_llama):
    from pagedserve.services.router.model_info import load_model_info
    return load_model_info(tiny_llama)


@pytest.fixture(scope="module")
def script(info) -> list[int]:
    return info.tokenizer(SCRIPT_TEXT, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def fake(script):
    f = FakeScheduler(script)
    f.start()
    yield f
    f.stop()


@pytest.fixture(scope="module")
def router(info, fake):
    cfg = Config(model=info.path, scheduler_endpoint=fake.endpoint, router_id="router-test")
    with RouterServer(create_app(cfg, info, MemoryState())) as srv:
        yield srv


@pytest.fixture
def client(router, fake):
    fake.ready, fake.silent, fake.reject_with, fake.token_delay_s = True, False, None, 0.0
    with httpx.Client(base_url=router.url, timeout=20) as c:
        yield c


JSON = {"Content-Type": "application/json"}   # bodies sent as raw bytes name their type


def expected_text(info, script, n_tokens, choice=0):
    ids = [script[(choice + k) % len(script)] for k in range(n_tokens)]
    return info.tokenizer.decode(ids, skip_special_tokens=True)


def stream_events(client, path, body, headers=None):
    """POST a streaming request -> (decoded chunks, raw data lines)."""
    chunks, lines = [], []
    with client.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            lines.append(line[6:])
            if line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks, lines


def stream_text(chunks, index=0, chat=False):
    parts = []
    for c in chunks:
        for ch in c["choices"]:
            if ch["index"] == index:
                parts.append(ch["delta"].get("content") or "" if chat else ch["text"])
    return "".join(parts)


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err


# ---- completions and chat -------------------------------------------------------------------

def test_completion_shape_text_and_usage(client, info, script):
    r = client.post("/v1/completions", json={"model": info.path, "prompt": "def f(x):", "max_tokens": 9})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"] == r.headers["x-request-id"]
    assert body["model"] == info.path and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["text"] == expected_text(info, script, 9)
    prompt_len = len(info.tokenizer("def f(x):")["input_ids"])
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 9, "total_tokens": prompt_len + 9}


def test_completion_default_max_tokens_is_16_and_token_prompts_pass_through(client, fake, info, script):
    before = len(fake.messages(protocol.AddRequest))
    r = client.post("/v1/completions", json={"prompt": [5, 6, 7]})
    assert r.status_code == 200, r.text
    add = fake.messages(protocol.AddRequest)[before]
    assert add.prompt_token_ids == [5, 6, 7] and add.params["max_tokens"] == 16
    assert r.json()["choices"][0]["text"] == expected_text(info, script, 16)


def test_chat_uses_the_template_without_a_second_bos_and_fills_the_context(client, fake, info):
    before = len(fake.messages(protocol.AddRequest))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    add = fake.messages(protocol.AddRequest)[before]
    rendered = info.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, tokenize=False)
    assert add.prompt_token_ids == info.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert add.prompt_token_ids.count(info.tokenizer.bos_token_id) == 1
    # Without max_tokens, chat may use the rest of the context (as vLLM).
    r = client.post("/v1/chat/completions", json={"messages": msgs[1:], "max_tokens": None, "stop": "jumps"})
    assert r.status_code == 200
    add = fake.messages(protocol.AddRequest)[-1]
    assert add.params["max_tokens"] == info.max_model_len - len(add.prompt_token_ids)


def test_chat_continues_the_final_message_and_echoes_it(client, fake, info, script):
    msgs = [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": msgs, "max_tokens": 3, "add_generation_prompt": False, "continue_final_message": True,
            "echo": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    rendered = info.tokenizer.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False,
                                                  continue_final_message=True)
    assert rendered.endswith("Once upon")
    add = fake.messages(protocol.AddRequest)[-1]
    assert add.prompt_token_ids == info.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert r.json()["choices"][0]["message"]["content"] == "Once upon" + expected_text(info, script, 3)
    chunks, _ = stream_events(client, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Once upon"}
    assert stream_text(chunks, chat=True) == r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_equals_non_streaming_and_ends_with_done(client, info, script, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 20, "n": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    full = client.post(path, json=body).json()
    chunks, lines = stream_events(client, path, body)
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    for i in range(2):
        key = full["choices"][i]["message"]["content"] if chat else full["choices"][i]["text"]
        assert stream_text(chunks, i, chat) == key == expected_text(info, script, 20, i)
        assert "\ufffd" not in key, "a character split across tokens must be joined, not replaced"
        finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["index"] == i]
        assert finishes[-1] == "length" and finishes.count("length") == 1
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"] != full["id"]
    if chat:
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    else:
        assert chunks[0]["object"] == "text_completion"


def test_echo_prefixes_the_prompt_text(client, info, script):
    r = client.post("/v1/completions", json={"prompt": "def g():", "max_tokens": 3, "echo": True})
    assert r.json()["choices"][0]["text"] == "def g():" + expected_text(info, script, 3)
    chunks, _ = stream_events(client, "/v1/completions", {"prompt": "def g():", "max_tokens": 3, "echo": True})
    assert stream_text(chunks) == r.json()["choices"][0]["text"]


def test_stream_usage_chunk_when_asked(client):
    chunks, _ = stream_events(client, "/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                                           "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_n3_returns_three_distinct_choices(client, info, script):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "n": 3})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == [expected_text(info, script, 6, j) for j in range(3)]
    assert r.json()["usage"]["completion_tokens"] == 18


def test_completion_logprobs_shape(client, info, script):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "logprobs": 2})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(lp[k]) == 5 for k in lp)
    assert lp["token_logprobs"] == pytest.approx([-0.5 - 0.01 * k for k in range(5)])
    assert lp["tokens"][0] == info.tokenizer.decode([script[0]])
    assert all(isinstance(t, dict) and 2 <= len(t) <= 3 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # The fifth token is the first byte of "ö": the text ends before it and its token is "" (as
    # vLLM shows a token that holds part of a character), never U+FFFD.
    assert "".join(lp["tokens"]) == choice["text"] and lp["tokens"][4] == ""


def test_chat_logprobs_shape(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 4, "logprobs": True, "top_logprobs": 3})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 3
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.json()["choices"][0]["logprobs"] is None


# ---- tool calls ------------------------------------------------------------------------------

# What a tool_choice "required" grammar lets the model write; the fake scheduler plays it back
# (whatever the grammar), ended by EOS as a stop token.
TOOL_TEXT = '[{"name":"get_weather","parameters":{"city":"Paris","days":3}},{"name":"now","parameters":{}}]'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tool_script(info) -> list[int]:
    return info.tokenizer(TOOL_TEXT, add_special_tokens=False)["input_ids"] + [info.eos_token_ids[0]]


@pytest.fixture(scope="module")
def tool_client(info, tool_script):
    fake = FakeScheduler(tool_script)
    fake.start()
    cfg = Config(model=info.path, scheduler_endpoint=fake.endpoint, router_id="router-tools")
    with RouterServer(create_app(cfg, info, MemoryState())) as srv, httpx.Client(base_url=srv.url, timeout=20) as c:
        yield c
    fake.stop()


def _cut_inside_second_call(info, tool_script) -> int:
    """A max_tokens that ends the text after the second call's name, inside its arguments."""
    return next(k for k in range(1, len(tool_script))
                if info.tokenizer.decode(tool_script[:k]).endswith('"now","parameters":{'))


def _streamed_calls(chunks) -> tuple[list[dict], str]:
    """A stream's tool_call deltas added up as OpenAI clients do (by index) -> (calls, finish reason).
    Each chunk holds at most one entry per index (black-box finding: the header and the first
    arguments of a named call came as two entries of index 0)."""
    calls, finish = {}, None
    for chunk in chunks:
        for ch in chunk["choices"]:
            deltas = ch["delta"].get("tool_calls") or []
            assert len({d["index"] for d in deltas}) == len(deltas), deltas
            for d in deltas:
                call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
                if "id" in d:
                    call["name"] = d["function"]["name"]
                call["arguments"] += d["function"].get("arguments", "")
            finish = ch["finish_reason"] or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut-by-length"])
def test_tool_calls_streamed_and_whole_agree(tool_client, info, tool_script, tool_choice, cut):
    """Black-box finding: a required tool call cut by max_tokens came back whole as content (the raw
    unfinished JSON) but streamed as tool_call deltas. Both are tool_calls now, the cut call's
    arguments as far as they got (vLLM's named tool calls do that), and finish_reason "length"."""
    eos = info.eos_token_ids[0]
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "tool_choice": tool_choice,
            "temperature": 0, "stop_token_ids": [eos],
            "max_tokens": _cut_inside_second_call(info, tool_script) if cut else 200}
    r = tool_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    whole = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in choice["message"]["tool_calls"]]
    assert choice["message"]["content"] is None
    streamed, finish = _streamed_calls(stream_events(tool_client, "/v1/chat/completions", body)[0])
    assert (streamed, finish) == (whole, choice["finish_reason"])
    # Ended by itself: "tool_calls" for "required", "stop" for a named function (OpenAI's, vLLM's).
    assert finish == ("length" if cut else "tool_calls" if tool_choice == "required" else "stop")
    text = TOOL_TEXT[:TOOL_TEXT.index('"now","parameters":{') + 20] if cut else TOOL_TEXT
    if tool_choice == "required":
        assert whole[0] == {"name": "get_weather", "arguments": '{"city":"Paris","days":3}'}
        assert whole[1] == {"name": "now", "arguments": "{" if cut else "{}"}
    else:
        assert whole == [{"name": "get_weather", "arguments": text}]


# ---- stop strings ----------------------------------------------------------------------------

def _split_stop(info, script) -> tuple[str, str]:
    """A stop string that straddles two tokens of the script, and the text before it."""
    texts = [info.tokenizer.decode([t]) for t in script]
    for k in range(len(texts) - 1):
        a, b = texts[k], texts[k + 1]
        if len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b and k > 2:
            stop = a[-2:] + b[:2]
            full = info.tokenizer.decode(script)
            return stop, full[:full.index(stop)]
    raise AssertionError("no token pair to straddle")


def test_stop_string_split_across_tokens_never_leaks_into_the_stream(client, fake, info, script):
    stop, before = _split_stop(info, script)
    aborts = len(fake.messages(protocol.AbortRequest))
    body = {"prompt": "x", "max_tokens": 40, "stop": ["never-there", stop]}
    chunks, lines = stream_events(client, "/v1/completions", body)
    texts = [ch["text"] for c in chunks for ch in c["choices"]]
    assert "".join(texts) == before, "the stream held back the start of the stop string and dropped it"
    sent = ""
    for t in texts:          # at no point did the client see any part of the stop string
        sent += t
        assert not any(sent.endswith(stop[:k]) for k in range(1, len(stop) + 1) if len(sent) > len(before))
        assert len(sent) <= len(before)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and lines[-1] == "[DONE]"
    assert len(fake.wait_for(protocol.AbortRequest, aborts + 1)) == aborts + 1
    full = client.post("/v1/completions", json=body).json()["choices"][0]
    assert full["text"] == before and full["finish_reason"] == "stop" and full["stop_reason"] == stop


def test_stop_with_n2_finishes_each_choice_then_aborts_once(client, fake, info, script):
    stop = "fox"
    aborts = len(fake.messages(protocol.AbortRequest))
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 40, "n": 2, "stop": stop})
    choices = r.json()["choices"]
    for j, c in enumerate(choices):
        full = expected_text(info, script, 40, j)
        assert c["finish_reason"] == "stop" and c["text"] == full[:full.index(stop)]
    time.sleep(0.1)
    assert len(fake.messages(protocol.AbortRequest)) == aborts + 1


def test_eos_ends_the_text_without_showing_it(client, info, script):
    # stop_token_ids makes the fake finish with "stop" on that token; the token is counted, not shown.
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "stop_token_ids": [script[3]],
                                             "skip_special_tokens": False})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["text"] == expected_text(info, script, 3)
    assert r.json()["usage"]["completion_tokens"] == 4


def test_beam_search_sends_the_beam_width(client, fake):
    before = len(fake.messages(protocol.AddRequest))
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "n": 2, "best_of": 3,
                                             "use_beam_search": True, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    add = fake.messages(protocol.AddRequest)[before]
    assert add.params["beam_width"] == 3 and add.params["n"] == 2


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_allowed_token_ids_reach_the_scheduler(client, fake, path, body):
    """Black-box finding: allowed_token_ids was dropped by the router, so the worker never masked."""
    before = len(fake.messages(protocol.AddRequest))
    r = client.post(path, json={**body, "max_tokens": 3, "temperature": 0, "allowed_token_ids": [10, 11]})
    assert r.status_code == 200
    assert fake.messages(protocol.AddRequest)[before].params["allowed_token_ids"] == [10, 11]


def test_best_of_returns_the_most_likely(client, fake):
    before = len(fake.messages(protocol.AddRequest))
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "n": 1, "best_of": 3})
    assert fake.messages(protocol.AddRequest)[before].params["n"] == 3
    assert len(r.json()["choices"]) == 1   # the fake makes choice 0 the most likely


# ---- bad input -------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5, "min_tokens": 6}, "min_tokens"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "seed": 2 ** 70}, "seed"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "x", "use_beam_search": True, "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999999": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 300}}, "logit_bias"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 99999999]}, "prompt"),
    ({"prompt": [1, -3]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options.include_usage"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "n": 5000}, "n"),
    ({"prompt": "x", "n": 1, "best_of": 5000}, "best_of"),        # the engine runs best_of: its bound
    ({"prompt": "x", "use_beam_search": True, "n": 1, "best_of": 5000}, "best_of"),
    ({"prompt": "x", "stop": ["\ud800"]}, "stop"),             # a lone surrogate cannot travel
    ({"prompt": "x", "cache_salt": "\udfff"}, "cache_salt"),
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": "x", "top_k": 2 ** 64}, "top_k"),
    ({"prompt": "x", "stop_token_ids": [2 ** 64]}, "stop_token_ids"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),           # vLLM: empty is refused
    ({"prompt": "x", "allowed_token_ids": [10, 99999999]}, "allowed_token_ids"),   # past the vocabulary
    ({"prompt": "x", "allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": "10"}, "allowed_token_ids"),
    ({"prompt": "x", "use_beam_search": True, "n": 2, "allowed_token_ids": [10]}, "allowed_token_ids"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"prompt": "x", "guided_json": {"type": "object", "properties": {"a": {"type": "foo"}}}}, "guided_json"),
    ({"prompt": "x", "guided_choice": "a"}, "guided_choice"),
    ({"prompt": "x", "guided_regex": r"a[^\s\S]"}, "guided_regex"),               # matches no text
    ({"prompt": "x", "guided_json": {"type": "integer", "enum": ["a"]}}, "guided_json"),   # no valid value
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "oneOf": [{"type": "integer"}, {"type": "number"}]}}}}, "response_format.json_schema.schema"),   # overlap
    ({"prompt": "x", "structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                     "required": ["b"], "additionalProperties": False}}},
     "structured_outputs.json"),
    ({"prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "use_beam_search": True, "n": 2, "logprobs": 1}, "logprobs"),
    ({"prompt": "many words " * 20000}, "prompt"),       # refused by its length, before tokenizing
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_requests_get_400_and_never_reach_the_scheduler(client, fake, body, param):
    before = len(fake.messages(protocol.AddRequest))
    # json.dumps escapes lone surrogates (\ud800), which httpx's own encoder cannot write.
    assert_error(client.post("/v1/completions", content=json.dumps(body), headers=JSON), 400, param)
    assert len(fake.messages(protocol.AddRequest)) == before


def test_a_schema_as_deep_as_the_grammar_limit_passes_the_body_limit(client, fake):
    """Black-box finding: a schema of 31 nested objects was refused as a body "nested more than 64
    levels deep" (two levels of JSON a property), below --max-grammar-depth (32). The body's bound
    follows the schema's now, and the schema's own limit names its flag."""
    def nested(levels):
        schema = {"type": "integer"}
        for _ in range(levels - 1):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        return {"prompt": "x", "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}
    before = len(fake.messages(protocol.AddRequest))
    assert client.post("/v1/completions", json=nested(32)).status_code == 200
    assert len(fake.messages(protocol.AddRequest)) == before + 1
    r = client.post("/v1/completions", json=nested(33))
    assert_error(r, 400, "response_format.json_schema.schema")
    assert "--max-grammar-depth" in r.json()["error"]["message"]


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi " * 2000}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": "hi"}], "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "a\udc00"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": [99999999]}, "allowed_token_ids"),
]


@pytest.mark.parametrize("body,param", BAD_CHATS, ids=[str(i) for i in range(len(BAD_CHATS))])
def test_bad_chat_requests_get_400_and_never_reach_the_scheduler(client, fake, body, param):
    before = len(fake.messages(protocol.AddRequest))
    assert_error(client.post("/v1/chat/completions", content=json.dumps(body), headers=JSON), 400, param)
    assert len(fake.messages(protocol.AddRequest)) == before


def test_malformed_bodies_unknown_models_and_routes(client, fake):
    before = len(fake.messages(protocol.AddRequest))
    assert_error(client.post("/v1/completions", content=b"{not json", headers=JSON), 400)
    assert_error(client.post("/v1/completions", content=b"[1, 2]", headers=JSON), 400)
    assert_error(client.post("/v1/completions", content=b"\xff\xfe", headers=JSON), 400)
    assert_error(client.post("/v1/chat/completions", content=b"", headers=JSON), 400)
    assert_error(client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "bad id!"}), 400)
    assert_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    assert_error(client.get("/v1/nothing-here"), 404)
    assert_error(client.get("/v1/completions"), 405)
    assert len(fake.messages(protocol.AddRequest)) == before


def test_a_request_the_scheduler_rejects_keeps_its_status(client, fake):
    fake.reject_with = protocol.Error("the engine is not ready", 503)
    assert_error(client.post("/v1/completions", json={"prompt": "x"}), 503)
    r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert_error(r, 503)


def test_client_supplied_request_id_names_the_request_and_its_record(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"X-Request-Id": "mine-1"})
    assert r.json()["id"] == "mine-1"
    rec = client.get("/v1/requests/mine-1").json()
    assert rec["status"] == "finished" and rec["router_id"] == "router-test" and rec["finish_reasons"] == ["length"]
    assert_error(client.get("/v1/requests/unknown-id"), 404)


# ---- disconnects, health, readiness, metrics ---------------------------------------------------

def test_client_disconnect_during_a_stream_aborts_the_request(client, fake):
    fake.token_delay_s = 0.02
    aborts = len(fake.messages(protocol.AbortRequest))
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 500, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                rid = json.loads(line[6:])["id"]
                break
    aborted = fake.wait_for(protocol.AbortRequest, aborts + 1, timeout_s=5)
    assert aborted[-1].request_id.startswith(rid + "#")
    deadline = time.monotonic() + 3
    while client.get(f"/v1/requests/{rid}").json()["status"] == "running" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.get(f"/v1/requests/{rid}").json()["status"] == "cancelled"


def _generated_total(c) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    return sum(s.value for f in text_string_to_metric_families(c.get("/metrics").text)
               for s in f.samples if s.name == "vllm:generation_tokens_total")


def test_client_disconnect_while_waiting_for_a_whole_response_aborts(router, fake):
    # Black-box finding: the tokens of an aborted whole response (merged in the scheduler client
    # until its end) were dropped with it: generation_tokens_total and the record counted 0.
    fake.token_delay_s = 0.02
    aborts = len(fake.messages(protocol.AbortRequest))
    with httpx.Client(base_url=router.url, timeout=0.3) as c:
        before = _generated_total(c)
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": "x", "max_tokens": 500}, headers={"X-Request-Id": "gone-1"})
        fake.wait_for(protocol.AbortRequest, aborts + 1, timeout_s=5)
        fake.token_delay_s = 0.0
        deadline = time.monotonic() + 3
        while c.get("/v1/requests/gone-1").json()["status"] == "running" and time.monotonic() < deadline:
            time.sleep(0.02)
        record = c.get("/v1/requests/gone-1").json()
        assert record["status"] == "cancelled" and record["num_generated_tokens"] > 0
        assert _generated_total(c) - before == record["num_generated_tokens"]


def test_health_and_ready_follow_the_scheduler(client, fake):
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 200
    fake.ready = False
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["status"] == "not ready"
    fake.ready = True
    assert client.get("/ready").status_code == 200


def test_models_and_kv(client, info):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == info.path
    assert models["data"][0]["max_model_len"] == info.max_model_len
    assert client.get("/v1/kv").json() == {"device_blocks_total": 64, "device_blocks_used": 16}


def test_metrics_exposition_parses_and_has_vllm_names(client):
    from prometheus_client.parser import text_string_to_metric_families
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
    client.post("/v1/completions", json={"prompt": "x", "n": 0})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "pagedserve:request_errors_total"):
        assert name in samples, name
    assert samples["vllm:num_requests_waiting"][0].value == 3
    assert samples["vllm:kv_cache_usage_perc"][0].value == 0.25
    assert samples["vllm:prefix_cache_hits_total"][0].value == 40
    assert samples["vllm:e2e_request_latency_seconds_count"][0].value >= 1
    assert any(s.labels.get("status") == "400" and s.value >= 1 for s in samples["pagedserve:request_errors_total"])


def test_openai_sdk_against_the_router(router, info, script):
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    done = sdk.completions.create(model=info.path, prompt="def f():", max_tokens=7)
    assert done.choices[0].text == expected_text(info, script, 7) and done.usage.completion_tokens == 7
    stream = sdk.chat.completions.create(model=info.path, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=12, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == expected_text(info, script, 12)
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=info.path, prompt="x", temperature=-3)
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="nope", prompt="x")


def test_a_silent_scheduler_fails_requests_with_503_instead_of_hanging(info, script):
    quiet = FakeScheduler(script)
    quiet.start()
    try:
        cfg = Config(model=info.path, scheduler_endpoint=quiet.endpoint, router_id="router-quiet",
                     ping_interval_s=0.05, scheduler_timeout_s=0.4)
        with RouterServer(create_app(cfg, info, MemoryState())) as srv, \
                httpx.Client(base_url=srv.url, timeout=10) as c:
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
            quiet.silent = True
            t0 = time.monotonic()
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert_error(r, 503)
            assert time.monotonic() - t0 < 3
            assert c.get("/ready").status_code == 503
            assert_error(c.post("/v1/completions", json={"prompt": "x"}), 503)   # refused at once now
    finally:
        quiet.stop()


def test_ready_answers_within_its_timeout_when_no_scheduler_is_connected(info, tmp_path):
    """/ready (and /metrics) used to wait up to 5 s more for the Ping to be sent (a DEALER with no
    peer blocks), longer than a probe's timeout: the answer was no answer, not a 503."""
    cfg = Config(model=info.path, scheduler_endpoint=f"ipc://{tmp_path}/nobody.sock", router_id="router-alone")
    with RouterServer(create_app(cfg, info, MemoryState())) as srv, \
            httpx.Client(base_url=srv.url, timeout=20) as c:
        for path in ("/ready", "/metrics"):
            t0 = time.monotonic()
            status = c.get(path).status_code
            assert time.monotonic() - t0 < cfg.ready_timeout_s + 1.0, path
        assert status == 200 and c.get("/ready").status_code == 503


def test_return_tokens_as_token_ids_names_tokens_as_vllm(client):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N" (and chat's bytes
    are those of that name); without it, the token's text."""
    body = {"prompt": "x", "max_tokens": 3, "logprobs": 2}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    named = client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()
    lp = named["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"]) and len(lp["tokens"]) == 3
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    assert not any(t.startswith("token_id:") for t in plain["tokens"])
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                     "logprobs": True, "return_tokens_as_token_ids": True}).json()
    entry = chat["choices"][0]["logprobs"]["content"][0]
    assert entry["token"].startswith("token_id:") and bytes(entry["bytes"]).decode() == entry["token"]


def test_stream_chunks_bypass_the_middleware_but_its_start_and_end_pass_through(info, fake):
    """EventStream sends a stream's status, headers and end through the app's middleware (CORS adds
    its headers there) and every chunk between straight to the server: counted here by a pure ASGI
    layer inside the app, which sees one body message (the end) for a stream of many chunks."""
    seen = []

    class CountBodies:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            async def counted(message):
                seen.append(message["type"])
                await send(message)
            await self.app(scope, receive, counted if scope["type"] == "http" else send)

    cfg = Config(model=info.path, scheduler_endpoint=fake.endpoint, router_id="router-bodies", allowed_origins=["*"])
    app = create_app(cfg, info, MemoryState())
    app.add_middleware(CountBodies)   # outermost of the app's own middleware, inside RouterApp
    fake.ready, fake.silent, fake.reject_with, fake.token_delay_s = True, False, None, 0.0
    with RouterServer(app) as srv, httpx.Client(base_url=srv.url, timeout=20) as c:
        chunks, lines = stream_events(c, "/v1/completions", {"prompt": "hi", "max_tokens": 6},
                                      headers={"Origin": "http://a.b"})
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True},
                      headers={"Origin": "http://a.b"}) as r:
            assert r.headers["access-control-allow-origin"] == "*"
            r.read()
    assert len(chunks) >= 6 and lines[-1] == "[DONE]"
    # Per stream: the start and the end; the chunks went around.
    assert seen == ["http.response.start", "http.response.body"] * 2


def test_sse_writes_the_json_that_json_dumps_writes():
    from pagedserve.services.router.event_stream import sse
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "text": " wörld € \u2028\"\\\n", "logprobs": {"tokens": ["a"], "token_logprobs": [-0.25],
                                                              "top_logprobs": [{"a": -0.25}], "text_offset": [0]},
         "finish_reason": None, "stop_reason": 7}]}
    body = sse(chunk)
    assert body.startswith(b"data: ") and body.endswith(b"\n\n")
    assert body[6:-2] == json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()


# ---- vLLM's truncate_prompt_tokens (the prompt's last k tokens are served; -1: as many as the
# context holds), and its fields that are not served. Black-box finding: both were dropped as
# unknown: a long prompt with truncate_prompt_tokens 100 got the 400 of a prompt longer than the
# context (vLLM serves its last 100 tokens), and bad_words ["he"] came back "hehehe".

def _served_prompt(fake, before: int) -> list[int]:
    added = fake.wait_for(protocol.AddRequest, before + 1)
    return list(added[before].prompt_token_ids)


def test_a_long_prompt_is_served_as_its_last_tokens(client, fake, info):
    text = "hello " * 2000                 # far past the 1024-token context
    ids = info.tokenizer(text)["input_ids"]
    before = len(fake.messages(protocol.AddRequest))
    r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 3, "truncate_prompt_tokens": 100})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 100
    # As vLLM's tokenizer truncates a text (left side, max_length 100): the BOS stays, then the
    # text's last 99 tokens. HF's own truncation is the reference.
    import copy
    left = copy.deepcopy(info.tokenizer)
    left.truncation_side = "left"
    expected = left(text, truncation=True, max_length=100)["input_ids"]
    assert _served_prompt(fake, before) == expected and expected[0] == ids[0] and expected[1:] == ids[-99:]
    # -1: as much as the context holds, which leaves no room for a completion: the context's 400.
    r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 3, "truncate_prompt_tokens": -1})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    # Token prompts and batches too; a prompt shorter than k is whole; echo shows what was served.
    before = len(fake.messages(protocol.AddRequest))
    r = client.post("/v1/completions", json={"prompt": [[11, 12, 13, 14, 15], [21, 22]], "max_tokens": 1,
                                             "truncate_prompt_tokens": 3, "echo": True})
    assert r.status_code == 200, r.text
    served = sorted(tuple(p) for p in (_served_prompt(fake, before), _served_prompt(fake, before + 1)))
    assert served == [(13, 14, 15), (21, 22)]
    echoed = {c["index"]: c["text"] for c in r.json()["choices"]}
    assert echoed[0].startswith(info.tokenizer.decode([13, 14, 15]))
    # A text it leaves whole echoes as sent (no BOS text: black-box round 3); one it cuts, as the
    # text of the tokens kept, less the BOS.
    short = client.post("/v1/completions", json={"prompt": "over the lazy dog", "max_tokens": 1, "echo": True,
                                                  "truncate_prompt_tokens": 100})
    assert short.json()["choices"][0]["text"].startswith("over the lazy dog")
    cut = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "echo": True,
                                                "truncate_prompt_tokens": 10})
    assert cut.json()["choices"][0]["text"].startswith(info.tokenizer.decode(ids[-9:]))


def test_chat_keeps_the_rendered_prompts_last_tokens(client, fake, info):
    before = len(fake.messages(protocol.AddRequest))
    body = {"messages": [{"role": "user", "content": "tell me about " * 40}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json={**body, "truncate_prompt_tokens": 10})
    assert r.status_code == 200, r.text
    whole = client.post("/tokenize", json={"messages": body["messages"]}).json()["tokens"]
    assert _served_prompt(fake, before) == whole[-10:] and r.json()["usage"]["prompt_tokens"] == 10


@pytest.mark.parametrize("k, says", [(0, "-1 or at least 1"), (-2, "-1 or at least 1"),
                                     (5000, "greater than max_model_len (1024)")])
def test_a_truncation_that_cannot_be_served_is_a_400(client, k, says):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = client.post(path, json={**body, "max_tokens": 1, "truncate_prompt_tokens": k})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert says in err["message"] and err["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("field, value", [("bad_words", ["he"]), ("priority", 5), ("logits_processors", ["x"]),
                                          ("guided_whitespace_pattern", r"[ ]?")])
def test_a_vllm_field_that_is_not_served_is_a_400_not_ignored(client, field, value):
    # Black-box finding: bad_words ["he"] came back "hehehe": the field was dropped as unknown.
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = client.post(path, json={**body, "max_tokens": 1, field: value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
    # Their defaults ask for nothing: served.
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": 0, "bad_words": []})
    assert ok.status_code == 200, ok.text
