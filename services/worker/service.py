"""The worker process: one tensor-parallel rank of the model, serving steps over ZeroMQ.

Owns this rank's shard of the weights, its mapping of its device pool (the kvstore created the pool
and owns it: the worker never allocates, frees or unlinks blocks), the block tables and sampling
params the scheduler sends as deltas (StepInputs), and torch's CPU threads.

Rank 0 binds a ROUTER at --endpoint and answers for the group: ExecuteStep -> StepResult,
Ping -> Pong, GetStats -> StatsReply, anything else or anything malformed -> Error (the loop goes
on). A model error inside a step becomes StepResult(error=...), never a crash.

With tp_size > 1, rank 0 forwards each step's raw frames to the other ranks over a gloo group
before running it, so every rank applies the same deltas and runs the same forward (whose
all_reduces pair up); only rank 0 samples. Ranks > 0 block in that broadcast. When idle, rank 0
sends a heartbeat every HEARTBEAT_S, so the others see their stop signals, never reach the group's
timeout, and notice a dead rank 0 (the broadcast raises): no orphans. On SIGTERM/SIGINT rank 0
tells them to stop. With tp_size == 1 nothing distributed is set up at all.

Start-up order: bind (rank 0), ask the kvstore for PoolInfo (an unreachable kvstore fails in
seconds, before the slow model load), join the group (tp_size > 1), load this rank's shard, run
the profile pass (services/worker/profile.py: every kernel compiles before the worker says ready),
map this rank's pool, serve. A kvstore that sizes its pools from free GPU memory answers the first
GetPoolInfo with "not yet" (services/kvstore/sizing.py): then the worker reports its profile's reserve
(ReportMemory) and asks again until the pools exist.

This module is the process: its start-up and its two loops, rank 0's socket loop and the other
ranks' follower loop. A request's handling is services/worker/service_core.py's, the start-up
steps services/worker/startup.py's, the flags services/worker/config.py's.
"""
from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time

import torch
import zmq

from pagedserve.services import protocol
from pagedserve.services.curve import InsecureEndpoint, KeysError, SocketGuard
from pagedserve.services.heartbeat import Heartbeat
from pagedserve.services.process import PeerWatch, on_stop_signals, service_main
from pagedserve.services.worker.config import HEARTBEAT_S, Config
from pagedserve.services.worker.service_core import PeerLost, WorkerService, first_line
from pagedserve.services.worker.startup import StartupError, start_worker
from pagedserve.services.worker.tp import broadcast_control, close_tensor_parallel

# Tests import Config and WorkerService from here (the module `pagedserve worker` runs); run looks
# start_worker up in this module, so that a test can replace it.
__all__ = ["Config", "WorkerService", "main", "run"]

log = logging.getLogger("pagedserve.worker")

POLL_MS = 100        # how long rank 0 blocks waiting for a message: also the latency of a stop signal


def run(config: Config) -> int:
    """Serve until SIGTERM/SIGINT (0), or until a start-up failure or a lost peer rank (1)."""
    config.validate()
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s worker{config.rank} %(levelname)s %(message)s")
    faulthandler.enable()   # a crash in native code (gloo, OpenMP) leaves a Python traceback on stderr
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    stop = threading.Event()
    restore = on_stop_signals(stop)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    service = beat = None
    guard = SocketGuard(None, log)
    try:
        try:
            guard = SocketGuard.from_setting(config.curve_keys, log)
        except KeysError as e:
            raise StartupError(str(e)) from None
        if config.rank == 0:
            _bind(guard, sock, config.endpoint)   # first: a busy port fails before the slow model load
        service = start_worker(config)
        log.info("rank %d/%d ready: %s on %s, pool %s", config.rank, config.tp_size, config.model,
                 config.torch_device, service.pool.name)
        if config.rank == 0 and config.heartbeat_endpoint:
            beat = Heartbeat(config.heartbeat_endpoint, "worker", config.hang_timeout_s, ctx)
            service.tick_per_layer(beat.tick)
        return _serve(sock, service, stop, beat) if config.rank == 0 else _follow(service, stop)
    except (StartupError, PeerLost) as e:
        log.error("%s", e)
        return 1
    except zmq.ZMQError as e:   # the heartbeat endpoint is taken
        log.error("cannot bind %s: %s", config.heartbeat_endpoint, e)
        return 1
    finally:
        if beat is not None:
            beat.close()
        if service is not None:
            service.close()
            close_tensor_parallel(service.tp)
        guard.close()
        sock.close()
        ctx.term()
        restore()


def _serve(sock: zmq.Socket, service: WorkerService, stop: threading.Event, beat=None) -> int:
    """Rank 0: block in poll (never spin); keep the other ranks' broadcast alive when idle.

    A step the scheduler planned ahead (async scheduling) is already waiting when this one is
    launched: it is launched too, its inputs the draw still on the device, before this one's tokens
    are read and answered, so that the device goes from one step to the next without waiting for
    the host (services/worker/worker_core.py)."""
    def keep_ranks_alive() -> None:
        if beat is not None:
            beat.tick()
        if time.monotonic() - service.last_broadcast >= HEARTBEAT_S:
            service.broadcast("beat")

    scheduler = PeerWatch("scheduler", log)
    current = None   # (identity, Started): begun, not answered yet
    while not stop.is_set():
        if current is None:
            if not sock.poll(POLL_MS, zmq.POLLIN):
                scheduler.check()
                keep_ranks_alive()
                continue
            scheduler.seen()
            identity, *frames = sock.recv_multipart()
            current = (identity, service.start(frames))
        following = None
        if service.pipelines(current[1]) and sock.poll(0, zmq.POLLIN):
            identity, *frames = sock.recv_multipart()
            following = (identity, service.start(frames))
        sock.send_multipart([current[0], *protocol.encode(service.finish(current[1]))])
        current = following
        keep_ranks_alive()
    if current is not None:   # stopped with a step launched: it is answered all the same
        sock.send_multipart([current[0], *protocol.encode(service.finish(current[1]))])
    log.info("stopping")
    try:
        service.broadcast("stop")
        service.barrier()
    except PeerLost:
        pass   # the other ranks are already gone: a launcher signals every rank at once
    return 0


def _follow(service: WorkerService, stop: threading.Event) -> int:
    """Ranks > 0: run what rank 0 forwards, until it says stop, goes away, or a signal comes."""
    while not stop.is_set():
        try:
            kind, payload = broadcast_control(service.tp)
        except RuntimeError as e:
            log.error("rank 0 went away (%s): stopping", first_line(e))
            return 1
        if kind == "stop":
            service.barrier()
            break
        if kind == "step":
            service.run_step(protocol.decode(payload))   # rank 0 decoded these frames already
    log.info("stopping")
    return 0


def _bind(guard: SocketGuard, sock: zmq.Socket, endpoint: str) -> None:
    try:
        guard.listen(sock, endpoint)
    except (InsecureEndpoint, KeysError) as e:
        raise StartupError(str(e)) from None
    except zmq.ZMQError as e:
        raise StartupError(f"cannot bind {endpoint}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    return service_main("worker", Config, run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
