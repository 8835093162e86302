"""POST /v1/completions: prompt checks, SamplingParams, and the text_completion JSON shapes."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from services.router.choices import ChoiceEvent, ChoiceState
from services.router.errors import bad_request
from services.router.generation import Generation
from services.router.openai_schema import CompletionRequest, parse_body, sampling_params
from services.router.responses import best_choices, prompt_logprobs_json, respond, usage

if TYPE_CHECKING:
    from services.router.app import RouterContext


async def create_completion(ctx: "RouterContext", request):
    ctx.authorize(request)
    req: CompletionRequest = parse_body(await request.body(), CompletionRequest)
    ctx.check_model(req.model)
    if req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    size = sum(len(p) for p in ([req.prompt] if isinstance(req.prompt, str) else req.prompt) if isinstance(p, str))
    prompts = await ctx.off_loop(tokenize_prompts, ctx, req.prompt, size=size)
    longest = max(len(p) for p in prompts)
    max_tokens = req.max_tokens if req.max_tokens is not None else ctx.info.max_model_len - longest
    ctx.check_length(longest, max_tokens, "prompt")
    if req.stream and req.echo and req.logprobs is not None and len(prompts) > 1:
        # Each prompt's echo chunk would wait for that prompt's first update; one at a time.
        raise bad_request("echo with logprobs streams one prompt at a time", "echo")
    # Echo with logprobs shows the prompt's logprobs too (as vLLM: prompt_logprobs = logprobs).
    params, n = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, vocab_size=ctx.info.vocab_size,
                                prompt_logprobs=req.logprobs if req.echo and req.prompt_logprobs is None else None)
    request_id = ctx.new_request_id(request, "cmpl")
    gen = Generation(ctx, request_id, prompts, params, req.include_stop_str_in_output, "completion",
                     stream=bool(req.stream), true_output_len=req.true_output_len)
    await gen.start()
    echo = [ctx.decode(p, params.skip_special_tokens) for p in prompts] if req.echo else None
    fmt = CompletionFormatter(ctx, gen, request_id, req.model or ctx.model_name, n, req.logprobs, echo,
                              req.prompt_logprobs)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await respond(request, gen, fmt, req.stream, include_usage, {"X-Request-Id": request_id})


def tokenize_prompts(ctx: "RouterContext", prompt) -> list[list[int]]:
    """str | list[int] | list[str] | list[list[int]] -> token ids per prompt, each checked."""
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    if len(items) > ctx.max_batch_prompts:
        raise bad_request(f"at most {ctx.max_batch_prompts} prompts per request, got {len(items)}", "prompt")
    out = []
    for item in items:
        ids = ctx.tokenize(item) if isinstance(item, str) else list(item)
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        bad = [t for t in ids if not 0 <= t < ctx.info.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of the vocabulary (size {ctx.info.vocab_size})", "prompt")
        out.append(ids)
    return out


class CompletionFormatter:
    def __init__(self, ctx, gen: Generation, request_id: str, model: str, n: int, logprobs: int | None,
                 echo: list[str] | None, prompt_logprobs: int | None = None):
        self.ctx, self.gen, self.id, self.model, self.n = ctx, gen, request_id, model, n
        self.logprobs = logprobs
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs     # vLLM's field, asked for by name
        self.created = int(time.time())

    def _base(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def _logprobs(self, entries, choice_offset: int = 0) -> dict | None:
        if self.logprobs is None:
            return None
        text = self.ctx.token_texts.text
        tops = []
        for e in entries:
            top = {text(e.token_id): e.logprob}
            top.update({text(tid): lp for tid, lp in e.top[:self.logprobs]})
            tops.append(top)
        return {"tokens": [text(e.token_id) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": tops,
                "text_offset": [choice_offset + e.text_offset for e in entries]}

    def _echo_logprobs(self, p: int) -> dict | None:
        """Echo with logprobs: the prompt's tokens (the first has no logprob: nothing precedes it)."""
        entries = self.gen.prompt_logprobs[p]
        if self.logprobs is None or entries is None:
            return None
        text, ids = self.ctx.token_texts.text, self.gen.prompts[p]
        tokens = [text(t) for t in ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        tops: list = [None]
        for tid, (lp, _, top) in zip(ids[1:], entries):
            tops.append({text(tid): lp, **{text(i): v for i, v in top[:self.logprobs]}})
        return {"tokens": tokens, "token_logprobs": [None] + [e[0] for e in entries], "top_logprobs": tops,
                "text_offset": offsets}

    def _choice_logprobs(self, p: int, entries) -> dict | None:
        own = self._logprobs(entries, len(self.echo[p]) if self.echo else 0)
        head = self._echo_logprobs(p) if self.echo else None
        if own is None or head is None:
            return own
        return {k: head[k] + own[k] for k in own}

    def _prompt_of(self, index: int) -> int:
        return index // self.gen.params.n

    def start_chunks(self) -> list[dict]:
        if not self.echo:
            return []
        return [{**self._base(), "choices": [{"index": c.index, "text": self.echo[self._prompt_of(c.index)],
                                              "logprobs": self._echo_logprobs(self._prompt_of(c.index)),
                                              "finish_reason": None}]}
                for c in self.gen.all_choices]

    def chunks(self, events: list[ChoiceEvent]) -> list[dict]:
        out = []
        for ev in events:
            if ev.says_nothing(self.logprobs is not None):
                continue
            offset = len(self.echo[self._prompt_of(ev.index)]) if self.echo else 0
            out.append({**self._base(), "choices": [{
                "index": ev.index, "text": ev.text, "logprobs": self._logprobs(ev.logprobs, offset),
                "finish_reason": ev.finish_reason, "stop_reason": ev.stop_reason}]})
        return out

    def usage_chunk(self) -> dict:
        return {**self._base(), "choices": [], "usage": usage(self.gen, self.gen.all_choices)}

    def final(self) -> dict:
        picked: list[ChoiceState] = best_choices(self.gen, self.n)
        choices = []
        for i, c in enumerate(picked):
            p = self._prompt_of(c.index)
            prefix = self.echo[p] if self.echo else ""
            choice = {"index": i, "text": prefix + c.text, "logprobs": self._choice_logprobs(p, c.logprobs),
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(self.gen, p, self.ctx.token_texts.text)
            choices.append(choice)
        return {**self._base(), "choices": choices, "usage": usage(self.gen, picked)}
