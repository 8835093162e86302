"""The router's bounded queue: how many sequences (and prompt tokens) it holds that have not started.

--max-queued-requests counts what the engine will queue, sequences: a request of 64 prompts x
n=128 is 8192 of them, not one (issue 28: one such request put 62 engine requests past a limit
of 4). A request takes a Ticket for one sequence before its body is tokenized (so a flood is
refused without paying for its tokenization), charges its real sequences and prompt tokens once
they are known (--max-queued-tokens), and gives the ticket back when its first token arrives or
when it ends, whichever comes first. The limits are per router: each router bounds what it
holds, as TGI's --max-concurrent-requests does; several routers hold at most the sum.

Owns only its two counters; the Generation that runs a request releases its ticket.
"""
from __future__ import annotations

import time
from typing import Callable

from pagedserve.services.router.errors import APIError, bad_request, unavailable


class Admission:
    def __init__(self, max_requests: int | None, max_tokens: int | None,
                 on_reject: Callable[[str], None] = lambda reason: None):
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.on_reject = on_reject      # vLLM's admission_rejections reasons: max_num_queued_reqs / _tokens
        self.sequences = 0
        self.tokens = 0

    def enter(self) -> "Ticket":
        if self.max_requests is not None and self.sequences >= self.max_requests:
            self.on_reject("max_num_queued_reqs")
            raise full(f"the server holds {self.sequences} sequences that have not started "
                       f"(--max-queued-requests {self.max_requests}); retry later")
        self.sequences += 1
        return Ticket(self)


class Ticket:
    """One request's place in the queue; release() is idempotent."""

    def __init__(self, admission: Admission):
        self.admission = admission
        self.since = time.monotonic()     # the request's arrival: --request-timeout counts from here
        self.tokens = 0
        self.sequences = 1       # what enter() counted; charge() sets the real number
        self.held = True
        self.owned = False      # a started Generation releases it (hand_over); until then its handler does

    def charge(self, tokens: int, sequences: int = 1) -> None:
        """The request's prompt tokens and sequences (prompts x n, or x the beam width), once known."""
        a = self.admission
        more = sequences - self.sequences
        if a.max_requests is not None and sequences > a.max_requests:
            # Never fits, however empty the queue: a 400 the client can act on, not a retry loop.
            self.release()
            raise bad_request(f"the request makes {sequences} sequences (prompts x n); this server queues at "
                              f"most {a.max_requests} (--max-queued-requests)", "n")
        if a.max_requests is not None and a.sequences + more > a.max_requests:
            self.release()
            a.on_reject("max_num_queued_reqs")
            raise full(f"the server holds {a.sequences - self.sequences} sequences that have not started; "
                       f"{sequences} more would pass --max-queued-requests {a.max_requests}; retry later")
        if a.max_tokens is not None and a.tokens + tokens > a.max_tokens and a.tokens > 0:
            # A prompt larger than the whole limit still runs when nothing else waits: the
            # context length, not this limit, bounds one request.
            self.release()
            a.on_reject("max_num_queued_tokens")
            raise full(f"the server holds {a.tokens} prompt tokens that have not started; {tokens} more "
                       f"would pass --max-queued-tokens {a.max_tokens}; retry later")
        self.tokens += tokens
        a.tokens += tokens
        self.sequences = sequences
        a.sequences += more

    def hand_over(self) -> None:
        """A Generation started with this ticket: it releases it (when its first token comes, or
        when it ends), not the handler that admitted the request."""
        self.owned = True

    def release_unless_handed_over(self) -> None:
        """The handler's end: a ticket no Generation took (a 4xx, a 503) is released here."""
        if not self.owned:
            self.release()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.sequences -= self.sequences
            self.admission.tokens -= self.tokens


def full(message: str) -> APIError:
    return unavailable(message)          # a 503 says Retry-After: 1 (services.router.errors)
