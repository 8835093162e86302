"""The differential suite's requests: what a client written for vLLM sends, a few hundred of them.

Built here, written once into tests/data/differential.jsonl with the expectations observed on our
stack (`python -m pagedserve.loadgen.differential record`), and read back from that file from then on. A case:

    {"id": str, "method": "POST", "path": "/v1/completions", "body": {...} | "raw": str,
     "headers": {...}, "serial": bool, "deliberate": str | None}

Bodies may hold placeholders that depend on the server, filled in just before sending
(loadgen.differential.materialize): the string "$MODEL" (the served model's name), and
{"$tokens": "L-4"}, a prompt of that many token ids (L is the server's max_model_len), and
{"$int": "L"}, so the same file runs against any model. `deliberate` names the README's deliberate difference a peer may show
on that case.
"""
from __future__ import annotations

import itertools

from pagedserve.services.router.openai_schema import ChatCompletionRequest, CompletionRequest

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Scheduler:", "x = [1, 2, 3]",
           "# A paged KV cache", "while True:"]
MESSAGES = [
    [{"role": "user", "content": "Write a function that adds two numbers."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block table?"}],
    [{"role": "developer", "content": "Answer in code."}, {"role": "user", "content": "Sort a list."}],
    [{"role": "user", "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "parts"}]}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "more"}],
]

# Deliberate differences (the README lists them); a case marked with one may differ on a peer.
STRICT_TYPES = "strict types: a string, float or boolean where a number or boolean is declared is a 400"
NULL_DEFAULT = "null is the default in every optional field, n and vLLM's own extensions too (vLLM refuses it there)"
N_GREEDY = "n > 1 at temperature 0 is allowed (vLLM refuses it)"
NOT_SERVED = 'tool_choice "auto" (the default with tools) is refused with a 400: it needs a tool parser'
COMPACT = "structured JSON output has compact whitespace (no blanks between tokens); vLLM's allows any"
BEST_OF = "best_of is served: below n it is a 400 (OpenAI's rule), and it cannot be streamed; vLLM ignores it"
LOGIT_BIAS_RANGE = "logit_bias values must be in OpenAI's [-100, 100]; vLLM takes any"
EMPTY_PROMPT = "an empty prompt is a 400 in a batch too; vLLM refuses it alone only"
ROLES = "message roles are OpenAI's five; vLLM hands any role to the chat template"
OPENAI_ERRORS = ("every error is OpenAI-shaped, routing and body-parsing ones too; vLLM sends FastAPI's "
                 "{\"detail\": ...} for unknown routes, wrong methods and bodies nested too deep")
MODELS = "/v1/models entries have no legacy permission list"
HEALTH = "/health and /ping answer {\"status\": \"ok\"}; vLLM an empty body"
SCORE = "echo with max_tokens 0 counts 0 completion tokens; vLLM counts the one token it made"
CHAT_ECHO = "chat echo computes no prompt_logprobs unasked; vLLM returns them"
ECHO_STREAM_IDS = "a streamed echo has prompt_token_ids only with return_token_ids; vLLM's always has them"
REQUEST_ID = "a malformed X-Request-Id is a 400; vLLM ignores the header"
# vLLM's own fields whose null vLLM refuses (its schema does not declare them nullable).
VLLM_REFUSES_NULL = {"n", "add_special_tokens", "ignore_eos", "include_stop_str_in_output", "length_penalty",
                     "min_tokens", "skip_special_tokens", "use_beam_search", "add_generation_prompt",
                     "continue_final_message", "echo"}


def _case(cid: str, path: str, body=None, *, method: str = "POST", raw: str | None = None, headers=None,
          serial: bool = False, deliberate: str | None = None) -> dict:
    out = {"id": cid, "method": method, "path": path}
    if raw is not None:
        out["raw"] = raw
    elif body is not None:
        out["body"] = body
    if headers:
        out["headers"] = headers
    if serial:
        out["serial"] = True
    if deliberate:
        out["deliberate"] = deliberate
    return out


def _cmpl(**fields) -> dict:
    return {"model": "$MODEL", **fields}


def completion_cases() -> list[dict]:
    out = []
    variants = [
        ("plain", {"max_tokens": 8}),
        ("logprobs0", {"max_tokens": 6, "logprobs": 0}),
        ("logprobs3", {"max_tokens": 6, "logprobs": 3}),
        ("echo", {"max_tokens": 4, "echo": True}),
        ("echo-logprobs", {"max_tokens": 4, "echo": True, "logprobs": 1}),
        ("stop", {"max_tokens": 12, "stop": ["\n", "):"]}),
        ("stop-include", {"max_tokens": 12, "stop": ["(", " "], "include_stop_str_in_output": True}),
        ("ignore-eos", {"max_tokens": 8, "ignore_eos": True}),
        ("min-tokens", {"max_tokens": 8, "min_tokens": 4}),
        ("special", {"max_tokens": 6, "skip_special_tokens": False}),
        ("token-ids", {"max_tokens": 6, "return_token_ids": True}),
        ("no-specials", {"max_tokens": 6, "add_special_tokens": False}),
        ("penalties", {"max_tokens": 8, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                       "repetition_penalty": 1.2}),
        ("top-k1", {"max_tokens": 6, "top_k": 1, "temperature": 1.0}),
        ("logit-bias", {"max_tokens": 6, "logit_bias": {"5": 100}}),
        ("beam", {"max_tokens": 6, "n": 2, "best_of": 2, "use_beam_search": True}),
        ("prompt-logprobs", {"max_tokens": 3, "prompt_logprobs": 1}),
        ("user", {"max_tokens": 3, "user": "someone", "seed": 3}),
    ]
    for (name, fields), (p, prompt) in itertools.product(variants, enumerate(PROMPTS[:4])):
        body = _cmpl(prompt=prompt, **{"temperature": 0, **fields})
        out.append(_case(f"cmpl-{name}-p{p}", "/v1/completions", body))
        if name not in ("beam", "prompt-logprobs") and p < 2:
            out.append(_case(f"cmpl-{name}-p{p}-stream", "/v1/completions", {**body, "stream": True},
                             deliberate=ECHO_STREAM_IDS if body.get("echo") else None))
    streams = [
        ("usage", {"stream_options": {"include_usage": True}}),
        ("continuous", {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
        ("echo-logprobs", {"echo": True, "logprobs": 2}),
        ("logprobs", {"logprobs": 1, "stream_options": {"include_usage": True}}),
        ("token-ids", {"return_token_ids": True}),
    ]
    for name, fields in streams:
        out.append(_case(f"cmpl-stream-{name}", "/v1/completions",
                         _cmpl(prompt=PROMPTS[4], temperature=0, max_tokens=6, stream=True, **fields),
                         deliberate=ECHO_STREAM_IDS if fields.get("echo") else None))
    out += [
        _case("cmpl-token-prompt", "/v1/completions", _cmpl(prompt=[1, 322, 287, 40], temperature=0, max_tokens=6)),
        _case("cmpl-token-prompt-echo", "/v1/completions",
              _cmpl(prompt=[1, 322, 287, 40], temperature=0, max_tokens=3, echo=True)),
        _case("cmpl-batch-text", "/v1/completions", _cmpl(prompt=PROMPTS[:3], temperature=0, max_tokens=5)),
        _case("cmpl-batch-tokens", "/v1/completions", _cmpl(prompt=[[1, 322], [1, 40, 41]], temperature=0,
                                                            max_tokens=5)),
        _case("cmpl-batch-stream", "/v1/completions", _cmpl(prompt=PROMPTS[:2], temperature=0, max_tokens=5,
                                                            stream=True)),
        _case("cmpl-n2-greedy", "/v1/completions", _cmpl(prompt=PROMPTS[0], temperature=0, max_tokens=5, n=2),
              deliberate=N_GREEDY),
        _case("cmpl-n3-sampled", "/v1/completions", _cmpl(prompt=PROMPTS[0], max_tokens=5, n=3, seed=7)),
        _case("cmpl-best-of", "/v1/completions", _cmpl(prompt=PROMPTS[1], max_tokens=5, n=1, best_of=3, seed=1)),
        _case("cmpl-sampled-top-p", "/v1/completions", _cmpl(prompt=PROMPTS[2], max_tokens=5, top_p=0.9,
                                                             min_p=0.05, seed=11)),
        _case("cmpl-default-max-tokens", "/v1/completions", _cmpl(prompt=PROMPTS[3], temperature=0)),
        _case("cmpl-null-max-tokens", "/v1/completions", _cmpl(prompt=PROMPTS[3], temperature=0, max_tokens=None)),
        _case("cmpl-score-prompt", "/v1/completions",
              _cmpl(prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=0, temperature=0), deliberate=SCORE),
        _case("cmpl-score-prompt-top", "/v1/completions",
              _cmpl(prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=5, temperature=0), deliberate=SCORE),
        _case("cmpl-stop-token-ids", "/v1/completions",
              _cmpl(prompt=PROMPTS[0], temperature=0, max_tokens=10, stop_token_ids=[2, 10])),
        _case("cmpl-temperature-2", "/v1/completions", _cmpl(prompt=PROMPTS[0], temperature=2, max_tokens=3,
                                                             seed=5)),
        _case("cmpl-four-stops", "/v1/completions", _cmpl(prompt=PROMPTS[0], temperature=0, max_tokens=6,
                                                          stop=["a", "b", "c", "d"])),
        _case("cmpl-model-omitted", "/v1/completions", {"prompt": PROMPTS[0], "temperature": 0, "max_tokens": 4}),
        _case("cmpl-unknown-field", "/v1/completions", _cmpl(prompt=PROMPTS[0], temperature=0, max_tokens=4,
                                                             some_new_field=1)),
        _case("cmpl-response-format-text", "/v1/completions",
              _cmpl(prompt=PROMPTS[0], temperature=0, max_tokens=4, response_format={"type": "text"})),
        _case("cmpl-guided-choice", "/v1/completions",
              _cmpl(prompt=PROMPTS[0], temperature=0, max_tokens=8, guided_choice=["yes", "no"])),
        _case("cmpl-structured-regex", "/v1/completions",
              _cmpl(prompt=PROMPTS[1], temperature=0, max_tokens=12,
                    structured_outputs={"regex": "[a-z]{3}-[0-9]{2}"})),
        _case("cmpl-json-object", "/v1/completions",
              _cmpl(prompt=PROMPTS[2], temperature=0, max_tokens=16, response_format={"type": "json_object"}),
              deliberate=COMPACT),
    ]
    return out


def chat_cases() -> list[dict]:
    out = []
    variants = [
        ("plain", {"max_tokens": 8}),
        ("max-completion-tokens", {"max_completion_tokens": 6}),
        ("logprobs", {"max_tokens": 5, "logprobs": True}),
        ("top-logprobs", {"max_tokens": 5, "logprobs": True, "top_logprobs": 3}),
        ("stop", {"max_tokens": 12, "stop": " "}),
        ("token-ids", {"max_tokens": 5, "return_token_ids": True}),
        ("special", {"max_tokens": 5, "skip_special_tokens": False, "ignore_eos": True}),
    ]
    for (name, fields), (m, messages) in itertools.product(variants, enumerate(MESSAGES)):
        body = {"model": "$MODEL", "messages": messages, "temperature": 0, **fields}
        out.append(_case(f"chat-{name}-m{m}", "/v1/chat/completions", body))
        if m < 2:
            out.append(_case(f"chat-{name}-m{m}-stream", "/v1/chat/completions", {**body, "stream": True}))
    m0 = MESSAGES[0]
    extra = [
        ("stream-usage", {"stream": True, "max_tokens": 6, "stream_options": {"include_usage": True}}),
        ("stream-continuous", {"stream": True, "max_tokens": 6,
                               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
        ("no-generation-prompt", {"max_tokens": 5, "add_generation_prompt": False}),
        ("continue-final", {"messages": [*m0, {"role": "assistant", "content": "def add"}], "max_tokens": 5,
                            "add_generation_prompt": False, "continue_final_message": True}),
        ("echo", {"messages": [*m0, {"role": "assistant", "content": "def add"}], "max_tokens": 5,
                  "add_generation_prompt": False, "continue_final_message": True, "echo": True}),
        ("tools-none", {"max_tokens": 4, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                        "tool_choice": "none"}),
        ("tool-choice-auto-no-tools", {"max_tokens": 4, "tool_choice": "auto"}),
        ("add-special-tokens", {"max_tokens": 4, "add_special_tokens": True}),
        ("default-max-tokens", {"stop": "\n"}),
        ("n2-greedy", {"max_tokens": 4, "n": 2}),
        ("sampled", {"max_tokens": 4, "temperature": 0.8, "seed": 3}),
        ("assistant-null-content", {"messages": [*m0, {"role": "assistant", "content": None},
                                                 {"role": "user", "content": "go"}], "max_tokens": 4}),
        ("name", {"messages": [{"role": "user", "content": "hi", "name": "bob"}], "max_tokens": 4}),
        ("json-schema", {"max_tokens": 24, "response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "strict": True, "schema": {"type": "object", "required": ["ok"],
                                                          "properties": {"ok": {"type": "boolean"}}}}}}),
        ("tool-named", {"max_tokens": 24, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ]
    for name, fields in extra:
        body = {"model": "$MODEL", "messages": m0, "temperature": 0, **fields}
        out.append(_case(f"chat-{name}", "/v1/chat/completions", body,
                         deliberate={"n2-greedy": N_GREEDY, "echo": CHAT_ECHO, "json-schema": COMPACT,
                                     "tool-named": COMPACT}.get(name)))
    return out


def context_edge_cases() -> list[dict]:
    edge = {"$tokens": "L-4"}
    return [
        _case("edge-default", "/v1/completions", _cmpl(prompt=edge, temperature=0)),
        _case("edge-max-tokens-100", "/v1/completions", _cmpl(prompt=edge, temperature=0, max_tokens=100)),
        _case("edge-max-tokens-3", "/v1/completions", _cmpl(prompt=edge, temperature=0, max_tokens=3)),
        _case("edge-stream", "/v1/completions", _cmpl(prompt=edge, temperature=0, max_tokens=50, stream=True)),
        _case("edge-ignore-eos", "/v1/completions", _cmpl(prompt=edge, temperature=0, max_tokens={"$int": "L"},
                                                          ignore_eos=True)),
        _case("edge-past-the-context", "/v1/completions", _cmpl(prompt="x", max_tokens={"$int": "L+1"})),
        _case("edge-one-left", "/v1/completions", _cmpl(prompt={"$tokens": "L-1"}, temperature=0, max_tokens=5)),
        _case("edge-full", "/v1/completions", _cmpl(prompt={"$tokens": "L"}, max_tokens=1)),
        _case("edge-over", "/v1/completions", _cmpl(prompt={"$tokens": "L+10"})),
        _case("edge-batch", "/v1/completions", _cmpl(prompt=[[5, 6, 7], {"$tokens": "L-2"}], temperature=0,
                                                     max_tokens=4, ignore_eos=True)),
    ]


def null_cases() -> list[dict]:
    """Every optional field sent as null, one at a time and all at once: null means the default."""
    out = []
    for path, model, base in [("/v1/completions", CompletionRequest, {"prompt": PROMPTS[0]}),
                              ("/v1/chat/completions", ChatCompletionRequest, {"messages": MESSAGES[0]})]:
        kind = "cmpl" if "chat" not in path else "chat"
        fields = sorted(name for name, f in model.model_fields.items() if not f.is_required())
        for name in fields:
            body = {"model": "$MODEL", "temperature": 0, "max_tokens": 4, **base, name: None}
            out.append(_case(f"{kind}-null-{name}", path, body,
                             deliberate=NULL_DEFAULT if name in VLLM_REFUSES_NULL else None))
        out.append(_case(f"{kind}-null-all", path, {**{name: None for name in fields}, **base, "model": "$MODEL"},
                         deliberate=NULL_DEFAULT))
    return out


def bad_cases() -> list[dict]:
    cm = [
        ("temperature-negative", {"temperature": -1}, None), ("temperature-string", {"temperature": "hot"}, None),
        ("temperature-3", {"temperature": 3}, None), ("top-p-0", {"top_p": 0}, None),
        ("top-p-1.5", {"top_p": 1.5}, None), ("top-k-minus-2", {"top_k": -2}, None),
        ("min-p-2", {"min_p": 2}, None), ("n-0", {"n": 0}, None), ("n-true", {"n": True}, STRICT_TYPES),
        ("max-tokens-0", {"max_tokens": 0}, None), ("max-tokens-float", {"max_tokens": 1.5}, STRICT_TYPES),
        ("max-tokens-string", {"max_tokens": "5"}, STRICT_TYPES), ("max-tokens-negative", {"max_tokens": -1}, None),
        ("min-over-max", {"max_tokens": 5, "min_tokens": 6}, None), ("logprobs-50", {"logprobs": 50}, None),
        ("presence-3", {"presence_penalty": 3}, None), ("frequency-minus-2.5", {"frequency_penalty": -2.5}, None),
        ("repetition-0", {"repetition_penalty": 0}, None), ("stop-empty", {"stop": ""}, None),
        ("stop-ints", {"stop": [1, 2]}, None), ("stop-five", {"stop": ["a", "b", "c", "d", "e"]}, None),
        ("stop-token-negative", {"stop_token_ids": [-1]}, None),
        ("stop-token-outside", {"stop_token_ids": [10 ** 6]}, None),
        ("seed-huge", {"seed": 2 ** 70}, None), ("best-of-below-n", {"n": 2, "best_of": 1}, BEST_OF),
        ("best-of-stream", {"n": 1, "best_of": 2, "stream": True}, BEST_OF),
        ("logit-bias-word", {"logit_bias": {"five": 1.0}}, None),
        ("logit-bias-outside", {"logit_bias": {"99999999": 1.0}}, None),
        ("logit-bias-300", {"logit_bias": {"5": 300}}, LOGIT_BIAS_RANGE),
        ("suffix", {"suffix": "y"}, None), ("prompt-logprobs-stream", {"prompt_logprobs": 1, "stream": True}, None),
        ("ignore-eos-string", {"ignore_eos": "yes"}, STRICT_TYPES),
        ("stream-options-no-stream", {"stream_options": {"include_usage": True}}, None),
        ("response-format-yaml", {"response_format": {"type": "yaml"}}, None),
        ("guided-choice-empty", {"guided_choice": []}, None),
        ("guided-json-bad-type", {"guided_json": {"type": "object", "properties": {"a": {"type": "foo"}}}}, None),
        ("prompt-logprobs-21", {"prompt_logprobs": 21}, None),
        ("echo-string", {"echo": "yes"}, STRICT_TYPES),
        ("stream-string", {"stream": "true"}, STRICT_TYPES),
        ("unknown-model", {"model": "no-such-model"}, None),
    ]
    out = [_case(f"bad-cmpl-{name}", "/v1/completions", {"model": "$MODEL", "prompt": "x", **fields},
                 deliberate=why) for name, fields, why in cm]
    prompts = [("empty-list", []), ("empty-text", ""), ("empty-in-batch", ["x", ""]), ("token-outside", [1, 99999999]),
               ("token-negative", [1, -3]), ("object", {"a": 1}), ("null", None), ("number", 5)]
    out += [_case(f"bad-cmpl-prompt-{name}", "/v1/completions", {"model": "$MODEL", "prompt": p},
                  deliberate=EMPTY_PROMPT if name == "empty-in-batch" else None) for name, p in prompts]
    out.append(_case("bad-cmpl-no-prompt", "/v1/completions", {"model": "$MODEL"}))
    m = MESSAGES[0]
    ch = [
        ("messages-empty", {"messages": []}, None), ("messages-string", {"messages": "hi"}, None),
        ("role-missing", {"messages": [{"content": "hi"}]}, None),
        ("role-unknown", {"messages": [{"role": "wizard", "content": "hi"}]}, ROLES),
        ("top-logprobs-without", {"messages": m, "top_logprobs": 2}, None),
        ("top-logprobs-21", {"messages": m, "logprobs": True, "top_logprobs": 21}, None),
        ("max-completion-tokens-0", {"messages": m, "max_completion_tokens": 0}, None),
        ("image-part", {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                   "image_url": {"url": "http://x/y.png"}}]}]}, None),
        ("tools-called", {"messages": m, "tools": [{"type": "function", "function": {"name": "f"}}]}, NOT_SERVED),
        ("tools-empty", {"messages": m, "tools": []}, None),
        ("tool-choice-required", {"messages": m, "tool_choice": "required"}, None),
        ("response-format-schema-missing", {"messages": m, "response_format": {"type": "json_schema"}}, None),
        ("both-continue-and-generate", {"messages": [{"role": "assistant", "content": "hi"}],
                                        "continue_final_message": True}, None),
        ("temperature-2.5", {"messages": m, "temperature": 2.5}, None),
        ("logprobs-int", {"messages": m, "logprobs": 1}, STRICT_TYPES),
        ("stop-token-outside", {"messages": m, "stop_token_ids": [10 ** 6]}, None),
        ("n-0", {"messages": m, "n": 0}, None),
        ("unknown-model", {"messages": m, "model": "no-such-model"}, None),
    ]
    out += [_case(f"bad-chat-{name}", "/v1/chat/completions", {"model": "$MODEL", **fields}, deliberate=why)
            for name, fields, why in ch]
    deep = "[" * 1500 + "]" * 1500
    raws = [("not-json", "{not json"), ("array", "[1, 2]"), ("empty", ""), ("deep", '{"prompt": "x", "user": %s}' % deep),
            ("deep-object", '{"prompt": "x", "user": ' + '{"a":' * 1500 + "1" + "}" * 1500 + "}")]
    out += [_case(f"bad-raw-{name}", "/v1/completions", raw=raw, headers={"Content-Type": "application/json"},
                  deliberate=OPENAI_ERRORS if name.startswith("deep") else None) for name, raw in raws]
    return out


def endpoint_cases() -> list[dict]:
    return [
        _case("get-models", "/v1/models", method="GET", deliberate=MODELS),
        _case("get-health", "/health", method="GET", deliberate=HEALTH),
        _case("get-ping", "/ping", method="GET", deliberate=HEALTH),
        _case("post-ping", "/ping", method="POST", deliberate=HEALTH),
        _case("get-version", "/version", method="GET"),
        _case("get-unknown", "/v1/nothing-here", method="GET", deliberate=OPENAI_ERRORS),
        _case("get-completions", "/v1/completions", method="GET", deliberate=OPENAI_ERRORS),
        _case("cors-preflight", "/v1/completions", method="OPTIONS",
              headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST",
                       "Access-Control-Request-Headers": "content-type,authorization"}),
        _case("cors-simple", "/v1/completions", _cmpl(prompt="x", max_tokens=1, temperature=0),
              headers={"Origin": "http://example.com"}),
        # A retry with the id of a finished request starts again (serial: in this order).
        _case("request-id-first", "/v1/completions", _cmpl(prompt="x", max_tokens=2, temperature=0),
              headers={"X-Request-Id": "diff-retry-1"}, serial=True),
        _case("request-id-again", "/v1/completions", _cmpl(prompt="x", max_tokens=2, temperature=0),
              headers={"X-Request-Id": "diff-retry-1"}, serial=True),
        _case("request-id-bad", "/v1/completions", _cmpl(prompt="x", max_tokens=2),
              headers={"X-Request-Id": "bad id!"}, deliberate=REQUEST_ID),
    ]


def build_cases() -> list[dict]:
    cases = completion_cases() + chat_cases() + context_edge_cases() + null_cases() + bad_cases() + endpoint_cases()
    ids = [c["id"] for c in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return cases
