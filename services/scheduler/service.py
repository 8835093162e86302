"""The scheduler process: the scheduler core between routers, the kvstore and the workers.

Owns request state (through the core) and the sockets to its peers. Each step: schedule on the
block-store mirror, send the kvstore the step's op log (one exchange), send the workers the step
(one exchange), apply the sampled tokens, stream the new tokens to the routers that own the
requests. Peers are pinged while idle; one that stops answering makes the replica not ready and
fails the requests in flight instead of hanging them.
"""
from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from dataclasses import dataclass

import zmq

from pagedserve.services.kvstore.client import KVStoreClient, KVStoreError
from pagedserve.services import config_fields as cf, protocol
from pagedserve.services.config_fields import positive
from pagedserve.services.flags import ProcessConfig, opt
from pagedserve.services.heartbeat import Heartbeat, HeartbeatWatch
from pagedserve.services.curve import InsecureEndpoint, KeysError, SocketGuard
from pagedserve.services.model_dir import context_length, read_model_dir
from pagedserve.services.process import on_stop_signals, service_main
from pagedserve.services.rpc import PeerTimeout, RpcClient
from pagedserve.services.state import redact_url
from pagedserve.services.sampling_params import SamplingParams, SamplingParamsError
from pagedserve.services.scheduler.scheduler import ScheduledStep, Scheduler, SchedulerConfig, SchedulerError
from pagedserve.services.scheduler.exporter import ExporterElection
from pagedserve.services.scheduler.step_stats import StepStats
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

    def cross_check(self) -> str | None:
        return cf.batch_limits_check(self.max_num_seqs, self.max_num_batched_tokens)



LEASE_S = 5.0   # the replica's lease in the shared state, renewed every heartbeat


class SchedulerService:
    def __init__(self, config: Config):
        self.config = config
        spec = read_model_dir(config.model)     # config.json alone: this process never loads torch
        self.guard = SocketGuard.from_setting(config.curve_keys, log)
        self.guard.check_listen(config.endpoint)   # before waiting for the peers: the operator's to fix
        self.ctx = zmq.Context()
        self.beat = (Heartbeat(config.heartbeat_endpoint, "scheduler", config.hang_timeout_s, self.ctx)
                     if config.heartbeat_endpoint else None)
        self.worker_watch = (HeartbeatWatch(config.worker_heartbeat_endpoint, config.hang_timeout_s, self.ctx)
                             if config.worker_heartbeat_endpoint else None)
        self.kv = KVStoreClient(config.kvstore_endpoint, config.peer_timeout_s, self.ctx, on_wait=self.tick,
                                guard=self.guard)
        self.worker = RpcClient(config.worker_endpoint, config.step_timeout_s, self.ctx,
                                on_wait=self._waiting_for_worker, guard=self.guard)
        self.draining = False
        self.worker_grammar_cache_bytes = 0     # as the last step's reply said (a metric)
        info = self._wait_for(lambda: self.kv.pool_info(timeout_s=1.0), "kvstore", self.kv.endpoint)
        # The kvstore may have served an earlier scheduler of this replica (a restart): it frees
        # what that one held and keeps the cache; the mirror starts from its state.
        snapshot = self.kv.resume("scheduler")
        self._wait_for(self._first_worker_answer, "worker", self.worker.endpoint)
        self._wait_for(self._worker_beat_answered, "worker's heartbeat", config.worker_heartbeat_endpoint)
        self.pool_info = info
        self.mirror = self._new_mirror(snapshot)
        max_len = context_length(config.max_model_len, spec)
        self.core = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_len,
                                              config.preemption_mode, eos_token_ids=spec.eos_token_ids,
                                              vocab_size=spec.vocab_size, batching=config.batching),
                              self.mirror, clock=time.monotonic)
        self.model_name = config.model
        self.max_model_len = max_len
        self.owner: dict[str, bytes] = {}           # request id -> router identity
        self.workers_view, self.routers_view = WorkerView(), RouterView()
        self.step_no = 0          # ApplyOps sent to the kvstore
        self.worker_step = 0      # ExecuteSteps sent to the worker
        self.in_flight: Dispatched | None = None   # a step sent to the worker, not yet answered
        self.last_step_end = 0.0
        self.unpublished = None   # (requests, finished) of the last step, not yet sent to routers
        self.timing = StepStats()
        self.exporters = ExporterElection()   # which router exports this engine's series
        self.host_copies_sent = self.mirror.host_cache_copies   # host-tier copies in the logs sent so far
        self.ready = True
        self.broken: str | None = None   # set when the kvstore diverged: reset at the next heartbeat
        self.last_beat = time.monotonic()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A ROUTER drops messages without a word once a peer's queue is full: a router that
        # fell behind (paused, busy) would lose tokens and ends. No limit: they wait for it.
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)   # a restarted router may reuse its identity
        self.guard.listen(self.sock, config.endpoint)
        self.state = self._register()

    def tick(self) -> None:
        """The main thread is alive (it steps, or waits on a peer that may still answer)."""
        if self.beat is not None:
            self.beat.tick()

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

    def lost(self, why: str) -> None:
        """A step failed (a peer died, hung or diverged): every request ends with the error, and the
        replica is not ready until the heartbeat finds every peer answering again. The worker's
        watch forgets the worker it watched: a replacement is judged by its own heartbeat, not by
        the silence of the one it replaces (a request just after /ready said 'stuck' of a worker
        still loading, when the old worker's last answer was 3 s old)."""
        self.ready = False
        self.fail_all(why)
        if self.worker_watch is not None:
            self.worker_watch.restart()

    def _first_worker_answer(self):
        """One Ping that the worker answers once it has loaded (a first start compiles the CPU
        kernel: ~15 s). Asked anew each second, every timed-out ask dropped the connection, and
        the worker logged each drop. The kvstore is pinged meanwhile, or it would take the
        silence for a scheduler that is gone."""
        if not self.worker.asked:
            self.worker.send(protocol.Ping("scheduler"))
        self.kv.ping("scheduler", 1.0)
        return self.worker.receive(timeout_s=1.0, keep_question=True)

    def _kvstore_same(self) -> None:
        """Ping the kvstore by asking for its pools: different pool names mean it restarted (its
        store is empty, its pools new): the mirror is wrong and every request must fail."""
        info = self.kv.pool_info(timeout_s=self.config.peer_timeout_s)
        if info.device_pool_names != self.pool_info.device_pool_names:
            log.warning("the kvstore restarted (new pools %s)", info.device_pool_names)
            self.pool_info = info
            self.broken = "the kvstore restarted"

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

    def _register(self):
        if not self.config.redis_url:
            return None
        from pagedserve.services.state import RedisState
        state = RedisState(self.config.redis_url)
        self._register_replica(state, {"model": self.model_name})
        return state

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

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> None:
        """Run one step to its update. With async scheduling the step after it is planned and sent
        first, when it can be planned without this one's tokens (Scheduler.schedule_ahead): the
        worker finds it waiting when it answers, and runs it while this one is applied and its
        tokens are published. Every ApplyOps is answered before step() returns; only a step sent to
        the worker stays in flight between calls."""
        t = time.perf_counter()
        cur, self.in_flight = self.in_flight or self._dispatch(self.core.schedule(), t), None
        try:
            self._run(cur)
        except BaseException:
            self.core.abandon(cur.scheduled)
            self.abandon_steps()
            raise

    def _run(self, cur: "Dispatched") -> None:
        if self.config.async_scheduling and cur.request is not None and self.core.has_unfinished():
            t = time.perf_counter()
            ahead = self.core.schedule_ahead(cur.scheduled)
            if ahead is not None:
                self._settle_ops(cur)   # the kvstore answers one ApplyOps at a time, in order
                self.in_flight = self._dispatch(ahead, t)
        results, worker_s, prompt_logprobs = [], 0.0, None
        try:
            if cur.request is not None:
                self.publish()   # the last step's tokens go to the routers while the worker computes
                reply = self.worker.receive()
                if not isinstance(reply, protocol.StepResult) or reply.error:
                    raise RuntimeError(f"worker failed step {cur.request.step}: {getattr(reply, 'error', reply)}")
                if reply.step != cur.request.step:   # never a reply to another question: fail, do not apply
                    raise RuntimeError(f"the worker answered step {cur.request.step} with step {reply.step}")
                results, worker_s, prompt_logprobs = reply.results, reply.elapsed, reply.prompt_logprobs
                self.worker_grammar_cache_bytes = reply.grammar_cache_bytes
        finally:   # read the kvstore's answers even if the worker failed: the socket must stay in step
            t_reply = time.perf_counter()
            self._settle_ops(cur)
            if self.in_flight is not None:
                self._settle_ops(self.in_flight)
        self.publish()   # (a step that reached no worker)
        finished = self.core.update(cur.scheduled, results, prompt_logprobs)
        # Sent once the next step is on its way to the worker (or now, if there is none): the
        # encoding overlaps the worker's compute instead of delaying its next step.
        self.unpublished = (cur.scheduled.requests, finished)
        if self.in_flight is None and not self.core.has_unfinished():
            self.publish()
            self._sync_kvstore()     # frees of the last step, so the kvstore's stats are current
        # Phases of overlapping steps: each counts from where the one before it ended.
        end = time.perf_counter()
        began, self.last_step_end = max(cur.t_plan, self.last_step_end), end
        self.timing.add(cur.scheduled.num_tokens, end - began, cur.t_ops - cur.t_plan, cur.t_sent - cur.t_ops,
                        t_reply - max(cur.t_sent, began), worker_s)

    def _dispatch(self, scheduled: ScheduledStep, t_plan: float) -> "Dispatched":
        """Send a planned step's block ops to the kvstore and its work to the worker. A step whose
        ops move no bytes (no copy-on-write, no swap: nearly every decode step) need not wait for
        the kvstore: the worker runs while the kvstore replays the metadata, and the answer is
        read after. Otherwise the copies must land before the worker reads."""
        t_ops = time.perf_counter()
        pending = self._send_ops()
        if pending is not None and pending[1]:
            self._check_ops(pending)
            pending = None
        request = None
        if scheduled.steps:
            self.worker_step += 1
            request = self.workers_view.execute_step(self.worker_step, scheduled, self.mirror,
                                                     self.core.requests.keys())
            self.worker.send(request)
        return Dispatched(scheduled, request, pending, t_plan, t_ops, time.perf_counter())

    def _settle_ops(self, d: "Dispatched") -> None:
        if d.pending is not None:
            pending, d.pending = d.pending, None
            self._check_ops(pending)

    def abandon_steps(self) -> None:
        """A step failed: the step planned ahead of it never runs to an update. Its blocks go, and the
        worker's connection is renewed, so that its late answer is never read as another's."""
        if self.in_flight is not None:
            self.core.abandon(self.in_flight.scheduled)
            self.in_flight = None
            self.worker.reset()

    def publish(self) -> None:
        """Send the routers what the last step produced: one message per router, then the ends."""
        if self.unpublished is None:
            return
        requests, finished = self.unpublished
        self.unpublished = None
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

    def _sync_kvstore(self) -> None:
        pending = self._send_ops()
        if pending is not None:
            self._check_ops(pending)

    def _send_ops(self):
        """Send the mirror's op log -> (expected results, whether it moves bytes), or None if empty."""
        ops, expected = self.mirror.drain()
        if not ops:
            return None
        self.step_no += 1
        self.kv.send_apply(self.step_no, ops)
        copies = self.mirror.host_cache_copies
        moved = _moves_bytes(ops, expected, copies - self.host_copies_sent)
        self.host_copies_sent = copies
        return expected, moved

    def _check_ops(self, pending) -> None:
        expected, _ = pending
        try:
            reply = self.kv.receive_apply(self.step_no)
            why = reply.error or (None if reply.results == expected else "different results")
        except KVStoreError as e:
            why = str(e)
        if why is not None:
            self.broken = "the kvstore diverged from the scheduler's block-store mirror"
            raise RuntimeError(f"kvstore diverged from the scheduler's mirror at step {self.step_no}: {why}")

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
        self.timing.maybe_log(idle=not self.core.has_unfinished())
        self._sync_kvstore()     # aborts and frees made while idle
        ok = True
        pings = ((self._kvstore_same, "kvstore", self.kv.endpoint),
                 (self._ping_worker, "worker", self.worker.endpoint))
        for ping, name, endpoint in pings:
            try:
                ping()
            except (PeerTimeout, KVStoreError) as e:   # KVStoreError: a kvstore still sizing its pools
                log.error("the %s at %s stopped answering: %s", name, endpoint, e)
                ok = False
                if name == "worker" and self.worker_watch is not None:
                    self.worker_watch.restart()     # its replacement is watched afresh (lost())
        if self.worker_watch is not None:
            self.worker_watch.poke()
            if self.worker_watch.stuck():
                log.error("the worker at %s is stuck (no heartbeat progress)", self.worker.endpoint)
                ok = False
            elif not self.worker_watch.answered():   # a worker since lost(): not ready before its heartbeat is
                ok = False
        if self.ready and not ok:
            self.fail_all("an engine process stopped answering")
        if ok and (not self.ready or self.broken):
            # Back after a silence (or a divergence): ops queued to the kvstore meanwhile may be lost,
            # so the mirror cannot be trusted to agree with the kvstore's store. Every request has
            # been failed; the mirror is rebuilt from the kvstore's state (_resync_block_stores).
            self.fail_all("the engine was reset")
            ok = self._resync_block_stores()
        self.ready = ok
        self._renew_lease()

    def busy(self) -> bool:
        """Requests to run, or a step in flight to collect."""
        return self.core.has_unfinished() or self.in_flight is not None

    def _ping_worker(self) -> None:
        """A Ping, unless a step is in flight: its answer would be taken for the Pong (the step's own
        answer, and the worker's heartbeat meanwhile, say whether it lives)."""
        if self.in_flight is None:
            self.worker.call(protocol.Ping("scheduler"), timeout_s=self.config.peer_timeout_s)

    def _new_mirror(self, snapshot: protocol.StoreSnapshot | None = None):
        """The scheduler's bookkeeping-only copy of the kvstore's BlockStore: empty, or the state
        of the kvstore's store (a resume)."""
        from pagedserve.kvstore.replay import RecordingStore
        from pagedserve.kvstore.allocator import make_policy
        from pagedserve.kvstore.store import BlockStore
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

    def _resync_block_stores(self) -> bool:
        """Both block stores agree again. After a divergence the kvstore's state is suspect (its
        hashed blocks may not hold what their keys say): both start from empty (ResetStore).
        Otherwise the kvstore is the authority: it frees what ran, keeps its cache, and the mirror
        is rebuilt from its state (ResumeStore), as at start."""
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
        self.core.plan_on(self.mirror)
        self.host_copies_sent = self.mirror.host_cache_copies
        self.step_no = 0                   # the kvstore takes step 1 next (it applies them in order)
        self.workers_view.forget_all()     # the worker drops its tables and params with the next step
        log.warning("block stores %s", "reset: the scheduler's mirror and the kvstore start from empty"
                    if self.broken else "resynchronized from the kvstore's state (its cache kept)")
        self.broken = None
        return True

    def _renew_lease(self) -> None:
        """Keep this replica listed in the shared state; a lapsed lease (a long pause) registers
        again, and a state store that is down is logged, not fatal (routers with a fixed
        scheduler endpoint keep working)."""
        if self.state is None:
            return
        info = {"model": self.model_name, "load": len(self.owner)}
        try:
            if not self.state.renew_replica(self.config.replica_id, ttl_s=LEASE_S, info=info):
                log.warning("the replica's lease had lapsed; registering again")
                self._register_replica(self.state, info)
        except Exception as e:   # redis-py's ConnectionError, TimeoutError, ...
            log.warning("cannot renew the replica's lease in the shared state: %s", e)

    def _register_replica(self, state, info: dict) -> None:
        state.register_replica(self.config.replica_id, self.config.advertise or self.config.endpoint,
                               info, ttl_s=LEASE_S)

    def stats(self) -> dict:
        try:
            kv = self.kv.stats()
        except KVStoreError:
            kv = {}
        total = max(1, kv.get("device_blocks_total", 1))
        s = self.core.stats
        return {"ready": self.ready, "model": self.model_name, "max_model_len": self.max_model_len,
                "broken": self.broken, "num_requests_running": len(self.core.running), "num_requests_waiting": len(self.core.waiting),
                "num_requests_swapped": len(self.core.swapped),
                "kv_cache_usage_perc": kv.get("device_blocks_used", 0) / total,
                "num_preemptions": s["preemptions"], "prefix_cache_queries": kv.get("prefix_queries_tokens", 0),
                "prefix_cache_hits": kv.get("prefix_hit_tokens", 0),
                "external_prefix_cache_queries": kv.get("host_queries_tokens", 0),
                "external_prefix_cache_hits": kv.get("host_hit_tokens", 0),
                "host_cache_demotions": kv.get("host_cache_demotions", 0),
                "host_cache_promotions": kv.get("host_cache_promotions", 0),
                "host_cache_bytes_copied": kv.get("host_cache_bytes_copied", 0), "scheduler": dict(s),
                "grammar_cache_bytes": self.worker_grammar_cache_bytes,
                "kv": {**kv, "kv_breakdown": self.core.kv_breakdown()},
                "engine": self.config.replica_id, "steps": self.timing.snapshot(),
                "cache_config": self._cache_config()}

    def _cache_config(self) -> dict:
        """vLLM's cache_config_info labels that carry over (its CacheConfig field names)."""
        info = self.pool_info
        return {"block_size": info.block_size, "num_gpu_blocks": info.num_device_blocks,
                "num_cpu_blocks": info.num_host_blocks, "enable_prefix_caching": info.enable_prefix_caching,
                "allocation": info.allocation, "device": info.device,
                "preemption_mode": self.config.preemption_mode}


@dataclass
class Dispatched:
    """A step sent on its way: its plan, what the worker was asked (None: nothing), the kvstore's
    answer still to read (None: read), and when it was planned, its ops sent, its work sent."""
    scheduled: ScheduledStep
    request: protocol.ExecuteStep | None
    pending: tuple | None
    t_plan: float
    t_ops: float
    t_sent: float


def _moves_bytes(ops: list[list], results: list, host_copies: int = 0) -> bool:
    """Whether replaying these ops copies block bytes (swaps, appends that copied on write, or
    host_copies blocks demoted or promoted: a demoted block is written again in this very step)."""
    return host_copies > 0 or any(op[0] in ("swap_out", "swap_in") or (op[0] in ("append_slots", "append_tokens") and r[1])
               for op, r in zip(ops, results))


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
    except Exception as e:   # redis-py raises ConnectionError, TimeoutError, AuthenticationError...
        if type(e).__module__.startswith("redis"):
            print(f"scheduler: cannot use Redis at {redact_url(config.redis_url)}: {e}", file=sys.stderr)
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
                svc.step()
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
    return 0


def main(argv=None) -> int:
    return service_main("scheduler", Config, run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
