"""The small fused functions of a decoder layer (nano-vllm's way): residual add + RMSNorm, SiLU-and-mul,
RoPE in place.

Each is a plain torch function that torch.compile turns into one kernel on a GPU. On CPU they run
eagerly: compiled, they were no faster at these sizes (scripts/layer_ops.py --compile measures it)
and every new batch size would cost a compile. On CUDA they are compiled only when
PAGEDSERVE_COMPILE=1 (until a GPU run has checked the compiled path; see issue 30).

Numerics follow transformers op for op (RMSNorm in float32, the residual added in the model's dtype,
RoPE as x*cos + rotate_half(x)*sin), so float32 greedy decoding stays equal to it token for token.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

COMPILE_ON_CUDA = os.environ.get("PAGEDSERVE_COMPILE", "0") == "1"


def fused(fn):
    """fn as given on CPU; torch.compile'd (once, on first use) for CUDA tensors when COMPILE_ON_CUDA."""
    compiled = None

    @functools.wraps(fn)
    def call(x: torch.Tensor, *args):
        nonlocal compiled
        if COMPILE_ON_CUDA and x.is_cuda:
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True)
            return compiled(x, *args)
        return fn(x, *args)
    call.eager = fn
    return call


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (RMSNorm(x + residual), x + residual); without residual, (RMSNorm(x), x).

    x may be overwritten (it becomes the new residual): pass a layer's output, not its input."""
    if residual is not None:
        x = x.add_(residual)          # in the model's dtype, as transformers adds the residual
    h = x.float()                     # x itself in float32: not modified below
    h = h * h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return weight * h.to(x.dtype), x


@fused
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@fused
def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place (q and k side by side in one view: one call per layer).

    cos [T, 1, D]; sin [T, 1, D] with its first half negated (RotaryEmbedding.forward), so that
    x*cos + swap_halves(x)*sin is transformers' x*cos + rotate_half(x)*sin, bit for bit."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x.mul_(cos).add_(swapped.mul_(sin))
