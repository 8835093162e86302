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
"""
from __future__ import annotations

import faulthandler
import functools
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import zmq

from pagedserve.services.kvstore.attach import attach_pools
from pagedserve.services.kvstore.client import KVStoreClient, KVStoreError, PeerTimeout
from pagedserve.kvstore.cuda_sync import NoSync, StepSync
from pagedserve.services.kvstore.sizing import WAITING
from pagedserve.kvstore.pool import BlockPool
from pagedserve.services import config_fields as cf, protocol
from pagedserve.services.config_fields import at_least, positive
from pagedserve.services.flags import ProcessConfig, opt
from pagedserve.services.heartbeat import Heartbeat
from pagedserve.services.curve import InsecureEndpoint, KeysError, SocketGuard
from pagedserve.services.process import PeerWatch, on_stop_signals, service_main
from pagedserve.services.worker.model_loader import ModelLoadError, inspect_model_dir, load_model, serving_dtype
from pagedserve.services.worker.cuda_graphs import capture_decode_graphs
from pagedserve.services.worker.model_runner import ModelRunner, SeqStep
from pagedserve.services.worker.profile import warm_up_and_profile
from pagedserve.services.guided.cache import CompileCache
from pagedserve.services.worker.guides import Guides
from pagedserve.services.worker.model_loader import load_tokenizer
from pagedserve.services.worker.step_inputs import StepError, StepInputs
from pagedserve.services.worker.tp import (SINGLE, TensorParallel, TPConfigError, broadcast_control,
                                close_tensor_parallel, init_tensor_parallel)
from pagedserve.services.worker.worker_core import PendingTokenError, SampleRequest, SampleResult, WorkerCore

log = logging.getLogger("pagedserve.worker")

POLL_MS = 100        # how long rank 0 blocks waiting for a message: also the latency of a stop signal
HEARTBEAT_S = 1.0    # rank 0 -> others when idle; must stay well under Config.dist_timeout_s


class StartupError(RuntimeError):
    """The worker cannot start; the message is the one line the operator reads."""


class PeerLost(RuntimeError):
    """Another rank of the tensor-parallel group went away."""


@dataclass
class Config(cf.GrammarOptions, ProcessConfig):
    model: str = cf.model()
    rank: int = opt(0, "tensor-parallel rank of this process", check=at_least(0))
    tp_size: int = opt(1, "tensor-parallel ranks in the group", check=at_least(1))
    dist_init: str = opt("tcp://127.0.0.1:29500", "torch.distributed init method (--tp-size > 1)",
                         check=lambda v: v.startswith(("tcp://", "file://")) or "must be a tcp:// or file:// address")
    dist_timeout_s: float = opt(60.0, "seconds to join the group, and for any one collective", flag="--dist-timeout",
                                check=lambda v: v > HEARTBEAT_S * 5 or f"must be above {HEARTBEAT_S * 5:g} s")
    endpoint: str = cf.endpoint("tcp://127.0.0.1:5603", "where rank 0 serves steps")
    kvstore_endpoint: str = cf.endpoint("tcp://127.0.0.1:5601", "the kvstore's endpoint")
    kvstore_timeout_s: float = opt(10.0, "seconds to wait for the kvstore", flag="--kvstore-timeout", check=positive)
    device: str = cf.device()
    dtype: str = cf.dtype()
    block_size: int = cf.block_size()              # must equal the kvstore's
    profile_tokens: int = opt(2048, "tokens of the start-up profiling step (the scheduler's "
                                    "--max-num-batched-tokens)", check=at_least(1))
    profile_seqs: int = opt(256, "sequences of the start-up profiling step (the scheduler's --max-num-seqs)",
                            check=at_least(1))
    enforce_eager: bool = cf.enforce_eager()
    launch_ahead: str = opt("auto", "launch a step the scheduler planned ahead before answering the one before "
                                    "it. auto: on CUDA, where a launch returns before the device is done; on "
                                    "CPU a launch computes the step, and answering first is sooner",
                            choices=("auto", "on", "off"))
    torch_threads: int = opt(0, "torch threads (0: torch's default)", check=at_least(0))
    seed: int = cf.seed()
    log_level: str = cf.log_level()
    # Supervision (services/heartbeat.py): rank 0 answers Pings here with whether its main thread
    # moved (a step's layers tick) within hang_timeout_s. None: no heartbeat.
    heartbeat_endpoint: str | None = cf.optional_endpoint("rank 0 answers heartbeat Pings here (the launcher and "
                                                          "the scheduler watch it)")
    hang_timeout_s: float = cf.hang_timeout("seconds without progress after which the heartbeat reports this "
                                            "worker stuck")
    curve_keys: str = cf.curve_keys("required to listen on a non-loopback address")

    def cross_check(self) -> str | None:
        if not self.rank < self.tp_size:
            return f"--rank must be in [0, --tp-size={self.tp_size}), got {self.rank}"
        return None


    @property
    def torch_device(self) -> str:
        return f"cuda:{self.rank}" if self.device == "cuda" else self.device


# ---- the service core: messages in, messages out (no sockets) ----------------------------------

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
            raise PeerLost(f"a tensor-parallel rank went away: {_first_line(e)}") from None
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
            raise PeerLost(f"a tensor-parallel rank went away: {_first_line(e)}") from None

    def close(self) -> None:
        """Drop every view of the pool, then unmap it (a view touched after close would segfault)."""
        if self.guides is not None:
            self.guides.close()
        self.core = self.guides = None
        self.runner.close()
        self.runner = None
        self.pool.close()


# ---- start-up ----------------------------------------------------------------------------------

POOL_WAIT_S = 300.0   # for a kvstore that sizes its pools: every rank loads and profiles first


def _kvstore_client(config: Config) -> KVStoreClient:
    return KVStoreClient(config.kvstore_endpoint, timeout_s=config.kvstore_timeout_s,
                         guard=SocketGuard.from_setting(config.curve_keys, log))


def fetch_pool_info(config: Config) -> protocol.PoolInfo | None:
    """The kvstore's PoolInfo, or None when it waits for memory reports before making its pools."""
    client = _kvstore_client(config)
    try:
        return check_pool_info(client.pool_info(), config)
    except PeerTimeout:
        raise StartupError(f"no answer from the kvstore at {config.kvstore_endpoint} within "
                           f"{config.kvstore_timeout_s:g} s (is it running?)") from None
    except KVStoreError as e:
        if e.code == 503 and e.param == WAITING:
            return None
        raise StartupError(f"the kvstore at {config.kvstore_endpoint} refused GetPoolInfo: {e}") from None
    finally:
        client.close()


def report_and_wait(config: Config, reserve_bytes: int, wait_s: float = POOL_WAIT_S) -> protocol.PoolInfo:
    """Send this rank's profile, then ask for PoolInfo until the kvstore has made the pools (it
    waits for every rank, then allocates and warms up: silent for a few seconds)."""
    client = _kvstore_client(config)
    deadline = time.monotonic() + wait_s
    try:
        client.report_memory(config.rank, reserve_bytes)
        while True:
            try:
                return check_pool_info(client.pool_info(), config)
            except (PeerTimeout, KVStoreError) as e:
                if isinstance(e, KVStoreError) and e.code != 503:
                    raise StartupError(f"the kvstore at {config.kvstore_endpoint} refused GetPoolInfo: {e}") from None
                if time.monotonic() > deadline:
                    raise StartupError(f"the kvstore at {config.kvstore_endpoint} made no pools within "
                                       f"{wait_s:g} s of this rank's memory report: {e}") from None
                time.sleep(0.5)
    except (PeerTimeout, KVStoreError) as e:   # the report itself
        raise StartupError(f"the kvstore at {config.kvstore_endpoint} did not take the memory report: {e}") from None
    finally:
        client.close()


def check_pool_info(info: protocol.PoolInfo, config: Config) -> protocol.PoolInfo:
    if len(info.device_pool_names) != config.tp_size:
        raise StartupError(f"the kvstore has pools for {len(info.device_pool_names)} rank(s), this worker "
                           f"group has --tp-size {config.tp_size}")
    if info.block_size != config.block_size:
        raise StartupError(f"the kvstore's block size is {info.block_size}, this worker's --block-size "
                           f"is {config.block_size}")
    return info


def attach_device_pool(info: protocol.PoolInfo, rank: int) -> BlockPool:
    """Map this rank's device pool (the kvstore's; never unlinked here)."""
    # CPU: shared memory by name; CUDA (run by `make gpu-check`): the kvstore's IPC handle.
    return attach_pools(info, "device", ranks=[rank])[0]


def start_worker(config: Config) -> WorkerService:
    """PoolInfo (or "not yet"), then the group (tp_size > 1), then this rank's shard, its profile,
    and its pool -> a ready service."""
    info = fetch_pool_info(config)
    device = config.torch_device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    try:
        tp = init_tensor_parallel(config.rank, config.tp_size, config.dist_init, device,
                                  config.dist_timeout_s)
    except (RuntimeError, ValueError) as e:   # includes torch.distributed's timeouts
        raise StartupError(f"cannot join the tensor-parallel group at {config.dist_init}: "
                           f"{_first_line(e)}") from None
    try:
        return _build_service(config, info, tp)
    except BaseException:
        close_tensor_parallel(tp)
        raise


def _build_service(config: Config, info: protocol.PoolInfo | None, tp: TensorParallel) -> WorkerService:
    device = config.torch_device
    try:
        dtype = serving_dtype(config.dtype, device, inspect_model_dir(config.model)[1])
        model, spec = load_model(config.model, dtype, device, tp)
        want = spec.block_bytes(config.block_size, dtype, config.tp_size)
    except (ModelLoadError, TPConfigError) as e:
        raise StartupError(str(e)) from None
    tokens, seqs = config.profile_tokens, config.profile_seqs
    if torch.device(device).type == "cpu":
        # Nothing compiles (the reference kernels) and nothing is measured on CPU, where the full
        # batch costs seconds per start: a small one still proves the model runs before "ready".
        tokens, seqs = min(tokens, 32), min(seqs, 2)
    reserve = warm_up_and_profile(model, spec, dtype, device, config.block_size, config.tp_size,
                                  tokens, seqs, samples=config.rank == 0, enforce_eager=config.enforce_eager)
    if info is None:   # the kvstore sizes its pools after every rank's profile
        info = report_and_wait(config, reserve)
    if want != info.block_bytes:
        raise StartupError(f"the kvstore's blocks are {info.block_bytes} bytes; this model needs {want} "
                           f"per rank (block size {config.block_size}, {dtype}, tp_size {config.tp_size})")
    try:
        pool = attach_device_pool(info, config.rank)
    except (OSError, ValueError) as e:
        raise StartupError(f"cannot map device pool {info.device_pool_names[config.rank]}: {e}") from None
    if pool.blocks.device != torch.device(device):
        where = pool.blocks.device
        pool.close()
        # Device numbers are per process (CUDA_VISIBLE_DEVICES): the two must name the same GPU.
        raise StartupError(f"the kvstore's pool for rank {config.rank} is on {where}, this worker runs on "
                           f"{device}: give the kvstore and the worker the same GPU")
    runner = ModelRunner(model, spec, pool.blocks, config.block_size, dtype, device, config.tp_size,
                         max_num_batched_tokens=config.profile_tokens)
    capture_decode_graphs(runner, config.profile_seqs, config.enforce_eager, config.tp_size)
    core = None
    if config.rank == 0:
        guides = Guides(functools.partial(load_tokenizer, config.model), spec.vocab_size, spec.eos_token_ids,
                        **CompileCache.bounds_of(config))
        core = WorkerCore(runner, spec.eos_token_ids, seed=config.seed, guides=guides)
    ahead = config.launch_ahead == "on" or (config.launch_ahead == "auto" and runner.device.type == "cuda")
    return WorkerService(runner, core, pool, tp, step_sync(info, config.rank, device, tp), launch_ahead=ahead)


def step_sync(info: protocol.PoolInfo, rank: int, device: str, tp: TensorParallel):
    """This rank's half of the ordering contract (kvstore/cuda_sync.py): StepSync on CUDA pools."""
    if not info.event_handles:
        return NoSync()
    barrier = None
    if tp.size > 1:
        def barrier() -> None:
            dist.barrier(group=tp.control_group)
    return StepSync(info.event_handles[rank], info.step_event_handles[rank], device, barrier)


# ---- the process -------------------------------------------------------------------------------

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
            log.error("rank 0 went away (%s): stopping", _first_line(e))
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
