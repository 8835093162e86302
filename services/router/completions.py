"""POST /v1/completions: its prompts (texts or token ids, a batch of them), its checks and logprobs
fields, and the text_completion JSON shapes; the steps it shares with chat are in pipeline.py."""
from __future__ import annotations

import time

from pagedserve.services.router.choices import ChoiceEvent, ChoiceState
from pagedserve.services.router.context import RouterContext
from pagedserve.services.router.errors import bad_request
from pagedserve.services.router.generation import Generation
from pagedserve.services.router.openai_schema import CompletionRequest
from pagedserve.services.router.pipeline import Endpoint
from pagedserve.services.router.responses import best_choices, prompt_logprobs_json, usage


class CompletionEndpoint(Endpoint):
    """What a text completion does its own way within the shared steps (services/router/pipeline.py)."""
    body = CompletionRequest
    batch_field = "prompt"
    kind, id_prefix, prompt_param = "completion", "cmpl", "prompt"

    def __init__(self, ctx: RouterContext, req: CompletionRequest):
        super().__init__(ctx, req)
        self.items = prompt_items(req.prompt)
        # Echo with max_tokens 0 scores the prompt (what evaluation harnesses send): the engine makes
        # one token, which nobody sees.
        self.score_only = req.echo and req.max_tokens == 0

    def check(self) -> None:
        if self.req.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        self.keep = self.ctx.prompt_keep(self.req.truncate_prompt_tokens)

    def token_ids(self) -> list[list[int]]:
        return tokenize_prompts(self.ctx, self.items, self.req.add_special_tokens, self.keep)

    def asked_max_tokens(self) -> int | None:
        return 1 if self.score_only else self.req.max_tokens

    def check_prompts(self, prompts: list[list[int]]) -> None:
        req = self.req
        if req.stream and req.echo and req.logprobs is not None and len(prompts) > 1:
            # Each prompt's echo chunk would wait for that prompt's first update; one at a time.
            raise bad_request("echo with logprobs streams one prompt at a time", "echo")

    def logprobs(self) -> int | None:
        return self.req.logprobs

    def prompt_logprobs(self) -> int | None:
        # Echo with logprobs shows the prompt's logprobs too, in the logprobs and (as vLLM) as
        # prompt_logprobs: vLLM sets prompt_logprobs = logprobs.
        req = self.req
        return req.logprobs if req.echo and req.prompt_logprobs is None else None

    def formatter(self, gen: Generation, request_id: str, n: int, model: str, name) -> CompletionFormatter:
        req, ctx = self.req, self.ctx
        # The prompt as sent; token prompts as the text of their tokens, special tokens included;
        # a text truncate_prompt_tokens cut as the text of the tokens kept, less the BOS the
        # tokenizer added (a text it left whole, fewer tokens than kept, is the text as sent).
        echo = [item if isinstance(item, str) and (self.keep is None or len(ids) < self.keep)
                else ctx.decode(ids, True) if isinstance(item, str) else ctx.decode(ids, False)
                for item, ids in zip(self.items, gen.prompts)] if req.echo else None
        return CompletionFormatter(ctx, gen, request_id, model, n, req.logprobs, echo, gen.params.prompt_logprobs,
                                   req.return_token_ids, name)


def prompt_items(prompt) -> list:
    """str | list[int] | list[str] | list[list[int]] -> the list of prompts (texts or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(x, int) for x in prompt):
        return [prompt]
    return list(prompt)


def tokenize_prompts(ctx: RouterContext, items: list, add_special_tokens: bool = True,
                     keep: int | None = None) -> list[list[int]]:
    """Each prompt (text or token ids) -> its token ids, checked; with keep (truncate_prompt_tokens)
    only its last keep tokens (a text's BOS kept, as vLLM's tokenizer truncates)."""
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    if len(items) > ctx.max_batch_prompts:
        raise bad_request(f"at most {ctx.max_batch_prompts} prompts per request, got {len(items)}", "prompt")
    out = []
    for item in items:
        if isinstance(item, str) and not item:     # its BOS alone is no prompt (vLLM refuses it too)
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(item, str):
            ids = ctx.tokenize(item, add_special_tokens) if keep is None else ctx.tokenize_last(item, keep, add_special_tokens)
        else:     # token ids are cut as they are (vLLM's too)
            ids = list(item) if keep is None else list(item)[-keep:]
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        # At once, not after the whole batch: 16 long texts took 4.7 s to tokenize before the first was refused.
        ctx.check_fits(len(ids), "prompt")
        ctx.check_token_ids(ids, "prompt")
        out.append(ids)
    return out


class CompletionFormatter:
    def __init__(self, ctx, gen: Generation, request_id: str, model: str, n: int, logprobs: int | None,
                 echo: list[str] | None, prompt_logprobs: int | None = None, token_ids: bool = False,
                 name=None):
        self.ctx, self.gen, self.id, self.model, self.n = ctx, gen, request_id, model, n
        self.name = name or ctx.token_texts.text   # a token as logprobs show it
        self.logprobs = logprobs
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs     # vLLM's field
        self.token_ids = token_ids                 # return_token_ids
        self.prompt_ids_sent: set[int] = set()     # streamed choices whose first chunk has gone
        self.created = int(time.time())
        # Echo with logprobs: offsets run on through the prompt's tokens into the completion's (as
        # vLLM counts them: each token's text, special tokens included), so they never go back.
        text = ctx.token_texts.text
        self.offsets = [sum(len(text(t)) for t in ids) for ids in gen.prompts] \
            if echo is not None and logprobs is not None else [0] * len(gen.prompts)

    def _base(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": self.ctx.system_fingerprint}

    def _logprobs(self, entries, choice_offset: int = 0) -> dict | None:
        if self.logprobs is None:
            return None
        text = self.name
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
        tokens, name = [self.name(t) for t in ids], self.name
        offsets, at = [], 0
        for t in ids:                # offsets count text, however the tokens are named
            offsets.append(at)
            at += len(text(t))
        tops: list = [None]
        for tid, (lp, _, top) in zip(ids[1:], entries):
            tops.append({name(tid): lp, **{name(i): v for i, v in top[:self.logprobs]}})
        return {"tokens": tokens, "token_logprobs": [None] + [e[0] for e in entries], "top_logprobs": tops,
                "text_offset": offsets}

    def _choice_logprobs(self, p: int, entries) -> dict | None:
        own = self._logprobs(entries, self.offsets[p])
        head = self._echo_logprobs(p) if self.echo else None
        if own is None or head is None:
            return own
        return {k: head[k] + own[k] for k in own}

    def _prompt_of(self, index: int) -> int:
        return index // self.gen.params.n

    def _prompt_ids(self, index: int) -> dict:
        """return_token_ids in a stream: the choice's first chunk carries its prompt's ids (as vLLM)."""
        if not self.token_ids or index in self.prompt_ids_sent:
            return {}
        self.prompt_ids_sent.add(index)
        return {"prompt_token_ids": list(self.gen.prompts[self._prompt_of(index)])}

    def start_chunks(self) -> list[dict]:
        if not self.echo:
            return []
        return [{**self._base(), "choices": [{"index": c.index, "text": self.echo[self._prompt_of(c.index)],
                                              "logprobs": self._echo_logprobs(self._prompt_of(c.index)),
                                              "finish_reason": None, **self._prompt_ids(c.index)}]}
                for c in self.gen.all_choices]

    def chunks(self, events: list[ChoiceEvent]) -> list[dict]:
        out = []
        for ev in events:
            p = self._prompt_of(ev.index)
            out.append({**self._base(), "choices": [{
                "index": ev.index, "text": ev.text, "logprobs": self._logprobs(ev.logprobs, self.offsets[p]),
                "finish_reason": ev.finish_reason, "stop_reason": ev.stop_reason, **self._prompt_ids(ev.index),
                **({"token_ids": [e.token_id for e in ev.logprobs]} if self.token_ids else {})}]})
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
            if self.token_ids:
                choice.update(prompt_token_ids=list(self.gen.prompts[p]), token_ids=list(c.token_ids))
            choices.append(choice)
        return {**self._base(), "choices": choices, "usage": usage(self.gen, picked)}
