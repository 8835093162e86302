"""The router's bounded queue: how many requests (and prompt tokens) it holds that have not started.

A request takes a Ticket before its body is tokenized (--max-queued-requests is checked there, so
a flood is refused without paying for its tokenization), charges its prompt tokens once they are
known (--max-queued-tokens), and gives the ticket back when its first token arrives or when it
ends, whichever comes first. The limits are per router: each router bounds what it holds, as
TGI's --max-concurrent-requests does; several routers hold at most the sum.

Owns only its two counters; the Generation that runs a request releases its ticket.
"""
from __future__ import annotations

import time
from typing import Callable

from pagedserve.services.router.errors import APIError, unavailable


class Admission:
    def __init__(self, max_requests: int | None, max_tokens: int | None,
                 on_reject: Callable[[str], None] = lambda reason: None):
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.on_reject = on_reject      # vLLM's admission_rejections reasons: max_num_queued_reqs / _tokens
        self.requests = 0
        self.tokens = 0

    def enter(self) -> "Ticket":
        if self.max_requests is not None and self.requests >= self.max_requests:
            self.on_reject("max_num_queued_reqs")
            raise full(f"the server holds {self.requests} requests that have not started "
                       f"(--max-queued-requests {self.max_requests}); retry later")
        self.requests += 1
        return Ticket(self)


class Ticket:
    """One request's place in the queue; release() is idempotent."""

    def __init__(self, admission: Admission):
        self.admission = admission
        self.since = time.monotonic()     # the request's arrival: --request-timeout counts from here
        self.tokens = 0
        self.held = True
        self.owned = False      # a started Generation releases it; until then its handler does

    def charge(self, tokens: int) -> None:
        a = self.admission
        if a.max_tokens is not None and a.tokens + tokens > a.max_tokens and a.tokens > 0:
            # A prompt larger than the whole limit still runs when nothing else waits: the
            # context length, not this limit, bounds one request.
            self.release()
            a.on_reject("max_num_queued_tokens")
            raise full(f"the server holds {a.tokens} prompt tokens that have not started; {tokens} more "
                       f"would pass --max-queued-tokens {a.max_tokens}; retry later")
        self.tokens += tokens
        a.tokens += tokens

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.requests -= 1
            self.admission.tokens -= self.tokens


def full(message: str) -> APIError:
    return unavailable(message)          # a 503 says Retry-After: 1 (services.router.errors)
