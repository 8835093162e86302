"""/tokenize and /detokenize (issue 15 part 3), in vLLM's shapes: real HTTP against the router,
token ids compared with the model's tokenizer itself. No engine is involved in either route."""
from __future__ import annotations

import json

import httpx
import pytest

from pagedserve.services import protocol
from test_router import assert_error, client, fake, info, router, script  # noqa: F401
from test_router_limits import _router

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello wörld €"}]


def template_ids(info, messages, **kw) -> list[int]:
    text = info.tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    return info.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_tokenize_a_prompt_as_the_tokenizer_does(client, info):
    text = "def f(x):\n    return x + 1  # wörld €"
    want = info.tokenizer(text)["input_ids"]
    r = client.post("/tokenize", json={"model": info.path, "prompt": text})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(want), "max_model_len": info.max_model_len, "tokens": want, "token_strs": None}
    bare = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                          "return_token_strs": True}).json()
    assert bare["tokens"] == info.tokenizer(text, add_special_tokens=False)["input_ids"] == want[1:]
    assert bare["token_strs"] == info.tokenizer.convert_ids_to_tokens(bare["tokens"])
    assert bare["count"] == len(want) - 1


def test_tokenize_chat_messages_through_the_chat_template(client, info):
    r = client.post("/tokenize", json={"messages": CHAT})
    assert r.status_code == 200, r.text
    got = r.json()
    # vLLM's chat defaults: the generation prompt, and no special tokens beyond the template's own.
    assert got["tokens"] == template_ids(info, CHAT, add_generation_prompt=True)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == info.max_model_len
    plain = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert plain["tokens"] == template_ids(info, CHAT, add_generation_prompt=False) != got["tokens"]
    prefill = CHAT + [{"role": "assistant", "content": "Hi"}]
    cont = client.post("/tokenize", json={"messages": prefill, "add_generation_prompt": False,
                                          "continue_final_message": True, "add_special_tokens": True}).json()
    text = info.tokenizer.apply_chat_template(prefill, tokenize=False, add_generation_prompt=False,
                                              continue_final_message=True)
    assert cont["tokens"] == info.tokenizer(text)["input_ids"]


def test_chat_template_kwargs_reach_the_template_and_tokenize_equals_the_chat_prompt(client, info, fake):
    # The template sees the request's variables; add_generation_prompt from the flag wins over them.
    kw = {"chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": False}}
    got = client.post("/tokenize", json={"messages": CHAT, **kw}).json()
    assert got["tokens"] == template_ids(info, CHAT, add_generation_prompt=True, enable_thinking=False)
    # What /tokenize counts is what a chat completion sends the engine.
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **kw})
    assert r.status_code == 200, r.text
    assert fake.messages(protocol.AddRequest)[-1].prompt_token_ids == got["tokens"]
    assert r.json()["usage"]["prompt_tokens"] == got["count"]


def test_detokenize_round_trips_and_keeps_special_tokens(client, info):
    text = "Hello wörld € and more"
    ids = info.tokenizer(text)["input_ids"]
    r = client.post("/detokenize", json={"model": info.path, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": info.tokenizer.decode(ids)}
    assert info.bos_token and r.json()["prompt"].startswith(info.bos_token)    # as vLLM: not skipped
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 7}, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "hi", "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "bad \ud800 surrogate"}, "prompt"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2.5]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, True]}, "tokens[1]"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_an_openai_400(client, path, body, param):
    # json.dumps escapes the lone surrogate (\ud800), as a client's JSON may carry it.
    assert_error(client.post(path, content=json.dumps(body), headers={"content-type": "application/json"}),
                 400, param)


def test_a_model_we_do_not_serve_is_a_404_and_a_body_that_is_not_json_a_400(client):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert_error(client.post(path, json={**body, "model": "other"}), 404, "model")
        assert_error(client.post(path, content=b"{nope", headers={"content-type": "application/json"}), 400)


def test_no_api_key_needed_as_in_vllm(info, fake):
    # vLLM guards /v1 (and /v2, /inference, /cohere) only; its /tokenize and /detokenize are open.
    with _router(info, fake, api_keys=["sk-one"]) as r, httpx.Client(base_url=r.url, timeout=10) as http:
        assert http.post("/v1/completions", json={"prompt": "hi"}).status_code == 401
        assert http.post("/tokenize", json={"prompt": "hi"}).json()["tokens"] == info.tokenizer("hi")["input_ids"]
        assert http.post("/detokenize", json={"tokens": [1]}).status_code == 200
