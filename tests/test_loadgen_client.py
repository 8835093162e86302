"""loadgen's client against servers that answer in odd but legal ways, and in wrong ones: every
request ends as a record (completed, or failed with the right kind), never as an exception."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pagedserve.loadgen.client import Target, new_session, send
from pagedserve.loadgen.scrape import Scraper, parse_metrics
from pagedserve.loadgen.workload import PlannedRequest

TOKEN = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": " x"}]}
USAGE = {"id": "c", "object": "text_completion", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}


def sse(obj, sep=b"\n\n") -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + sep


BODIES = {
    "plain": b"".join(sse(TOKEN) for _ in range(4)) + sse(USAGE) + sse(b"[DONE]"),
    "crlf": b"".join(sse(TOKEN, b"\r\n\r\n") for _ in range(4)) + sse(USAGE, b"\r\n\r\n") + sse(b"[DONE]", b"\r\n\r\n"),
    "fields": b"".join(b"id: %d\nevent: completion\n" % i + sse(TOKEN) for i in range(4)) + b": keep-alive\n\n"
              + sse(USAGE) + b"data: [DONE]\n",
    "no_usage": sse(dict(TOKEN, choices=[{"index": 0, "text": " x x"}])) * 2 + sse(b"[DONE]"),
    "error_event": sse(TOKEN) + sse({"error": {"message": "boom", "code": 500}}) + sse(b"[DONE]"),
    "not_sse": b"<html>hello</html>",
    "list_event": sse(TOKEN) + b'data: ["usage"]\n\n',
    "cut": sse(TOKEN) + b'data: {"id": "c", "choi',
    "cached": sse(TOKEN) + sse(dict(USAGE, usage={"prompt_tokens": 40, "completion_tokens": 1,
                                                  "prompt_tokens_details": {"cached_tokens": 32}})) + sse(b"[DONE]"),
}


async def handler(request: web.Request) -> web.StreamResponse:
    mode = request.match_info["mode"]
    if mode == "http500":
        return web.Response(status=500, body=b"<h1>\xff\xfe broken</h1>", content_type="text/html")
    if mode == "json_list":
        return web.Response(body=b"[1, 2, 3]", content_type="application/json")
    if mode == "json_ok":
        return web.json_response({"choices": [{"text": "x"}], "usage": {"completion_tokens": 4, "prompt_tokens": 3}})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    body = BODIES[mode.removesuffix("_split")]
    step = 3 if mode.endswith("_split") else len(body)
    for i in range(0, len(body), step):          # _split: 3 bytes a write, events cut anywhere
        await resp.write(body[i:i + step])
        if step == 3:
            await asyncio.sleep(0)
    if mode == "cut":
        request.transport.close()
        return resp
    await resp.write_eof()
    return resp


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=b"\xff\xfe\x00 garbage\nvllm:num_requests_running nan\n")


async def run_one(mode: str, stream: bool = True):
    app = web.Application()
    app.router.add_post("/{mode}/v1/completions", handler)
    app.router.add_get("/metrics", metrics)
    server = TestServer(app)
    await server.start_server()
    try:
        async with new_session(None) as session:
            target = Target(str(server.make_url(f"/{mode}")), "m", stream=stream)
            rec = await send(session, target, PlannedRequest(0, 0.0, [11, 12, 13], 3, 4), 0.0, 10)
            scraper = Scraper(session, str(server.make_url("")), 0.5, 0.0)
            await scraper.scrape_once()
            return rec, scraper
    finally:
        await server.close()


@pytest.mark.parametrize("mode", ["plain", "crlf", "fields", "plain_split", "crlf_split", "fields_split"])
def test_legal_streams_complete(mode):
    rec, _ = asyncio.run(run_one(mode))
    assert rec.ok, (rec.error, rec.error_detail)
    assert rec.output_tokens == 4 and rec.prompt_tokens == 3 and len(rec.token_times) == 4
    assert not rec.usage_missing and rec.ttft is not None


def test_the_prefix_cache_hits_of_a_request_come_from_its_usage():
    rec, _ = asyncio.run(run_one("cached"))
    assert rec.ok and rec.prompt_tokens == 40 and rec.cached_tokens == 32
    rec, _ = asyncio.run(run_one("plain"))
    assert rec.cached_tokens is None


def test_a_stream_without_usage_counts_events_and_says_so():
    rec, _ = asyncio.run(run_one("no_usage"))
    assert rec.ok and rec.output_tokens == 2 and rec.usage_missing


@pytest.mark.parametrize("mode,stream,kind", [
    ("error_event", True, "stream_error"), ("not_sse", True, "bad_response"), ("list_event", True, "bad_response"),
    ("cut", True, "disconnect"), ("http500", True, "http_500"), ("json_list", False, "bad_response"),
])
def test_wrong_answers_are_records_of_the_right_kind(mode, stream, kind):
    rec, _ = asyncio.run(run_one(mode, stream))
    assert rec.error == kind, (rec.error, rec.error_detail)
    assert rec.end is not None and rec.send is not None


def test_a_json_answer_when_not_streamed():
    rec, _ = asyncio.run(run_one("json_ok", stream=False))
    assert rec.ok and rec.output_tokens == 4 and rec.ttft is None


def test_metrics_that_are_not_text_or_not_numbers_do_not_stop_the_scraper():
    _, scraper = asyncio.run(run_one("plain"))
    assert scraper.available and scraper.samples[0]["running"] is None
    assert parse_metrics("vllm:num_requests_running inf\nvllm:num_requests_waiting 2\n")["waiting"] == 2
