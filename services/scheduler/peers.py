"""The scheduler's peers, the kvstore and rank 0 of the workers: their clients, the wait for them
at start-up, and whether they still answer.

A peer that stops answering makes the replica not ready (the service then fails its requests). The
worker's own heartbeat (services/heartbeat.py) is watched while a step runs: a stuck worker is
found in hang_timeout_s, not step_timeout_s.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from pagedserve.services import protocol
from pagedserve.services.curve import SocketGuard
from pagedserve.services.heartbeat import HeartbeatWatch
from pagedserve.services.kvstore.client import KVStoreClient, KVStoreError
from pagedserve.services.rpc import PeerTimeout, RpcClient

log = logging.getLogger("pagedserve.scheduler")


class Peers:
    """config: the scheduler's Config (its peers' endpoints and timeouts); tick: called while
    waiting on a peer (the main thread is alive)."""

    def __init__(self, config, ctx: zmq.Context, guard: SocketGuard, tick: Callable[[], None]):
        self.config = config
        self.tick = tick
        self.worker_watch = (HeartbeatWatch(config.worker_heartbeat_endpoint, config.hang_timeout_s, ctx)
                             if config.worker_heartbeat_endpoint else None)
        self.kv = KVStoreClient(config.kvstore_endpoint, config.peer_timeout_s, ctx, on_wait=tick, guard=guard)
        self.worker = RpcClient(config.worker_endpoint, config.step_timeout_s, ctx,
                                on_wait=self._waiting_for_worker, guard=guard)

    def connect(self) -> tuple[protocol.PoolInfo, protocol.StoreSnapshot]:
        """Wait for both peers (up to startup_timeout_s each) -> the kvstore's pools and state."""
        info = self._wait_for(lambda: self.kv.pool_info(timeout_s=1.0), "kvstore", self.kv.endpoint)
        # The kvstore may have served an earlier scheduler of this replica (a restart): it frees
        # what that one held and keeps the cache; the mirror starts from its state.
        snapshot = self.kv.resume("scheduler")
        self._wait_for(self._first_worker_answer, "worker", self.worker.endpoint)
        self._wait_for(self._worker_beat_answered, "worker's heartbeat", self.config.worker_heartbeat_endpoint)
        return info, snapshot

    def answering(self, kvstore_same: Callable[[], None], step_in_flight: bool) -> bool:
        """Ping each peer (the kvstore through kvstore_same, which also notices one that restarted):
        whether both answered and the worker's heartbeat shows progress."""
        ok = True
        pings = ((kvstore_same, "kvstore", self.kv.endpoint),
                 (lambda: self._ping_worker(step_in_flight), "worker", self.worker.endpoint))
        for ping, name, endpoint in pings:
            try:
                ping()
            except (PeerTimeout, KVStoreError) as e:   # KVStoreError: a kvstore still sizing its pools
                log.error("the %s at %s stopped answering: %s", name, endpoint, e)
                ok = False
                if name == "worker" and self.worker_watch is not None:
                    self.worker_watch.restart()     # its replacement is watched afresh (forget_worker())
        if self.worker_watch is not None:
            self.worker_watch.poke()
            if self.worker_watch.stuck():
                log.error("the worker at %s is stuck (no heartbeat progress)", self.worker.endpoint)
                ok = False
            elif not self.worker_watch.answered():   # a worker since lost(): not ready before its heartbeat is
                ok = False
        return ok

    def forget_worker(self) -> None:
        """The worker's watch forgets the worker it watched: a replacement is judged by its own
        heartbeat, not by the silence of the one it replaces."""
        if self.worker_watch is not None:
            self.worker_watch.restart()

    def _ping_worker(self, step_in_flight: bool) -> None:
        """A Ping, unless a step is in flight: its answer would be taken for the Pong (the step's own
        answer, and the worker's heartbeat meanwhile, say whether it lives)."""
        if not step_in_flight:
            self.worker.call(protocol.Ping("scheduler"), timeout_s=self.config.peer_timeout_s)

    def _waiting_for_worker(self) -> None:
        self.tick()
        if self.worker_watch is not None:
            self.worker_watch.poke()
            if self.worker_watch.stuck():
                raise PeerTimeout(f"the worker at {self.worker.endpoint} is stuck: no heartbeat progress "
                                  f"for {self.worker_watch.silent_for():.1f} s")

    def _worker_beat_answered(self) -> None:
        """PeerTimeout until the worker's heartbeat has answered (since start, or since lost()):
        only then does its silence mean something."""
        if self.worker_watch is None:
            return
        deadline = time.monotonic() + 1.0
        while not self.worker_watch.answered():
            if time.monotonic() > deadline:
                raise PeerTimeout(f"the worker's heartbeat at {self.worker_watch.endpoint} has not answered")
            self.worker_watch.poke()
            time.sleep(0.05)

    def _first_worker_answer(self):
        """One Ping that the worker answers once it has loaded (a first start compiles the CPU
        kernel: ~15 s). Asked anew each second, every timed-out ask dropped the connection, and
        the worker logged each drop. The kvstore is pinged meanwhile, or it would take the
        silence for a scheduler that is gone."""
        if not self.worker.asked:
            self.worker.send(protocol.Ping("scheduler"))
        self.kv.ping("scheduler", 1.0)
        return self.worker.receive(timeout_s=1.0, keep_question=True)

    def _wait_for(self, call, name: str, endpoint: str):
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            try:
                return call()
            except (PeerTimeout, KVStoreError) as e:
                if isinstance(e, KVStoreError):
                    if e.code != 503:   # 503: a kvstore still sizing its pools (services/kvstore/sizing.py)
                        raise
                    time.sleep(0.5)
                if time.monotonic() > deadline:
                    raise SystemExit(f"scheduler: the {name} at {endpoint} did not answer "
                                     f"within {self.config.startup_timeout_s:.0f} s")
