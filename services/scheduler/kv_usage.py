"""Time-averaged KV usage: the PagedAttention paper's Fig. 2 split and the average batch, measured.

Owned by the scheduler core, which samples the block store's `kv_usage`, its running-request count
and whether requests are waiting, once per step (at most once per `interval_s` of its clock). Each
sample stands for the time until the next one, so the averages weigh every state by how long it
lasted (in virtual time under the simulator, in wall time when served). Two windows are kept: the
whole run, and only the time while requests waited (the server was saturated: memory or the batch
limits bound), which is what the paper's figures compare; ramp-up and drain fall outside it.
"""
from __future__ import annotations

PARTS = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation", "free")
ALLOCATED = ("token_states", "reserved", "internal_fragmentation")
WINDOWS = ("all", "saturated")


class _Window:
    def __init__(self):
        self.slot_seconds = dict.fromkeys(PARTS, 0.0)
        self.request_seconds = 0.0
        self.table_slot_seconds = 0.0
        self.seconds = 0.0

    def add(self, usage: dict[str, int], running: int, dt: float) -> None:
        for part in PARTS:
            self.slot_seconds[part] += usage[part] * dt
        self.table_slot_seconds += usage["table_slots"] * dt
        self.request_seconds += running * dt
        self.seconds += dt

    def report(self) -> dict:
        total = sum(self.slot_seconds.values())
        held = sum(self.slot_seconds[p] for p in ALLOCATED)
        return {"cache": {p: (self.slot_seconds[p] / total if total else 0.0) for p in PARTS},
                "allocated": {p: (self.slot_seconds[p] / held if held else 0.0) for p in ALLOCATED},
                "avg_batched_requests": self.request_seconds / self.seconds if self.seconds else 0.0,
                # Slots that sharing saved: 1 - held / what every table would hold on its own.
                "sharing_saving": 1 - held / self.table_slot_seconds if self.table_slot_seconds else 0.0,
                "seconds": self.seconds}


class KVUsageMeter:
    def __init__(self, interval_s: float = 0.0):
        self.interval_s = interval_s
        self._last: tuple[float, dict[str, int], int, bool] | None = None
        self._windows = {w: _Window() for w in WINDOWS}

    def due(self, now: float) -> bool:
        return self._last is None or now - self._last[0] >= self.interval_s

    def sample(self, now: float, usage: dict[str, int], running: int, waiting: bool) -> None:
        if self._last is not None:
            then, before, was_running, was_waiting = self._last
            dt = max(0.0, now - then)
            self._windows["all"].add(before, was_running, dt)
            if was_waiting:
                self._windows["saturated"].add(before, was_running, dt)
        self._last = (now, usage, running, waiting)

    def breakdown(self) -> dict:
        """The whole run's {"cache": share of the whole cache per part (sums to 1), "allocated":
        share of the allocated slots per allocated part (sums to 1), "avg_batched_requests",
        "seconds"}, and the same while requests waited under "saturated"."""
        return {**self._windows["all"].report(), "saturated": self._windows["saturated"].report()}
