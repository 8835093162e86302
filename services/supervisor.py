"""The launcher's supervisor: starts the processes of one replica, restarts what dies or hangs, and
stops everything, reaping every descendant.

Owns the child processes, nothing else. What restarts what:
- a worker rank (dead, or stuck: its heartbeat is silent or reports no progress): every rank (a
  tensor-parallel group cannot take a new member). The scheduler fails the requests that were
  running (the connection drop, or the heartbeat, tells it within seconds) and, once the new
  worker answers, rebuilds its mirror from the kvstore's state (the kvstore frees what ran and
  keeps its cache).
- the kvstore: the kvstore, then the workers: their mapping is of the dead kvstore's pools, and a
  worker writing there while the new kvstore copies blocks in its own pools would serve garbage.
  The scheduler sees new pool names, fails what ran and starts its mirror over.
- the scheduler: only itself. At start it resumes from the kvstore (ResumeStore: what the dead one
  held is freed, the prefix cache kept); the routers see the connection drop and fail what they
  were waiting for.
- a router: only itself; the others keep serving.
A restart waits a backoff (0.5 s, doubling to 8 s) that resets once the new process answers; a
process that fails `max_restarts` times in a row without ever answering ends the launcher.

The launcher is the child subreaper of its tree (PR_SET_CHILD_SUBREAPER): whatever a child leaves
behind (a resource tracker, a compile worker) is reparented here and reaped before the launcher
exits. A kvstore that died without unlinking its shared-memory pools has them unlinked here.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field

from pagedserve.services.heartbeat import HeartbeatWatch

log = logging.getLogger("pagedserve.launcher")

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
BACKOFF_S, BACKOFF_MAX_S = 0.5, 8.0


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)
    except OSError:   # not Linux: no death signal, no subreaper
        pass


def _die_with_parent() -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)   # the child gets SIGTERM when the launcher dies, however


def _starting(cpus: frozenset[int] | None):
    """What a child runs before its program: it dies with the launcher, and is bound to its cores
    (its threads, torch's included, inherit them)."""
    def run() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)
    return run


@dataclass(eq=False)   # children are compared by identity
class Child:
    name: str                     # kvstore, worker0.., scheduler, router0..
    argv: list[str]
    threads: int = 1
    cpus: frozenset[int] | None = None   # the cores it is bound to (launcher.cpu_sets); None: any
    heartbeat: str | None = None  # a ZeroMQ endpoint answering Ping (services/heartbeat.py)
    health_url: str | None = None  # or an HTTP liveness URL (a router's /health)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    first_ok: float | None = None
    last_ok: float | None = None
    failures: int = 0             # restarts in a row without answering in between
    restarts: int = 0
    watch: HeartbeatWatch | None = field(default=None, repr=False)

    @property
    def role(self) -> str:
        return self.name.rstrip("0123456789")


def restart_set(children: list[Child], failed: Child) -> list[Child]:
    """Who restarts with `failed`, in start order (see the module's docstring)."""
    if failed.role == "kvstore":
        return [c for c in children if c.role in ("kvstore", "worker")]
    if failed.role == "worker":
        return [c for c in children if c.role == "worker"]
    return [failed]


class Supervisor:
    def __init__(self, hang_timeout_s: float, start_timeout_s: float, max_restarts: int = 5):
        self.hang_timeout_s, self.start_timeout_s, self.max_restarts = hang_timeout_s, start_timeout_s, max_restarts
        self.children: list[Child] = []
        self.pending: list[tuple[float, list[Child]]] = []   # (when, who) restarts due
        self.kvstore_pids: list[int] = []
        self.events: list[tuple[float, str, str]] = []       # (time, child, what): for logs and tests
        _prctl(PR_SET_CHILD_SUBREAPER, 1)

    # ---- starting ------------------------------------------------------------------------------
    def add(self, child: Child) -> None:
        self.children.append(child)
        self._spawn(child)

    def _spawn(self, child: Child) -> None:
        # Only workers compute; every other process gets one OpenMP thread, so that none of them
        # keeps spare threads spinning on cores the workers need (measured: ~1.4x tokens/s on 2 cores).
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(child.threads))
        if child.threads > 1:
            # An idle OpenMP thread spins ~300k rounds (GNU's default) before it sleeps: after each
            # step that holds a core for a millisecond or more, just when the scheduler, kvstore and
            # router need it. 3000 rounds still bridge the gaps between the ops of one forward.
            # On 2 cores: the worker's CPU time per run fell from ~3.2 to ~2.3 core-seconds at the
            # same or better tokens/s (loadgen.bench_e2e). An operator's own setting wins.
            env.setdefault("GOMP_SPINCOUNT", "3000")
        # A process group of its own: a terminal's Ctrl-C (SIGINT to the foreground group) reaches the
        # launcher alone, which stops every child once and in order (scheduler first, to drain).
        # Signalled by the terminal too, a router got SIGINT and then the launcher's SIGTERM, and
        # uvicorn cut its shutdown short with a CancelledError traceback.
        child.proc = subprocess.Popen(child.argv, preexec_fn=_starting(child.cpus), env=env, process_group=0)
        child.started_at, child.first_ok, child.last_ok = time.monotonic(), None, None
        if child.role == "kvstore":
            self.kvstore_pids.append(child.proc.pid)
        if child.heartbeat:
            if child.watch is None:
                child.watch = HeartbeatWatch(child.heartbeat, self.hang_timeout_s)
            else:
                child.watch.restart()

    def failed(self) -> tuple[str, int] | None:
        """A child that exited (before the stack was ever ready, when nothing restarts)."""
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                return c.name, c.proc.returncode
        return None

    # ---- supervising ---------------------------------------------------------------------------
    def check(self) -> str | None:
        """One round: probe, restart what is dead or stuck, start restarts that are due. Returns
        why the launcher must give up (a crash loop), or None."""
        now = time.monotonic()
        for c in self.children:
            if c.proc is None or any(c in who for _, who in self.pending):
                continue
            why = self._trouble(c, now)
            if why is None:
                continue
            log.error("the %s process %s; restarting it", c.name, why)
            self.events.append((time.time(), c.name, why))
            who = restart_set(self.children, c)
            c.failures += 1
            if c.failures > self.max_restarts:
                return f"the {c.name} process failed {c.failures} times in a row (last: {why})"
            for other in who:
                self._kill(other)
            delay = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (c.failures - 1))
            self.pending.append((now + delay, who))
        for due in [p for p in self.pending if p[0] <= now]:
            self.pending.remove(due)
            for c in due[1]:
                c.restarts += 1
                self._spawn(c)
                self.events.append((time.time(), c.name, "restarted"))
        return None

    def _trouble(self, c: Child, now: float) -> str | None:
        code = c.proc.poll()
        if code is not None:
            self._cleanup_shm(c)
            return f"exited with code {code}"
        if self._probe(c):
            c.last_ok = now
            if c.first_ok is None:
                c.first_ok = now
                c.failures = 0    # it came up: the backoff starts over
            return None
        if c.first_ok is None:
            return f"did not come up within {self.start_timeout_s:.0f} s" \
                if now - c.started_at > self.start_timeout_s else None
        if now - c.last_ok > self.hang_timeout_s:
            return f"is stuck (no heartbeat for {now - c.last_ok:.1f} s)"
        return None

    def _probe(self, c: Child) -> bool:
        if c.watch is not None:
            c.watch.poke()
            return c.watch.last_ok is not None and not c.watch.stuck() and c.watch.silent_for() < 1.5
        if c.health_url:
            try:
                with urllib.request.urlopen(c.health_url, timeout=0.5) as r:
                    return r.status == 200
            except OSError:
                return False
        return True

    def _kill(self, c: Child) -> None:
        if c.proc is not None and c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()
        self._cleanup_shm(c)

    def _cleanup_shm(self, c: Child) -> None:
        """A kvstore that died without unlinking its pools (SIGKILL): unlink them (mapped views in
        other processes stay valid until they unmap)."""
        if c.role == "kvstore" and c.proc is not None:
            unlink_pools_of(c.proc.pid)

    # ---- stopping ------------------------------------------------------------------------------
    def stop(self, drain_s: float, grace_s: float = 10.0) -> None:
        """The scheduler first, given drain_s to let running requests finish (it refuses new ones
        with 503 meanwhile, and fails what is left with an error the routers pass on). Then the
        routers, the workers and the kvstore (which unlinks its pools). Then every descendant."""
        self.pending = []
        by_role = {r: [c for c in self.children if c.role == r and c.proc is not None and c.proc.poll() is None]
                   for r in ("scheduler", "router", "worker", "kvstore")}
        for c in by_role["scheduler"]:
            c.proc.send_signal(signal.SIGTERM)
            try:
                c.proc.wait(drain_s + 3.0)
            except subprocess.TimeoutExpired:
                c.proc.kill()
        rest = by_role["router"] + by_role["worker"] + by_role["kvstore"]
        for c in rest:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in by_role["scheduler"] + rest:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        for c in self.children:
            if c.watch is not None:
                c.watch.close()
        reap_descendants(grace_s=2.0)
        for pid in self.kvstore_pids:
            unlink_pools_of(pid)


def unlink_pools_of(pid: int) -> None:
    """The shared-memory pools a kvstore process made (named by kvstore.pool.unique_pool_name)."""
    for path in glob.glob(f"/dev/shm/pagedserve-{pid}-*"):
        try:
            os.unlink(path)
        except FileNotFoundError:   # it unlinked them itself meanwhile
            pass


def reap_descendants(grace_s: float) -> None:
    """Wait for every process reparented to this subreaper; SIGKILL what is left after grace_s."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            continue
        if time.monotonic() > deadline:
            for kid in _children(os.getpid()):
                try:
                    os.kill(kid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = float("inf")
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    try:
        return [int(k) for k in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []
