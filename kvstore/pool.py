"""Physical KV block pools: one byte buffer of num_blocks rows, and the copies between rows.

A BlockPool owns one buffer. On CPU it is NAMED POSIX shared memory, so an unrelated process (a
worker) can map the same bytes by name; on CUDA it is a plain device tensor that workers map through
CUDA IPC handles (services/kvstore/service.py). A CPU pool that swaps with a CUDA one is pinned (pin()). The pool knows nothing about models: `blocks` is torch.uint8 [num_blocks, block_bytes]
and workers reinterpret it (docs/INTERFACES.md, "Tensor layout of the KV pools").

Lifetime rules on CPU (see ../shared/ENVIRONMENT.md):
- the creator is the only process that unlinks the name; an attacher only closes its mapping;
- Python < 3.13 registers an attached segment with the attacher's resource tracker, which unlinks it
  when the attacher exits, so attach() unregisters it right away;
- touching a tensor view after its segment is closed segfaults, so close() drops the views first.
"""

from __future__ import annotations

import os
import sys
import uuid
from multiprocessing import resource_tracker, shared_memory

import torch

from pagedserve.kernels.ops import copy_blocks
from pagedserve.kernels.device import on_device


# Names this process (or a parent it was forked from, which shares its resource tracker) created.
# Attaching to one of them must not unregister it: that registration is the creator's, and the
# tracker keeps one entry per name, so unregistering would drop it and break the creator's unlink.
_created_here: set[str] = set()


def unique_pool_name(role: str) -> str:
    """A shared-memory name no other process on this host uses: /dev/shm is shared by everyone."""
    return f"pagedserve-{os.getpid()}-{uuid.uuid4().hex[:8]}-{role}"


class BlockPool:
    """One pool of fixed-size blocks; build it with create() or attach(), not the constructor."""

    def __init__(self, name: str, num_blocks: int, block_bytes: int, blocks: torch.Tensor,
                 shm: shared_memory.SharedMemory | None, owner: bool):
        self.name = name
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.blocks: torch.Tensor | None = blocks  # uint8 [num_blocks, block_bytes]
        self._shm = shm
        self._owner = owner
        self._pinned = False

    @property
    def device(self) -> torch.device:
        return self._live_blocks().device

    @classmethod
    def create(cls, name: str, num_blocks: int, block_bytes: int, device: str = "cpu") -> "BlockPool":
        """Allocate a new pool. CPU: a new shared-memory segment called `name` (FileExistsError if
        the name is taken). CUDA: torch.empty on that device; the name is only a label."""
        _check_shape(num_blocks, block_bytes)
        if torch.device(device).type != "cpu":
            blocks = torch.empty((num_blocks, block_bytes), dtype=torch.uint8, device=device)
            return cls(name, num_blocks, block_bytes, blocks, shm=None, owner=True)
        # A zero-byte segment is not allowed; one spare byte keeps empty pools (no swap space) legal.
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, num_blocks * block_bytes))
        _created_here.add(name)
        return cls(name, num_blocks, block_bytes, _view(shm, num_blocks, block_bytes), shm, owner=True)

    @classmethod
    def attach(cls, name: str, num_blocks: int, block_bytes: int) -> "BlockPool":
        """Map an existing CPU pool created by another process (or this one) by its name."""
        _check_shape(num_blocks, block_bytes)
        shm = _attach_untracked(name)
        if shm.size < num_blocks * block_bytes:
            shm.close()
            raise ValueError(f"segment {name} has {shm.size} bytes, fewer than "
                             f"{num_blocks} x {block_bytes}")
        return cls(name, num_blocks, block_bytes, _view(shm, num_blocks, block_bytes), shm, owner=False)

    def pin(self) -> None:
        """Page-lock this CPU pool's shared memory for CUDA (cudaHostRegister, portable to every
        device), so that copies to and from a GPU are asynchronous DMA instead of staged, host-
        synchronous memcpys. Only the kvstore pins (it does the swap copies); close() unpins."""
        blocks = self._live_blocks()
        if blocks.is_cuda or self._pinned or blocks.numel() == 0:
            return
        cudart = torch.cuda.cudart()
        # flags 1 = cudaHostRegisterPortable: pinned for every device's context, not just the current one.
        err = int(cudart.cudaHostRegister(blocks.data_ptr(), blocks.numel(), 1))
        if err != 0:
            raise RuntimeError(f"cannot pin host pool {self.name} ({blocks.numel()} bytes): cudaError {err}")
        self._pinned = True

    def close(self) -> None:
        """Drop this process's mapping; the bytes live on until the name is unlinked.

        Callers must not keep their own views of `blocks` past this point (they would segfault)."""
        if self._pinned:
            # Every copy that reads or writes this memory, on any device, must be over first.
            for device in range(torch.cuda.device_count()):
                torch.cuda.synchronize(device)
            torch.cuda.cudart().cudaHostUnregister(self.blocks.data_ptr())
            self._pinned = False
        self.blocks = None
        if self._shm is not None:
            self._shm.close()

    def unlink(self) -> None:
        """Remove the name (creator only); mappings that are still open stay valid until closed."""
        if self._shm is None:
            return
        if not self._owner:
            raise ValueError(f"pool {self.name} was attached, not created, here: its creator unlinks it")
        self._shm.unlink()
        _created_here.discard(self.name)

    def copy_within(self, pairs: list[tuple[int, int]]) -> None:
        """copy_within(self, pairs): the block store calls the pools it was given, and so never
        imports this module (the scheduler's pool-less mirror runs without torch)."""
        copy_within(self, pairs)

    def copy_to(self, dst_pool: "BlockPool", pairs: list[tuple[int, int]]) -> None:
        """copy_between(self, dst_pool, pairs), for the block store as copy_within."""
        copy_between(self, dst_pool, pairs)

    def _live_blocks(self) -> torch.Tensor:
        if self.blocks is None:
            raise ValueError(f"pool {self.name} is closed")
        return self.blocks


def _check_shape(num_blocks: int, block_bytes: int) -> None:
    if num_blocks < 0 or block_bytes <= 0:
        raise ValueError(f"bad pool shape: {num_blocks} blocks of {block_bytes} bytes")


def _view(shm: shared_memory.SharedMemory, num_blocks: int, block_bytes: int) -> torch.Tensor:
    if num_blocks == 0:
        return torch.empty((0, block_bytes), dtype=torch.uint8)
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=num_blocks * block_bytes)
    return flat.view(num_blocks, block_bytes)


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    shm = shared_memory.SharedMemory(name=name)
    if name in _created_here:
        return shm
    # Undo the attach-time registration, else this process's tracker unlinks the segment when this
    # process exits and the creator (and every other worker) loses it.
    resource_tracker.unregister(shm._name, "shared_memory")  # _name carries the leading "/"
    return shm


def copy_within(pool: BlockPool, pairs: list[tuple[int, int]]) -> None:
    """pool.blocks[dst] = pool.blocks[src] for every (src, dst): the copy-on-write copy, on the
    kernels package's copy_blocks (Triton on CUDA, indexing on CPU), on the pool's device's current
    stream (the kvstore's copy stream: kvstore/cuda_sync.py)."""
    if pairs:
        _copy_rows(pool._live_blocks(), pairs)


def _copy_rows(blocks: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    with on_device(blocks):
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=blocks.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=blocks.device)
        copy_blocks(blocks, src, dst)


def warm_up(pool: BlockPool) -> None:
    """Compile the copy-on-write kernel for this pool's rows now, before the kvstore answers anyone:
    a first Triton compile takes seconds (it builds its launcher with gcc), over the scheduler's 5 s
    peer timeout had it happened inside the loop. It runs on two scratch rows of the same size and
    device, which specialize the kernel exactly as the pool does, so the pool's bytes stay as they are.
    On CPU it runs the reference copy, which has nothing to compile."""
    blocks = pool._live_blocks()
    with on_device(blocks):
        scratch = torch.zeros((2, pool.block_bytes), dtype=torch.uint8, device=blocks.device)
        _copy_rows(scratch, [(0, 1)])
        if blocks.is_cuda:
            torch.cuda.synchronize(blocks.device)


def copy_between(src_pool: BlockPool, dst_pool: BlockPool, pairs: list[tuple[int, int]]) -> None:
    """dst_pool.blocks[dst] = src_pool.blocks[src] for every (src, dst): the swap copy.

    Between a CUDA pool and a pinned host pool each block row is one asynchronous copy on the CUDA
    device's current stream (the kvstore's copy stream), so swaps overlap the workers' compute;
    runs of consecutive blocks on both sides go as one copy. CPU to CPU it is one indexed copy."""
    if not pairs:
        return
    src_blocks, dst_blocks = src_pool._live_blocks(), dst_pool._live_blocks()
    if not (src_blocks.is_cuda or dst_blocks.is_cuda):
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64)
        dst_blocks[dst] = src_blocks[src]
        return
    with on_device(src_blocks if src_blocks.is_cuda else dst_blocks):
        for s, d, n in _runs(pairs):
            dst_blocks[d:d + n].copy_(src_blocks[s:s + n], non_blocking=True)


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) pairs -> (src, dst, count) runs where both sides are consecutive."""
    runs: list[list[int]] = []
    for s, d in pairs:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]
