"""Turning a Generation into an HTTP response: one JSON body, or a stream of SSE chunks.

A stream waits for the scheduler's first update before answering 200, so a request the scheduler
rejects still gets its own status code; after that, errors travel as an SSE `data: {"error": ...}`
event followed by `data: [DONE]`, as vLLM sends them.
"""
from __future__ import annotations

import asyncio
from typing import Protocol

from fastapi.responses import JSONResponse, Response

from pagedserve.services.router.choices import ChoiceEvent
from pagedserve.services.router.errors import APIError
from pagedserve.services.router.event_stream import DONE, EventStream, sse
from pagedserve.services.router.generation import ClientDisconnected, Generation, watch_disconnect

class Formatter(Protocol):
    def start_chunks(self) -> list[dict]: ...
    def chunks(self, events: list[ChoiceEvent]) -> list[dict]: ...   # one per event, in order
    def usage_chunk(self) -> dict: ...
    def final(self) -> dict: ...


def usage(gen: Generation, choices) -> dict:
    completion = sum(len(c.token_ids) for c in choices)
    out = {"prompt_tokens": gen.num_prompt_tokens, "completion_tokens": completion,
           "total_tokens": gen.num_prompt_tokens + completion}
    if gen.num_cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": gen.num_cached_tokens}
    return out


def best_choices(gen: Generation, n: int) -> list:
    """The choices to return: all of them, or (best_of > n) the n most likely of each prompt."""
    out = []
    for per_prompt in gen.choices:
        picked = per_prompt if len(per_prompt) <= n else \
            sorted(per_prompt, key=lambda c: -c.cumulative_logprob)[:n]
        out.extend(picked)
    return out


def prompt_logprobs_json(gen: Generation, p: int, text) -> list | None:
    """vLLM's prompt_logprobs of prompt p: None for its first token, then {id: {logprob, rank,
    decoded_token}} for the token itself and its top alternatives."""
    entries = gen.prompt_logprobs[p]
    if entries is None:
        return None
    out: list = [None]
    for tid, (lp, rank, top) in zip(gen.prompts[p][1:], entries):
        d = {str(i): {"logprob": v, "rank": r, "decoded_token": text(i)} for r, (i, v) in enumerate(top, 1)}
        d[str(tid)] = {"logprob": lp, "rank": rank, "decoded_token": text(tid)}
        out.append(d)
    return out


# Bytes of JSON per token in an answer, roughly: its text, and each logprob entry.
TOKEN_JSON_BYTES = 48


def answer_size(gen: Generation) -> int:
    """A non-streamed answer's JSON in bytes, estimated from its tokens and logprobs."""
    per_token = 1 + (gen.params.logprobs or 0)
    prompt = sum(len(p) for p, lp in zip(gen.prompts, gen.prompt_logprobs) if lp is not None) * \
        (1 + (gen.params.prompt_logprobs or 0))
    return TOKEN_JSON_BYTES * (sum(len(c.token_ids) for c in gen.all_choices) * per_token + prompt)


def running_usage(gen: Generation, index: int, done: int) -> dict:
    """vLLM's continuous_usage_stats: one choice's usage up to a chunk (its prompt, and its tokens
    up to that chunk's: none yet for the chunks before the first token, the role, the echo)."""
    prompt = len(gen.prompts[index // gen.params.n])
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


async def respond(request, gen: Generation, fmt: Formatter, stream: bool, stream_options,
                  headers: dict) -> Response:
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = include_usage and stream_options.continuous_usage_stats   # as vLLM: only with include_usage
    watcher = asyncio.create_task(watch_disconnect(request, gen))
    events = gen.events()
    try:
        if not stream:
            try:
                async for _ in events:
                    pass
            finally:
                watcher.cancel()
            gen.close()
            # Built and encoded off the loop when large; the generation is over, nothing changes it.
            return await gen.ctx.off_loop(lambda: JSONResponse(fmt.final(), headers=headers),
                                          size=answer_size(gen), refuse=False)
        first = await anext(events, None)
    except ClientDisconnected:
        watcher.cancel()
        gen.close()
        return Response(status_code=499)    # nobody reads it; nginx's code for a client that left
    except BaseException:
        watcher.cancel()
        gen.abort()
        gen.close(None if gen.error else APIError(500, "internal error"))
        raise

    def write(batch: list[ChoiceEvent]) -> bytes:
        """A batch's chunks, one per event that says something, in one write."""
        said = [ev for ev in batch if not ev.says_nothing()]
        chunks = fmt.chunks(said)
        if continuous:
            for c, ev in zip(chunks, said):
                c["usage"] = running_usage(gen, ev.index, ev.tokens_so_far)
        return b"".join(map(sse, chunks))

    async def body():
        try:
            # One write per batch of updates, not per chunk: a router that falls behind catches
            # up in fewer, larger sends (each send costs a trip through starlette and uvicorn).
            start = fmt.start_chunks()
            if continuous:
                for c in start:
                    c["usage"] = running_usage(gen, c["choices"][0]["index"], 0)
            head = b"".join(map(sse, start)) + (write(first) if first is not None else b"")
            if head:
                yield head
            async for batch in events:
                text = write(batch)
                if text:
                    yield text
            gen.close()
            yield (sse(fmt.usage_chunk()) if include_usage else b"") + DONE
        except ClientDisconnected:
            gen.close()
        except APIError as e:
            gen.ctx.metrics.error(e.status)
            yield sse(e.body())
            yield DONE
        finally:
            watcher.cancel()
            if not gen.closed:      # the stream was cancelled: the client is gone
                gen.abort()
                gen.close()

    return EventStream(body(), headers)
