"""POST /v1/chat/completions: the messages through the model's chat template (chat_template.py),
and the chat.completion JSON shapes."""
from __future__ import annotations

import time

from pagedserve.services.router.chat_template import message_text, render_prompt
from pagedserve.services.router.choices import ChoiceEvent
from pagedserve.services.router.context import RouterContext
from pagedserve.services.router.errors import bad_request
from pagedserve.services.router.generation import Generation
from pagedserve.services.guided import spec as specs
from pagedserve.services.router.constraints import constraint_of
from pagedserve.services.router.constraints import check as check_constraint
from pagedserve.services.router.openai_schema import ChatCompletionRequest, sampling_params
from pagedserve.services.router.tools import ToolCallStream, ToolPlan, tool_plan
from pagedserve.services.router.responses import best_choices, prompt_logprobs_json, respond, usage
from pagedserve.services.sampling_params import MAX_LOGPROBS


async def create_chat_completion(ctx: RouterContext, request):
    req, size = await ctx.read_json(request, ChatCompletionRequest)
    ctx.check_model(req.model)
    plan = tool_plan(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs")
    prompt_ids = await ctx.off_loop(render_prompt, ctx, req, size=size)
    if not prompt_ids:
        raise bad_request("the rendered prompt is empty", "messages")
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # No max_tokens in chat means "the rest of the context", as in vLLM.
    max_tokens = ctx.fit_max_tokens([len(prompt_ids)], asked, "messages")
    constraint, constraint_param = constraint_of(req, ctx.structured_backend)
    if plan is not None:
        if constraint is not None:
            raise bad_request(f"a tool call is a structured output already: drop {constraint_param}", "tool_choice")
        constraint, constraint_param = specs.make("json", plan.schema, ctx.structured_backend), "tools"
    params, n = sampling_params(req, max_tokens=max_tokens,
                                logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                vocab_size=ctx.info.vocab_size, max_stop_strings=ctx.config.max_stop_strings,
                                structured_outputs=constraint)
    await check_constraint(ctx.grammar_cache, constraint, constraint_param, ctx.time_left(request))
    request_id = ctx.new_request_id(request, "chatcmpl")
    gen = Generation(ctx, request_id, [prompt_ids], params, req.include_stop_str_in_output, "chat",
                     stream=bool(req.stream), true_output_len=req.true_output_len,
                     ticket=request.state.ticket, stream_interval=ctx.stream_interval(req.stream_interval),
                     record_id=ctx.record_id(request, request_id))
    await gen.start()
    fmt = ChatFormatter(ctx, gen, request_id, req.model or ctx.model_name, n,
                        (req.top_logprobs or 0) if req.logprobs else None, echo_of(req),
                        req.prompt_logprobs is not None, req.return_token_ids, plan,
                        ctx.token_namer(req.return_tokens_as_token_ids))
    return await respond(request, gen, fmt, req.stream, req.stream_options, {"X-Request-Id": request_id})


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
            finish = "tool_calls" if ev.finish_reason == "stop" and stream.sent else ev.finish_reason
            out.append({**self._base(), "choices": [{
                "index": ev.index, "delta": {"tool_calls": deltas} if deltas else {},
                "logprobs": self._logprobs(ev.logprobs), "finish_reason": finish,
                "stop_reason": ev.stop_reason,
                **({"token_ids": [e.token_id for e in ev.logprobs]} if self.token_ids else {})}]})
        return out

    def _message(self, c) -> dict:
        """The message and finish reason of a finished choice; a tool call's text becomes tool_calls."""
        calls = self.tools.calls(c.text) if self.tools is not None and c.finish_reason == "stop" else None
        if calls is None:
            return {"message": {"role": "assistant", "content": self.echo + c.text}, "finish_reason": c.finish_reason}
        return {"message": {"role": "assistant", "content": None, "tool_calls": calls}, "finish_reason": "tool_calls"}

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
