"""Talking to the kvstore process: the request/reply client of the scheduler and the workers.

Owns one DEALER socket (through services.rpc.RpcClient) and nothing else. A kvstore that does not
answer within the timeout raises PeerTimeout so the caller fails its requests fast instead of
hanging; an Error reply raises KVStoreError. No torch here: the scheduler process uses this client
(the workers map the pools with services.kvstore.attach).
"""
from __future__ import annotations

import zmq

from pagedserve.services import protocol
from pagedserve.services.curve import SocketGuard
from pagedserve.services.rpc import PeerTimeout, RpcClient

__all__ = ["KVStoreClient", "KVStoreError", "PeerTimeout"]


class KVStoreError(RuntimeError):
    """The kvstore answered with an Error (a malformed request, a step it already applied, ...)."""

    def __init__(self, message: str, code: int = 500, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


class KVStoreClient:
    def __init__(self, endpoint: str, timeout_s: float = 5.0, ctx: zmq.Context | None = None,
                 on_wait=None, guard: SocketGuard | None = None):
        self.endpoint = endpoint
        self._rpc = RpcClient(endpoint, timeout_s, ctx, on_wait=on_wait, guard=guard)   # guard: CURVE keys (services.curve)

    def apply(self, step: int, ops: list[list]) -> protocol.ApplyOpsReply:
        """Send one step's op log; the reply's results are to be compared with the mirror's."""
        self.send_apply(step, ops)
        return self.receive_apply(step)

    def send_apply(self, step: int, ops: list[list]) -> None:
        """The first half of apply: the scheduler sends, then works on while the kvstore applies."""
        self._rpc.send(protocol.ApplyOps(step, ops))

    def receive_apply(self, step: int) -> protocol.ApplyOpsReply:
        reply = self._check(protocol.ApplyOps, self._rpc.receive(), protocol.ApplyOpsReply)
        if reply.step != step:
            raise KVStoreError(f"asked to apply step {step}, the kvstore answered for step {reply.step}")
        return reply

    def resume(self, sender: str) -> protocol.StoreSnapshot:
        """Take over the store (a new scheduler): the last one's sequences freed, the state to mirror."""
        return self._call(protocol.ResumeStore(sender), protocol.StoreSnapshot)

    def reset(self, sender: str) -> None:
        """Empty the store, its cache too (a diverged mirror starts from nothing)."""
        self._call(protocol.ResetStore(sender), protocol.Pong)

    def pool_info(self, timeout_s: float | None = None) -> protocol.PoolInfo:
        return self._call(protocol.GetPoolInfo(), protocol.PoolInfo, timeout_s)

    def report_memory(self, rank: int, reserve_bytes: int) -> protocol.Pong:
        """A worker rank's profile, for a kvstore that sizes its pools from free GPU memory."""
        return self._call(protocol.ReportMemory(rank, reserve_bytes), protocol.Pong)

    def stats(self) -> dict:
        return self._call(protocol.GetStats(), protocol.StatsReply).stats

    def ping(self, sender: str = "kvstore-client", timeout_s: float | None = None) -> protocol.Pong:
        return self._call(protocol.Ping(sender=sender), protocol.Pong, timeout_s)

    def close(self) -> None:
        self._rpc.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, msg, want: type, timeout_s: float | None = None):
        # PeerTimeout when the kvstore is silent
        return self._check(type(msg), self._rpc.call(msg, timeout_s), want)

    @staticmethod
    def _check(asked: type, reply, want: type):
        if isinstance(reply, protocol.Error):
            raise KVStoreError(f"kvstore: {reply.message}", reply.code, reply.param)
        if not isinstance(reply, want):
            raise KVStoreError(f"kvstore answered {asked.__name__} with {type(reply).__name__}")
        return reply
