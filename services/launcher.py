"""`pagedserve up`: start every process of one engine replica plus its routers, keep them running,
and stop them all.

Owns only the child processes (through services/supervisor.py, which restarts what dies or hangs
and reaps everything on the way out). Internal sockets are ipc:// endpoints in a private temp
folder, so two stacks on one machine never collide; routers listen on --port, --port+1, ...
Children get PR_SET_PDEATHSIG so that even a SIGKILLed launcher leaves no orphan behind. SIGTERM
drains: new requests get 503, running ones have --shutdown-timeout seconds to finish.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pagedserve.services import config_fields as cf
from pagedserve.services.config_fields import at_least, positive
from pagedserve.services.engine_config import EngineOptions
from pagedserve.services.flags import ConfigError, ProcessConfig, opt
from pagedserve.services.router.options import RouterOptions, passed_down
from pagedserve.services.supervisor import Child, Supervisor
from pagedserve.services.tiny_model import resolve_model


log = logging.getLogger("pagedserve.launcher")

CPU_BINDINGS = ("auto", "off")     # --cpu-binding (cpu_sets)


@dataclass(kw_only=True)
class Config(RouterOptions, EngineOptions, ProcessConfig):
    """`pagedserve serve`/`up`: the routers' options (RouterOptions), the engine's (EngineOptions),
    and the stack's own below."""
    model: str = opt("tiny", "a local model folder, or 'tiny' (built on first use)")
    device: str = opt("cpu", "where the model runs", choices=("cpu", "cuda"))
    host: str = opt("127.0.0.1", "address the routers listen on")
    port: int = opt(8000, "the first router's port; the others take the next ones",
                    check=lambda v: 0 < v < 65536 or "must be in [1, 65535]")
    routers: int = opt(1, "HTTP routers (more than one needs --redis-url)", check=at_least(1))
    redis_url: str | None = cf.redis_url()
    # The `engine` label of every metric and the name /ready gives: stable across restarts (a
    # name per start made a new series each time) and unique among stacks that share a Redis.
    replica_id: str | None = opt(None, "this replica's name: the engine label of its metrics, its key in Redis "
                                       "(default: local; with --redis-url HOST:PORT of the first router)")
    tensor_parallel: int = opt(1, "tensor-parallel ranks (one worker process each)", flag="--tensor-parallel-size",
                               aliases=["--tensor-parallel", "-tp"], check=at_least(1))
    worker_threads: int = opt(0, "torch threads per worker; 0 = auto (on CPU every core but one, or every core from 64 MiB of weights on; split between the ranks)",
                              check=at_least(0))
    cpu_binding: str = opt("auto", "CPU: when the workers leave cores over, bind each worker to cores of its own "
                                   "and the router, scheduler and kvstore to the others (auto); off: the OS "
                                   "places every process", choices=CPU_BINDINGS)
    # Supervision and shutdown (services/supervisor.py).
    shutdown_timeout_s: float = cf.shutdown_timeout(10.0)
    hang_timeout_s: float = cf.hang_timeout("seconds of heartbeat silence after which a process counts as stuck "
                                            "and is restarted")
    ready_timeout_s: float = opt(300.0, "seconds to wait for every process to be ready", flag="--ready-timeout",
                                 check=positive)
    log_level: str = cf.log_level()
    step_log: str | None = cf.step_log()

    def __post_init__(self):
        self.log_level = self.log_level.upper()

    def cross_check(self) -> str | None:
        if self.routers > 1 and not self.redis_url:
            return "--routers > 1 needs --redis-url: routers share request state through Redis"
        if self.port + self.routers > 65536:
            return f"--port {self.port} leaves no room for {self.routers} routers"
        return super().cross_check()   # EngineOptions'

    def validate(self) -> "Config":
        super().validate()
        if self.device == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise ConfigError("--device cuda, but torch sees no CUDA device here")
        return self


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """`pagedserve serve MODEL`: vLLM's spelling, the model as the first word."""
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="a local model folder, or 'tiny'")
    Config.add_arguments(p)


def config_from_args(args) -> Config:
    tag = getattr(args, "model_tag", None)
    if tag is not None and getattr(args, "model", tag) != tag:
        raise ConfigError(f"the model is given twice: {tag!r} and --model {args.model!r}")
    return Config.from_args({k: v for k, v in vars(args).items() if k != "model_tag"},
                            **({"model": tag} if tag is not None else {})).validate()


def process_commands(cfg: Config, model: str, run_dir: str) -> list[tuple[str, list[str]]]:
    """(name, argv) of every process, in start order: kvstore, workers, scheduler, routers."""
    from pagedserve.services.model_dir import context_length, read_model_dir, serving_dtype_name

    spec = read_model_dir(model)     # config.json alone: the launcher starts without loading torch
    context_length(cfg.max_model_len, spec)              # refused here, before anything starts
    dtype = serving_dtype_name(cfg.dtype, cfg.device, spec)   # resolved once: kvstore and workers agree
    block_bytes = spec.block_bytes(cfg.block_size, dtype, cfg.tensor_parallel)
    gib = 1 << 30
    if cfg.device == "cuda" and cfg.num_device_blocks is None:
        # Sized by the kvstore once the workers have loaded and profiled (services/kvstore/sizing.py).
        device_pool = ["--num-device-blocks", "0", "--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    else:
        device_blocks = cfg.num_device_blocks or cf.kv_pool_bytes(cfg) // block_bytes
        device_pool = ["--num-device-blocks", str(device_blocks)]
    host_blocks = int(cfg.swap_space_gib * gib) // block_bytes
    kv, sched, worker = (f"ipc://{run_dir}/{n}.sock" for n in ("kvstore", "scheduler", "worker"))
    worker_beat, sched_beat = heartbeat_endpoints(run_dir)
    hang = ["--hang-timeout", str(cfg.hang_timeout_s)]
    py = [sys.executable, "-m"]
    procs = [("kvstore", py + ["pagedserve.services.kvstore.service", "--endpoint", kv, *device_pool,
                               "--num-host-blocks", str(host_blocks), "--block-size", str(cfg.block_size),
                               "--host-cache-blocks",
                               str(cf.host_cache_blocks(cfg, host_blocks, block_bytes, cfg.tensor_parallel)),
                               "--block-bytes", str(block_bytes), "--tp-size", str(cfg.tensor_parallel),
                               "--device", cfg.device, "--allocation", cfg.allocation,
                               "--max-model-len", str(spec.max_model_len)]
                              + ([] if cfg.enable_prefix_caching else ["--no-prefix-caching"]))]
    dist = f"tcp://127.0.0.1:{_free_port()}"
    threads = worker_threads(cfg, model)
    for rank in range(cfg.tensor_parallel):
        procs.append((f"worker{rank}", py + ["pagedserve.services.worker.service", "--model", model, "--rank", str(rank),
                                             "--tp-size", str(cfg.tensor_parallel), "--dist-init", dist,
                                             "--endpoint", worker, "--kvstore-endpoint", kv,
                                             "--device", cfg.device, "--block-size", str(cfg.block_size),
                                             "--dtype", dtype,
                                             "--profile-tokens", str(cfg.max_num_batched_tokens),
                                             "--profile-seqs", str(cfg.max_num_seqs),
                                             "--torch-threads", str(threads),
                                             *cf.grammar_argv(cfg)]
                      + (["--enforce-eager"] if cfg.enforce_eager else [])
                      + (["--heartbeat-endpoint", worker_beat] + hang if rank == 0 else [])))
    procs.append(("scheduler", py + ["pagedserve.services.scheduler.service", "--model", model, "--endpoint", sched,
                                     "--kvstore-endpoint", kv, "--worker-endpoint", worker,
                                     "--max-num-seqs", str(cfg.max_num_seqs),
                                     "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
                                     "--preemption-mode", cfg.preemption_mode, "--batching", cfg.batching,
                                     "--log-level", cfg.log_level,
                                     "--replica-id", replica_id(cfg),
                                     "--heartbeat-endpoint", sched_beat, "--worker-heartbeat-endpoint", worker_beat,
                                     "--shutdown-timeout", str(cfg.shutdown_timeout_s), *hang]
                  + (["--redis-url", cfg.redis_url] if cfg.redis_url else [])
                  + ([] if cfg.async_scheduling else ["--no-async-scheduling"])
                  + (["--step-log", os.path.abspath(cfg.step_log)] if cfg.step_log else [])))
    context = ["--max-model-len", str(cfg.max_model_len)] if cfg.max_model_len else []
    procs[-1][1].extend(context)
    router_flags, _ = passed_down(cfg)
    for i in range(cfg.routers):
        procs.append((f"router{i}", py + ["pagedserve.services.router.service", "--model", model, "--host", cfg.host,
                                          "--port", str(cfg.port + i), "--scheduler-endpoint", sched,
                                          "--router-id", f"router-{i}", "--log-level", cfg.log_level]
                      + (["--redis-url", cfg.redis_url] if cfg.redis_url else []) + context + router_flags))
    return procs


def replica_id(cfg: Config) -> str:
    if cfg.replica_id:
        return cfg.replica_id
    return f"{socket.gethostname()}:{cfg.port}" if cfg.redis_url else "local"


def heartbeat_endpoints(run_dir: str) -> tuple[str, str]:
    """(worker rank 0's, the scheduler's) heartbeat endpoints."""
    return f"ipc://{run_dir}/worker-beat.sock", f"ipc://{run_dir}/scheduler-beat.sock"


def cpu_sets(cfg: Config, threads: int, available: list[int]) -> dict[str, frozenset[int]]:
    """{process name: the cores it is bound to} (empty: no binding). On CPU with --cpu-binding auto,
    when the workers' threads leave cores of `available` over, worker rank r takes its own
    `threads` of the last cores and every other process the cores before them: a worker that shares
    its core with the router, scheduler and kvstore waits for it mid-step.

    Measured on 2 cores (tiny Llama, one worker thread, ShareGPT-like at 15 req/s, 150 requests,
    2026-12-07, alternating, two rounds each): unbound TPOT 2.17 / 2.38 ms, TTFT 12.8 / 13.2 ms;
    bound 1.63 / 1.70 ms, 9.6 / 9.9 ms; the worker's own compute of a decode step of 8-16 rows 1.91 /
    1.98 ms unbound, 1.66 / 1.62 bound. At 45 req/s: TPOT 3.60 / 3.23 against 2.70 / 2.65 ms,
    6,709 / 7,037 against 7,396 / 7,480 output tok/s. 64 requests at once: within the noise."""
    if cfg.device != "cpu" or cfg.cpu_binding == "off":
        return {}
    need = threads * cfg.tensor_parallel
    if need >= len(available):
        return {}
    others, workers = available[:len(available) - need], available[len(available) - need:]
    sets = {f"worker{r}": frozenset(workers[r * threads:(r + 1) * threads]) for r in range(cfg.tensor_parallel)}
    sets.update({name: frozenset(others) for name in ("kvstore", "scheduler", *(f"router{i}" for i in range(cfg.routers)))})
    return sets


def supervised(cfg: Config, name: str, argv: list[str], run_dir: str, threads: int,
               cpus: frozenset[int] | None = None) -> Child:
    """A process of the stack with the probe the supervisor watches it by."""
    worker_beat, sched_beat = heartbeat_endpoints(run_dir)
    probe = {"kvstore": {"heartbeat": f"ipc://{run_dir}/kvstore.sock"},   # answers Ping in its loop
             "worker0": {"heartbeat": worker_beat}, "scheduler": {"heartbeat": sched_beat}}.get(name, {})
    if name.startswith("router"):
        probe = {"health_url": f"http://{cfg.host}:{cfg.port + int(name[6:])}/health"}
    return Child(name, argv, threads if name.startswith("worker") else 1, cpus=cpus, **probe)


# Weights (bytes on disk) from which a CPU worker takes every core: its step's matrix products then
# outweigh what the router and the client do per token. Between the two models measured below.
ALL_CORES_WEIGHT_BYTES = 64 << 20


def worker_threads(cfg: Config, model: str) -> int:
    """--worker-threads, or when 0 what worker_threads_auto picks for this model's weights."""
    if cfg.worker_threads:
        return cfg.worker_threads
    weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    return worker_threads_auto(cfg.device, cfg.tensor_parallel, weights)


def worker_threads_auto(device: str, tp: int, weight_bytes: int) -> int:
    """CPU threads per worker, split between the ranks (at least one each). A small model's workers
    get every core but one: the router and the client of a saturated server compute while the
    worker does (SSE events, the detokenizer), and OpenMP threads that find their core taken wait
    for it. From ALL_CORES_WEIGHT_BYTES of weights on, the workers get every core: the matrix
    products are the step, and the router has few tokens a second to send.

    Measured on 2 cores with vLLM's own client at saturation (bench_peer, 2026-12-07, AVX2):
    the reference model (9 MB of weights, 64 x 128 -> 128): 1 thread 2,895 / 3,964 out tok/s,
    2 threads 2,400 / 2,156; the 94M Llama (378 MB, 32 x 128 -> 128): 1 thread 145 / 141,
    2 threads 163."""
    if device != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    spare = 0 if weight_bytes >= ALL_CORES_WEIGHT_BYTES else 1
    return max(1, (cores - spare) // tp)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _port_taken(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on, or None (checked before anything starts: the router
    would only find out after its model loaded)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            return str(e)
    return None


def run(cfg: Config) -> int:
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s launcher %(levelname)s %(message)s")
    for port in range(cfg.port, cfg.port + cfg.routers):
        why = _port_taken(cfg.host, port)
        if why:
            print(f"pagedserve up: cannot listen on {cfg.host}:{port}: {why}", file=sys.stderr)
            return 1
    model = resolve_model(cfg.model)
    os.environ.update(passed_down(cfg)[1])   # the API keys: children inherit them, `ps` does not show them
    run_dir = tempfile.mkdtemp(prefix="pagedserve-")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    sup = Supervisor(cfg.hang_timeout_s, cfg.ready_timeout_s)
    try:
        threads = worker_threads(cfg, model)
        commands = process_commands(cfg, model, run_dir)   # refuses a bad setting before anything starts
        cpus = cpu_sets(cfg, threads, sorted(os.sched_getaffinity(0)))
        if cpus:
            log.info("cores: workers %s, the other processes %s",
                     ", ".join(f"{n} {sorted(c)}" for n, c in cpus.items() if n.startswith("worker")), sorted(cpus["kvstore"]))
        for name, argv in commands:
            sup.add(supervised(cfg, name, argv, run_dir, threads, cpus.get(name)))
        urls = [f"http://{cfg.host}:{cfg.port + i}" for i in range(cfg.routers)]
        deadline = time.monotonic() + cfg.ready_timeout_s
        while not all(_ready(u + "/ready") for u in urls):
            failed = sup.failed()   # at start-up a failure is a setting or a model: restarting won't help
            if failed:
                print(f"pagedserve up: the {failed[0]} process exited with code {failed[1]}; stopping the others",
                      file=sys.stderr)
                return 1
            if stopping:
                return 0
            if time.monotonic() > deadline:
                print(f"pagedserve up: not ready after {cfg.ready_timeout_s:.0f} s; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(f"pagedserve is ready: {', '.join(urls)}  (model {model})", flush=True)
        print(f"try:\n  curl {urls[0]}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{cfg.served_model_name or model}\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32}}'", flush=True)
        while not stopping:
            gave_up = sup.check()
            if gave_up:
                print(f"pagedserve up: {gave_up}; stopping the others", file=sys.stderr)
                return 1
            time.sleep(0.25)
        print("pagedserve up: stopping (draining for up to "
              f"{cfg.shutdown_timeout_s:g} s)", file=sys.stderr, flush=True)
        return 0
    finally:
        sup.stop(cfg.shutdown_timeout_s)
        shutil.rmtree(run_dir, ignore_errors=True)
