"""POST /v1/chat/completions: its prompt (the messages through chat_template.py), its checks, tool
calls and logprobs fields, and the chat.completion JSON shapes; the steps it shares with
completions are in pipeline.py."""
from __future__ import annotations

import time

from pagedserve.services.guided import spec as specs
from pagedserve.services.router.chat_template import message_text, render_prompt
from pagedserve.services.router.choices import ChoiceEvent
from pagedserve.services.router.errors import bad_request
from pagedserve.services.router.generation import Generation
from pagedserve.services.router.openai_schema import ChatCompletionRequest
from pagedserve.services.router.pipeline import Endpoint
from pagedserve.services.router.responses import best_choices, prompt_logprobs_json, usage
from pagedserve.services.router.tools import ToolCallStream, ToolPlan, tool_plan
from pagedserve.services.sampling_params import MAX_LOGPROBS


class ChatEndpoint(Endpoint):
    """What a chat completion does its own way within the shared steps (services/router/pipeline.py)."""
    body = ChatCompletionRequest
    kind, id_prefix, prompt_param = "chat", "chatcmpl", "messages"
    plan: ToolPlan | None = None     # the output is a tool call (tool_choice required / named)

    def check(self) -> None:
        req = self.req
        self.plan = tool_plan(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs")
        self.keep = self.ctx.prompt_keep(req.truncate_prompt_tokens)

    def token_ids(self) -> list[list[int]]:
        prompt_ids = render_prompt(self.ctx, self.req)
        if not prompt_ids:
            raise bad_request("the rendered prompt is empty", "messages")
        # truncate_prompt_tokens keeps the rendered prompt's last tokens, as vLLM's (the template's
        # head goes first).
        return [prompt_ids if self.keep is None else prompt_ids[-self.keep:]]

    def asked_max_tokens(self) -> int | None:
        # No max_tokens in chat means "the rest of the context", as in vLLM.
        req = self.req
        return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens

    def constraint(self) -> tuple[dict | None, str | None]:
        constraint, constraint_param = super().constraint()
        if self.plan is None:
            return constraint, constraint_param
        if constraint is not None:
            raise bad_request(f"a tool call is a structured output already: drop {constraint_param}", "tool_choice")
        return specs.make("json", self.plan.schema, self.ctx.structured_backend), "tools"

    def logprobs(self) -> int | None:
        return (self.req.top_logprobs or 0) if self.req.logprobs else None

    def formatter(self, gen: Generation, request_id: str, n: int, model: str, name) -> ChatFormatter:
        req = self.req
        return ChatFormatter(self.ctx, gen, request_id, model, n, self.logprobs(), echo_of(req),
                             req.prompt_logprobs is not None, req.return_token_ids, self.plan, name)


def echo_of(req: ChatCompletionRequest) -> str:
    """With echo, the last message's text when it is of the role being answered (as vLLM: the
    assistant, or with add_generation_prompt false the last message's own role)."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    return message_text(last.content) if last.role == role else ""


class ChatFormatter:
    def __init__(self, ctx, gen: Generation, request_id: str, model: str, n: int, top_logprobs: int | None,
                 echo: str = "", with_prompt_logprobs: bool = False, token_ids: bool = False,
                 tools: ToolPlan | None = None, name=None):
        self.ctx, self.gen, self.id, self.model, self.n = ctx, gen, request_id, model, n
        self.token_ids = token_ids       # return_token_ids
        self.name = name                 # a token as logprobs show it (None: its text)
        self.top = top_logprobs          # None: no logprobs asked
        self.echo = echo                 # text every choice starts with (chat echo)
        self.with_prompt_logprobs = with_prompt_logprobs
        self.tools = tools               # the output is a tool call (tool_choice required / named)
        self.tool_streams: dict[int, ToolCallStream] = {}   # per streamed choice
        self.created = int(time.time())

    def _base(self, obj: str = "chat.completion.chunk") -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.ctx.system_fingerprint}

    def _entry(self, token_id: int, logprob) -> dict:
        texts = self.ctx.token_texts
        if self.name is not None and self.name is not texts.text:   # vLLM: the bytes of what it shows
            token = self.name(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
        return {"token": texts.text(token_id), "logprob": logprob, "bytes": texts.bytes(token_id)}

    def _logprobs(self, entries) -> dict | None:
        if self.top is None:
            return None
        return {"content": [{**self._entry(e.token_id, e.logprob),
                             "top_logprobs": [self._entry(t, lp) for t, lp in e.top[:self.top]]}
                            for e in entries]}

    def start_chunks(self) -> list[dict]:
        prompt_ids = {"prompt_token_ids": list(self.gen.prompts[0])} if self.token_ids else {}
        return [{**self._base(), **prompt_ids,
                 "choices": [{"index": c.index, "delta": {"role": "assistant", "content": self.echo},
                              "logprobs": None, "finish_reason": None}]}
                for c in self.gen.all_choices]

    def chunks(self, events: list[ChoiceEvent]) -> list[dict]:
        if self.tools is not None:
            return self._tool_chunks(events)
        out = []
        for ev in events:
            out.append({**self._base(), "choices": [{
                # content even when empty (a token that ends the choice unseen), as vLLM sends it
                "index": ev.index, "delta": {"content": ev.text},
                "logprobs": self._logprobs(ev.logprobs), "finish_reason": ev.finish_reason,
                "stop_reason": ev.stop_reason,
                **({"token_ids": [e.token_id for e in ev.logprobs]} if self.token_ids else {})}]})
        return out

    def _tool_chunks(self, events: list[ChoiceEvent]) -> list[dict]:
        """A tool call streamed: tool_call deltas instead of content; a token that completes no
        part of a call sends nothing until the end (as vLLM's tool streaming does)."""
        out = []
        for ev in events:
            stream = self.tool_streams.get(ev.index)
            if stream is None:
                stream = self.tool_streams[ev.index] = ToolCallStream(self.tools)
            deltas = stream.feed(ev.text)
            if not deltas and ev.finish_reason is None:
                continue
            out.append({**self._base(), "choices": [{
                "index": ev.index, "delta": {"tool_calls": deltas} if deltas else {},
                "logprobs": self._logprobs(ev.logprobs),
                "finish_reason": self.tools.finish_reason(ev.finish_reason, bool(stream.sent)),
                "stop_reason": ev.stop_reason,
                **({"token_ids": [e.token_id for e in ev.logprobs]} if self.token_ids else {})}]})
        return out

    def _message(self, c) -> dict:
        """The message and finish reason of a finished choice; a tool call's text becomes tool_calls,
        cut short or not (as its stream sent them: never content)."""
        if self.tools is None:
            return {"message": {"role": "assistant", "content": self.echo + c.text}, "finish_reason": c.finish_reason}
        calls = self.tools.calls(c.text)
        return {"message": {"role": "assistant", "content": None, "tool_calls": calls},
                "finish_reason": self.tools.finish_reason(c.finish_reason, bool(calls))}

    def usage_chunk(self) -> dict:
        return {**self._base(), "choices": [], "usage": usage(self.gen, self.gen.all_choices)}

    def final(self) -> dict:
        picked = best_choices(self.gen, self.n)
        return {**self._base("chat.completion"),
                "choices": [{"index": i, **self._message(c),
                             "logprobs": self._logprobs(c.logprobs),
                             "stop_reason": c.stop_reason,
                             **({"token_ids": list(c.token_ids)} if self.token_ids else {})}
                            for i, c in enumerate(picked)],
                "usage": usage(self.gen, picked),
                **({"prompt_token_ids": list(self.gen.prompts[0])} if self.token_ids else {}),
                **({"prompt_logprobs": prompt_logprobs_json(self.gen, 0, self.ctx.token_texts.text)}
                   if self.with_prompt_logprobs else {})}
