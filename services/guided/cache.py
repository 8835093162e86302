"""Compiled constraints, once per constraint, in an LRU bounded in entries and in bytes; compiling
runs on a thread of its own.

Router and worker each keep one (the router to turn a constraint that does not compile into a 400
before the request is queued, the worker to build matchers). `submit` returns a Future at once:
the router awaits it off its event loop (up to the compile deadline), the worker starts it when
the params arrive and never makes a step wait for it (services/worker/guides.py), so neither loop
waits on a compiler. A failure is cached too (a client that resends a bad schema costs one
compile). Only this cache's own thread touches the backend's compiler; the dict is guarded because
callers run on other threads.

Why bytes: a compiled grammar's size follows its input, not the count of entries (twelve 223 KB
schemas added ~56 MB each; at 256 entries that was ~14 GB a process). Each entry is counted at
the size its backend reports for its compiled form (xgrammar's memory_size_bytes), once it is
done; a constraint whose compiled form alone exceeds the budget is refused (it could never stay).
Why a deadline on top of the limits (limits.py): a compile cannot be interrupted (xgrammar's C++
runs to its end), so a result that took longer than the deadline is refused, the same way in
router and worker, and a waiter stops waiting at the deadline.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pagedserve.services.guided import spec as specs
from pagedserve.services.guided.limits import DEFAULT_CACHE_BYTES, GrammarError, Limits

DEFAULT_CAPACITY = 256
DEFAULT_MAX_BYTES = DEFAULT_CACHE_BYTES


@dataclass
class _Entry:
    since: float                   # time.monotonic() when submitted
    future: Future | None = None
    size: int = 0                  # bytes of the compiled form, counted once it is done
    started: float | None = None   # time.monotonic() when the compile thread took it
    ended: float | None = None


class CompileCache:
    def __init__(self, factory, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES,
                 limits: Limits = Limits()):
        """factory(name) -> a backends.*Backend; each is made once, on first use."""
        if capacity < 1 or max_bytes < 1:
            raise ValueError(f"the compile cache needs a capacity and a byte budget of at least 1, "
                             f"got {capacity} and {max_bytes}")
        self.capacity, self.max_bytes, self.limits = capacity, max_bytes, limits
        self._factory = factory
        self._backends: dict = {}
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.hits = self.misses = 0
        self.bytes = 0                 # of the compiled forms held

    @staticmethod
    def bounds_of(config) -> dict:
        """The constructor's bounds from a process's config fields (services/config_fields.py)."""
        return {"capacity": config.grammar_cache_size, "max_bytes": config.grammar_cache_bytes,
                "limits": Limits.of(config)}

    def backend(self, name: str):
        with self._lock:
            b = self._backends.get(name)
            if b is None:
                b = self._backends[name] = self._factory(name)
            return b

    def submit(self, constraint: dict) -> Future:
        """The compiled form (or GrammarError) of a wire-form constraint, as a Future."""
        k = specs.key(constraint)
        with self._lock:
            entry = self._entries.get(k)
            if entry is not None:
                self._entries.move_to_end(k)
                self.hits += 1
                return entry.future
            self.misses += 1
            entry = self._entries[k] = _Entry(time.monotonic())
            entry.future = self._pool.submit(self._compile, constraint, k, entry)
            self._evict()
        return entry.future

    def compiling_for(self, constraint: dict) -> float:
        """Seconds since this constraint's compile was submitted (0: not in the cache)."""
        entry = self._entries.get(specs.key(constraint))
        return 0.0 if entry is None else time.monotonic() - entry.since

    def running_for(self, constraint: dict) -> float | None:
        """Seconds its compile has run (for one done: ran); None while it waits for the compile
        thread, or is not in the cache."""
        entry = self._entries.get(specs.key(constraint))
        if entry is None or entry.started is None:
            return None
        return (entry.ended or time.monotonic()) - entry.started

    def compile(self, constraint: dict):
        """Blocking form of submit (tests, the offline engine's checks)."""
        return self.submit(constraint).result()

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _evict(self) -> None:
        while len(self._entries) > self.capacity or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size

    def _compile(self, constraint: dict, k: str, entry: _Entry):
        entry.started = time.monotonic()
        try:
            return self._compile_checked(constraint, k, entry)
        except GrammarError:
            raise                       # a verdict on the constraint: cached
        except Exception:
            # A fault of the compiler (a child that could not start, a bug): not the constraint's,
            # so not cached; the next request with it compiles again.
            with self._lock:
                if self._entries.get(k) is entry:
                    del self._entries[k]
            raise
        finally:
            entry.ended = time.monotonic()

    def _compile_checked(self, constraint: dict, k: str, entry: _Entry):
        self.limits.check(constraint)
        backend = self.backend(constraint["backend"])
        start = time.monotonic()
        compiled = backend.compile(constraint)
        took = time.monotonic() - start
        kind = constraint["kind"]
        if took > self.limits.compile_timeout_s:
            raise GrammarError(f"the {kind} constraint took {took:.1f} s to compile, over the limit of "
                               f"{self.limits.compile_timeout_s:g} s (--grammar-compile-timeout)")
        size = getattr(backend, "size_of", sys.getsizeof)(compiled)
        if size > self.max_bytes:
            raise GrammarError(f"the {kind} constraint compiles to {size} bytes, more than the grammar cache "
                               f"holds ({self.max_bytes}, --grammar-cache-bytes)")
        with self._lock:
            entry.size = size
            if self._entries.get(k) is entry:   # not evicted while it compiled
                self.bytes += size
                self._evict()
        return compiled
