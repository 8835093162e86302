"""The project's one HTTP client for OpenAI-compatible servers: one request in, one timed record out.

It shares the cores with the server it measures, so it does as little per token as it can: the
body is read in whatever pieces the socket gives (`iter_any`, not line by line), events are cut at
blank lines, a token event (one with text: its arrival time is kept) is recognized by a regex
without decoding it, and only an event with an error or the usage is decoded. Output tokens are the usage's `completion_tokens`
(streams ask for it with `stream_options.include_usage`), not the number of events: a server may
put several tokens in one event.

Every failure is a record with an error kind, never an exception: `connect`, `timeout`, `http_NNN`,
`stream_error` (an error event inside a 200 stream), `disconnect` (the body was cut), `bad_response`
(a 200 that is not what the API sends) and `interrupted` (Ctrl-C).
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field, fields

import aiohttp

from pagedserve.loadgen.workload import PlannedRequest


@dataclass
class Target:
    url: str                        # base URL, no trailing slash
    model: str
    endpoint: str = "completions"   # or "chat"
    api_key: str | None = None
    stream: bool = True
    temperature: float = 0.0
    force_output_len: bool = True
    send_true_output_len: bool = False   # pagedserve's Orca baselines reserve it; other servers reject it
    keep_text: bool = False     # decode every token event and keep the answer (multi-turn: the next
                                # turn sends it back); off, token events are only timed

    @property
    def path(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, req: PlannedRequest) -> dict:
        body: dict = {"model": self.model, "temperature": self.temperature, "stream": self.stream}
        if self.endpoint == "completions":
            body["prompt"] = req.prompt
            body["max_tokens"] = req.output_len
        else:
            body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
            body["max_completion_tokens"] = req.output_len
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.force_output_len:
            body["ignore_eos"] = True
            body["min_tokens"] = req.output_len
        if self.send_true_output_len:
            body["true_output_len"] = req.output_len
        return body


@dataclass
class RequestRecord:
    index: int
    arrival: float                          # when it was due (s after the run's start)
    input_len: int                          # planned prompt tokens
    output_len: int                         # asked output tokens
    prefix_blocks: int = 0
    send: float | None = None               # when it went out (later than arrival under --max-concurrency)
    first_token: float | None = None        # streams: arrival of the first event with text
    token_times: list[float] = field(default_factory=list)   # every event with text (streams)
    end: float | None = None
    prompt_tokens: int | None = None        # the server's usage
    output_tokens: int | None = None
    status: int | None = None
    error: str | None = None                # kind; None when it succeeded
    error_detail: str | None = None
    usage_missing: bool = False             # output_tokens counted from text events, a lower bound
    cached_tokens: int | None = None        # usage.prompt_tokens_details.cached_tokens: prefix-cache hits
    answer: str | None = None               # the answer's text, only under Target.keep_text

    @classmethod
    def planned(cls, req: PlannedRequest) -> "RequestRecord":
        return cls(req.index, req.arrival, req.input_len, req.output_len, req.prefix_blocks)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.send

    @property
    def e2el(self) -> float:
        return self.end - self.send

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def to_json(self) -> dict:
        # Not dataclasses.asdict: it deep-copies every token_times list (a second per 65k events).
        return {f.name: getattr(self, f.name) for f in fields(self)}


async def send(session: aiohttp.ClientSession, target: Target, req: PlannedRequest, t0: float,
               timeout: float, rec: RequestRecord | None = None) -> RequestRecord:
    """Send one request, filling `rec` (a new record if None); its times are seconds after t0
    (perf_counter). Cancelled, it keeps what it received, marks itself interrupted and re-raises."""
    rec = rec or RequestRecord.planned(req)
    clock = time.perf_counter
    rec.send = clock() - t0
    if target.keep_text:
        rec.answer = ""
    try:
        async with asyncio.timeout(timeout):
            async with session.post(target.url + target.path, json=target.body(req),
                                    headers=target.headers()) as resp:
                rec.status = resp.status
                if resp.status != 200:
                    detail = (await resp.read())[:500].decode("utf-8", "replace")
                    return _failed(rec, f"http_{resp.status}", detail, clock() - t0)
                if target.stream:
                    await _read_stream(resp, rec, t0)
                else:
                    obj = _object(await resp.read())
                    _take_usage(rec, obj)
                    if rec.answer is not None:
                        rec.answer = _text_of(obj, "message")
    except asyncio.CancelledError:
        _failed(rec, "interrupted", "the run was stopped", clock() - t0)
        raise
    except TimeoutError:
        return _failed(rec, "timeout", f"no answer within {timeout:g} s", clock() - t0)
    except aiohttp.ClientConnectorError as e:
        return _failed(rec, "connect", str(e), clock() - t0)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as e:
        return _failed(rec, "disconnect", str(e) or type(e).__name__, clock() - t0)
    except aiohttp.ClientError as e:
        return _failed(rec, "client", f"{type(e).__name__}: {e}", clock() - t0)
    except BadResponse as e:
        return _failed(rec, "bad_response", str(e), clock() - t0)
    rec.end = clock() - t0
    if rec.error is None and rec.output_tokens is None:
        if target.stream and rec.token_times:
            rec.output_tokens = len(rec.token_times)   # no usage: one token per event, a lower bound
            rec.usage_missing = True
        else:
            return _failed(rec, "bad_response", "no usage in the response", rec.end)
    return rec


class BadResponse(ValueError):
    """A 200 whose body is not what an OpenAI-compatible server sends."""


def _object(data: bytes) -> dict:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadResponse(f"not JSON ({e}): {data[:200]!r}") from None
    if not isinstance(obj, dict):
        raise BadResponse(f"a JSON {type(obj).__name__} where an object was expected: {data[:200]!r}")
    return obj


# A non-empty text or delta content: what makes an event a token event (as vllm bench serve counts
# them). JSON escapes every quote inside a string, so these bytes can only be a key and its value.
TEXT = re.compile(rb'"(?:text|content|reasoning_content)"\s*:\s*"(?!")')


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, t0: float) -> None:
    """Token events are found by TEXT without being decoded; only events that carry an error or the
    usage (once a stream, normally) go through json.loads. Events end at a blank line; CR and CRLF
    line ends are read as LF (the SSE spec allows all three)."""
    clock, buf, seen = time.perf_counter, b"", False
    async for piece in resp.content.iter_any():
        now = clock() - t0
        buf += piece
        if b"\r" in buf:
            keep = b"\r" if buf.endswith(b"\r") else b""      # its \n may come in the next piece
            buf = buf[:len(buf) - len(keep)].replace(b"\r\n", b"\n").replace(b"\r", b"\n") + keep
        *events, buf = buf.split(b"\n\n")
        for event in events:
            data = _data_of(event)
            if data is None:
                continue                            # comments, keep-alives, other fields only
            seen = True
            if _take_event(data, rec, now):
                return
    if buf.strip():                                 # the last event without its blank line
        data = _data_of(buf.strip(b"\r\n"))
        if data is not None and (data == b"[DONE]" or _complete(data)):
            _take_event(data, rec, clock() - t0)
            return
        if seen or b"data:" in buf:
            raise aiohttp.ClientPayloadError("the stream ended inside an event")
        raise BadResponse(f"not an event stream: {buf[:200]!r}")


def _data_of(event: bytes) -> bytes | None:
    """The data of one SSE event (its `data:` lines joined), None when it has none."""
    if event.startswith(b"data:"):
        if b"\n" not in event:
            return event[5:].strip()                # the usual event: one data line
    elif b"\ndata:" not in event:
        return None
    lines = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines)


def _complete(data: bytes) -> bool:
    try:
        json.loads(data)
        return True
    except ValueError:
        return False


def _take_event(data: bytes, rec: RequestRecord, now: float) -> bool:
    """Note one event's data in `rec`; True when the stream is over ([DONE] or an error)."""
    if TEXT.search(data):
        if rec.first_token is None:
            rec.first_token = now
        rec.token_times.append(now)
        if rec.answer is not None:
            rec.answer += _text_of(_object(data), "delta")
    if data == b"[DONE]":
        return True
    if b'"error"' in data or b'"usage"' in data:
        obj = _object(data)
        err = obj.get("error") or (obj if obj.get("object") == "error" else None)
        if err:
            rec.error = "stream_error"
            rec.error_detail = str(err.get("message", err) if isinstance(err, dict) else err)
            return True
        if obj.get("usage"):
            _take_usage(rec, obj)
    return False


def _text_of(obj: dict, part: str) -> str:
    """The first choice's text: chat's `part` (delta or message) content, or completions' text."""
    choices = obj.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    inner = choice.get(part)
    text = inner.get("content") if isinstance(inner, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def _take_usage(rec: RequestRecord, obj: dict) -> None:
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return
    for key, attr in (("completion_tokens", "output_tokens"), ("prompt_tokens", "prompt_tokens")):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            setattr(rec, attr, value)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
        rec.cached_tokens = cached


def _failed(rec: RequestRecord, kind: str, detail: str, now: float) -> RequestRecord:
    rec.error, rec.error_detail, rec.end = kind, detail, now
    return rec


def new_session(max_concurrency: int | None) -> aiohttp.ClientSession:
    """One keep-alive pool for the whole run; no per-session timeout (each request has its own).

    Idle connections are dropped after 2 s, before the server drops them: uvicorn closes an idle
    keep-alive connection after 5 s, and a request sent on it at that moment fails with
    'Server disconnected' (2 of 200 requests against vLLM at 4 req/s with aiohttp's 15 s)."""
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, ttl_dns_cache=300, keepalive_timeout=2.0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                 read_bufsize=1 << 18)


async def get_json(session: aiohttp.ClientSession, url: str, headers: dict | None = None) -> dict:
    async with session.get(url, headers=headers or {}, timeout=aiohttp.ClientTimeout(total=10)) as r:
        r.raise_for_status()
        return await r.json(content_type=None)
