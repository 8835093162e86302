"""Paged-attention kernels behind one dispatching API (docs/INTERFACES.md, "kernels/").

Each function takes `impl`: None picks Triton for CUDA tensors; for CPU tensors the attention calls
and the cache write pick the C++ kernels (kernels/cpu_ops.py, compiled on first use) and fall back
to the PyTorch reference where they cannot be built, while the block copy is the reference's on CPU
either way (so a kvstore copying blocks never triggers a build). "triton", "cpu" or
"reference" force one. The Triton module is imported only when it is first chosen: importing it
decorates the kernels, and on a CPU-only machine that must happen after TRITON_INTERPRET=1 is set
(tests set it) — importing `kernels` alone never touches Triton, nor builds anything.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from pagedserve.kernels import cpu_ops, reference

__all__ = ["write_kv_cache", "paged_attention", "paged_decode_attention", "copy_blocks",
           "resolve_impl", "warm_up"]

_IMPLS = ("triton", "cpu", "reference")


def resolve_impl(tensor: torch.Tensor, impl: str | None, attention: bool = True) -> str:
    """The implementation a call on `tensor` with this `impl` argument runs (`attention`: whether
    the call is one the C++ CPU kernels serve: the attention calls and the cache write)."""
    if impl is None:
        if tensor.is_cuda:
            return "triton"
        return "cpu" if attention and cpu_ops.available() else "reference"
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS} or None, got {impl!r}")
    if impl == "cpu" and not cpu_ops.available():
        raise RuntimeError(f"impl='cpu': the C++ kernel is unavailable: {cpu_ops.unavailable_reason()}")
    return impl


def _backend(tensor: torch.Tensor, impl: str | None, attention: bool = True) -> ModuleType:
    chosen = resolve_impl(tensor, impl, attention)
    if chosen == "reference":
        return reference
    if chosen == "cpu":
        return cpu_ops
    return importlib.import_module("pagedserve.kernels.triton_ops")


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   impl: str | None = None) -> None:
    """key, value: [T, Hkv, D] -> their slots in k_cache, v_cache [N, B, Hkv, D]; slot < 0 skips."""
    _backend(key, impl).write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                    impl: str | None = None) -> torch.Tensor:
    """Ragged causal attention of q [T, Hq, D] over the paged cache -> [T, Hq, D]."""
    return _backend(q, impl).paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                             query_start_loc, scale, max_query_len)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           impl: str | None = None) -> torch.Tensor:
    """One query per sequence, q [S, Hq, D] at position seq_lens[s]-1 -> [S, Hq, D]."""
    return _backend(q, impl).paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                    scale)


def copy_blocks(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                impl: str | None = None) -> None:
    """pool[dst[i]] = pool[src[i]] for pool [num_blocks, ...], src/dst [N] int64."""
    _backend(pool, impl, attention=False).copy_blocks(pool, src, dst)


def warm_up(dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int, block_size: int,
            device: torch.device | str) -> None:
    """CUDA: compile every attention variant a model of these heads can take, now rather than in a
    served step (triton_ops.warm_up_attention); nothing elsewhere (the C++ kernel is built once)."""
    if torch.device(device).type == "cuda":
        importlib.import_module("pagedserve.kernels.triton_ops").warm_up_attention(
            dtype, head_dim, num_q_heads, num_kv_heads, block_size, device)
