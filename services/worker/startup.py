"""The worker's start-up: PoolInfo from the kvstore, the tensor-parallel group, this rank's shard
and its profile, its pool mapped -> a ready WorkerService (the order is service.py's docstring's)."""
from __future__ import annotations

import functools
import logging
import time

import torch
import torch.distributed as dist

from pagedserve.services.kvstore.attach import attach_pools
from pagedserve.services.kvstore.client import KVStoreClient, KVStoreError, PeerTimeout
from pagedserve.kvstore.cuda_sync import NoSync, StepSync
from pagedserve.services.kvstore.sizing import WAITING
from pagedserve.kvstore.pool import BlockPool
from pagedserve.services import protocol
from pagedserve.services.curve import SocketGuard
from pagedserve.services.guided.cache import CompileCache
from pagedserve.services.worker.config import Config
from pagedserve.services.worker.cuda_graphs import capture_decode_graphs
from pagedserve.services.worker.guides import Guides
from pagedserve.services.worker.model_loader import (ModelLoadError, inspect_model_dir, load_model, load_tokenizer,
                                                     serving_dtype)
from pagedserve.services.worker.model_runner import ModelRunner
from pagedserve.services.worker.profile import warm_up_and_profile
from pagedserve.services.worker.service_core import WorkerService, first_line
from pagedserve.services.worker.tp import TensorParallel, TPConfigError, close_tensor_parallel, init_tensor_parallel
from pagedserve.services.worker.worker_core import WorkerCore

log = logging.getLogger("pagedserve.worker")


class StartupError(RuntimeError):
    """The worker cannot start; the message is the one line the operator reads."""


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
                           f"{first_line(e)}") from None
    try:
        return build_service(config, info, tp)
    except BaseException:
        close_tensor_parallel(tp)
        raise


def build_service(config: Config, info: protocol.PoolInfo | None, tp: TensorParallel) -> WorkerService:
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
