"""Which scheduler a request goes to, and the router's connections to schedulers.

A router is given either one scheduler endpoint (the embedded stack) or none, in which case it
picks among the replicas holding a live lease in the shared state. Picking is by load with
prefix-cache affinity: among replicas whose load is within `slack` of the least loaded, the one
that rendezvous-hashes highest with the prompt's first full block gets it, so requests sharing a
prefix land where that prefix is already cached while loads stay close.
"""
from __future__ import annotations

import hashlib
import struct

import zmq.asyncio

from pagedserve.services.curve import SocketGuard
from pagedserve.services.router.errors import unavailable
from pagedserve.services.router.scheduler_client import SchedulerClient
from pagedserve.services.state import Replica, StateStore

AFFINITY_BLOCK_TOKENS = 16


def prefix_key(prompt_ids: list[int], block_tokens: int = AFFINITY_BLOCK_TOKENS) -> bytes | None:
    """The first full block of the prompt, hashed; None if the prompt has no full block to share."""
    if len(prompt_ids) < block_tokens:
        return None
    return hashlib.blake2b(struct.pack(f"<{block_tokens}q", *prompt_ids[:block_tokens]), digest_size=8).digest()


def pick_replica(replicas: list[Replica], loads: dict[str, float], key: bytes | None,
                 slack: float = 2.0) -> Replica:
    """loads: replica id -> requests in flight. Deterministic for equal inputs."""
    if not replicas:
        raise ValueError("no replicas to pick from")
    least = min(loads.get(r.id, 0.0) for r in replicas)
    # Close enough: within `slack` requests, or 25 % of the least load when loads are large.
    bound = least + max(slack, 0.25 * least)
    close = [r for r in replicas if loads.get(r.id, 0.0) <= bound]
    if key is None:
        return min(close, key=lambda r: (loads.get(r.id, 0.0), r.id))
    return max(close, key=lambda r: hashlib.blake2b(key + r.id.encode(), digest_size=8).digest())


class Backends:
    """The scheduler clients of one router, created on first use and kept."""

    def __init__(self, router_id: str, ctx: zmq.asyncio.Context, state: StateStore,
                 fixed_endpoint: str | None, ping_interval_s: float = 1.0, dead_after_s: float = 10.0,
                 guard: SocketGuard | None = None):
        self.router_id = router_id
        self.guard = guard
        self.ctx = ctx
        self.state = state
        self.fixed_endpoint = fixed_endpoint
        self.ping_interval_s = ping_interval_s
        self.dead_after_s = dead_after_s
        self.clients: dict[str, SchedulerClient] = {}
        self.inflight: dict[str, int] = {}       # this router's requests per endpoint

    def client(self, endpoint: str) -> SchedulerClient:
        c = self.clients.get(endpoint)
        if c is None:
            c = SchedulerClient(endpoint, self.router_id, self.ctx, self.ping_interval_s, self.dead_after_s,
                                self.guard)
            c.start()
            self.clients[endpoint] = c
        return c

    def start(self) -> None:
        if self.fixed_endpoint:
            self.client(self.fixed_endpoint)

    async def close(self) -> None:
        for c in self.clients.values():
            await c.close()
        self.clients.clear()

    def targets(self) -> list[tuple[str, str]]:
        """(replica id, endpoint) of every scheduler this router may use now."""
        if self.fixed_endpoint:   # named as its scheduler names itself (the metrics' engine label)
            return [(self.client(self.fixed_endpoint).engine or "local", self.fixed_endpoint)]
        return [(r.id, r.endpoint) for r in self.state.live_replicas()]

    def pick(self, prompt_ids: list[int]) -> SchedulerClient:
        if self.fixed_endpoint:
            client = self.client(self.fixed_endpoint)
        else:
            replicas = self.state.live_replicas()
            if not replicas:
                raise unavailable("no engine replica is registered (none holds a live lease)")
            # A replica's reported load lags; add what this router has sent it since.
            loads = {r.id: r.load + self.inflight.get(r.endpoint, 0) for r in replicas}
            usable = [r for r in replicas if self.client(r.endpoint).alive] or replicas
            client = self.client(pick_replica(usable, loads, prefix_key(prompt_ids)).endpoint)
        if not client.alive:
            raise unavailable(f"the engine at {client.endpoint} is not answering")
        return client

    def started(self, endpoint: str) -> None:
        self.inflight[endpoint] = self.inflight.get(endpoint, 0) + 1

    def ended(self, endpoint: str) -> None:
        self.inflight[endpoint] = max(0, self.inflight.get(endpoint, 0) - 1)
