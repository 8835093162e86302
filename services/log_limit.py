"""A warning that can repeat per token or per sequence, logged at most once per interval per kind.

One n=128 request under a grammar that refused every token logged a warning per token per
sequence: 5.5 MB of log. A client must not be able to fill the disk; the counts are kept, and the
next line says how many were left out.
"""
from __future__ import annotations

import logging
import time


class LimitedLog:
    def __init__(self, log: logging.Logger, interval_s: float = 10.0, clock=time.monotonic):
        self.log, self.interval_s, self.clock = log, interval_s, clock
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args) -> None:
        """Log msg unless a warning of this kind was logged within interval_s (then count it)."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return
        self._last[kind] = now
        left_out = self._left_out.pop(kind, 0)
        if left_out:
            msg += f" ({left_out} more like it in the last {self.interval_s:g} s not logged)"
        self.log.warning(msg, *args)
