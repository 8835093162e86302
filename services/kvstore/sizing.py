"""Sizing the device pools from free GPU memory (`--gpu-memory-utilization`, vLLM's meaning: this
replica may use that fraction of each GPU's total memory, weights and activations included).

Owns the hand-over at start-up: the kvstore binds and waits; every worker rank loads its weights,
runs a profiling forward pass at the scheduler's largest step (services/worker/profile.py) and
reports the activation memory that step needed on top of what stays allocated (ReportMemory).
Once every rank has reported, the kvstore reads each device's free memory itself (so its own CUDA
context, the workers' weights and contexts, and anything else on the GPU are counted) and makes
the pools:

    blocks = (free - reserve - (1 - utilization) * total) // block_bytes, the least over the ranks

Until then it answers GetPoolInfo with a 503 that names the missing ranks, and Ping with
ready=False. No I/O here: services/kvstore/service.py feeds this core from its socket.
"""
from __future__ import annotations

from typing import Callable

from pagedserve.services import protocol

WAITING = "memory_report"   # Error.param of the 503 a worker reads as "profile, then report"


def device_blocks_for(total_bytes: int, free_bytes: int, reserve_bytes: int, utilization: float,
                      block_bytes: int) -> int:
    """KV blocks one device can hold: what is free, less the workers' activation reserve, less the
    share of the device this replica must leave to others."""
    budget = free_bytes - reserve_bytes - int((1.0 - utilization) * total_bytes)
    return max(0, budget // block_bytes)


def read_device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of one CUDA device, as the driver sees it (every process's use counted)."""
    import torch
    from pagedserve.kernels.device import on_device
    with on_device(device):
        return torch.cuda.mem_get_info(torch.device(device))


class PoolSizing:
    """Collects the ranks' reports; answers the messages that may come before the pools exist."""

    def __init__(self, tp_size: int, utilization: float, block_bytes: int, devices: list[str],
                 read_memory: Callable[[str], tuple[int, int]] | None = None):
        self.tp_size, self.utilization, self.block_bytes = tp_size, utilization, block_bytes
        self.devices, self.read_memory = devices, read_memory   # None: read_device_memory
        self.reserve: dict[int, int] = {}

    @property
    def done(self) -> bool:
        return len(self.reserve) == self.tp_size

    def handle(self, msg):
        if isinstance(msg, protocol.ReportMemory):
            if not 0 <= msg.rank < self.tp_size or msg.reserve_bytes < 0:
                return protocol.Error(f"bad memory report: rank {msg.rank} of {self.tp_size}, "
                                      f"reserve {msg.reserve_bytes}", code=400, param="rank")
            self.reserve[msg.rank] = msg.reserve_bytes
            return protocol.Pong(sender="kvstore", role="kvstore", ready=False)
        if isinstance(msg, protocol.Ping):
            return protocol.Pong(sender="kvstore", role="kvstore", ready=False)
        missing = sorted(set(range(self.tp_size)) - set(self.reserve))
        return protocol.Error(f"the kvstore sizes its pools from free GPU memory once every worker rank "
                              f"has reported its profile; waiting for rank(s) {missing}",
                              code=503, type="server_error", param=WAITING)

    def num_device_blocks(self) -> int:
        """After done: the blocks every rank's device can hold; ValueError when that is none."""
        per_rank = []
        for rank, device in enumerate(self.devices):
            free, total = (self.read_memory or read_device_memory)(device)
            per_rank.append(device_blocks_for(total, free, self.reserve[rank], self.utilization,
                                              self.block_bytes))
        blocks = min(per_rank)
        if blocks < 1:
            raise ValueError(f"no GPU memory left for the KV cache at --gpu-memory-utilization "
                             f"{self.utilization} (blocks per rank: {per_rank}): raise it, or free the GPU")
        return blocks
