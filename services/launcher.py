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
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from services.flags import opt
from services.router.service import add_cors_arguments, cors_argv
from services.supervisor import Child, Supervisor

TINY_DIR = Path(".cache/tiny-llama")


@dataclass
class Config:
    model: str = "tiny"
    device: str = "cpu"
    dtype: str = "auto"                    # auto: float32 on CPU, the checkpoint's on CUDA
    host: str = "127.0.0.1"
    port: int = 8000
    routers: int = 1
    redis_url: str | None = None
    num_device_blocks: int | None = None   # None: CUDA sizes by gpu_memory_utilization, CPU by kv_cache_memory_gib
    kv_cache_memory_gib: float = 0.25
    gpu_memory_utilization: float = 0.9    # CUDA: this replica's share of each GPU (vLLM's meaning)
    block_size: int = 16
    swap_space_gib: float = 0.25
    preemption_mode: str = "recompute"
    tensor_parallel: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    worker_threads: int = 0                # 0: auto (CPU: every core, split between the TP ranks)
    enable_prefix_caching: bool = True
    allocation: str = "paged"              # the kvstore's policy: paged, or an Orca baseline
    batching: str = "iteration"            # the scheduler's: iteration, or request (FasterTransformer)
    ready_timeout_s: float = 300.0
    log_level: str = "INFO"
    extra_router_args: list[str] = field(default_factory=list)
    # Supervision and shutdown (services/supervisor.py).
    shutdown_timeout_s: float = opt(10.0, "on SIGTERM, seconds running requests may take to finish (new ones "
                                    "get 503); 0: fail them now", check=lambda v: v >= 0 or "must be 0 or more",
                                    flag="--shutdown-timeout")
    hang_timeout_s: float = opt(4.0, "seconds of heartbeat silence after which a process counts as stuck "
                                "and is restarted", check=lambda v: v > 0 or "must be positive", flag="--hang-timeout")

    def validate(self) -> "Config":
        from services.engine_config import EngineConfig
        EngineConfig(model=self.model, device=self.device, dtype=self.dtype, block_size=self.block_size,
                     num_device_blocks=self.num_device_blocks, swap_space_gib=self.swap_space_gib,
                     gpu_memory_utilization=self.gpu_memory_utilization,
                     preemption_mode=self.preemption_mode, max_num_seqs=self.max_num_seqs,
                     max_num_batched_tokens=self.max_num_batched_tokens, allocation=self.allocation,
                     batching=self.batching).validate()
        if self.routers < 1:
            raise ValueError("--routers must be at least 1")
        if self.routers > 1 and not self.redis_url:
            raise ValueError("--routers > 1 needs --redis-url: routers share request state through Redis")
        if self.tensor_parallel < 1:
            raise ValueError("--tensor-parallel must be at least 1")
        if not 0 < self.port < 65536 - self.routers:
            raise ValueError(f"--port {self.port} is out of range")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"--log-level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, not {self.log_level!r}")
        if self.worker_threads < 0:
            raise ValueError(f"--worker-threads must be 0 (auto) or more, not {self.worker_threads}")
        if self.num_device_blocks is None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, not {self.kv_cache_memory_gib}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be 0 or more, not {self.shutdown_timeout_s}")
        if self.hang_timeout_s <= 0:
            raise ValueError(f"--hang-timeout must be positive, not {self.hang_timeout_s}")
        if self.device == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise ValueError("--device cuda, but torch sees no CUDA device here")
        return self


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="a local model folder, or 'tiny' (built on first use)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=Config.dtype,
                   help="auto (float32 on CPU, the checkpoint's dtype on CUDA), float32, float16 or bfloat16")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--routers", type=int, default=1)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--num-device-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=float, default=0.25, help="CPU: GiB for the device KV pool")
    p.add_argument("--gpu-memory-utilization", type=float, default=Config.gpu_memory_utilization,
                   help="CUDA: the fraction of each GPU the replica may use; the KV pool gets what the "
                        "weights and a profiled largest step leave (unless --num-device-blocks)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--swap-space", type=float, default=0.25, help="GiB of host memory for swapped blocks")
    p.add_argument("--preemption-mode", default="recompute")
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--worker-threads", type=int, default=0,
                   help="torch threads per worker; 0 = auto (on CPU every core, split between the ranks)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--allocation", default="paged",
                   help="paged | orca-max | orca-pow2 | orca-oracle (the paper's contiguous baselines)")
    p.add_argument("--batching", default="iteration", help="iteration | request (FasterTransformer-style)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--shutdown-timeout", type=float, default=Config.shutdown_timeout_s,
                   help="on SIGTERM, seconds running requests may take to finish (new ones get 503); 0: fail them now")
    p.add_argument("--hang-timeout", type=float, default=Config.hang_timeout_s,
                   help="seconds of heartbeat silence after which a process counts as stuck and is restarted")
    add_cors_arguments(p)     # the routers' own flags, passed through


def config_from_args(args) -> Config:
    return Config(model=args.model, device=args.device, dtype=args.dtype, host=args.host, port=args.port, routers=args.routers,
                  redis_url=args.redis_url, num_device_blocks=args.num_device_blocks,
                  kv_cache_memory_gib=args.kv_cache_memory, block_size=args.block_size,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  swap_space_gib=args.swap_space, preemption_mode=args.preemption_mode,
                  tensor_parallel=args.tensor_parallel, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, worker_threads=args.worker_threads,
                  enable_prefix_caching=not args.no_prefix_caching, allocation=args.allocation,
                  batching=args.batching, log_level=args.log_level.upper(),
                  extra_router_args=cors_argv(args), shutdown_timeout_s=args.shutdown_timeout,
                  hang_timeout_s=args.hang_timeout).validate()


def resolve_model(model: str) -> str:
    if model != "tiny":
        return model
    if not (TINY_DIR / "config.json").exists():
        from services.tiny_model import build_tiny_model
        print(f"building the tiny model in {TINY_DIR} (first use only) ...", file=sys.stderr, flush=True)
        build_tiny_model(TINY_DIR, arch="llama")
    return str(TINY_DIR)


def process_commands(cfg: Config, model: str, run_dir: str) -> list[tuple[str, list[str]]]:
    """(name, argv) of every process, in start order: kvstore, workers, scheduler, routers."""
    from services.worker.model_loader import inspect_model_dir, serving_dtype

    _, spec = inspect_model_dir(model)
    dtype = serving_dtype(cfg.dtype, cfg.device, spec)   # resolved once: kvstore and workers agree
    block_bytes = spec.block_bytes(cfg.block_size, dtype, cfg.tensor_parallel)
    gib = 1 << 30
    if cfg.device == "cuda" and cfg.num_device_blocks is None:
        # Sized by the kvstore once the workers have loaded and profiled (kvstore/sizing.py).
        device_pool = ["--num-device-blocks", "0", "--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    else:
        device_blocks = cfg.num_device_blocks or int(cfg.kv_cache_memory_gib * gib) // block_bytes
        device_pool = ["--num-device-blocks", str(device_blocks)]
    host_blocks = int(cfg.swap_space_gib * gib) // block_bytes
    kv, sched, worker = (f"ipc://{run_dir}/{n}.sock" for n in ("kvstore", "scheduler", "worker"))
    worker_beat, sched_beat = heartbeat_endpoints(run_dir)
    hang = ["--hang-timeout", str(cfg.hang_timeout_s)]
    py = [sys.executable, "-m"]
    procs = [("kvstore", py + ["kvstore.service", "--endpoint", kv, *device_pool,
                               "--num-host-blocks", str(host_blocks), "--block-size", str(cfg.block_size),
                               "--block-bytes", str(block_bytes), "--tp-size", str(cfg.tensor_parallel),
                               "--device", cfg.device, "--allocation", cfg.allocation,
                               "--max-model-len", str(spec.max_model_len)]
                              + ([] if cfg.enable_prefix_caching else ["--no-prefix-caching"]))]
    dist = f"tcp://127.0.0.1:{_free_port()}"
    threads = cfg.worker_threads or worker_threads_auto(cfg.device, cfg.tensor_parallel)
    for rank in range(cfg.tensor_parallel):
        procs.append((f"worker{rank}", py + ["services.worker.service", "--model", model, "--rank", str(rank),
                                             "--tp-size", str(cfg.tensor_parallel), "--dist-init", dist,
                                             "--endpoint", worker, "--kvstore-endpoint", kv,
                                             "--device", cfg.device, "--block-size", str(cfg.block_size),
                                             "--dtype", str(dtype).removeprefix("torch."),
                                             "--profile-tokens", str(cfg.max_num_batched_tokens),
                                             "--profile-seqs", str(cfg.max_num_seqs),
                                             "--torch-threads", str(threads)]
                      + (["--heartbeat-endpoint", worker_beat] + hang if rank == 0 else [])))
    procs.append(("scheduler", py + ["services.scheduler.service", "--model", model, "--endpoint", sched,
                                     "--kvstore-endpoint", kv, "--worker-endpoint", worker,
                                     "--max-num-seqs", str(cfg.max_num_seqs),
                                     "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
                                     "--preemption-mode", cfg.preemption_mode, "--batching", cfg.batching,
                                     "--log-level", cfg.log_level,
                                     "--replica-id", f"replica-{os.getpid()}-{Path(run_dir).name}",
                                     "--heartbeat-endpoint", sched_beat, "--worker-heartbeat-endpoint", worker_beat,
                                     "--shutdown-timeout", str(cfg.shutdown_timeout_s), *hang]
                  + (["--redis-url", cfg.redis_url] if cfg.redis_url else [])))
    for i in range(cfg.routers):
        procs.append((f"router{i}", py + ["services.router.service", "--model", model, "--host", cfg.host,
                                          "--port", str(cfg.port + i), "--scheduler-endpoint", sched,
                                          "--router-id", f"router-{i}"]
                      + (["--redis-url", cfg.redis_url] if cfg.redis_url else []) + cfg.extra_router_args))
    return procs


def heartbeat_endpoints(run_dir: str) -> tuple[str, str]:
    """(worker rank 0's, the scheduler's) heartbeat endpoints."""
    return f"ipc://{run_dir}/worker-beat.sock", f"ipc://{run_dir}/scheduler-beat.sock"


def supervised(cfg: Config, name: str, argv: list[str], run_dir: str, threads: int) -> Child:
    """A process of the stack with the probe the supervisor watches it by."""
    worker_beat, sched_beat = heartbeat_endpoints(run_dir)
    probe = {"kvstore": {"heartbeat": f"ipc://{run_dir}/kvstore.sock"},   # answers Ping in its loop
             "worker0": {"heartbeat": worker_beat}, "scheduler": {"heartbeat": sched_beat}}.get(name, {})
    if name.startswith("router"):
        probe = {"health_url": f"http://{cfg.host}:{cfg.port + int(name[6:])}/health"}
    return Child(name, argv, threads if name.startswith("worker") else 1, **probe)


def worker_threads_auto(device: str, tp: int) -> int:
    """On CPU the workers get every core. The router, scheduler and kvstore sleep on their sockets
    while a step computes, so leaving them a core idles it: on 2 cores one worker thread gave 0.48
    of the offline engine's tokens/s at saturation, two gave 0.78 (loadgen.bench_e2e, JSON)."""
    if device != "cpu":
        return 1
    return max(1, (os.cpu_count() or 2) // tp)


def _free_port() -> int:
    import socket
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
    import socket
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
    run_dir = tempfile.mkdtemp(prefix="pagedserve-")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    sup = Supervisor(cfg.hang_timeout_s, cfg.ready_timeout_s)
    try:
        threads = cfg.worker_threads or worker_threads_auto(cfg.device, cfg.tensor_parallel)
        for name, argv in process_commands(cfg, model, run_dir):
            sup.add(supervised(cfg, name, argv, run_dir, threads))
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
              f"-d '{{\"model\": \"{model}\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32}}'", flush=True)
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
