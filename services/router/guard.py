"""What every HTTP request meets before a route: the API key on /v1/*, and the body size limit.

A pure ASGI middleware (Starlette's BaseHTTPMiddleware would wrap every streamed response):
- `/v1/*` needs `Authorization: Bearer KEY` when keys are configured (401 otherwise, as vLLM);
  `/health`, `/ping`, `/ready`, `/version` and `/metrics` stay public, for probes and Prometheus,
  and `/tokenize`, `/detokenize` too, as vLLM leaves them (it guards only /v1 and a few prefixes).
  Keys given on the command line are compared in constant time (every configured key is compared,
  a mismatch takes as long as a match); keys kept in Redis (--require-api-key) are found by the
  SHA-256 of the key, which tells an attacker nothing about any key.
- 401s are counted per client address: past --auth-failure-limit in a --rate-limit-window, that
  address gets 429 on /v1/* before any key it sends is checked.
- A body over --max-request-body-mb is a 413 before any of it is parsed: at once from
  Content-Length, or as soon as a chunked body passes the limit.
- Every refusal here drains what is left of the body, within bounds, before it answers (_drain).
The key that passed is left in scope["state"]["api_key"] for the rate limit of the routes that count.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math

from fastapi.responses import JSONResponse

from pagedserve.services.router.errors import error_body

log = logging.getLogger("pagedserve.router")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class Guard:
    def __init__(self, app, config, state, on_error=lambda status: None):
        self.app, self.on_error = app, on_error
        self.max_body = int(config.max_request_body_mb * (1 << 20))
        self.auth_required = config.auth_required
        self.digests = [key_digest(k) for k in config.api_keys]
        self.use_store = config.require_api_key
        self.failure_limit, self.window_s = config.auth_failure_limit, config.rate_limit_window_s
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.auth_required and (path == "/v1" or path.startswith("/v1/")) and scope["method"] != "OPTIONS":
            # Throttled before the key is looked at: past the limit a right key is refused too,
            # so a guesser learns nothing from its guesses (clients behind one proxy share its address).
            throttle = f"auth-failures:{(scope.get('client') or ('?',))[0]}"
            if self.failure_limit:
                blocked = self.state.hit_rate_limit(throttle, self.failure_limit, self.window_s, count=False)
                if not blocked.allowed:
                    self.on_error(429)
                    wait = max(1, math.ceil(blocked.retry_after_s))
                    return await _refuse(scope, receive, send, 429, f"Too many requests with a wrong or missing "
                                         f"API key from this address; retry in {wait} s.", {"Retry-After": str(wait)})
            key = self._bearer(scope)
            info = self._check(key) if key else None
            if info is None:
                if self.failure_limit:
                    self.state.hit_rate_limit(throttle, self.failure_limit, self.window_s)
                self.on_error(401)
                why = "Incorrect API key provided." if key else "Missing API key: send 'Authorization: Bearer <key>'."
                return await _refuse(scope, receive, send, 401, why, {"WWW-Authenticate": "Bearer"})
            scope.setdefault("state", {})["api_key"] = (key, info)
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.isdigit():
                self.on_error(400)
                return await _answer(send, 400, "Content-Length is not a number", close=True)
            if int(length) > self.max_body:
                self.on_error(413)
                return await _refuse(scope, receive, send, 413, self._too_large(int(length)))
            return await self.app(scope, receive, send)
        return await self._counted(scope, receive, send)

    def _bearer(self, scope) -> str:
        auth = (_header(scope, b"authorization") or "")
        return auth[7:].strip() if auth[:7].lower() == "bearer " else ""

    def _check(self, key: str) -> dict | None:
        digest = key_digest(key)
        matched = False
        for d in self.digests:                 # no early exit: the time does not say which key matched
            matched |= hmac.compare_digest(d, digest)
        if matched:
            return {"name": "cli"}
        return self.state.check_api_key(key) if self.use_store else None

    def _too_large(self, size: int | None = None) -> str:
        got = f" ({size} bytes)" if size is not None else ""
        return f"the request body{got} is larger than the limit of {self.max_body} bytes (--max-request-body-mb)"

    async def _counted(self, scope, receive, send):
        """A body without Content-Length (chunked): read it whole, counting, before the route runs."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return                          # the client left before its body ended
            size += len(message.get("body", b""))
            if size > self.max_body:
                self.on_error(413)
                return await _refuse(scope, receive, send, 413, self._too_large(),
                                      drained=not message.get("more_body"))
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()              # then the disconnect, when it comes

        return await self.app(scope, replay, send)


def _header(scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


# A refused request's body still on its way is read and dropped up to these bounds before the
# answer: http.client (and others) send the whole body before they read, and a server that closes
# on unread data sends them a connection reset instead of its 413 or 401. Past the bounds the
# connection is closed: an unauthenticated client never makes the router read a huge body.
DRAIN_BYTES = 64 << 20
DRAIN_S = 10.0


async def _refuse(scope, receive, send, status: int, message: str, headers: dict | None = None,
                  drained: bool = False) -> None:
    """Answer before the route reads the body (drained: it has been read to its end already)."""
    await _answer(send, status, message, headers, close=not (drained or await _drain(scope, receive)))


async def _drain(scope, receive) -> bool:
    """Read and drop the request's body, within the bounds; whether it was read to its end."""
    if (_header(scope, b"expect") or "").lower() == "100-continue":
        return False              # the client waits for our word before it sends: close, it sends nothing
    length = _header(scope, b"content-length")
    if (length is None and _header(scope, b"transfer-encoding") is None) or length == "0":
        return True               # no body
    if length is not None and (not length.isdigit() or int(length) > DRAIN_BYTES):
        return False
    read = 0
    try:
        async with asyncio.timeout(DRAIN_S):
            while read <= DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return False
                read += len(message.get("body", b""))
                if not message.get("more_body"):
                    return True
    except TimeoutError:
        pass
    return False


async def _answer(send, status: int, message: str, headers: dict | None = None, close: bool = False) -> None:
    # The app's own encoder (compact JSON), so that the guard's errors read like every other one.
    body = JSONResponse(error_body(status, message)).body
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if close:
        raw.append((b"connection", b"close"))    # the rest of the body is not read
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
