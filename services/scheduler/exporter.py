"""Which router exports this engine's own series (queue lengths, KV usage, preemptions, step stats).

Every router's /metrics asks each engine for its stats. Were every router to render the engine's
gauges and counters, a Prometheus `sum` over routers would count them once per router. The engine
names one exporter instead: among the routers that asked within `window_s`, the smallest id. The
others render only what they saw themselves (their requests' latencies and tokens). The window is
longer than any sane scrape interval; when the exporter goes away, the next router takes over
once the window has passed (its series continue from the engine's counters: nothing resets).
"""
from __future__ import annotations

WINDOW_S = 120.0


class ExporterElection:
    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.last_asked: dict[str, float] = {}

    def elect(self, router_id: str, now: float) -> bool:
        """Whether `router_id`, asking now, is the one to export."""
        self.last_asked[router_id] = now
        live = [r for r, t in self.last_asked.items() if now - t <= self.window_s]
        if len(live) < len(self.last_asked):
            self.last_asked = {r: self.last_asked[r] for r in live}
        return router_id == min(live)
