"""The replica's lease in the shared state (Redis): how routers that pick replicas find this one.

The scheduler registers its replica at start with a short TTL and renews it every heartbeat with
its load; a replica that stops renewing drops out of the routers' choice on its own.
"""
from __future__ import annotations

import logging

log = logging.getLogger("pagedserve.scheduler")

LEASE_S = 5.0   # the replica's lease in the shared state, renewed every heartbeat


class ReplicaLease:
    """One replica's registration; `state` is a services.state store (RedisState, MemoryState)."""

    def __init__(self, state, replica_id: str, endpoint: str, model: str):
        self.state = state
        self.replica_id = replica_id
        self.endpoint = endpoint     # what routers connect to (--advertise, else --endpoint)
        self.model = model
        self._register({"model": model})   # a Redis that is down fails start-up (the operator's to fix)

    @classmethod
    def open(cls, redis_url: str | None, replica_id: str, endpoint: str, model: str) -> ReplicaLease | None:
        """The lease in the Redis at redis_url, or None without one (routers then name the scheduler)."""
        if not redis_url:
            return None
        from pagedserve.services.state import RedisState
        return cls(RedisState(redis_url), replica_id, endpoint, model)

    def renew(self, load: int) -> None:
        """Keep this replica listed in the shared state; a lapsed lease (a long pause) registers
        again, and a state store that is down is logged, not fatal (routers with a fixed
        scheduler endpoint keep working)."""
        info = {"model": self.model, "load": load}
        try:
            if not self.state.renew_replica(self.replica_id, ttl_s=LEASE_S, info=info):
                log.warning("the replica's lease had lapsed; registering again")
                self._register(info)
        except Exception as e:   # redis-py's ConnectionError, TimeoutError, ...
            log.warning("cannot renew the replica's lease in the shared state: %s", e)

    def _register(self, info: dict) -> None:
        self.state.register_replica(self.replica_id, self.endpoint, info, ttl_s=LEASE_S)
