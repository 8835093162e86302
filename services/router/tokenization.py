"""POST /tokenize and /detokenize, as vLLM answers them: the router's own tokenizer and chat
template, no engine involved.

/tokenize takes vLLM's completion form ({prompt}) or its chat form ({messages, ...}: the same
fields and template path as chat completions) and answers {count, max_model_len, tokens,
token_strs}; /detokenize takes {tokens} and answers {prompt}, special tokens kept (vLLM decodes with
the tokenizer's defaults). Outside /v1, so like vLLM's they need no API key (services/router/guard.py).
"""
from __future__ import annotations

from pagedserve.services.router.chat_template import render_prompt
from pagedserve.services.router.context import RouterContext
from pagedserve.services.router.errors import bad_request
from pagedserve.services.router.openai_schema import DetokenizeRequest, TokenizeRequest


async def tokenize(ctx: RouterContext, request) -> dict:
    req, size = await ctx.read_json(request, TokenizeRequest)
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send either prompt (a text) or messages (a chat), not both" if req.prompt is not None
                          else "prompt or messages is required", "prompt")
    if req.messages is not None:
        ids = await ctx.off_loop(render_prompt, ctx, req, size=size)
    else:
        if req.chat_template_kwargs is not None:
            raise bad_request("chat_template_kwargs needs messages", "chat_template_kwargs")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await ctx.off_loop(ctx.tokenize, req.prompt, special, size=size)
    strs = await ctx.off_loop(ctx.info.tokenizer.convert_ids_to_tokens, ids, size=size) \
        if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.info.max_model_len, "tokens": ids, "token_strs": strs}


async def detokenize(ctx: RouterContext, request) -> dict:
    req, size = await ctx.read_json(request, DetokenizeRequest)
    ctx.check_model(req.model)
    return {"prompt": await ctx.off_loop(_decode, ctx, req.tokens, size=size)}


def _decode(ctx: RouterContext, tokens: list[int]) -> str:
    ctx.check_token_ids(tokens, "tokens")      # a walk of every id: off the loop with the decode
    return ctx.info.tokenizer.decode(tokens)
