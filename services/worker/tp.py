"""Tensor parallelism (Megatron style) for the paged models: how a layer is split across ranks.

Owns the rank's view of the tensor-parallel group and the parallel linear layers:
- ColumnParallelLinear: this rank holds a slice of the OUTPUT features (q/k/v split by heads,
  gate/up/fc1 split by intermediate features); no communication, the output stays sharded.
- RowParallelLinear: this rank holds the matching slice of the INPUT features (o_proj, down_proj,
  out_proj, fc2); partial products are summed with one all_reduce and the bias is added once,
  after the reduce (adding it on every rank would count it tp_size times).
Embeddings and lm_head are replicated on every rank: simple, and at these sizes the vocabulary
matmul is small next to the layers; only rank 0 samples.

Each parameter carries `tp_slice = (dim, start, length)`: the loader reads just that slice of the
full checkpoint tensor (weights are sliced at load time, the checkpoint is never re-saved).

MergedColumnParallelLinear runs several column-parallel linears over one input as one matmul
(q/k/v, gate/up). Its parameters carry `packed_parts` instead: for each checkpoint tensor, where its
rows go in the merged parameter and which slice of it this rank reads. A rank's merged weight is
the concatenation of its q, k and v slices, not a slice of the concatenated weight.

KV heads: with num_kv_heads >= tp_size each rank holds num_kv_heads / tp_size of them; with fewer
KV heads than ranks each KV head is replicated on tp_size / num_kv_heads ranks (as vLLM does), so
every rank holds exactly one and its query heads all map onto it.

tp_size == 1 takes no distributed path at all: no process group, no collective, no slicing.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
from torch import nn
import torch.nn.functional as F

# The heads' arithmetic lives without torch: the launcher and the scheduler size pools with it.
from pagedserve.services.head_split import HeadShard, TPConfigError, head_shard, kv_heads_per_rank, split  # noqa: F401


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group; the groups are None when size == 1.

    `group` carries the model's all_reduce (gloo on CPU, nccl on CUDA); `control_group` (gloo,
    CPU objects) carries the step messages rank 0 forwards to the others."""
    rank: int = 0
    size: int = 1
    group: Any = None
    control_group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks in place (the identity on one rank)."""
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(x, group=self.group)
        return x


SINGLE = TensorParallel()


def init_tensor_parallel(rank: int, size: int, init_method: str, device: str = "cpu",
                         timeout_s: float = 60.0) -> TensorParallel:
    """Join the group (blocks until every rank has joined, or raises after timeout_s).

    gloo on CPU, nccl on CUDA. size == 1 returns SINGLE without touching torch.distributed."""
    if size == 1:
        return SINGLE
    import torch.distributed as dist
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    return TensorParallel(rank, size, dist.group.WORLD, control)


def close_tensor_parallel(tp: TensorParallel) -> None:
    if tp.size > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def broadcast_control(tp: TensorParallel, obj: Any = None) -> Any:
    """Rank 0 sends `obj` to every rank; ranks > 0 block here until it comes and get it back.

    Raises RuntimeError when a peer is gone (its connection closed) or after the group timeout."""
    import torch.distributed as dist
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=tp.control_group)
    return box[0]


def _mark(param: nn.Parameter | None, dim: int, start: int, length: int) -> None:
    if param is not None:
        param.tp_slice = (dim, start, length)


class ColumnParallelLinear(nn.Linear):
    """y[:, out_start:out_start+out_local] of a full Linear(in, out): rows of the weight (and bias)."""

    def __init__(self, in_features: int, out_local: int, out_start: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_local, bias=bias)
        if tp.size > 1:
            _mark(self.weight, 0, out_start, out_local)
            _mark(self.bias, 0, out_start, out_local)


@dataclass(frozen=True)
class PackedPart:
    """Checkpoint tensor `<module>.<name>.<weight|bias>` fills rows [offset, offset + length) of the
    merged parameter; tp_slice: the (dim, start, length) of it this rank reads (None: all of it)."""
    name: str
    offset: int
    length: int
    tp_slice: tuple[int, int, int] | None


class MergedColumnParallelLinear(nn.Linear):
    """Column-parallel linears over the same input in one matmul: y = [y_a | y_b | ...].

    parts: (checkpoint module name, out_local, out_start) each, e.g. ("q_proj", Hq*D, q_start*D);
    `sizes` are the out_local widths, to split the output with."""

    def __init__(self, in_features: int, parts: Sequence[tuple[str, int, int]], bias: bool, tp: TensorParallel):
        super().__init__(in_features, sum(n for _, n, _ in parts), bias=bias)
        self.sizes = [n for _, n, _ in parts]
        packed, offset = [], 0
        for name, n, start in parts:
            packed.append(PackedPart(name, offset, n, (0, start, n) if tp.size > 1 else None))
            offset += n
        self.weight.packed_parts = tuple(packed)
        if self.bias is not None:
            self.bias.packed_parts = tuple(packed)


class RowParallelLinear(nn.Linear):
    """A full Linear(in, out) from this rank's input slice: partial x @ W^T, all_reduce, then bias."""

    def __init__(self, in_local: int, in_start: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_local, out_features, bias=bias)
        self.tp = tp
        if tp.size > 1:
            _mark(self.weight, 1, in_start, in_local)   # the bias is not sliced: added once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))   # [T, out]: the sum of every rank's part
        return y if self.bias is None else y + self.bias


def read_shard(f, name: str, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` from an open safetensors file (reads the slice only)."""
    return read_slice(f, name, getattr(param, "tp_slice", None))


def read_slice(f, name: str, spec: tuple[int, int, int] | None) -> torch.Tensor:
    """Checkpoint tensor `name`, or only its [start, start + length) along dim for spec (dim, start, length)."""
    if spec is None:
        return f.get_tensor(name)
    dim, start, length = spec
    sl = f.get_slice(name)
    full = sl.get_shape()
    if start + length > full[dim]:
        raise TPConfigError(f"weight {name}: shard [{start}, {start + length}) of dim {dim} is outside "
                            f"its shape {tuple(full)}")
    index = [slice(None)] * len(full)
    index[dim] = slice(start, start + length)
    return sl[tuple(index)]
