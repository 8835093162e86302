"""Structured outputs through the whole stack (real processes, the openai SDK) on the random tiny
model, the hardest case: without the mask it never writes valid JSON. Every choice that ends with
"stop" must parse and validate (or match its regex / choice / grammar); one cut by max_tokens says
"length". The pool is small so that a burst of requests is preempted (recompute for single
sequences, swap for n > 1, under --preemption-mode auto) while its grammars run.
"""
from __future__ import annotations

import json
import re
import threading
import urllib.request

import jsonschema_rs
import openai
import pytest

from pagedserve.loadgen.stack import Stack

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "home"],
          "properties": {
              "name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer", "minimum": 0, "maximum": 150},
              "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
              "home": {"type": "object", "additionalProperties": False, "required": ["zip"],
                       "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


@pytest.fixture(scope="module")
def stack(tiny_llama):
    s = Stack(tiny_llama, "--num-device-blocks", "32", "--preemption-mode", "auto")
    yield s
    s.stop()


def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_json(choice_text: str, finish_reason: str, schema: dict) -> bool:
    """True when it ended with stop (and then it must validate); a length cut is allowed to be partial."""
    assert finish_reason in ("stop", "length"), finish_reason
    if finish_reason == "length":
        return False
    value = json.loads(choice_text)
    assert jsonschema_rs.validator_for(schema).is_valid(value), choice_text
    return True


def test_json_schema_in_chat_and_completions(stack, tiny_llama):
    c = client(stack)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = c.chat.completions.create(model=tiny_llama, messages=[{"role": "user", "content": "a person"}],
                                     response_format=rf, max_tokens=200, temperature=1.0, seed=1, n=3)
    got = [check_json(ch.message.content, ch.finish_reason, PERSON) for ch in chat.choices]
    cmpl = c.completions.create(model=tiny_llama, prompt="person:", max_tokens=200, temperature=0.8, seed=2,
                                extra_body={"response_format": rf})
    got.append(check_json(cmpl.choices[0].text, cmpl.choices[0].finish_reason, PERSON))
    assert sum(got) >= 2, "most outputs end within 200 tokens"
    assert " " not in cmpl.choices[0].text.split('"name"')[0], "compact whitespace"


def test_json_object_regex_choice_grammar(stack, tiny_llama):
    c = client(stack)

    def run(body, **kw):
        kw = {"max_tokens": 120, "temperature": 1.0, "seed": 7, **kw}
        out = c.completions.create(model=tiny_llama, prompt="x = ", extra_body=body, **kw)
        return [(ch.text, ch.finish_reason) for ch in out.choices]

    for text, why in run({"structured_outputs": {"json_object": True}}, n=2, max_tokens=160):
        if why == "stop":
            assert isinstance(json.loads(text), dict)
    for body in ({"guided_regex": r"[a-z]{2,5}-[0-9]{3}"}, {"structured_outputs": {"regex": r"[a-z]{2,5}-[0-9]{3}"}}):
        for text, why in run(body, n=2):
            assert why == "stop" and re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", text), text
    for body in ({"guided_choice": ["yes", "no", "maybe"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        texts = [t for t, why in run(body, n=4) if why == "stop"]
        assert len(texts) == 4 and set(texts) <= {"yes", "no", "maybe"}
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for body in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        for text, why in run(body, n=2, max_tokens=60):
            if why == "stop":
                assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text
    # Streamed, the same rule holds for the joined text.
    chunks = c.completions.create(model=tiny_llama, prompt="x = ", max_tokens=40, seed=3, stream=True,
                                  extra_body={"guided_regex": r"[a-z]{2,5}-[0-9]{3}"})
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", "".join(ch.choices[0].text for ch in chunks if ch.choices))
    # Greedy too: the mask comes before the argmax.
    (text, why), = run({"guided_regex": "(true|false)"}, temperature=0)
    assert why == "stop" and text in ("true", "false")
    # A stop string still cuts (as vLLM): here at the dash the regex puts in.
    (text, why), = run({"guided_regex": r"[a-z]{3}-[0-9]{3}"}, stop=["-"])
    assert why == "stop" and re.fullmatch("[a-z]{3}", text), text


def test_tool_calls_required_and_named(stack, tiny_llama):
    c = client(stack)
    weather = {"type": "object", "additionalProperties": False, "required": ["city"],
               "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "maximum": 9}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                              "additionalProperties": False}}}]
    msgs = [{"role": "user", "content": "weather?"}]
    named = c.chat.completions.create(model=tiny_llama, messages=msgs, tools=tools, max_tokens=80, seed=3,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ch = named.choices[0]
    # A named function's call ends "stop" (OpenAI's, and vLLM's since its PR 25054); "required" below
    # ends "tool_calls".
    assert ch.finish_reason == "stop" and ch.message.content is None
    call, = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert jsonschema_rs.validator_for(weather).is_valid(json.loads(call.function.arguments))
    req = c.chat.completions.create(model=tiny_llama, messages=msgs, tools=tools, tool_choice="required",
                                    max_tokens=120, seed=4, n=2)
    for ch in req.choices:
        if ch.finish_reason == "length":
            continue
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
        for call in ch.message.tool_calls:
            assert call.function.name in ("get_weather", "now")
            json.loads(call.function.arguments)
    with pytest.raises(openai.BadRequestError, match="auto"):
        c.chat.completions.create(model=tiny_llama, messages=msgs, tools=tools, tool_choice="auto")
    # Streamed, the same seeds: OpenAI's tool_call deltas add up to the same calls.
    for choice, seed, n in (({"type": "function", "function": {"name": "get_weather"}}, 3, 1), ("required", 4, 2)):
        done = c.chat.completions.create(model=tiny_llama, messages=msgs, tools=tools, tool_choice=choice,
                                         max_tokens=120 if n == 2 else 80, seed=seed, n=n)
        streamed: dict = {}
        finish: dict = {}
        for chunk in c.chat.completions.create(model=tiny_llama, messages=msgs, tools=tools, tool_choice=choice,
                                               max_tokens=120 if n == 2 else 80, seed=seed, n=n, stream=True):
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    call = streamed.setdefault(ch.index, {}).setdefault(d.index, {"name": None, "args": ""})
                    if d.id is not None:
                        assert call["name"] is None and d.type == "function"   # the header comes once
                        call["name"] = d.function.name
                    call["args"] += d.function.arguments or ""
                if ch.finish_reason:
                    finish[ch.index] = ch.finish_reason
        for ch in done.choices:
            assert finish[ch.index] == ch.finish_reason
            if ch.finish_reason == "length":
                continue
            got = [(v["name"], json.loads(v["args"])) for _, v in sorted(streamed[ch.index].items())]
            assert got == [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls]


@pytest.mark.parametrize("body, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "foo"}}}}}}, "response_format.json_schema.schema", "foo"),
    ({"guided_regex": "(ab"}, "guided_regex", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar", "nothing"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured-output"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"guided_regex": "a+", "use_beam_search": True, "n": 2}, "use_beam_search", "beam"),
])
def test_a_bad_constraint_is_a_400_naming_it(stack, tiny_llama, body, param, says):
    c = client(stack)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=tiny_llama, prompt="x", max_tokens=4, extra_body=body)
    err = e.value.body
    assert err["param"] == param and says in err["message"], err


def test_preempted_and_cached_prefix_requests_keep_to_their_grammar(stack, tiny_llama):
    """A burst larger than the 32-block pool: single sequences are recomputed, n = 2 ones swapped;
    a long shared prompt is served from the prefix cache on its second use."""
    c = client(stack)
    pattern = r"(\d )+"
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n#"
    results, errors = [], []

    def one(i):
        try:
            out = c.completions.create(model=tiny_llama, prompt=prompt if i % 3 == 0 else f"seq {i}:",
                                       max_tokens=56, temperature=1.0, seed=i, n=2 if i % 4 == 1 else 1,
                                       extra_body={"guided_regex": pattern, "min_tokens": 0})
            results.append(out)
        except Exception as e:   # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for out in results:
        for ch in out.choices:
            assert re.fullmatch(r"(\d )*\d? ?", ch.text), ch.text        # a prefix of the language
            if ch.finish_reason == "stop":
                assert re.fullmatch(pattern, ch.text), ch.text
    # Whether a burst's copies of the shared prompt hit each other's blocks depends on which step
    # admits them (the same one: none is cached yet); one more after the burst must hit.
    again = c.completions.create(model=tiny_llama, prompt=prompt, max_tokens=8, temperature=1.0, seed=99,
                                 extra_body={"guided_regex": pattern, "min_tokens": 0})
    assert re.fullmatch(r"(\d )*\d? ?", again.choices[0].text), again.choices[0].text
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens, "the shared prompt hit the prefix cache"
    with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    preemptions = float(re.search(r"^vllm:num_preemptions_total\S* (\S+)$", metrics, re.M).group(1))
    assert preemptions > 0, "the burst was preempted"
