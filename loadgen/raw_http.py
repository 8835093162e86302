"""HTTP/1.1 by hand, for the attack soak: requests no well-behaved client library would send
(bytes that are not UTF-8, no Content-Type, huge or trickled headers, a body the server stops
reading), and one answer for each: the status, or what became of the connection instead.

Every answer is an `Answer`: `status` is the HTTP status, or one of "closed" (the server ended the
connection without a status line), "reset" (a connection reset or broken pipe), "timeout".
"""
from __future__ import annotations

import asyncio
import contextvars
import http.client
import json
import time
from dataclasses import dataclass

# The loopback address a hostile client sends from. Each class gets its own (the soak sets it per
# class), as attackers on a network have addresses of their own: the router throttles failed keys
# per client address, and one class's flood must not throttle the normal load or another class.
SOURCE = contextvars.ContextVar("source_address", default="127.0.0.1")


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the router on 127.0.0.1:port, from this class's source address."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(SOURCE.get(), 0))


@dataclass
class Answer:
    status: int | str
    latency_s: float
    body: bytes = b""
    round_at: float | None = None     # when its class's round began (time.monotonic; set by the soak)

    def to_dict(self, t0: float = 0.0) -> dict:
        out = {"status": self.status, "latency_s": round(self.latency_s, 3)}
        if self.round_at is not None:
            out["round_at_s"] = round(self.round_at - t0, 1)        # beside proc_watch's restart times
        if self.body and not (isinstance(self.status, int) and self.status < 300):
            out["said"] = self.body[:160].decode("utf-8", "replace")     # the evidence for a report
        return out


def json_headers(key: str | None = None, content_type: str | None = "application/json") -> dict[str, str]:
    h = {"Content-Type": content_type} if content_type else {}
    if key:
        h["Authorization"] = f"Bearer {key}"
    return h


def head(method: str, path: str, headers: dict[str, str], body_len: int | None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    if body_len is not None:
        lines.append(f"Content-Length: {body_len}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def read_answer(reader: asyncio.StreamReader, t0: float) -> Answer:
    """The status line, the headers and a Content-Length body (or what arrived before the close)."""
    try:
        status_line = await reader.readline()
        if not status_line:
            return Answer("closed", time.monotonic() - t0)
        status = int(status_line.split()[1])
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        latency = time.monotonic() - t0
        body = await reader.readexactly(length) if length else b""
        return Answer(status, latency, body)
    except (ConnectionResetError, BrokenPipeError):
        return Answer("reset", time.monotonic() - t0)
    except asyncio.IncompleteReadError as e:
        return Answer(status, time.monotonic() - t0, e.partial)


async def send(port: int, method: str, path: str, headers: dict[str, str], body: bytes | None = None,
               timeout_s: float = 10.0, raw_head: bytes | None = None) -> Answer:
    """One request on its own connection; `raw_head` replaces the head built from the arguments."""
    t0 = time.monotonic()
    writer = None
    try:
        reader, writer = await asyncio.wait_for(connect(port), timeout_s)
        writer.write(raw_head or head(method, path, headers, None if body is None else len(body)))
        if body:
            writer.write(body)
        await writer.drain()
        return await asyncio.wait_for(read_answer(reader, t0), timeout_s)
    except asyncio.TimeoutError:
        return Answer("timeout", time.monotonic() - t0)
    except (ConnectionResetError, BrokenPipeError):
        return Answer("reset", time.monotonic() - t0)
    finally:
        if writer is not None:
            writer.close()


async def post_json(port: int, path: str, payload, key: str | None = None, timeout_s: float = 10.0) -> Answer:
    return await send(port, "POST", path, json_headers(key), json.dumps(payload).encode(), timeout_s)


def http_client_post(port: int, path: str, body: bytes, headers: dict[str, str], timeout_s: float = 20.0) -> Answer:
    """As the standard library's client sends it (the whole body, then the answer): the issue's
    24 MB case, where a server that answers early and closes resets this client."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s, source_address=(SOURCE.get(), 0))
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        return Answer(resp.status, time.monotonic() - t0, resp.read())
    except (ConnectionResetError, BrokenPipeError):
        return Answer("reset", time.monotonic() - t0)
    except TimeoutError:
        return Answer("timeout", time.monotonic() - t0)
    except http.client.HTTPException:
        return Answer("closed", time.monotonic() - t0)
    finally:
        conn.close()
