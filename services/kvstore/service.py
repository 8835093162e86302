"""The kvstore process: the authoritative BlockStore and its pools behind a ZeroMQ ROUTER socket.

Owns the device and host pools of every tensor-parallel rank (it creates them at start and unlinks
them on SIGTERM/SIGINT) and the BlockStore over them: refcounts, block tables, the prefix index and
the copy-on-write, swap and host-tier copies. The scheduler sends each step's op log (ApplyOps)
recorded on its mirror; this process replays it once, in order, and answers with the results. A
(re)started scheduler resumes (ResumeStore): the sequences of the one before are freed, and it
builds its mirror from this store's snapshot, so the prefix cache outlives the scheduler. Workers ask for the
pool names (GetPoolInfo) and map the pools; they never ask for blocks.

Steps apply in order, each once: after a reset (and at start) the next step must be 1, then each
one the last applied plus one. A repeated or older ApplyOps (a resend after a timeout, a duplicate)
or one from the future (a lost step between) is answered with an Error and not applied: either would
corrupt the replica. Malformed messages are logged on one line and answered with an Error; the loop
never dies of one. The socket is guarded by services.curve (CURVE keys on a network address, a
frame size limit).
"""
from __future__ import annotations

import base64
import dataclasses
import gc
import logging
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from pagedserve.kernels.device import on_device
from pagedserve.kvstore.cuda_sync import CopySync, NoSync
from pagedserve.kvstore.pool import BlockPool, unique_pool_name, warm_up
from pagedserve.kvstore.replay import ReplayError, ReplicaDiverged, apply_ops
from pagedserve.kvstore.allocator import make_policy
from pagedserve.services.kvstore.sizing import PoolSizing
from pagedserve.kvstore.store import BlockStore
from pagedserve.services import config_fields as cf, protocol
from pagedserve.services.config_fields import at_least
from pagedserve.services.flags import ProcessConfig, opt
from pagedserve.services.curve import SocketGuard
from pagedserve.services.process import answer_requests, on_stop_signals, service_main

log = logging.getLogger("pagedserve.kvstore")

POLL_MS = 100   # how long the loop blocks waiting for a message: also the latency of a stop signal


@dataclass
class Config(ProcessConfig):
    num_device_blocks: int = opt(1024, "blocks in each device pool (0 with --gpu-memory-utilization: "
                                       "sized once the workers have profiled)", check=at_least(0))
    num_host_blocks: int = opt(0, "blocks in each host pool (swapped-out blocks)", check=at_least(0))
    block_size: int = cf.block_size()
    block_bytes: int = opt(0, "bytes of one block on one tensor-parallel rank (required: the model decides it)",
                           check=lambda v: v >= 1 or "must be positive (bytes of one block on one worker rank)")
    tp_size: int = opt(1, "tensor-parallel ranks: one device pool and one host pool each", check=at_least(1))
    enable_prefix_caching: bool = opt(True, "find full blocks again by the hash of their tokens",
                                      aliases=["--prefix-caching"])
    host_cache_blocks: int = opt(0, "host blocks (of each host pool) that may keep prefix blocks evicted "
                                    "from the device: the host tier (0: none; the launcher derives it "
                                    "from --kv-offloading-size)", check=at_least(0))
    allocation: str = cf.allocation()
    max_model_len: int = opt(2048, "the context orca-max reserves per request", check=at_least(1))
    device: str = cf.device(help="where the device pools live: cpu (shared memory) or cuda")
    gpu_memory_utilization: float = opt(0.0, "CUDA: the fraction of each GPU this replica may use; the device "
                                             "pools are sized from free memory after the workers' profiling "
                                             "pass (0: --num-device-blocks)",
                                        check=lambda v: 0 <= v <= 1 or "must be in [0, 1]")
    endpoint: str = cf.endpoint("tcp://127.0.0.1:5601", "where the kvstore serves the scheduler and the workers")
    log_level: str = cf.log_level()
    curve_keys: str = cf.curve_keys("required to listen on a non-loopback address")

    def cross_check(self) -> str | None:
        if self.gpu_memory_utilization and self.device == "cpu":
            return ("--gpu-memory-utilization sizes CUDA pools: it needs --device cuda "
                    "(on CPU give --num-device-blocks)")
        if self.num_device_blocks < 1 and not self.gpu_memory_utilization:
            return "--num-device-blocks must be at least 1"
        if self.host_cache_blocks > self.num_host_blocks:
            return (f"--host-cache-blocks {self.host_cache_blocks} is more than the host pool's "
                    f"{self.num_host_blocks} blocks (--num-host-blocks)")
        return None



# ---- pools -------------------------------------------------------------------------------------

class Pools:
    """Every pool this process created; close_all() unmaps and unlinks them (idempotent)."""

    def __init__(self, config: Config):
        self.device: list[BlockPool] = []
        self.host: list[BlockPool] = []
        try:
            for rank in range(config.tp_size):
                self.device.append(_create_device_pool(config, rank))
                self.host.append(BlockPool.create(unique_pool_name(f"host{rank}"), config.num_host_blocks,
                                                  config.block_bytes, "cpu"))
                if config.device != "cpu":
                    self.host[-1].pin()   # swaps become asynchronous copies on the copy stream
        except BaseException:
            self.close_all()
            raise

    def close_all(self) -> None:
        for pool in self.device + self.host:
            pool.close()
            try:
                pool.unlink()
            except FileNotFoundError:   # someone removed /dev/shm/<name> by hand: nothing to do
                pass
        self.device, self.host = [], []


def _device_of(config: Config, rank: int) -> str:
    return "cpu" if config.device == "cpu" else f"cuda:{rank}"


def _create_device_pool(config: Config, rank: int) -> BlockPool:
    return BlockPool.create(unique_pool_name(f"device{rank}"), config.num_device_blocks,
                            config.block_bytes, _device_of(config, rank))


def _cuda_ipc_handles(pools: list[BlockPool]) -> list[str]:
    """CUDA only (run by `make gpu-check`, not by CI): per rank, the pickled IPC handle of its device
    pool, base64 text so msgpack carries it; a worker rebuilds the tensor with
    services.kvstore.attach.attach_pools. This process keeps the tensors alive for as long as workers map
    them (until exit)."""
    from torch.multiprocessing.reductions import reduce_tensor
    handles = []
    for p in pools:
        with on_device(p.blocks):
            handles.append(base64.b64encode(pickle.dumps(reduce_tensor(p.blocks))).decode("ascii"))
    return handles


def pool_info(config: Config, pools: Pools, sync=None) -> protocol.PoolInfo:
    copies_events, step_events = (sync or NoSync()).event_handles()
    return protocol.PoolInfo(
        block_size=config.block_size, block_bytes=config.block_bytes,
        num_device_blocks=config.num_device_blocks, num_host_blocks=config.num_host_blocks,
        device_pool_names=[p.name for p in pools.device], host_pool_names=[p.name for p in pools.host],
        device="cpu" if config.device == "cpu" else "cuda",
        enable_prefix_caching=config.enable_prefix_caching,
        allocation=config.allocation, max_model_len=config.max_model_len,
        ipc_handles=[] if config.device == "cpu" else _cuda_ipc_handles(pools.device),
        event_handles=copies_events, step_event_handles=step_events, host_cache_blocks=config.host_cache_blocks)


# ---- the service core: frames in, frames out ---------------------------------------------------

class KVStoreService:
    """Answers one decoded request at a time; no sockets, so tests can drive it directly."""

    def __init__(self, make_store: Callable[[], BlockStore], info: protocol.PoolInfo, sync=None):
        self.make_store = make_store   # a new, empty store over the same pools (ResetStore)
        self.store = make_store()
        self.info = info
        self.sync = sync or NoSync()   # CUDA: copies on the kvstore's streams, then an event per device
        self.last_step: int | None = None
        self._handlers = {protocol.ApplyOps: self._apply, protocol.ResumeStore: self._resume,
                          protocol.ResetStore: self._reset, protocol.GetPoolInfo: lambda _: self.info,
                          protocol.GetStats: self._stats, protocol.Ping: _pong}

    def handle(self, frames: list) -> list:
        """Request frames -> reply frames. Never raises: every failure becomes an Error reply."""
        try:
            msg = protocol.decode(frames)
            handler = self._handlers.get(type(msg))
            if handler is None:
                log.warning("rejected %s: not a kvstore request", type(msg).__name__)
                reply = protocol.Error(f"the kvstore does not handle {type(msg).__name__}", code=404)
            else:
                reply = handler(msg)
        except (protocol.ProtocolError, ReplayError) as e:
            log.warning("rejected a malformed message: %s", e)
            reply = protocol.Error(str(e), code=400)
        except Exception as e:  # a bug must not take the pools down with it: answer and carry on
            log.error("internal error: %r", e)
            reply = protocol.Error(f"internal error: {e!r}", code=500, type="internal_error")
        return protocol.encode(reply)

    def _stats(self, _msg) -> protocol.StatsReply:
        stats = self.store.stats()
        # The core counts blocks; a block is block_bytes on every tensor-parallel rank.
        stats["host_cache_bytes_copied"] = self.store.host_cache_copies * self.info.block_bytes \
            * len(self.info.device_pool_names)
        return protocol.StatsReply(stats)

    def _resume(self, msg: protocol.ResumeStore) -> protocol.StoreSnapshot:
        """A new scheduler takes over: what the one before it held is freed (its requests died
        with it; their computed prefix blocks stay cached), and it gets the state to mirror."""
        ids = sorted(self.store.seq_ids())
        for seq_id in ids:
            self.store.free(seq_id)
        self.last_step = None
        stats = self.store.stats()
        log.info("resumed by %s: %d sequences of the scheduler before freed, %d device + %d host blocks "
                 "cached", msg.sender or "a scheduler", len(ids), stats["device_blocks_cached"],
                 stats["host_blocks_cached"])
        return protocol.StoreSnapshot(self.store.snapshot(), len(ids))

    def _reset(self, msg: protocol.ResetStore) -> protocol.Pong:
        """Block metadata back to empty for a scheduler that starts over; the bytes are garbage now
        and nobody refers to them (the new scheduler's mirror is empty too)."""
        log.info("reset by %s: %d sequences forgotten", msg.sender or "a scheduler", len(self.store.seq_ids()))
        self.store = self.make_store()
        self.last_step = None
        return _pong(protocol.Ping())

    def _apply(self, msg: protocol.ApplyOps):
        expected = (self.last_step or 0) + 1
        if msg.step != expected:
            why = (f"step {msg.step} is not after the last applied step {self.last_step}: not applied again"
                   if msg.step < expected else f"step {msg.step} is from the future: the next step is {expected}")
            log.warning("rejected ApplyOps: %s", why)
            return protocol.Error(why, code=409, param="step")
        error = None
        try:
            with self.sync.copies():
                results = apply_ops(self.store, msg.ops)   # ReplayError (malformed): nothing applied
        except ReplicaDiverged as e:
            log.error("step %d: %s", msg.step, e)
            results, error = e.results, str(e)
        self.last_step = msg.step
        return protocol.ApplyOpsReply(msg.step, results, self.store.num_free_device_blocks,
                                      self.store.num_free_host_blocks, error)


def _pong(msg: protocol.Ping) -> protocol.Pong:
    return protocol.Pong(sender="kvstore", time=time.time(), role="kvstore", ready=True)


# ---- the process -------------------------------------------------------------------------------

def run(config: Config, stop: threading.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or `stop` is set); 0 on a clean stop, 1 if the socket or the
    pools cannot be set up."""
    config.validate()
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s kvstore %(levelname)s %(message)s")
    stop = stop or threading.Event()
    restore = on_stop_signals(stop)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    pools = None
    guard = SocketGuard(None, log)
    try:
        try:
            guard = SocketGuard.from_setting(config.curve_keys, log)
            guard.listen(sock, config.endpoint)   # first: a busy port must fail before the pools are made
        except ValueError as e:   # InsecureEndpoint, KeysError: the operator's to fix
            log.error("%s", e)
            return 2
        except zmq.ZMQError as e:
            log.error("cannot bind %s: %s", config.endpoint, e)
            return 1
        try:
            if config.gpu_memory_utilization:
                blocks = _size_device_pools(sock, config, stop)
                if blocks is None:   # stopped while waiting for the workers
                    return 0
                config = dataclasses.replace(config, num_device_blocks=blocks)
            pools = Pools(config)
            for pool in pools.device:
                warm_up(pool)   # before anyone is answered: no compile inside the loop
            def make_store() -> BlockStore:
                return BlockStore(config.num_device_blocks, config.num_host_blocks, config.block_size,
                                  config.enable_prefix_caching, pools.device, pools.host,
                                  policy=make_policy(config.allocation, config.max_model_len),
                                  host_cache_blocks=config.host_cache_blocks)
            sync = NoSync() if config.device == "cpu" else CopySync([str(p.device) for p in pools.device])
            service = KVStoreService(make_store, pool_info(config, pools, sync), sync)
        except (OSError, ValueError, RuntimeError) as e:
            log.error("cannot create the pools: %s", e)
            return 1
        log.info("serving on %s: %d device + %d host blocks of %d bytes, %d rank(s), device pools %s",
                 config.endpoint, config.num_device_blocks, config.num_host_blocks, config.block_bytes,
                 config.tp_size, [p.name for p in pools.device])
        # Everything made so far (torch's modules above all) lives until exit: keep it out of the
        # garbage collector's full passes, which otherwise cost ~100 ms every few thousand ops.
        gc.freeze()
        _serve(sock, service, stop)
        log.info("stopping: closing and unlinking the pools")
        return 0
    finally:
        if pools is not None:
            pools.close_all()
        guard.close()
        sock.close()
        ctx.term()
        restore()


def _size_device_pools(sock: zmq.Socket, config: Config, stop: threading.Event) -> int | None:
    """Answer the workers' memory reports (and everyone else with 'not yet') until every rank has
    reported -> the device pools' block count; None if stopped first."""
    sizing = PoolSizing(config.tp_size, config.gpu_memory_utilization, config.block_bytes,
                        [_device_of(config, rank) for rank in range(config.tp_size)])
    log.info("waiting for %d worker rank(s) to profile before sizing the device pools at "
             "--gpu-memory-utilization %g", config.tp_size, config.gpu_memory_utilization)

    def answer(frames: list) -> list:
        try:
            return protocol.encode(sizing.handle(protocol.decode(frames)))
        except protocol.ProtocolError as e:
            log.warning("rejected a malformed message: %s", e)
            return protocol.encode(protocol.Error(str(e), code=400))

    phase = threading.Event()
    answer_requests(sock, answer, phase, log, POLL_MS,
                    between=lambda: (sizing.done or stop.is_set()) and phase.set())
    if stop.is_set():
        return None
    blocks = sizing.num_device_blocks()
    log.info("device pools sized from free memory: %d blocks per rank (worker reserves %s bytes)",
             blocks, [sizing.reserve[r] for r in range(config.tp_size)])
    return blocks


def _serve(sock: zmq.Socket, service: KVStoreService, stop: threading.Event) -> None:
    answer_requests(sock, service.handle, stop, log, POLL_MS)


def main(argv: list[str] | None = None) -> int:
    return service_main("kvstore", Config, run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
