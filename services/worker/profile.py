"""The worker's start-up pass: run the scheduler's largest step once, and a decode step after it,
before the worker says ready.

Why: (1) every kernel the model runs (the K/V write, ragged prefill attention, decode attention)
compiles here, not inside the first real step; (2) on CUDA it measures the activation memory such
a step needs beyond what stays allocated, which the kvstore subtracts from free memory when it
sizes the pools (services/kvstore/sizing.py). It runs on a scratch KV pool of its own, freed afterwards;
the kvstore's pool may not exist yet. Every rank runs it (their collectives pair up); rank 0 also
samples, with top-k/top-p so the sampler's temporaries are in the peak too.
"""
from __future__ import annotations

import torch

from pagedserve.kernels import ops
from pagedserve.kernels.device import on_device
from pagedserve.services.sampling_params import SamplingParams
from pagedserve.services.worker.cuda_graphs import capture_decode_graphs
from pagedserve.services.worker.model_runner import ModelRunner, SeqStep
from pagedserve.services.worker.worker_core import SampleRequest, WorkerCore

# The heaviest sampling path: sorting for top-p, a top-k cut, logprobs.
PROFILE_PARAMS = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=50, logprobs=5)


class CudaMemory:
    """torch's allocator statistics for one device."""

    def __init__(self, device: str):
        self.device = torch.device(device)

    def start(self) -> int:
        """Settle, clear the peak; -> bytes allocated now (weights, the scratch pool)."""
        with on_device(self.device):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        with on_device(self.device):
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)

    def release(self) -> None:
        """Hand the allocator's cached blocks back, so the kvstore's reading of free memory is true."""
        with on_device(self.device):
            torch.cuda.empty_cache()


class NoMemory:
    """CPU: nothing to measure (the pools are sized by --num-device-blocks there)."""

    def start(self) -> int:
        return 0

    def peak(self) -> int:
        return 0

    def release(self) -> None:
        pass


def profile_batch(num_tokens: int, num_seqs: int, block_size: int):
    """The largest step the scheduler can send: num_tokens prompt tokens over num_seqs sequences,
    each wanting a token; then one decode token each. -> (blocks needed, prefill, decode)."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    prefill, decode, next_block = [], [], 0
    for seq_id, n in enumerate(lens):
        blocks = -(-(n + 1) // block_size)   # + 1: room for the decode token
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        prefill.append(SeqStep(seq_id, [seq_id % 7 + 1] * n, 0, table))
        decode.append(SeqStep(seq_id, [1], n, table))
    return next_block, prefill, decode


def warm_up_and_profile(model: torch.nn.Module, spec, dtype: torch.dtype, device: str, block_size: int,
                        tp_size: int, num_tokens: int, num_seqs: int, samples: bool,
                        memory=None, enforce_eager: bool = True) -> int:
    """Run the profile batch -> activation bytes its steps need on top of what stays allocated
    (0 on CPU), plus what the decode graphs keep when they will be captured (not enforce_eager,
    on CUDA: captured here once on the scratch pool to measure them). `samples`: this rank samples
    (rank 0)."""
    memory = memory or (CudaMemory(device) if torch.device(device).type == "cuda" else NoMemory())
    q_heads = (spec.num_attention_heads or spec.num_kv_heads) // tp_size    # this rank's
    ops.warm_up(dtype, spec.head_dim, q_heads, spec.kv_heads_per_rank(tp_size), block_size, device)
    num_blocks, prefill, decode = profile_batch(num_tokens, num_seqs, block_size)
    with on_device(device):
        scratch = torch.zeros((num_blocks, spec.block_bytes(block_size, dtype, tp_size)),
                              dtype=torch.uint8, device=device)   # [N, block_bytes]
    runner = ModelRunner(model, spec, scratch, block_size, dtype, device, tp_size,
                         max_num_batched_tokens=num_tokens,
                         max_model_len=max(spec.max_model_len, num_blocks * block_size))
    core = WorkerCore(runner, spec.eos_token_ids) if samples else None
    try:
        before = memory.start()
        for steps in (prefill, decode):
            if core is None:
                runner.execute(steps, compute_logits=False)
                continue
            wanted = [[SampleRequest(s.seq_id, PROFILE_PARAMS, s.token_ids, [])] for s in steps]
            core.execute(steps, wanted)
        reserve = max(0, memory.peak() - before)
        graphs = capture_decode_graphs(runner, num_seqs, enforce_eager, tp_size)
        reserve += graphs["bytes"] if graphs else 0
    finally:
        runner.close()
        del scratch, runner, core
        memory.release()
    return reserve
