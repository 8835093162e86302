"""CUDA graphs for decode steps: one captured forward per batch bucket, replayed on the runner's
persistent buffers.

Why: a decode step of a small model is bound by the host launching its kernels one by one (issue
30: 676 launches and 11.6 ms on the host for 2.3 ms of GPU work at batch 64); a replayed graph
launches them all at once. What a capture freezes: every tensor's address and shape, every Python
value the forward computed (the batch size, max_query_len == 1, each kernel's grid). So:
- a decode step (one token per sequence) runs in the graph of the smallest bucket that holds its
  sequences; ModelRunner.fill writes it into the persistent buffers the graph reads, padded to the
  bucket: spare rows of length 0 that read nothing and whose token's slot is negative (written
  nowhere);
- everything the forward reads comes from device tensors (the attention kernels take their bounds
  from seq_lens on the device; the slot mapping and the block-table gather are device ops);
- prefill and mixed steps, and decode batches past the largest bucket, run eagerly; sampling and
  the lm_head run outside the graph on its output rows.
Buckets are captured at start-up once the KV pool exists, largest first, sharing one memory pool
(a smaller graph's temporaries fit in the larger one's).

On CPU nothing is captured in service (no graphs there). Tests capture with `Recorder` instead: it
records the aten ops the forward dispatches and replays exactly those ops, with the Python values
and the tensors of the capture, as a graph replays its kernels. A buffer the fill forgot, a host
read of a device value (refused at capture, as a CUDA capture refuses a sync), or a kernel whose
work depends on a value seen at capture time shows up on CPU as a wrong answer or an error.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

log = logging.getLogger("pagedserve.worker")


@dataclass
class StepShape:
    """What ModelRunner.fill wrote: the rows the forward runs (padding included)."""
    num_tokens: int
    num_seqs: int
    max_query_len: int
    num_logits: int           # logits rows [R] at the front of the logits buffer
    graph: int | None         # the bucket whose graph serves the step; None: eager


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes with a graph: 1, 2, 4, 8, then every 16 up to max_num_seqs, and
    max_num_seqs itself (vLLM's ladder is 1, 2, 4 and every 8; 16 halves the captures and pads a
    batch by 7.5 rows on average, cheap beside a step's weights)."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


class CudaCapture:
    """torch.cuda.CUDAGraph per bucket, all in one memory pool."""

    def __init__(self):
        self.pool = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # torch's recipe: a warm-up run on a side stream first (lazy inits, cuBLAS workspaces).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out   # the same tensor every replay: read it before the next one
        return replay


class HostRead(RuntimeError):
    """The captured forward read a device value on the host: frozen in a graph, a sync on CUDA."""


class Recorder(TorchDispatchMode):
    """The CPU stand-in for CudaCapture: records the aten ops of one run of fn, replays them.

    Tensors an op got from outside the capture (weights, the KV cache, the step buffers) are the
    same tensors at replay; tensors made by an earlier recorded op are that op's new result;
    everything else (shapes, Python numbers) is as captured. The output is copied into the
    capture's output tensor, whose storage stays the same, as a graph's does."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise HostRead("a device value was read on the host inside the captured forward "
                           "(.item(), int(), a Python branch on a tensor): a graph would freeze it")
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.ops = []
        with self:
            out = fn()
        ops, self.ops = self.ops, []

        def replay() -> torch.Tensor:
            made: dict[int, torch.Tensor] = {}   # id of a tensor made at capture -> its replayed twin
            swap = lambda x: made.get(id(x), x) if isinstance(x, torch.Tensor) else x  # noqa: E731
            for func, args, kwargs, result in ops:
                new = func(*tree_map(swap, args), **tree_map(swap, kwargs))
                for old, fresh in zip(_tensors(result), _tensors(new)):
                    made[id(old)] = fresh
            return out.copy_(made.get(id(out), out))
        return replay


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


class DecodeGraphs:
    """The captured decode graphs of one ModelRunner, by bucket."""

    def __init__(self):
        self.buckets: list[int] = []
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}

    def find(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds num_seqs decode rows; None: run eagerly."""
        for bucket in self.buckets:
            if bucket >= num_seqs:
                return bucket
        return None

    def replay(self, shape: StepShape) -> torch.Tensor:
        return self.replays[shape.graph]()

    def capture(self, runner, max_num_seqs: int, capture) -> dict:
        """Capture a graph of runner.forward per bucket on padding-only steps, largest first ->
        {"graphs", "largest", "seconds", "bytes"} (bytes: device memory the graphs keep, CUDA)."""
        buckets = [b for b in batch_buckets(max_num_seqs) if b <= runner.max_seqs]
        cuda = runner.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(runner.device)
            free_before = torch.cuda.mem_get_info(runner.device)[0]
        start = time.perf_counter()
        with torch.inference_mode():
            for bucket in reversed(buckets):
                shape = runner.fill_padding(bucket)
                self.replays[bucket] = capture(lambda shape=shape: runner.forward(shape))
        self.buckets = buckets
        used = 0
        if cuda:
            torch.cuda.synchronize(runner.device)
            used = max(0, free_before - torch.cuda.mem_get_info(runner.device)[0])
        return {"graphs": len(buckets), "largest": buckets[-1] if buckets else 0,
                "seconds": time.perf_counter() - start, "bytes": used}


def capture_decode_graphs(runner, max_num_seqs: int, enforce_eager: bool, tp_size: int = 1) -> dict | None:
    """Start-up, once the runner's KV pool exists: the decode graphs where they apply (CUDA, not
    --enforce-eager, one rank) -> the capture's cost, logged; None where every step runs eagerly."""
    if enforce_eager or runner.device.type != "cuda":
        return None
    if tp_size > 1:
        # Every rank would have to capture the same all_reduces in the same order; not yet run on
        # a machine with several GPUs, so tensor parallelism stays eager.
        log.info("decode runs eagerly: CUDA graphs are not captured with tensor parallelism yet")
        return None
    stats = runner.capture_graphs(max_num_seqs, CudaCapture())
    log.info("captured %d decode graphs (batch 1-%d) in %.2f s, %.1f MiB of device memory",
             stats["graphs"], stats["largest"], stats["seconds"], stats["bytes"] / (1 << 20))
    return stats
