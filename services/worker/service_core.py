"""The worker's service core: one request's frames in, its reply out, no sockets.

WorkerService owns this rank's model runner, pool mapping, step inputs (the deltas the scheduler
sends) and, on rank 0, the sampler (WorkerCore); it forwards each step to the other ranks before
running it (tensor parallelism). services/worker/service.py's loops feed it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.kvstore.cuda_sync import NoSync
from pagedserve.kvstore.pool import BlockPool
from pagedserve.services import protocol
from pagedserve.services.worker.model_runner import ModelRunner
from pagedserve.services.worker.step_inputs import StepError, StepInputs
from pagedserve.services.worker.tp import SINGLE, TensorParallel, broadcast_control
from pagedserve.services.worker.worker_core import PendingTokenError, SampleResult, WorkerCore

log = logging.getLogger("pagedserve.worker")


class PeerLost(RuntimeError):
    """Another rank of the tensor-parallel group went away."""


@dataclass
class Started:
    """A request being answered: a reply ready, or a step begun (WorkerService.start)."""
    reply: Any = None
    step: protocol.ExecuteStep | None = None
    launched: Any = None              # WorkerCore.Launched (rank 0)
    error: str | None = None
    began: float = 0.0
    prompt_logprobs: dict = field(default_factory=dict)


class WorkerService:
    """One rank's model, pool mapping and step state; rank 0 also has the sampler (WorkerCore)."""

    def __init__(self, runner: ModelRunner, core: WorkerCore | None, pool: BlockPool,
                 tp: TensorParallel = SINGLE, sync=None, launch_ahead: bool = False):
        self.runner, self.core, self.pool, self.tp = runner, core, pool, tp
        self.launch_ahead = launch_ahead and tp.size == 1   # other ranks need a step's inputs on the host
        self.sync = sync or NoSync()   # CUDA: StepSync, this rank's half of kvstore/cuda_sync.py's contract
        self.inputs = StepInputs(pool.num_blocks, runner.spec.vocab_size)   # ids checked against both
        self.guides = core.guides if core is not None else None
        self.steps_run = 0
        self.last_broadcast = time.monotonic()

    def handle(self, frames: list) -> Any:
        """Rank 0: request frames -> reply message. Raises only PeerLost."""
        return self.finish(self.start(frames))

    def start(self, frames: list) -> "Started":
        """Rank 0: a request's frames -> its work begun: a step launched (on a GPU perhaps still
        running), anything else answered. `finish` gives the reply. Raises only PeerLost."""
        try:
            msg = protocol.decode(frames)
        except protocol.ProtocolError as e:
            log.warning("rejected a malformed message: %s", e)
            return Started(protocol.Error(str(e), code=400))
        if isinstance(msg, protocol.ExecuteStep):
            if self.tp.size > 1 and any(w.token_ids == [protocol.PENDING_TOKEN] for w in msg.seqs):
                # The other ranks have no draws of their own: they get this step with its inputs filled.
                try:
                    self.core.fill_pending(msg.seqs)
                except PendingTokenError as e:
                    log.warning("step %d rejected: %s", msg.step, e)
                    return Started(protocol.StepResult(msg.step, [], str(e)))
                frames = protocol.encode(msg)
            self.broadcast("step", frames)   # before running it: the others must join its collectives
            return self.start_step(msg)
        if isinstance(msg, protocol.Ping):
            return Started(protocol.Pong(sender=f"worker{self.tp.rank}", time=time.time(), role="worker"))
        if isinstance(msg, protocol.GetStats):
            return Started(protocol.StatsReply({"rank": self.tp.rank, "tp_size": self.tp.size,
                                                "steps": self.steps_run, "tables": len(self.inputs.tables),
                                                "params": len(self.inputs.params),
                                                **(self.guides.stats() if self.guides is not None else {})}))
        log.warning("rejected %s: not a worker request", type(msg).__name__)
        return Started(protocol.Error(f"the worker does not handle {type(msg).__name__}", code=404))

    def pipelines(self, started: "Started") -> bool:
        """Whether the next step may be launched before this one is answered (launch_ahead)."""
        return self.launch_ahead and started.step is not None and started.error is None

    def run_step(self, msg: protocol.ExecuteStep) -> protocol.StepResult:
        """Apply the deltas, run the forward (and sample, on rank 0); errors become the reply's error."""
        return self.finish(self.start_step(msg))

    def start_step(self, msg: protocol.ExecuteStep) -> "Started":
        started = Started(step=msg, began=time.perf_counter())
        try:
            with self.sync.step():   # every step, on every rank, sampled or not (the ordering contract)
                new = self.inputs.apply_deltas(msg)
                if self.guides is not None:   # compiling starts now, alongside this step's forward
                    for p in new.values():
                        if p.structured_outputs is not None:
                            self.guides.prepare(p.structured_outputs)
                steps, samples = self.inputs.build(msg)
                if steps and self.core is not None:
                    started.launched = self.core.launch(steps, samples, started.prompt_logprobs)
                elif steps:
                    self.runner.execute(steps, compute_logits=False)   # ranks > 0: KV writes and collectives only
        except Exception as e:
            started.error = self._step_error(msg, e)
        return started

    def finish(self, started: "Started") -> Any:
        """The reply to a started request: for a step, its tokens (waiting for its draw)."""
        msg = started.step
        if msg is None:
            return started.reply
        results: list[SampleResult] = []
        try:
            if started.error is None and started.launched is not None:
                results = self.core.finish(started.launched)
        except Exception as e:
            started.error = self._step_error(msg, e)
        finally:
            self.inputs.drop_params(msg)
            if self.guides is not None:
                self.guides.forget(msg.dropped_params)
        self.steps_run += 1
        error = started.error
        return protocol.StepResult(msg.step, results if error is None else [], error,
                                   time.perf_counter() - started.began,
                                   started.prompt_logprobs if error is None else {},
                                   self.guides.cache.bytes if self.guides is not None else 0)

    @staticmethod
    def _step_error(msg: protocol.ExecuteStep, e: Exception) -> str:
        if isinstance(e, (StepError, PendingTokenError)):
            log.warning("step %d rejected: %s", msg.step, e)
            return str(e)
        log.exception("step %d failed", msg.step)   # a model error fails this step, not the worker
        return f"model error: {type(e).__name__}: {e}"

    def broadcast(self, kind: str, payload: Any = None) -> None:
        """Rank 0 -> the other ranks (nothing when alone); PeerLost when one is gone."""
        if self.tp.size == 1:
            return
        try:
            broadcast_control(self.tp, (kind, payload))
        except RuntimeError as e:
            raise PeerLost(f"a tensor-parallel rank went away: {first_line(e)}") from None
        self.last_broadcast = time.monotonic()

    def tick_per_layer(self, tick) -> None:
        """Call tick() before every decoder layer runs: a long step still shows progress to the
        heartbeat, a deadlocked one stops ticking."""
        for name, module in self.runner.model.named_modules():
            if name.endswith("layers") and isinstance(module, torch.nn.ModuleList):
                for layer in module:
                    layer.register_forward_pre_hook(lambda *_: tick())

    def barrier(self) -> None:
        """On a clean stop: every rank has read the last message before any tears its group down."""
        if self.tp.size == 1:
            return
        try:
            dist.barrier(group=self.tp.control_group)
        except RuntimeError as e:
            raise PeerLost(f"a tensor-parallel rank went away: {first_line(e)}") from None

    def close(self) -> None:
        """Drop every view of the pool, then unmap it (a view touched after close would segfault)."""
        if self.guides is not None:
            self.guides.close()
        self.core = self.guides = None
        self.runner.close()
        self.runner = None
        self.pool.close()


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
