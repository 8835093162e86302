"""The CUDA device guard every CUDA call in this project runs under: the device of the tensor it
touches, never whatever device happens to be current.

Why: CUDA objects and launches bind to the *current* device. Triton launches on it and takes its
current stream; a torch Event is created lazily on it at its first record or ipc_handle(); and
`torch.cuda.stream(s)` makes s's device current as a side effect. In a process that holds one pool
per tensor-parallel rank (the kvstore) the current device is wrong for every rank but one, so each
call names its device instead. On CPU the guard is a no-op.
"""
from __future__ import annotations

import contextlib

import torch


def on_device(where: torch.Tensor | torch.device | str):
    """`with on_device(t):` makes t's CUDA device current (and its current stream the one that
    launches see); nothing for CPU tensors and devices."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)
