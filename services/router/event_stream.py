"""The SSE response path: chunks encoded by msgspec, written past the middleware.

A stream sends one chunk per token, so what each chunk costs on its way out is paid per token. Through
Starlette's StreamingResponse a chunk went through the app's send wrappers (the exception handlers'
response trackers, ServerErrorMiddleware's, CORS') and an anyio task group before uvicorn wrote it:
about a tenth of the router's CPU at saturation, and json.dumps another tenth. Those wrappers only
look at the response's start; so the start (status and headers) goes through them as before, and the
body chunks go to the server's own send, which RouterApp puts in the scope.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI
from starlette.responses import Response

# The scope key under which RouterApp leaves the server's send for the response body.
CONNECTION_SEND = "pagedserve.connection_send"

_encode = msgspec.json.Encoder().encode


def sse(obj: dict) -> bytes:
    """One SSE event of a JSON object. msgspec writes the same JSON as json.dumps(ensure_ascii=False,
    separators=(",", ":")) for every finite value (a float may be spelled differently, 1e22 for
    1e+22); a non-finite float, which json.dumps writes as the invalid -Infinity, becomes null."""
    return b"data: " + _encode(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


class RouterApp(FastAPI):
    """The router's FastAPI app; for HTTP requests the server's send is left in the scope, before any
    middleware wraps it (EventStream writes body chunks with it)."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[CONNECTION_SEND] = send
        await super().__call__(scope, receive, send)


class EventStream(Response):
    """text/event-stream from an iterator of encoded chunks. The start and the end of the response go
    through the app's send (the middleware sees both); the chunks between go straight to the server
    (its send where RouterApp left it, else the app's, as under a plain FastAPI app in a test)."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], headers: dict | None = None):
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        write = scope.get(CONNECTION_SEND, send)
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.chunks:
                await write({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:   # cancelled (the server stops): the generator's own cleanup runs now, not at collection
            await self.chunks.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
