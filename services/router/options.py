"""What a router takes that `pagedserve serve`/`up` takes too and passes down: auth, limits, CORS.

One dataclass, inherited by the router's Config and by the launcher's, so each flag is written once
and the launcher hands it on with services.flags.to_argv (API keys travel in the environment, not
on a command line that `ps` shows). No web stack imported here: the launcher imports it.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pagedserve.services import config_fields as cf
from pagedserve.services.config_fields import at_least, positive
from pagedserve.services.flags import opt
from pagedserve.services.guided.spec import BACKENDS, DEFAULT_BACKEND

API_KEY_ENV = "PAGEDSERVE_API_KEY"


def _json_list(text: str) -> list[str]:
    value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("must be a JSON list of strings")
    return value


def _cors(default: list[str], help: str):
    return opt(default, f"{help} (a JSON list, as vLLM takes it)", parse=_json_list, show=lambda v: [json.dumps(v)])


@dataclass(kw_only=True)
class RouterOptions(cf.GrammarOptions):
    served_model_name: str | None = opt(None, "the model name clients send and see (default: the model's path)")
    api_keys: list[str] = opt([], "an API key clients must send as 'Authorization: Bearer KEY' on /v1/* "
                                  "(repeatable; the environment variable may hold several, comma-separated)",
                              flag="--api-key", env=API_KEY_ENV, split=False, metavar="KEY",
                              check=lambda keys: all(keys) or "an API key may not be empty")
    require_api_key: bool = opt(False, "ask for an API key even without --api-key (keys kept in Redis)")
    rate_limit: int | None = opt(None, "requests per window per API key (429 beyond it)", check=at_least(1))
    auth_failure_limit: int | None = opt(60, "requests with a wrong or missing API key one client address may "
                                             "send per rate-limit window; beyond it that address gets 429 on "
                                             "/v1/* (its keys unchecked) until the window has passed",
                                         check=at_least(1))
    rate_limit_window_s: float = opt(60.0, "seconds of the rate-limit window (an exact sliding window)",
                                     flag="--rate-limit-window", check=positive)
    max_queued_requests: int | None = opt(None, "sequences (prompts x n) a router holds that have not started "
                                                "(503 with Retry-After beyond it; a request alone larger is a 400)",
                                          check=at_least(1))
    max_queued_tokens: int | None = opt(None, "prompt tokens of the requests a router holds that have not "
                                              "started (503 with Retry-After beyond it)", check=at_least(1))
    max_request_body_mb: float = opt(16.0, "the largest request body in MiB (413 beyond it, before parsing)",
                                     check=positive)
    # Work that grows with a body (parsing, chat templates, tokenizing) runs in a bounded pool, off
    # the event loop (services/router/offload.py).
    offload_threads: int = opt(1, "threads that parse, render and tokenize large request bodies off the "
                                  "event loop", check=at_least(1))
    offload_queue: int = opt(16, "large request bodies that may wait for an offload thread (503 with "
                                 "Retry-After beyond it)", check=at_least(0))
    max_chat_messages: int = opt(4096, "messages a chat request or /tokenize body may hold (400 beyond it, "
                                       "before they are validated or rendered)", check=at_least(1))
    # Parsing holds the GIL for the whole body: its JSON is bounded from its bytes before it is
    # parsed (services/router/openai_schema.py BodyLimits; issue 28).
    max_json_values: int = opt(1 << 20, "JSON values (array items, object members) a request body may hold "
                                        "(400 beyond it, before it is parsed)", check=at_least(4096))
    max_json_containers: int = opt(1 << 16, "JSON arrays and objects a request body may hold (400 beyond it, "
                                            "before it is parsed)", check=at_least(4096))
    token_text_cache_mb: float = opt(16.0, "MiB of single-token texts and bytes a router keeps for logprobs "
                                           "(the least recently used go first)", check=positive)
    request_timeout_s: float | None = opt(None, "seconds a request may take in all; then it is aborted, its "
                                                "blocks freed, and it ends with a 504", flag="--request-timeout",
                                          check=positive)
    # vLLM's flag: a stream's chunk carries one token (1), or N tokens, the first and the last
    # chunk at once (services/router/pacing.py); a request's own stream_interval may raise it.
    stream_interval: int = opt(1, "tokens per streamed chunk (the first and the final chunk go at once)",
                               check=at_least(1))
    return_tokens_as_token_ids: bool = opt(False, "name tokens in logprobs as 'token_id:N' (a request's "
                                                  "return_tokens_as_token_ids overrides it)")
    max_stop_strings: int = opt(4, "stop strings a request may send (OpenAI's limit is 4)", check=at_least(0))
    # CORS with vLLM's flags and defaults: no cross-origin browser access unless origins are named.
    allowed_origins: list[str] = _cors([], "origins browsers may call from")
    allowed_methods: list[str] = _cors(["*"], "methods allowed cross-origin")
    allowed_headers: list[str] = _cors(["*"], "headers allowed cross-origin")
    allow_credentials: bool = opt(False, "allow credentials cross-origin")
    # Structured outputs: the grammar engine (services/guided/spec.py says why xgrammar); the
    # compile cache's bounds and the limits are GrammarOptions' (it compiles each once, to refuse a bad one).
    structured_outputs_backend: str = opt(DEFAULT_BACKEND, "grammar engine for response_format / "
                                                           "structured_outputs / guided_*", choices=BACKENDS)

    @property
    def auth_required(self) -> bool:
        return self.require_api_key or bool(self.api_keys)


def passed_down(config: RouterOptions) -> tuple[list[str], dict[str, str]]:
    """(flags, environment) that give a router these settings of `config`."""
    from pagedserve.services.flags import to_argv
    names = [f.name for f in dataclasses.fields(RouterOptions) if f.name != "api_keys"]
    env = {API_KEY_ENV: ",".join(config.api_keys)} if config.api_keys else {}
    return to_argv(config, names), env
