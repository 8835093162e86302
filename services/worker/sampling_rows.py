"""A step's rows for the sampler (SamplingRow), and the per-row values it moves to the device.

Each helper builds its tensor from a Python list without waiting for the device (to_device), and
touches only the rows a processor chose (take_rows / put_rows: the whole tensor when all are).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.services.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence in this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seq_index: int = 0  # which of the request's n samples: seeded samples must differ
    drawn: int = 0      # outputs drawn already, in a step still running, that output_token_ids lacks

    @property
    def num_output(self) -> int:
        return len(self.output_token_ids) + self.drawn


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A Python list as a tensor on `device`. On a GPU through pinned memory, without waiting: a
    plain torch.tensor(..., device=cuda) waits for everything queued before it (the forward)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)


def param_column(values: list[float], device: torch.device) -> torch.Tensor:
    """Per-row parameters as a float32 column [R, 1] that broadcasts over the vocabulary."""
    return to_device(values, torch.float32, device)[:, None]


def take_rows(t: torch.Tensor, chosen: list[int]) -> torch.Tensor:
    """The chosen rows of t: t itself when all are chosen (the common case), else a copy."""
    if len(chosen) == t.shape[0]:
        return t
    return t[index_tensor(chosen, t.device)]


def put_rows(t: torch.Tensor, chosen: list[int], sub: torch.Tensor) -> None:
    """Write rows computed from take_rows(t, chosen) back into t (a no-op when sub is t itself)."""
    if sub is t:
        return
    if len(chosen) == t.shape[0]:
        t.copy_(sub)
    else:
        t[index_tensor(chosen, t.device)] = sub

