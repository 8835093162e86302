"""The scheduler process: the scheduler core between routers, the kvstore and the workers.

Owns request state (through the core) and the sockets to its peers. Each step: schedule on the
block-store mirror, send the kvstore the step's op log (one exchange), send the workers the step
(one exchange), apply the sampled tokens, stream the new tokens to the routers that own the
requests. Peers are pinged while idle; one that stops answering makes the replica not ready and
fails the requests in flight instead of hanging them.

This module wires the parts and runs the loop: the peers and their liveness (peers.py), the mirror
and its op-log exchange with the kvstore (mirror_sync.py), the steps (step_pipeline.py), the
replica's lease in Redis (lease.py) and the stats reply (stats_reply.py).
"""
from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from dataclasses import dataclass

import zmq

from pagedserve.services.kvstore.client import KVStoreError
from pagedserve.services import config_fields as cf, protocol
from pagedserve.services.config_fields import positive
from pagedserve.services.flags import ProcessConfig, opt
from pagedserve.services.heartbeat import Heartbeat
from pagedserve.services.curve import InsecureEndpoint, KeysError, SocketGuard
from pagedserve.services.model_dir import context_length, read_model_dir
from pagedserve.services.process import on_stop_signals, service_main
from pagedserve.services.rpc import PeerTimeout
from pagedserve.services.state import redis_start_failure
from pagedserve.services.sampling_params import SamplingParams, SamplingParamsError
from pagedserve.services.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerError
from pagedserve.services.scheduler.exporter import ExporterElection
from pagedserve.services.scheduler.lease import ReplicaLease
from pagedserve.services.scheduler.mirror_sync import MirrorSync
from pagedserve.services.scheduler.mirror_sync import moves_bytes as _moves_bytes  # noqa: F401 (tests' old name)
from pagedserve.services.scheduler.peers import Peers
from pagedserve.services.scheduler.stats_reply import engine_stats
from pagedserve.services.scheduler.step_log import StepLog
from pagedserve.services.scheduler.step_pipeline import StepPipeline
from pagedserve.services.scheduler.stepper import RouterView, WorkerView

log = logging.getLogger("pagedserve.scheduler")


@dataclass
class Config(ProcessConfig):
    model: str = cf.model()
    endpoint: str = cf.endpoint("tcp://127.0.0.1:5602", "where the scheduler serves the routers")
    kvstore_endpoint: str = cf.endpoint("tcp://127.0.0.1:5601", "the kvstore's endpoint")
    worker_endpoint: str = cf.endpoint("tcp://127.0.0.1:5603", "rank 0 of the workers")
    max_num_seqs: int = cf.max_num_seqs()
    max_num_batched_tokens: int = cf.max_num_batched_tokens()
    preemption_mode: str = cf.preemption_mode()
    batching: str = cf.batching()         # request: the kvstore holds the allocation (orca-max)
    async_scheduling: bool = cf.async_scheduling()
    max_model_len: int | None = cf.max_model_len()
    redis_url: str | None = cf.redis_url("Redis where the replica registers for routers that pick replicas")
    replica_id: str = opt("replica-0", "this replica's name in Redis")
    advertise: str | None = opt(None, "the endpoint routers should use (default: --endpoint)")
    heartbeat_s: float = opt(1.0, "seconds between pings of idle peers", flag="--heartbeat", check=positive)
    peer_timeout_s: float = opt(5.0, "seconds a peer may stay silent before the replica is not ready",
                                flag="--peer-timeout", check=positive)
    step_timeout_s: float = opt(120.0, "seconds one step may take before the worker counts as lost",
                                flag="--step-timeout", check=positive)
    startup_timeout_s: float = opt(120.0, "seconds to wait for the kvstore and the worker at start-up",
                                   flag="--startup-timeout", check=positive)
    log_level: str = cf.log_level()
    # Supervision and shutdown (services/heartbeat.py): this process's own heartbeat, the worker's
    # (watched while a step runs: a stuck worker fails its requests in hang_timeout_s, not
    # step_timeout_s), and how long SIGTERM lets running requests finish (new ones get 503).
    heartbeat_endpoint: str | None = cf.optional_endpoint("answer heartbeat Pings here (the launcher watches it)")
    worker_heartbeat_endpoint: str | None = cf.optional_endpoint("the worker's heartbeat, watched while a step runs")
    hang_timeout_s: float = cf.hang_timeout("seconds without a good heartbeat after which the worker counts as stuck")
    shutdown_timeout_s: float = cf.shutdown_timeout(0.0)
    curve_keys: str = cf.curve_keys("required to listen on a non-loopback address")
    step_log: str | None = cf.step_log()

    def cross_check(self) -> str | None:
        return cf.batch_limits_check(self.max_num_seqs, self.max_num_batched_tokens)


class SchedulerService:
    def __init__(self, config: Config):
        self.config = config
        spec = read_model_dir(config.model)     # config.json alone: this process never loads torch
        self.guard = SocketGuard.from_setting(config.curve_keys, log)
        self.guard.check_listen(config.endpoint)   # before waiting for the peers: the operator's to fix
        self.ctx = zmq.Context()
        self.beat = (Heartbeat(config.heartbeat_endpoint, "scheduler", config.hang_timeout_s, self.ctx)
                     if config.heartbeat_endpoint else None)
        self.peers = Peers(config, self.ctx, self.guard, self.tick)
        self.kv, self.worker = self.peers.kv, self.peers.worker
        self.draining = False
        info, snapshot = self.peers.connect()
        self.kvsync = MirrorSync(self.kv, info, snapshot, config.peer_timeout_s)
        max_len = context_length(config.max_model_len, spec)
        self.core = Scheduler(SchedulerConfig.of(config, max_model_len=max_len, eos_token_ids=spec.eos_token_ids,
                                                 vocab_size=spec.vocab_size),
                              self.kvsync.mirror, clock=time.monotonic)
        self.model_name = config.model
        self.max_model_len = max_len
        self.owner: dict[str, bytes] = {}           # request id -> router identity
        self.workers_view, self.routers_view = WorkerView(), RouterView()
        self.steps = StepPipeline(self.core, self.kvsync, self.worker, self.workers_view,
                                  config.async_scheduling, self.publish,
                                  StepLog(config.step_log) if config.step_log else None)
        self.exporters = ExporterElection()   # which router exports this engine's series
        self.ready = True
        self.last_beat = time.monotonic()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A ROUTER drops messages without a word once a peer's queue is full: a router that
        # fell behind (paused, busy) would lose tokens and ends. No limit: they wait for it.
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)   # a restarted router may reuse its identity
        self.guard.listen(self.sock, config.endpoint)
        self.lease = ReplicaLease.open(config.redis_url, config.replica_id, config.advertise or config.endpoint,
                                       self.model_name)

    def tick(self) -> None:
        """The main thread is alive (it steps, or waits on a peer that may still answer)."""
        if self.beat is not None:
            self.beat.tick()

    def lost(self, why: str) -> None:
        """A step failed (a peer died, hung or diverged): every request ends with the error, and the
        replica is not ready until the heartbeat finds every peer answering again. The worker's
        watch forgets the worker it watched: a replacement is judged by its own heartbeat, not by
        the silence of the one it replaces (a request just after /ready said 'stuck' of a worker
        still loading, when the old worker's last answer was 3 s old)."""
        self.ready = False
        self.fail_all(why)
        self.peers.forget_worker()

    # ---- messages from routers -------------------------------------------------------------

    def handle(self, identity: bytes, frames) -> None:
        try:
            msg = protocol.decode(frames)
        except protocol.ProtocolError as e:
            log.warning("rejected a malformed message from %r: %s", identity, e)
            self._send(identity, protocol.Error(str(e)))
            return
        if isinstance(msg, protocol.AddRequest):
            self._add(identity, msg)
        elif isinstance(msg, protocol.AbortRequest):
            self.publish()   # the request's last tokens before its end
            self.core.abort(msg.request_id)
            self._flush_finished([self.core.requests[msg.request_id]] if msg.request_id in self.core.requests else [])
        elif isinstance(msg, protocol.GetStats):
            try:
                stats = self.stats()
                stats["exporter"] = bool(msg.router_id) and self.exporters.elect(msg.router_id, time.monotonic())
                self._send(identity, protocol.StatsReply(stats))
            except PeerTimeout as e:   # the heartbeat marks the replica not ready; this caller gets a 503
                self._send(identity, protocol.Error(f"the kvstore did not answer: {e}", 503, "server_error"))
        elif isinstance(msg, protocol.Ping):
            self._send(identity, protocol.Pong(self.config.replica_id, time.time(), "scheduler",
                                               self.ready and not self.draining))
        else:
            self._send(identity, protocol.Error(f"the scheduler does not take {type(msg).__name__}"))

    def _add(self, identity: bytes, msg: protocol.AddRequest) -> None:
        if not self.ready or self.draining:
            why = "the engine is shutting down" if self.draining else "the engine is not ready"
            self._send(identity, protocol.Error(why, 503, "server_error", request_id=msg.request_id))
            return
        try:
            params = SamplingParams.from_dict(msg.params)
            self.core.add_request(msg.request_id, msg.prompt_token_ids, params,
                                  true_output_len=msg.true_output_len)
        except (SamplingParamsError, SchedulerError, ValueError, TypeError) as e:
            log.info("rejected request %s: %s", msg.request_id, e)
            self._send(identity, protocol.Error(str(e), 400, param=getattr(e, "param", None),
                                                request_id=msg.request_id))
            return
        self.owner[msg.request_id] = identity

    def _send(self, identity: bytes, msg) -> None:
        self.sock.send_multipart([identity, *protocol.encode(msg)], copy=False)

    def publish(self) -> None:
        """Send the routers what the last step produced: one message per router, then the ends."""
        unpublished = self.steps.take_unpublished()
        if unpublished is None:
            return
        requests, finished = unpublished
        for identity, batch in self.routers_view.updates_for(requests, self.owner).items():
            self._send(identity, batch)   # the finished ones' last updates included
        self._flush_finished(finished, announce=False)

    def _flush_finished(self, finished, announce: bool = True) -> None:
        """Forget finished requests, first sending each owner its final update (unless it was sent)."""
        for req in finished:
            if req.request_id in self.owner and req.is_finished:
                update = self.routers_view.update_for(req) if announce else None
                if update is not None:
                    self._send(self.owner[req.request_id], update)
                del self.owner[req.request_id]
            if req.is_finished and req.request_id in self.core.requests:
                self.core.pop_finished(req.request_id)

    def fail_all(self, why: str) -> None:
        """A peer is gone: end every request with an error rather than leave routers waiting."""
        self.publish()
        for request_id in list(self.owner):
            req = self.core.requests.get(request_id)
            if req is not None and not req.is_finished:
                req.error = why
                self.core.abort(request_id)
                self._flush_finished([req])

    def heartbeat(self) -> None:
        now = time.monotonic()
        if now - self.last_beat < self.config.heartbeat_s:
            return
        self.last_beat = now
        self.publish()
        self.steps.timing.maybe_log(idle=not self.core.has_unfinished())
        self.kvsync.sync()     # aborts and frees made while idle
        ok = self.peers.answering(self.kvsync.kvstore_same, step_in_flight=self.steps.in_flight is not None)
        if self.ready and not ok:
            self.fail_all("an engine process stopped answering")
        if ok and (not self.ready or self.kvsync.broken):
            # Back after a silence (or a divergence): ops queued to the kvstore meanwhile may be lost,
            # so the mirror cannot be trusted to agree with the kvstore's store. Every request has
            # been failed; the mirror is rebuilt from the kvstore's state (_resync_block_stores).
            self.fail_all("the engine was reset")
            ok = self._resync_block_stores()
        self.ready = ok
        if self.lease is not None:
            self.lease.renew(load=len(self.owner))

    def busy(self) -> bool:
        """Requests to run, or a step in flight to collect."""
        return self.core.has_unfinished() or self.steps.in_flight is not None

    def _resync_block_stores(self) -> bool:
        """Both block stores agree again (MirrorSync.resync); the core plans on the new mirror."""
        if not self.kvsync.resync():
            return False
        self.core.plan_on(self.kvsync.mirror)
        self.workers_view.forget_all()     # the worker drops its tables and params with the next step
        return True

    def stats(self) -> dict:
        try:
            kv = self.kv.stats()
        except KVStoreError:
            kv = {}
        return engine_stats(self.core, kv, self.kvsync.pool_info, ready=self.ready, broken=self.kvsync.broken,
                            model=self.model_name, max_model_len=self.max_model_len,
                            replica_id=self.config.replica_id, preemption_mode=self.config.preemption_mode,
                            grammar_cache_bytes=self.steps.grammar_cache_bytes, steps=self.steps.timing.snapshot())


def run(config: Config) -> int:
    logging.basicConfig(level=config.log_level, format="%(asctime)s scheduler %(levelname)s %(message)s")
    stop = threading.Event()
    on_stop_signals(stop)
    try:
        svc = SchedulerService(config)
    except (InsecureEndpoint, KeysError) as e:
        print(f"scheduler: {e}", file=sys.stderr)
        return 2
    except zmq.ZMQError as e:
        print(f"scheduler: cannot bind {config.endpoint}: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if redis_start_failure("scheduler", config.redis_url, e):
            return 1
        raise
    # Everything built so far lives as long as the process: keep the collector from rescanning it
    # (a full collection with torch's objects loaded costs ~100 ms, a visible stall in a step).
    gc.freeze()
    log.info("scheduler ready on %s (kvstore %s, worker %s)", config.endpoint,
             config.kvstore_endpoint, config.worker_endpoint)
    drain_until = None
    while True:
        if stop.is_set() and drain_until is None:
            # Drain: new requests get 503 (and /ready says not ready) while those running finish.
            svc.draining = True
            drain_until = time.monotonic() + config.shutdown_timeout_s
            log.info("draining: %d request(s) may run for up to %.0f s", len(svc.owner), config.shutdown_timeout_s)
        if drain_until is not None and (not svc.busy() or time.monotonic() >= drain_until):
            break
        svc.tick()
        busy = svc.busy() and svc.ready
        if svc.sock.poll(0 if busy else 50, zmq.POLLIN):
            while svc.sock.poll(0, zmq.POLLIN):
                identity, *frames = svc.sock.recv_multipart(copy=False)
                svc.handle(bytes(identity), frames)
        try:
            if busy:
                svc.steps.step()
            svc.heartbeat()
        except (PeerTimeout, RuntimeError) as e:
            log.error("%s", e)
            svc.lost(str(e))
    # Requests still running end with an error their clients see (a 503), not a cut connection.
    svc.publish()
    svc.fail_all("the engine is shutting down")
    if svc.beat is not None:
        svc.beat.close()
    # Those last words must leave before the process does. destroy(linger) alone lost one of two
    # final messages in about one stop of three (seen on ipc://); a short pause first delivered
    # every one in repeated stops.
    time.sleep(0.2)
    svc.guard.close()
    svc.ctx.destroy(linger=1000)
    if svc.steps.step_log is not None:
        svc.steps.step_log.close()
    return 0


def main(argv=None) -> int:
    return service_main("scheduler", Config, run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
