"""A least-recently-used cache bounded in bytes, for the router's per-token caches.

A bound in entries says nothing of memory when entries differ in size (issue 28: the grammar
cache's 256 entries could hold 14 GB); this one counts an estimate of each entry's bytes and
drops the least recently used past its budget. Its size is exported (services/router/metrics.py).
Thread-safe: the offload pool's threads may share it with the event loop.
"""
from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any, Callable

# What an entry costs beyond its value: the dict slot, the key and the bookkeeping (a rough bound).
ENTRY_OVERHEAD = 100


def size_of(value: Any) -> int:
    """Bytes of a str or a flat list of byte values (the values cached here): small ints are
    shared objects, so a list costs its slots alone."""
    return sys.getsizeof(value)


class BytesLRU:
    def __init__(self, max_bytes: int, make: Callable[[Any], Any]):
        self.max_bytes = max_bytes
        self._make = make
        self._items: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __call__(self, key):
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit[0]
        value = self._make(key)           # outside the lock: two threads may make one value twice
        cost = size_of(value) + ENTRY_OVERHEAD
        with self._lock:
            if key not in self._items and cost <= self.max_bytes:
                self._items[key] = (value, cost)
                self.bytes += cost
                while self.bytes > self.max_bytes:
                    _, (_, dropped) = self._items.popitem(last=False)
                    self.bytes -= dropped
        return value
