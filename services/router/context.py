"""RouterContext: what every request handler of the router shares, one per app.

It holds the router's parts (model info, shared state, scheduler backends, caches, metrics, the
admission queue, the offload pool) and the checks the endpoints share. It lives apart from app.py,
and imports no handler, so that the handlers import it and app.py imports the handlers: the
dependencies run one way, with no type-only back-edge to the module that wires the routes.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import importlib.metadata
import math
import re
import time
import uuid

import zmq.asyncio
from fastapi import Request
from starlette.requests import ClientDisconnect

from pagedserve.services.curve import SocketGuard
from pagedserve.services.guided.cache import CompileCache
from pagedserve.services.guided.compile_process import CompileProcess
from pagedserve.services.guided.limits import Limits
from pagedserve.services.router.admission import Admission, Ticket
from pagedserve.services.router.detokenizer import TokenTexts, fast_decoder
from pagedserve.services.router.errors import APIError, bad_request
from pagedserve.services.router.metrics import RouterMetrics
from pagedserve.services.router.model_info import ModelInfo
from pagedserve.services.router.offload import Offload
from pagedserve.services.router.openai_schema import MAX_STOP_TOKEN_IDS, BodyLimits, parse_body
from pagedserve.services.router.replicas import Backends
from pagedserve.services.state import StateStore, hash_api_key

# Levels of a body above a schema in it (body, tools, a tool, function, parameters; or
# response_format, json_schema, schema), with room: a schema as deep as --max-grammar-depth lets is
# refused by that limit, which names the schema's place, not by the body's.
SCHEMA_ENVELOPE = 8
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# application/json, and the structured-syntax types built on it (application/merge-patch+json ...).
_JSON_TYPE = re.compile(r"application/(?:[a-z0-9.!#$&^_-]+\+)?json")


@functools.cache
def server_version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:   # run from a checkout that was never installed
        return "unknown"


class RouterContext:
    """Everything a request handler needs; one per app."""

    def __init__(self, config, info: ModelInfo, state: StateStore):
        self.config = config
        self.info = info
        self.state = state
        self.router_id = config.router_id
        self.model_name = config.served_model_name or config.model
        self.system_fingerprint = f"pagedserve-{server_version()}"
        self.served_names = {self.model_name}
        self.max_batch_prompts = 64
        self.decode = fast_decoder(info.tokenizer)
        self.token_texts = TokenTexts(self.decode, info.tokenizer, int(config.token_text_cache_mb * (1 << 20)))
        self.metrics = RouterMetrics(self.model_name, info.max_model_len)
        self.backends: Backends | None = None
        self.zmq_ctx: zmq.asyncio.Context | None = None
        # CURVE keys for the scheduler sockets (services/curve.py); KeysError here, at start-up.
        self.guard = SocketGuard.from_setting(config.curve_keys)
        self.offload = Offload(config.offload_threads, config.offload_queue)
        self.metrics.router.watch(caches={"token_texts": self.token_texts.text, "token_bytes": self.token_texts.bytes},
                                  offload=self.offload)
        self.admission = Admission(config.max_queued_requests, config.max_queued_tokens,
                                   on_reject=self.metrics.admission_rejected)
        # Compiles run in a child process (xgrammar imports torch; this process does not), and the
        # cache keeps each verdict with the size the worker will hold the compiled form at.
        bounds = CompileCache.bounds_of(config)
        self.compiler = CompileProcess(info.path, info.vocab_size, info.eos_token_ids,
                                       bounds["limits"].compile_timeout_s)
        self.grammar_cache = CompileCache(self.compiler.backend, **bounds)
        self.metrics.grammar_cache_bytes.set_function(lambda: self.grammar_cache.bytes)
        self.structured_backend = config.structured_outputs_backend

    # ---- lifecycle (inside the server's event loop) ---------------------------------------------
    def start(self) -> None:
        self.zmq_ctx = zmq.asyncio.Context()
        self.backends = Backends(self.router_id, self.zmq_ctx, self.state, self.config.scheduler_endpoint,
                                 self.config.ping_interval_s, self.config.scheduler_timeout_s, self.guard)
        self.backends.start()

    async def stop(self) -> None:
        self.offload.close()
        self.grammar_cache.close()
        self.compiler.close()
        if self.backends is not None:
            await self.backends.close()
        if self.zmq_ctx is not None:
            # destroy, not term: term blocks forever on any socket still open (seen when uvicorn
            # could not bind and shut the app down mid-start), destroy closes them first.
            self.zmq_ctx.destroy(linger=0)

    def fail_in_flight(self, message: str) -> None:
        """End every request waiting on a scheduler with a 503 (the router is stopping)."""
        if self.backends is not None:
            for client in self.backends.clients.values():
                client.fail_all(503, message)

    # ---- checks shared by the endpoints ---------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self._check_text(text, param)
        return list(self.info.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _check_text(self, text: str, param: str) -> None:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise bad_request("the text is not valid Unicode (it holds a lone surrogate)", param) from None
        if size > self.info.max_prompt_bytes:
            raise bad_request(f"This model's maximum context length is {self.info.max_model_len} tokens; "
                              f"a text of {size} bytes cannot fit in it.", param)

    def tokenize_last(self, text: str, keep: int, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """The text's tokens cut to keep from the left, as vLLM's tokenizer truncates (truncation
        side left, max_length keep): the special tokens the tokenizer adds (the BOS) stay, the
        text's last tokens fill the rest."""
        self._check_text(text, param)
        return list(self._left_tokenizer(text, add_special_tokens=add_special_tokens, truncation=True,
                                          max_length=keep)["input_ids"])

    @functools.cached_property
    def _left_tokenizer(self):
        """A copy of the tokenizer that truncates on the left (the shared one truncates nothing)."""
        tok = copy.deepcopy(self.info.tokenizer)
        tok.truncation_side = "left"
        return tok

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of the vocabulary (size {self.info.vocab_size})", param)

    async def read_json(self, request: Request, model, prompts: str | None = None):
        """The request's body as `model`, and its size in bytes (what decides whether its later
        work runs off the loop). JSON only (application/json, or a +json type as FastAPI and vLLM
        take): a text/plain or form POST is one a web page may send cross-origin without a CORS
        preflight, so it is refused (415) before its body is read. `prompts` names the field that
        holds a batch of prompts, bounded before the body is parsed."""
        kind = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
        if not _JSON_TYPE.fullmatch(kind):
            raise APIError(415, f"the request body must be JSON (Content-Type: application/json), "
                                f"got {kind or 'no Content-Type'}", "Content-Type")
        try:
            raw = await request.body()
        except ClientDisconnect:
            # The client left before its body arrived: nobody reads an answer, and no server error
            # happened (nginx's 499; a 4xx, so its rate-limit quota is refunded).
            raise APIError(499, "the client closed the connection before its request body arrived") from None
        limits = BodyLimits(values=self.config.max_json_values, containers=self.config.max_json_containers,
                            lists={"messages": self.config.max_chat_messages,
                                   "stop_token_ids": MAX_STOP_TOKEN_IDS},
                            batches={prompts: self.max_batch_prompts} if prompts else {},
                            depth=max(BodyLimits.depth, Limits.of(self.config).max_json_depth + SCHEMA_ENVELOPE))
        return await self.off_loop(parse_body, raw, model, limits, size=len(raw)), len(raw)

    async def off_loop(self, fn, *args, size: int, refuse: bool = True):
        """fn(*args), in the bounded pool when size (the body's bytes) is large (services/router/offload.py)."""
        return await self.offload.run(fn, *args, size=size, refuse=refuse)

    def stream_interval(self, asked: int | None) -> int:
        """Tokens per streamed chunk: --stream-interval, raised (never lowered) by the request's own, as vLLM."""
        return max(asked or 1, self.config.stream_interval)

    def token_namer(self, asked: bool | None):
        """How logprobs name a token: its text, or vLLM's "token_id:N" (--return-tokens-as-token-ids,
        or the request's own return_tokens_as_token_ids), for tokens whose text is not valid alone."""
        if asked if asked is not None else self.config.return_tokens_as_token_ids:
            return lambda token_id: f"token_id:{token_id}"
        return self.token_texts.text

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def prompt_keep(self, truncate_prompt_tokens: int | None) -> int | None:
        """vLLM's truncate_prompt_tokens as the prompt tokens to keep (its last ones; None: all):
        -1 is the model's context, 1 up to it that many; anything else a 400."""
        k, limit = truncate_prompt_tokens, self.info.max_model_len
        if k is None:
            return None
        if k == -1:
            return limit
        if k < 1:
            raise bad_request(f"truncate_prompt_tokens must be -1 or at least 1, got {k}", "truncate_prompt_tokens")
        if k > limit:
            raise bad_request(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({limit}). "
                              "Please, select a smaller truncation size.", "truncate_prompt_tokens")
        return k

    def check_fits(self, prompt_len: int, prompt_param: str) -> None:
        """A prompt of prompt_len tokens leaves room for a completion, or a 400 (as vLLM's)."""
        limit = self.info.max_model_len
        if prompt_len >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your "
                              f"{prompt_param} has {prompt_len} tokens, leaving no room for a completion.",
                              prompt_param)

    def fit_max_tokens(self, prompt_lens: list[int], asked: int | None, prompt_param: str) -> int:
        """max_tokens as sent to the engine: what was asked (None: the rest of the context),
        shortened to the room the shortest prompt leaves, as vLLM does. The scheduler ends each
        sequence at the context's end ("length"), so every prompt gets min(asked, its own room).
        A prompt that does not fit by itself is a 400, and so (as in vLLM) is a max_tokens that
        could not fit even after an empty prompt."""
        limit = self.info.max_model_len
        self.check_fits(max(prompt_lens), prompt_param)
        if asked is not None and asked > limit:
            raise bad_request(f"max_tokens={asked} cannot be greater than the model's maximum context "
                              f"length of {limit} tokens", "max_tokens")
        room = limit - min(prompt_lens)
        return room if asked is None else min(asked, room)

    def new_request_id(self, request: Request, prefix: str) -> str:
        given = request.headers.get("x-request-id")
        if given is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if not REQUEST_ID_RE.match(given):
            raise bad_request("X-Request-Id must be 1-128 characters of letters, digits and . _ : -",
                              "X-Request-Id")
        return given

    def record_id(self, request: Request, request_id: str) -> str:
        """The key of a request's record in the shared state: its id under the API key that made
        it, so that another key's lookup, cancel or reuse of the id never meets it (it gets the
        404 of an unknown id). '/' cannot appear in an X-Request-Id, so no id can pose as a
        scoped one; without keys every client shares the one unnamed scope."""
        key, _ = (request.scope.get("state") or {}).get("api_key", (None, {}))
        return request_id if key is None else f"{hash_api_key(key)[:32]}/{request_id}"

    def admit(self, request: Request) -> Ticket:
        """A generation request's rate limit (per API key) and its place in the bounded queue;
        the key itself was checked by the Guard middleware."""
        key, info = (request.scope.get("state") or {}).get("api_key", (None, {}))
        limit = info.get("rate_limit", self.config.rate_limit)
        if key is not None and limit:
            decision = self.state.hit_rate_limit(key, int(limit), self.config.rate_limit_window_s)
            if not decision.allowed:
                raise APIError(429, f"Rate limit reached: {limit} requests per "
                                    f"{self.config.rate_limit_window_s:g} s.",
                               headers={"Retry-After": str(max(1, math.ceil(decision.retry_after_s)))})
            request.state.rate_hit = (key, decision.token)
        try:
            return self.admission.enter()
        except APIError:          # the queue is full: nothing reached an engine, the quota goes back
            self.refund(request)
            raise

    def refund(self, request: Request) -> None:
        """Give back the rate-limit quota a request took: one the API refused as invalid (a 4xx)
        never reached an engine, and a client fixing its requests is not throttled for them."""
        hit = getattr(request.state, "rate_hit", None)
        if hit is not None:
            self.state.refund_rate_limit(*hit)

    def time_left(self, request: Request) -> float | None:
        """Seconds --request-timeout leaves this request (None: no limit)."""
        if self.config.request_timeout_s is None:
            return None
        return max(0.0, self.config.request_timeout_s - (time.monotonic() - request.state.ticket.since))

    async def engine_stats(self) -> list[tuple[str, dict]]:
        """(replica id, StatsReply.stats) of every scheduler that answers within the timeout."""
        targets = self.backends.targets()
        replies = await asyncio.gather(*(self.backends.client(ep).stats(self.config.stats_timeout_s)
                                         for _, ep in targets))
        return [(rid, s) for (rid, _), s in zip(targets, replies) if s is not None]
