"""The scheduler's steps: each planned on the core, its op log sent to the kvstore, its work to the
worker, its results applied, with the next step planned and sent while the worker runs this one
(async scheduling).

No sockets of its own: it uses the scheduler's clients (the kvstore's through MirrorSync, the
worker's RpcClient), and hands the tokens of each step to the service to publish. Owned by the
scheduler process.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.services import protocol
from pagedserve.services.rpc import RpcClient
from pagedserve.services.scheduler.mirror_sync import MirrorSync
from pagedserve.services.scheduler.scheduler import ScheduledStep, Scheduler
from pagedserve.services.scheduler.step_log import StepLog
from pagedserve.services.scheduler.step_stats import StepStats
from pagedserve.services.scheduler.stepper import WorkerView


class StepPipeline:
    """publish: sends the routers what take_unpublished() returns (called while the worker computes)."""

    def __init__(self, core: Scheduler, kvsync: MirrorSync, worker: RpcClient, workers_view: WorkerView,
                 async_scheduling: bool, publish: Callable[[], None], step_log: StepLog | None = None):
        self.core, self.kvsync, self.worker, self.workers_view = core, kvsync, worker, workers_view
        self.async_scheduling = async_scheduling
        self.publish = publish
        self.worker_step = 0      # ExecuteSteps sent to the worker
        self.in_flight: Dispatched | None = None   # a step sent to the worker, not yet answered
        self.last_step_end = 0.0
        self.unpublished = None   # (requests, finished) of the last step, not yet sent to routers
        self.timing = StepStats()
        self.step_log = step_log          # --step-log: a line per step (step_log.py)
        self.grammar_cache_bytes = 0     # the worker's, as the last step's reply said (a metric)

    def take_unpublished(self):
        """(requests, finished) of the last step, not yet sent to routers, or None; taken once."""
        out, self.unpublished = self.unpublished, None
        return out

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
        if self.async_scheduling and cur.request is not None and self.core.has_unfinished():
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
                self.grammar_cache_bytes = reply.grammar_cache_bytes
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
        idle = self.in_flight is None and not self.core.has_unfinished()
        if idle:
            self.publish()
            self.kvsync.sync()     # frees of the last step, so the kvstore's stats are current
        # Phases of overlapping steps: each counts from where the one before it ended.
        end = time.perf_counter()
        began, self.last_step_end = max(cur.t_plan, self.last_step_end), end
        self.timing.add(cur.scheduled.num_tokens, end - began, cur.t_ops - cur.t_plan, cur.t_sent - cur.t_ops,
                        t_reply - max(cur.t_sent, began), worker_s)
        if self.step_log is not None:
            self.step_log.add(cur.scheduled, end - began, worker_s)
            if idle:
                self.step_log.flush()

    def _dispatch(self, scheduled: ScheduledStep, t_plan: float) -> "Dispatched":
        """Send a planned step's block ops to the kvstore and its work to the worker. A step whose
        ops move no bytes (no copy-on-write, no swap: nearly every decode step) need not wait for
        the kvstore: the worker runs while the kvstore replays the metadata, and the answer is
        read after. Otherwise the copies must land before the worker reads."""
        t_ops = time.perf_counter()
        pending = self.kvsync.send_ops()
        if pending is not None and pending[1]:
            self.kvsync.check_ops(pending)
            pending = None
        request = None
        if scheduled.steps:
            self.worker_step += 1
            request = self.workers_view.execute_step(self.worker_step, scheduled, self.kvsync.mirror,
                                                     self.core.live_request_ids)
            self.worker.send(request)
        return Dispatched(scheduled, request, pending, t_plan, t_ops, time.perf_counter())

    def _settle_ops(self, d: "Dispatched") -> None:
        if d.pending is not None:
            pending, d.pending = d.pending, None
            self.kvsync.check_ops(pending)

    def abandon_steps(self) -> None:
        """A step failed: the step planned ahead of it never runs to an update. Its blocks go, and the
        worker's connection is renewed, so that its late answer is never read as another's."""
        if self.in_flight is not None:
            self.core.abandon(self.in_flight.scheduled)
            self.in_flight = None
            self.worker.reset()


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
