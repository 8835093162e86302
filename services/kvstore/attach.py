"""A worker's mapping of the kvstore's pools: by name (CPU shared memory) or by CUDA IPC handle.

The kvstore created the pools and stays their owner (it unlinks them); a worker maps its rank's
and closes its mapping. Needs torch (the pools are tensors), unlike services.kvstore.client.
"""
from __future__ import annotations

import base64
import pickle

from pagedserve.kernels.device import on_device
from pagedserve.kvstore.pool import BlockPool
from pagedserve.services import protocol

# Where torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments name the storage's device.
_STORAGE_DEVICE = 6


def attach_pools(info: protocol.PoolInfo, kind: str = "device", ranks: list[int] | None = None) -> list[BlockPool]:
    """Map the kvstore's pools of one kind ("device" or "host"), one per tensor-parallel rank (or
    only those of `ranks`: a worker maps its own).

    The caller closes them (never unlinks: the kvstore does) and must drop its own views first."""
    if kind == "device":
        names, num_blocks = info.device_pool_names, info.num_device_blocks
        if info.device != "cpu":
            return _attach_cuda(info, ranks)
    elif kind == "host":
        names, num_blocks = info.host_pool_names, info.num_host_blocks
    else:
        raise ValueError(f"kind must be 'device' or 'host', not {kind!r}")
    pools: list[BlockPool] = []
    if ranks is not None:
        names = [names[r] for r in ranks]
    try:
        for name in names:
            pools.append(BlockPool.attach(name, num_blocks, info.block_bytes))
    except BaseException:
        for p in pools:
            p.close()
        raise
    return pools


def _attach_cuda(info: protocol.PoolInfo, ranks: list[int] | None) -> list[BlockPool]:
    # Run by `make gpu-check`, not by CI. The handles come from services.kvstore.service._cuda_ipc_handles;
    # pickle is acceptable only because the peer is our own kvstore on this host (loopback/ipc).
    import torch
    pools = []
    for rank in ranks if ranks is not None else range(len(info.device_pool_names)):
        name, handle = info.device_pool_names[rank], info.ipc_handles[rank]
        rebuild, args = pickle.loads(base64.b64decode(handle))
        with on_device(torch.device("cuda", args[_STORAGE_DEVICE])):
            blocks = rebuild(*args)   # uint8 [num_device_blocks, block_bytes] on the kvstore's GPU
        pools.append(BlockPool(name, info.num_device_blocks, info.block_bytes, blocks, shm=None, owner=False))
    return pools
