"""A scripted OpenAI-compatible server whose timing is known: for testing load generators (ours
included) and for measuring how many events per second a client can take.

Each completion answers after `ttft + ttft_per_token * prompt tokens` seconds, then sends one event
every `itl` seconds with `tokens_per_event` tokens, `max_tokens` tokens in all (fewer with
`--short-by`), then the usage and [DONE]. With every delay 0 it answers as fast as the socket
takes it. Faults on request: `--fail-every K` answers every K-th request with a 503, `--error-every K`
ends every K-th stream with an error event after its first token.

Plain asyncio and HTTP/1.1 with keep-alive and chunked bodies: no framework, so that the server is
never the bottleneck of what it measures.

    python -m pagedserve.loadgen.fake_server --port 8100 --ttft 0.05 --itl 0.01
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

MODEL = "fake-model"


class FakeServer:
    def __init__(self, ttft: float = 0.0, ttft_per_token: float = 0.0, itl: float = 0.0,
                 tokens_per_event: int = 1, max_model_len: int = 4096, short_by: int = 0,
                 fail_every: int = 0, error_every: int = 0, metrics: bool = True):
        self.ttft, self.ttft_per_token, self.itl = ttft, ttft_per_token, itl
        self.tokens_per_event, self.max_model_len, self.short_by = tokens_per_event, max_model_len, short_by
        self.fail_every, self.error_every, self.metrics = fail_every, error_every, metrics
        self.requests = 0
        self.in_flight = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                await self.route(method, path.split("?")[0], body, writer)
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def route(self, method: str, path: str, body: bytes, w: asyncio.StreamWriter) -> None:
        if method == "GET" and path == "/v1/models":
            data = {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": self.max_model_len}]}
            return _send(w, 200, json.dumps(data).encode(), "application/json")
        if method == "GET" and path == "/metrics" and self.metrics:
            text = (f"vllm:num_requests_running{{model_name=\"{MODEL}\"}} {self.in_flight}\n"
                    f"vllm:num_requests_waiting{{model_name=\"{MODEL}\"}} 0\n"
                    f"vllm:kv_cache_usage_perc{{model_name=\"{MODEL}\"}} {min(1.0, self.in_flight / 64)}\n"
                    f"vllm:num_preemptions_total{{model_name=\"{MODEL}\"}} 0\n")
            return _send(w, 200, text.encode(), "text/plain; version=0.0.4")
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            return await self.complete(json.loads(body or b"{}"), path.endswith("chat/completions"), w)
        _send(w, 404, b'{"error": {"message": "not found", "type": "NotFoundError", "code": 404}}', "application/json")

    async def complete(self, req: dict, chat: bool, w: asyncio.StreamWriter) -> None:
        self.requests += 1
        n = self.requests
        if self.fail_every and n % self.fail_every == 0:
            return _send(w, 503, b'{"error": {"message": "scripted failure", "type": "ServiceUnavailable", '
                                 b'"code": 503}}', "application/json")
        prompt = req["messages"][-1]["content"] if chat else req["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        asked = req.get("max_completion_tokens" if chat else "max_tokens") or 16
        tokens = max(1, asked - self.short_by)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}
        self.in_flight += 1
        try:
            start = time.perf_counter()
            await _sleep_until(start + self.ttft + self.ttft_per_token * prompt_tokens)
            if not req.get("stream"):
                choice = {"index": 0, "finish_reason": "length"}
                choice.update({"message": {"role": "assistant", "content": " x" * tokens}} if chat else {"text": " x" * tokens})
                body = {"id": f"cmpl-{n}", "object": "chat.completion" if chat else "text_completion",
                        "model": MODEL, "choices": [choice], "usage": usage}
                return _send(w, 200, json.dumps(body).encode(), "application/json")
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            kind = "chat.completion.chunk" if chat else "text_completion"
            sent, event = 0, 0
            while sent < tokens:
                if event:
                    await _sleep_until(start + self.ttft + self.ttft_per_token * prompt_tokens + event * self.itl)
                k = min(self.tokens_per_event, tokens - sent)
                text = " x" * k
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                _chunk(w, {"id": f"cmpl-{n}", "object": kind, "model": MODEL, "choices": [choice]})
                sent, event = sent + k, event + 1
                if self.error_every and n % self.error_every == 0:
                    _chunk(w, {"error": {"message": "scripted stream error", "type": "InternalServerError",
                                         "code": 500}})
                    break
                if self.itl == 0 and event % 64 == 0:
                    await w.drain()
            else:
                _chunk(w, {"id": f"cmpl-{n}", "object": kind, "model": MODEL, "choices": [], "usage": usage})
            _raw_chunk(w, b"data: [DONE]\n\n")
            w.write(b"0\r\n\r\n")
            await w.drain()
        finally:
            self.in_flight -= 1


def _chunk(w: asyncio.StreamWriter, obj: dict) -> None:
    _raw_chunk(w, b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def _raw_chunk(w: asyncio.StreamWriter, data: bytes) -> None:
    w.write(b"%x\r\n%s\r\n" % (len(data), data))


def _send(w: asyncio.StreamWriter, status: int, body: bytes, ctype: str) -> None:
    reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}.get(status, "Error")
    w.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def serve(server: FakeServer, host: str, port: int) -> None:
    srv = await asyncio.start_server(server.handle, host, port, limit=1 << 22, backlog=1024)
    print(f"fake server on http://{host}:{srv.sockets[0].getsockname()[1]}", flush=True)
    async with srv:
        await srv.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0: any free port (printed)")
    p.add_argument("--ttft", type=float, default=0.0, help="seconds before the first token")
    p.add_argument("--ttft-per-token", type=float, default=0.0, help="more seconds per prompt token")
    p.add_argument("--itl", type=float, default=0.0, help="seconds between events")
    p.add_argument("--tokens-per-event", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--short-by", type=int, default=0, help="return this many tokens fewer than asked")
    p.add_argument("--fail-every", type=int, default=0, help="answer every K-th request with a 503")
    p.add_argument("--error-every", type=int, default=0, help="end every K-th stream with an error event")
    p.add_argument("--no-metrics", action="store_true", help="no /metrics (404)")
    a = p.parse_args(argv)
    server = FakeServer(a.ttft, a.ttft_per_token, a.itl, a.tokens_per_event, a.max_model_len, a.short_by,
                        a.fail_every, a.error_every, not a.no_metrics)
    try:
        asyncio.run(serve(server, a.host, a.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
