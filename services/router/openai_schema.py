"""OpenAI request bodies (with vLLM's extensions) and their translation into SamplingParams.

Owns what a client may send and how it maps onto services.sampling_params. Types are strict (a
string is not a number, `true` is not 1) and every failure becomes an APIError(400) naming the
field; unknown fields are ignored, as vLLM does, so newer clients keep working.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pagedserve.services.router.errors import APIError, bad_request
from pagedserve.services.sampling_params import SamplingParams, SamplingParamsError


T = TypeVar("T")
# A list whose validation stops at its first bad item: pydantic otherwise builds an error for every
# item, for every member of a union (a prompt of 65,536 `["a"]` took 1.1 s, holding the GIL).
FastList = Annotated[list[T], Field(fail_fast=True)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        # OpenAI declares its optional fields nullable: `null` asks for the default, never a 400.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False      # vLLM's: every chunk carries the usage so far


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""
    model: str | None = None
    # Not OpenAI's: a benchmark's true output length, read only by the Orca baselines (which
    # reserve it); a server under --allocation orca-pow2 / orca-oracle rejects requests without it.
    true_output_len: int | None = Field(default=None, ge=1)
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | FastList[str] | None = None
    stop_token_ids: FastList[int] | None = None
    allowed_token_ids: FastList[int] | None = None   # vLLM's: only these ids can be sampled
    ignore_eos: bool = False
    min_tokens: int = 0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stream_interval: int | None = Field(default=None, ge=1)   # vLLM's: raises --stream-interval for this stream
    logit_bias: dict[str, float] | None = None
    # Structured output (services/router/constraints.py reads these): OpenAI's response_format,
    # vLLM's structured_outputs and its older guided_* fields.
    response_format: dict | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    prompt_logprobs: int | None = None
    return_token_ids: bool = False            # vLLM's: prompt_token_ids and token_ids in the response
    return_tokens_as_token_ids: bool | None = None   # vLLM's: logprobs name tokens "token_id:N"
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: the context)
    # vLLM's fields that are not served: read only to refuse them (a 400 naming the field, never
    # silently ignored; refuse_unserved).
    bad_words: Any = None
    priority: Any = None
    logits_processors: Any = None
    guided_whitespace_pattern: Any = None


class CompletionRequest(_SamplingFields):
    prompt: str | FastList[int] | FastList[str] | FastList[FastList[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatTemplateFields(_Strict):
    """What the chat template is rendered from (services/router/chat_template.py render_prompt); chat
    completions and /tokenize take the same fields, with vLLM's defaults."""
    messages: FastList[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False          # as vLLM: the chat template writes the BOS itself
    # Extra variables for the template (vLLM's); the two flags above win over keys of the same name.
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(ChatTemplateFields, _SamplingFields):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    # Tool calling: tool_choice "required" or a named function constrains the output to the tools'
    # argument schemas (services/router/tools.py); "auto" needs a model's tool parser: a 400.
    tools: list | None = None
    tool_choice: Any = None
    # OpenAI's: false allows at most one call (tool_choice "required" then makes exactly one).
    parallel_tool_calls: bool = True
    functions: list | None = None
    function_call: Any = None


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize body: its completion form (`prompt`) or its chat form (`messages`), one of
    the two. add_special_tokens defaults by form, as in vLLM: true for a prompt, false for chat."""
    model: str | None = None
    prompt: str | None = None
    messages: FastList[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: FastList[int]


def openapi_body(model: type[BaseModel]) -> dict:
    """The route's OpenAPI request body, for `openapi_extra`: the routes read the raw body
    themselves (parse_body: 400s named by field, not FastAPI's 422s), so FastAPI cannot see it.
    Nested models are inlined: the route's schema stands alone, with no components to register."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref[len("#/$defs/"):]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


@dataclass(frozen=True)
class BodyLimits:
    """What a body may hold, read from its bytes and its shape before it is parsed (issue 28).

    Parsing and validating hold the GIL for the whole body (json.loads and pydantic are single C
    calls), so a body's cost must be bounded before either runs, even in the offload pool: one
    `/detokenize` of 2,000,000 `[1]` (10 MB) took 11 s and restarted the router. Every container
    costs a Python object and a validation step; every value at least an object."""
    values: int = 1 << 20                       # array items and object members, containers included
    # Arrays and objects inside each other: far deeper than any request takes, but for a schema
    # nested as deep as --max-grammar-depth lets it, to which the router raises it (context.py).
    depth: int = 64
    containers: int = 1 << 16                   # arrays and objects, at any depth
    lists: Mapping[str, int] = field(default_factory=dict)    # top-level lists: their most items
    # Top-level fields that are a prompt or a batch of them: their most prompts (a flat list of
    # token ids is one prompt, bounded by the context, not counted here).
    batches: Mapping[str, int] = field(default_factory=dict)


def parse_body(raw: bytes, model: type[BaseModel], limits: BodyLimits | None = None) -> Any:
    """JSON bytes -> a validated request model, or APIError(400) in the OpenAI shape. The limits
    are checked before anything is parsed."""
    limits = limits or BodyLimits()
    _check_limits(raw, limits)
    too_deep = False
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    except RecursionError:      # the decoder recursed past Python's limit (depth ~1000)
        data, too_deep = {}, True
    if not isinstance(data, dict):   # (a body of `null` too: found by a black-box check)
        raise bad_request("The request body must be a JSON object")
    # Validation (and any later walk of the body) recurses too: a bound keeps a deep body a 400.
    if too_deep or _depth_exceeds(raw, data, limits.depth):
        raise bad_request(f"The request body is nested more than {limits.depth} levels deep")
    # The JSON escape \ud800 decodes to a str that no later step can encode (a 500, or a garbled
    # error message): refused here, for every field at once.
    bad = _lone_surrogate_at(data) if _LONE_SURROGATE.search(raw) else None
    if bad is not None:
        where = f"'{bad}'" if bad else "a field name"
        raise bad_request(f"{where} holds a lone surrogate (\\ud800-\\udfff without its pair); it is not "
                          f"valid Unicode", bad or None)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _check_limits(raw: bytes, limits: BodyLimits) -> None:
    values, containers = json_counts(raw)
    if containers > limits.containers:
        raise bad_request(f"The request body holds {containers} JSON arrays and objects; at most "
                          f"{limits.containers} are accepted")
    if values > limits.values:
        raise bad_request(f"The request body holds {values} JSON values; at most {limits.values} are accepted")
    # After the counts: a list of millions of items takes msgspec ~0.3 s to cut into raw items.
    _check_list_lengths(raw, limits)


def json_counts(raw: bytes) -> tuple[int, int]:
    """(values, containers) of a JSON text, from its bytes, never parsed: containers are its `[`
    and `{`, values those plus its `,` (each separates two items or members), all outside strings.

    The counts of the raw bytes bound them from above and cost ~1 ms per 10 MB; only a body over
    a limit by that bound is looked at closely: strings masked with numpy (a quote toggles, once
    the escaped backslashes and quotes are gone), whose loops release the GIL; ~100 ms for 16 MB."""
    bound_containers = raw.count(b"[") + raw.count(b"{")
    bound_values = bound_containers + raw.count(b",")
    if bound_values <= _PRECISE_FROM:
        return bound_values, bound_containers
    flat = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    outside = (np.cumsum(flat == ord('"'), dtype=np.uint8) & 1) == 0    # uint8: only the parity matters
    opens = np.count_nonzero(((flat == ord("[")) | (flat == ord("{"))) & outside)
    commas = np.count_nonzero((flat == ord(",")) & outside)
    return int(opens + commas), int(opens)


# Bodies whose raw counts stay under every limit need no close look (the smallest limit a router
# may be given is far above what a normal request holds).
_PRECISE_FROM = 4096


def _check_list_lengths(raw: bytes, limits: BodyLimits) -> None:
    """A top-level list longer than its limit -> 400, read before the body is parsed.

    msgspec reads only the body's shape here: the named lists' items stay raw bytes, never Python
    objects. A 100,000-message body (3.4 MB) is refused in ~12 ms, where json.loads alone takes
    ~70 ms holding the GIL, which stalls the event loop even from the offload pool (issue 28).
    A body whose shape does not fit (not JSON, a field of another type) is left to the full parse,
    which names the problem."""
    names = tuple(sorted({*limits.lists, *limits.batches}))
    if not names:
        return
    try:
        lists = _shape_decoder(names).decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):   # deep: msgspec's own limit
        return
    for name, most in limits.lists.items():
        items = getattr(lists, name)
        if isinstance(items, list) and len(items) > most:
            raise bad_request(f"{name} holds {len(items)} items; at most {most} are accepted", name)
    for name, most in limits.batches.items():
        items = getattr(lists, name)
        if isinstance(items, list) and len(items) > most and bytes(items[0])[:1] in (b'"', b"["):
            raise bad_request(f"at most {most} prompts per request, got {len(items)}", name)


_SHAPES: dict[tuple[str, ...], msgspec.json.Decoder] = {}


def _shape_decoder(names: tuple[str, ...]) -> msgspec.json.Decoder:
    if names not in _SHAPES:
        # A text (a prompt) decodes too, and is left alone; any other type leaves the check to the parse.
        fields = [(n, list[msgspec.Raw] | str | None, None) for n in names]
        _SHAPES[names] = msgspec.json.Decoder(msgspec.defstruct("Shape", fields))
    return _SHAPES[names]


def _depth_exceeds(raw: bytes, data, limit: int) -> bool:
    """Whether data nests more than limit containers deep (iterative: no recursion to run out of)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:     # the usual body: too few brackets to be deep
        return False
    todo = [(data, 1)] if isinstance(data, (dict, list)) else []
    while todo:
        node, depth = todo.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        todo.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


# A surrogate can only come from a \\uD800-\\uDFFF escape (UTF-8 bytes of one do not decode):
# bodies without one need no walk.
_LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate_at(data: dict) -> str | None:
    """The top-level field (stop, messages) in which a key or string holds an unpaired surrogate;
    None when none does. Iterative: a wide body costs no recursion."""
    for field, value in data.items():
        if not _encodes(field):
            return ""
        todo = [value]
        while todo:
            node = todo.pop()
            if isinstance(node, str) and not _encodes(node):
                return field
            if isinstance(node, dict):
                todo.extend(node.keys())
                todo.extend(node.values())
            elif isinstance(node, list):
                todo.extend(node)
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*|dict\[.*|literal\[.*|function-.*|[A-Z]\w*)$")


def validation_error(errors: list) -> APIError:
    """pydantic/FastAPI error list -> one 400 naming the first offending field."""
    if not errors:
        return bad_request("Invalid request")
    first = errors[0]
    # The full path (messages[0].role), cut at pydantic's first union-member tag (str, list[int], ...).
    loc = []
    for p in first.get("loc", ()):
        if p == "body":
            continue
        if isinstance(p, str) and _UNION_TAG.match(p):
            break
        loc.append(f"[{p}]" if isinstance(p, int) else ("." if loc else "") + str(p))
    param = "".join(loc) if loc else None
    if first.get("type") == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {first.get('msg')}")
    if first.get("type") == "missing":
        return bad_request(f"Missing required field '{param}'", param)
    where = f"'{param}'" if param else "the request"
    return bad_request(f"Invalid value for {where}: {first.get('msg')}", param)


# vLLM's sampling fields this server does not serve -> why, for the 400 that names each.
UNSERVED = {
    "bad_words": "bad_words is not supported; use logit_bias with -100 on the words' token ids",
    "logits_processors": "logits_processors is not supported (no custom logits processors are loaded)",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported: structured outputs write "
                                 "compact whitespace",
}


def refuse_unserved(req: _SamplingFields) -> None:
    """A 400 for the first vLLM field given that is not served (priority 0 is the default)."""
    for name, why in UNSERVED.items():
        if getattr(req, name) not in (None, []):
            raise bad_request(why, name)
    if req.priority not in (None, 0):
        raise bad_request("priority scheduling is not enabled: requests are served first come, first served",
                          "priority")


def sampling_params(req: _SamplingFields, *, max_tokens: int, logprobs: int | None, vocab_size: int,
                    max_stop_strings: int, prompt_logprobs: int | None = None,
                    structured_outputs: dict | None = None) -> tuple[SamplingParams, int]:
    """The request's SamplingParams (validated) and how many choices the client gets back.

    params.n is what the scheduler runs: best_of when it exceeds n (the best n are returned).
    The API's own limits (OpenAI's, narrower than what the engine takes) are checked here."""
    logit_bias = {}
    if len(req.logit_bias or ()) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    for key, bias in (req.logit_bias or {}).items():
        if not _TOKEN_ID.fullmatch(key) or int(key) >= vocab_size:
            raise bad_request(f"logit_bias keys must be token ids below {vocab_size}, got {key!r}", "logit_bias")
        logit_bias[int(key)] = bias
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs cannot be streamed", "prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be given when stream is true", "stream_options")
    if req.n < 1:
        raise bad_request(f"n must be at least 1, got {req.n}", "n")
    best_of = req.best_of if req.best_of is not None else req.n
    if best_of < req.n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({req.n})", "best_of")
    if req.stream and best_of > req.n and not req.use_beam_search:
        raise bad_request("best_of greater than n cannot be streamed", "best_of")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > max_stop_strings:
        raise bad_request(f"at most {max_stop_strings} stop strings, got {len(stop)}", "stop")
    if req.temperature is not None and req.temperature > MAX_TEMPERATURE:
        raise bad_request(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {req.temperature}", "temperature")
    for name in ("stop_token_ids", "allowed_token_ids"):
        outside = [t for t in getattr(req, name) or () if not 0 <= t < vocab_size]
        if outside:
            raise bad_request(f"{name} must be token ids below {vocab_size}, got {outside[0]}", name)
    fields = dict(
        n=best_of if not req.use_beam_search else req.n,
        max_tokens=max_tokens, min_tokens=req.min_tokens,
        # Beam search is greedy; with one beam (n 1, no best_of) the engine sees beam_width 1, no
        # beam search, so the greedy choice is asked for here (it sampled at temperature 1 before).
        temperature=0.0 if req.use_beam_search and best_of == 1 else _default(req.temperature, 1.0),
        top_p=_default(req.top_p, 1.0),
        top_k=_default(req.top_k, 0), min_p=_default(req.min_p, 0.0),
        presence_penalty=_default(req.presence_penalty, 0.0),
        frequency_penalty=_default(req.frequency_penalty, 0.0),
        repetition_penalty=_default(req.repetition_penalty, 1.0),
        seed=req.seed, logprobs=logprobs, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
        allowed_token_ids=req.allowed_token_ids,
        ignore_eos=req.ignore_eos, beam_width=best_of if req.use_beam_search else 1,
        length_penalty=req.length_penalty, early_stopping=req.early_stopping,
        cache_salt=req.cache_salt, skip_special_tokens=req.skip_special_tokens, logit_bias=logit_bias,
        prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        structured_outputs=structured_outputs)
    try:
        params = SamplingParams(**fields).validate()
    except SamplingParamsError as e:
        # The engine runs best_of sequences (its n, or beam_width for beams): a bound they break is
        # best_of's when the request set it above n.
        if e.param == "beam_width" or (e.param == "n" and best_of > req.n):
            message = e.message
            if message.startswith(e.param):
                message = "best_of" + message[len(e.param):]
            raise bad_request(message, "best_of") from None
        raise bad_request(e.message, e.param) from None
    return params, req.n


# OpenAI's range (the engine itself takes any temperature).
MAX_TEMPERATURE = 2.0
# The sampler adds each bias row by row every step: a bound keeps a request from slowing its batch.
MAX_LOGIT_BIAS = 1024
# The scheduler checks each new token against them; vLLM sets no bound, a vocabulary's worth would
# travel with every step message (checked from the body's shape, before it is parsed).
MAX_STOP_TOKEN_IDS = 1024
_TOKEN_ID = re.compile(r"[0-9]{1,19}")


def _default(value, default):
    return default if value is None else value
