"""Stop strings on streamed text: no part of a stop string is ever emitted.

Text that might be the start of a stop string (the longest tail of the unsent text that is a
prefix of one) is held back until the next text decides it. Any match therefore starts inside the
held text, so only that needs searching. The matched stop string itself is dropped (or kept, with
include_stop_str_in_output) and everything after it is discarded.

Text fed with can_stop=False (the first min_tokens tokens) can start a stop string but not end
one, as in vLLM: a match must end in text fed after it.
"""
from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str], include_in_output: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include_in_output
        self.pending = ""            # text received but not yet released
        self.protected = 0           # a match must end past this many characters of pending
        self.matched: str | None = None

    def feed(self, text: str, can_stop: bool = True) -> tuple[str, bool]:
        """Add text; return (text now safe to emit, whether a stop string matched)."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        self.pending += text
        if not can_stop:
            self.protected = len(self.pending)
        best = None
        for s in self.stops:
            i = self.pending.find(s)
            while i >= 0 and i + len(s) <= self.protected:
                i = self.pending.find(s, i + 1)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            out = self.pending[:i + (len(s) if self.include else 0)]
            self.pending, self.matched = "", s
            return out, True
        hold = self._hold_len()
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.protected = max(0, self.protected - cut)
        return out, False

    def _hold_len(self) -> int:
        p = self.pending
        for k in range(min(len(p), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = p[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """The sequence ended without a match: what was held back is plain output after all."""
        out, self.pending = self.pending, ""
        return out
