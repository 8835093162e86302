"""The steps of a generation request, written once: /v1/completions and /v1/chat/completions run
the same sequence, and each supplies only what is its own through an Endpoint (completions.py,
chat.py): how its prompt becomes token ids, its extra checks, its logprobs fields and the shape
of its answer (its Formatter).

    admit (rate limit, queue place) -> parse the body, check the model -> the endpoint's checks
    -> its prompts as token ids (off the loop for a large body) -> max_tokens fitted to the
    context -> the endpoint's checks on its prompts -> the structured-output constraint ->
    SamplingParams -> compile the constraint -> name the request -> submit it (Generation) ->
    answer, one JSON body or a stream (responses.respond) -> give back the queue place, and the
    rate-limit quota of a request refused with a 4xx.

Each hook runs where its endpoint always ran that step, so a request with several faults still
gets the same first error.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from fastapi import Request

from pagedserve.services.router.constraints import check as check_constraint
from pagedserve.services.router.constraints import constraint_of
from pagedserve.services.router.context import RouterContext
from pagedserve.services.router.errors import APIError
from pagedserve.services.router.generation import Generation
from pagedserve.services.router.openai_schema import refuse_unserved, sampling_params
from pagedserve.services.router.responses import Formatter, respond


class Endpoint(ABC):
    """One request's endpoint-specific part (one instance a request, made once its body is parsed)."""
    body: type                          # the request body's model
    batch_field: str | None = None      # the field holding a batch of prompts, bounded before parsing
    kind: str                           # the request record's kind
    id_prefix: str                      # of the request ids made for it (without an X-Request-Id)
    prompt_param: str                   # the field blamed for a prompt that leaves no room
    score_only = False                  # the engine's output is not the client's (it only scores the prompt)

    def __init__(self, ctx: RouterContext, req):
        self.ctx = ctx
        self.req = req

    def check(self) -> None:
        """The body's checks that come before its prompt is tokenized (the cheap ones)."""

    @abstractmethod
    def token_ids(self) -> list[list[int]]:
        """Each prompt's token ids, checked; runs off the event loop when the body is large."""

    @abstractmethod
    def asked_max_tokens(self) -> int | None:
        """max_tokens as the request asks it (None: the rest of the context)."""

    def check_prompts(self, prompts: list[list[int]]) -> None:
        """Checks that need the prompts' token ids, once max_tokens fits them."""

    def constraint(self) -> tuple[dict | None, str | None]:
        """The structured-output constraint in wire form and the field it came from."""
        return constraint_of(self.req, self.ctx.structured_backend)

    @abstractmethod
    def logprobs(self) -> int | None:
        """Top logprobs per output token (None: none asked)."""

    def prompt_logprobs(self) -> int | None:
        """The engine's prompt_logprobs, when the endpoint sets it beyond the request's own field."""
        return None

    @abstractmethod
    def formatter(self, gen: Generation, request_id: str, n: int, model: str, name) -> Formatter:
        """How this endpoint's chunks and answer are shaped: n choices returned, model as the
        answer names it, name(token id) a token as its logprobs show it."""


async def generate(ctx: RouterContext, request: Request, endpoint: type[Endpoint]):
    """A generation request, from its admission to its answer (the module's docstring)."""
    ticket = ctx.admit(request)
    request.state.ticket = ticket
    try:
        return await _run(ctx, request, endpoint)
    except APIError as e:
        if 400 <= e.status < 500:
            ctx.refund(request)
        raise
    finally:
        ticket.release_unless_handed_over()


async def _run(ctx: RouterContext, request: Request, endpoint: type[Endpoint]):
    req, size = await ctx.read_json(request, endpoint.body, prompts=endpoint.batch_field)
    ctx.check_model(req.model)
    refuse_unserved(req)
    ep = endpoint(ctx, req)
    ep.check()
    prompts = await ctx.off_loop(ep.token_ids, size=size)
    max_tokens = ctx.fit_max_tokens([len(p) for p in prompts], ep.asked_max_tokens(), ep.prompt_param)
    ep.check_prompts(prompts)
    constraint, constraint_param = ep.constraint()
    params, n = sampling_params(req, max_tokens=max_tokens, logprobs=ep.logprobs(), vocab_size=ctx.info.vocab_size,
                                max_stop_strings=ctx.config.max_stop_strings, prompt_logprobs=ep.prompt_logprobs(),
                                structured_outputs=constraint)
    await check_constraint(ctx.grammar_cache, constraint, constraint_param, ctx.time_left(request),
                           ready=None if constraint is None else ctx.compiler.ready())
    request_id = ctx.new_request_id(request, ep.id_prefix)
    gen = Generation(ctx, request_id, prompts, params, req.include_stop_str_in_output, ep.kind,
                     stream=bool(req.stream), score_only=ep.score_only, true_output_len=req.true_output_len,
                     ticket=request.state.ticket, stream_interval=ctx.stream_interval(req.stream_interval),
                     record_id=ctx.record_id(request, request_id))
    await gen.start()
    fmt = ep.formatter(gen, request_id, n, req.model or ctx.model_name,
                       ctx.token_namer(req.return_tokens_as_token_ids))
    return await respond(request, gen, fmt, req.stream, req.stream_options, {"X-Request-Id": request_id})
