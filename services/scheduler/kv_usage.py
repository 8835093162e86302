"""Time-averaged KV usage: the PagedAttention paper's Fig. 2 split and the average batch, measured.

Owned by the scheduler core, which samples the block store's `kv_usage` and its running-request
count once per step (at most once per `interval_s` of its clock). Each sample stands for the time
until the next one, so the averages weigh every state by how long it lasted (in virtual time under
the simulator, in wall time when served).
"""
from __future__ import annotations

PARTS = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation", "free")
ALLOCATED = ("token_states", "reserved", "internal_fragmentation")


class KVUsageMeter:
    def __init__(self, interval_s: float = 0.0):
        self.interval_s = interval_s
        self._last: tuple[float, dict[str, int], int] | None = None
        self._slot_seconds = dict.fromkeys(PARTS, 0.0)
        self._request_seconds = 0.0
        self._seconds = 0.0

    def due(self, now: float) -> bool:
        return self._last is None or now - self._last[0] >= self.interval_s

    def sample(self, now: float, usage: dict[str, int], running: int) -> None:
        if self._last is not None:
            then, before, was_running = self._last
            dt = max(0.0, now - then)
            for part in PARTS:
                self._slot_seconds[part] += before[part] * dt
            self._request_seconds += was_running * dt
            self._seconds += dt
        self._last = (now, usage, running)

    def avg_batched_requests(self) -> float:
        return self._request_seconds / self._seconds if self._seconds else 0.0

    def breakdown(self) -> dict:
        """{"cache": share of the whole cache per part (sums to 1), "allocated": share of the
        allocated slots per allocated part (sums to 1), "seconds": the time they average over}."""
        total = sum(self._slot_seconds.values())
        held = sum(self._slot_seconds[p] for p in ALLOCATED)
        return {"cache": {p: (self._slot_seconds[p] / total if total else 0.0) for p in PARTS},
                "allocated": {p: (self._slot_seconds[p] / held if held else 0.0) for p in ALLOCATED},
                "seconds": self._seconds}
