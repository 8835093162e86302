"""Compiled constraints, once per constraint, in a bounded LRU; compiling runs on a thread of its own.

Router and worker each keep one (the router to turn a constraint that does not compile into a 400
before the request is queued, the worker to build matchers). `submit` returns a Future at once:
the router awaits it off its event loop, the worker starts it when the params arrive and collects
it after the forward pass, so neither loop nor step waits on a compiler. A failure is cached too
(a client that resends a bad schema costs one compile). Only this cache's own thread touches the
backend's compiler; the dict is guarded because callers run on other threads.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from pagedserve.services.guided import spec as specs

DEFAULT_CAPACITY = 256


class CompileCache:
    def __init__(self, factory, capacity: int = DEFAULT_CAPACITY):
        """factory(name) -> a backends.*Backend; each is made once, on first use."""
        if capacity < 1:
            raise ValueError(f"the compile cache needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self._factory = factory
        self._backends: dict = {}
        self._entries: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.hits = self.misses = 0

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
            fut = self._entries.get(k)
            if fut is not None:
                self._entries.move_to_end(k)
                self.hits += 1
                return fut
            self.misses += 1
            fut = self._pool.submit(self._compile, constraint)
            self._entries[k] = fut
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return fut

    def compile(self, constraint: dict):
        """Blocking form of submit (tests, the offline engine's checks)."""
        return self.submit(constraint).result()

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, constraint: dict):
        return self.backend(constraint["backend"]).compile(constraint)
