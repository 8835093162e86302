"""What the processes of a running stack do over time, read from /proc: the RSS of each role
(launcher, router, scheduler, worker, kvstore) and the restarts the launcher's supervisor made.

A restart is counted as loadgen/soak.py counts them: a pid of a role that was not among the role's
pids when watching began (the supervisor replaces a dead or hung child by a new process). The
supervisor's own log line ("the X process ...; restarting it") is kept beside it as the reason.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.loadgen.soak import ROLES, role_pids
from pagedserve.loadgen.stack import Stack


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (/proc/PID/stat; a gone one counts 0)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])      # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@dataclass
class ProcWatch:
    stack: Stack
    interval_s: float = 0.5
    first: dict[str, set[int]] = field(default_factory=dict)     # role -> pids when watching began
    seen: dict[str, set[int]] = field(default_factory=dict)      # role -> every pid seen since
    samples: list[dict] = field(default_factory=list)            # {"t", role: MiB summed over its pids}
    marks: dict[str, float] = field(default_factory=dict)        # phase name -> t it began
    events: list[dict] = field(default_factory=list)             # {"role", "pid", "t"} of each new pid
    t0: float = field(default_factory=time.monotonic)

    def pids(self) -> dict[str, list[int]]:
        out = {role: role_pids(self.stack.proc.pid, role) for role in ROLES}
        out["launcher"] = [self.stack.proc.pid]
        return out

    def sample(self) -> None:
        row: dict = {"t": round(time.monotonic() - self.t0, 2)}
        for role, pids in self.pids().items():
            self.first.setdefault(role, set(pids))
            self.events += [{"role": role, "pid": p, "t": row["t"]} for p in set(pids) - self.seen.get(role, set(pids))]
            self.seen.setdefault(role, set()).update(pids)
            sizes = [s for s in map(rss_mb, pids) if s is not None]
            row[role] = round(sum(sizes), 1) if sizes else None
        self.samples.append(row)

    def mark(self, phase: str) -> None:
        self.marks[phase] = round(time.monotonic() - self.t0, 2)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass
        self.sample()

    def restarts(self) -> dict[str, int]:
        return {role: len(self.seen[role] - self.first[role]) for role in self.seen}

    def restart_reasons(self) -> list[str]:
        return [line.strip() for line in self.stack.lines if "restarting it" in line]

    def rss(self, since: str) -> dict[str, dict]:
        """Per role: MiB at the mark `since` (the baseline), the most after it, and the last."""
        t = self.marks.get(since, 0.0)
        out = {}
        for role in self.first:
            before = [s[role] for s in self.samples if s["t"] <= t and s[role] is not None]
            after = [s[role] for s in self.samples if s["t"] >= t and s[role] is not None]
            if not after:
                continue
            base = before[-1] if before else after[0]
            out[role] = {"baseline_mb": base, "max_mb": max(after), "last_mb": after[-1],
                         "growth_mb": round(max(after) - base, 1)}
        return out
