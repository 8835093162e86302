"""The scheduler's block-store mirror and its agreement with the kvstore's store.

The scheduler plans on a bookkeeping-only copy of the kvstore's BlockStore (the mirror), which
records every call as an op log. Each step's log goes to the kvstore (`ApplyOps`), which replays it
and answers with results that must equal the mirror's; different results mean the two diverged.
After a divergence or a silence, both are brought to agree again (`resync`). Owned by the scheduler
process; no sockets of its own (it uses the scheduler's KVStoreClient).
"""
from __future__ import annotations

import logging

from pagedserve.services import protocol
from pagedserve.services.kvstore.client import KVStoreClient, KVStoreError
from pagedserve.services.rpc import PeerTimeout

log = logging.getLogger("pagedserve.scheduler")


class MirrorSync:
    """The mirror, the op-log exchange with the kvstore, and what is known of the kvstore's state:
    its pools (`pool_info`) and whether it diverged or restarted (`broken`, a reason)."""

    def __init__(self, kv: KVStoreClient, pool_info: protocol.PoolInfo,
                 snapshot: protocol.StoreSnapshot | None, peer_timeout_s: float):
        self.kv = kv
        self.peer_timeout_s = peer_timeout_s
        self.pool_info = pool_info
        self.mirror = self._new_mirror(snapshot)
        self.step_no = 0          # ApplyOps sent to the kvstore
        self.host_copies_sent = self.mirror.host_cache_copies   # host-tier copies in the logs sent so far
        self.broken: str | None = None   # set when the kvstore diverged: reset at the next heartbeat

    def sync(self) -> None:
        """Send the op log and read the kvstore's answer (nothing if the log is empty)."""
        pending = self.send_ops()
        if pending is not None:
            self.check_ops(pending)

    def send_ops(self):
        """Send the mirror's op log -> (expected results, whether it moves bytes), or None if empty."""
        ops, expected = self.mirror.drain()
        if not ops:
            return None
        self.step_no += 1
        self.kv.send_apply(self.step_no, ops)
        copies = self.mirror.host_cache_copies
        moved = moves_bytes(ops, expected, copies - self.host_copies_sent)
        self.host_copies_sent = copies
        return expected, moved

    def check_ops(self, pending) -> None:
        expected, _ = pending
        try:
            reply = self.kv.receive_apply(self.step_no)
            why = reply.error or (None if reply.results == expected else "different results")
        except KVStoreError as e:
            why = str(e)
        if why is not None:
            self.broken = "the kvstore diverged from the scheduler's block-store mirror"
            raise RuntimeError(f"kvstore diverged from the scheduler's mirror at step {self.step_no}: {why}")

    def kvstore_same(self) -> None:
        """Ping the kvstore by asking for its pools: different pool names mean it restarted (its
        store is empty, its pools new): the mirror is wrong and every request must fail."""
        info = self.kv.pool_info(timeout_s=self.peer_timeout_s)
        if info.device_pool_names != self.pool_info.device_pool_names:
            log.warning("the kvstore restarted (new pools %s)", info.device_pool_names)
            self.pool_info = info
            self.broken = "the kvstore restarted"

    def resync(self) -> bool:
        """Both block stores agree again. After a divergence the kvstore's state is suspect (its
        hashed blocks may not hold what their keys say): both start from empty (ResetStore).
        Otherwise the kvstore is the authority: it frees what ran, keeps its cache, and the mirror
        is rebuilt from its state (ResumeStore), as at start. The caller plans on the new
        `mirror` from then on, and has the worker forget what it was sent."""
        try:
            if self.broken:
                self.kv.reset("scheduler")
                snapshot = None
            else:
                snapshot = self.kv.resume("scheduler")
        except (PeerTimeout, KVStoreError) as e:
            log.error("could not resynchronize with the kvstore: %s", e)
            return False
        self.mirror = self._new_mirror(snapshot)
        self.host_copies_sent = self.mirror.host_cache_copies
        self.step_no = 0                   # the kvstore takes step 1 next (it applies them in order)
        log.warning("block stores %s", "reset: the scheduler's mirror and the kvstore start from empty"
                    if self.broken else "resynchronized from the kvstore's state (its cache kept)")
        self.broken = None
        return True

    def _new_mirror(self, snapshot: protocol.StoreSnapshot | None = None):
        """The scheduler's bookkeeping-only copy of the kvstore's BlockStore: empty, or the state
        of the kvstore's store (a resume)."""
        from pagedserve.kvstore.replay import RecordingStore
        from pagedserve.kvstore.allocator import make_policy
        info = self.pool_info
        mirror = RecordingStore(info.num_device_blocks, info.num_host_blocks, info.block_size,
                                enable_prefix_caching=info.enable_prefix_caching,
                                policy=make_policy(info.allocation, info.max_model_len),
                                host_cache_blocks=info.host_cache_blocks)
        if snapshot is not None:
            mirror.restore(snapshot.snapshot)   # ValueError: a kvstore that is not the one described
            log.info("mirror built from the kvstore's state: %d sequences of the scheduler before freed, "
                     "%d device + %d host blocks cached", snapshot.released,
                     mirror.stats()["device_blocks_cached"], mirror.stats()["host_blocks_cached"])
        return mirror


def moves_bytes(ops: list[list], results: list, host_copies: int = 0) -> bool:
    """Whether replaying these ops copies block bytes (swaps, appends that copied on write, or
    host_copies blocks demoted or promoted: a demoted block is written again in this very step)."""
    return host_copies > 0 or any(op[0] in ("swap_out", "swap_in") or (op[0] in ("append_slots", "append_tokens") and r[1])
               for op, r in zip(ops, results))
