"""The router's bounded pool for work whose cost grows with a request's body: JSON parsing and
validation, chat-template rendering, tokenizing, detokenizing; and with its answer: the JSON of
a non-streamed response (n=1024 choices with 20 top logprobs each is millions of objects).

Done on the event loop, one large body (100,000 chat messages, 3.4 MB) stalled every other request,
/health included, for seconds: the launcher judged the router stuck and restarted it (issue 28).
Here such work runs in a few threads; the loop keeps serving while they work (the tokenizer
releases the GIL, and the Python parts yield it every few milliseconds). The pool is bounded: past
its threads plus --offload-queue waiting jobs, a request is refused at once with a 503 rather than
queued behind minutes of others' work.

A small body's work is done inline (size below INLINE_BYTES): its cost is bounded by its size,
and a thread hop would cost more than the work.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from pagedserve.services.router.errors import unavailable

# Bodies below this many bytes are parsed, rendered and tokenized inline: well under a millisecond.
INLINE_BYTES = 16384


class Offload:
    def __init__(self, threads: int, queue: int):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="offload")
        self.limit = threads + queue
        self._lock = threading.Lock()
        self.pending = 0     # jobs submitted and not finished (running or waiting for a thread)

    async def run(self, fn, *args, size: int, refuse: bool = True):
        """fn(*args), inline when size (bytes of the body, or of the answer) is small, else in the
        pool. refuse=False queues past the bound: a finished generation's answer is paid for."""
        if size < INLINE_BYTES:
            return fn(*args)
        with self._lock:
            if refuse and self.pending >= self.limit:
                raise unavailable(f"the router is busy with {self.pending} large request bodies "
                                  f"(--offload-threads + --offload-queue is {self.limit}); retry later")
            self.pending += 1
        # Counted down when the job itself ends, not when its caller stops waiting: a client that
        # leaves does not stop its job, which still holds a thread.
        job = self.pool.submit(fn, *args)
        job.add_done_callback(self._done)
        return await asyncio.wrap_future(job)

    def _done(self, _job) -> None:
        with self._lock:
            self.pending -= 1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
