"""Rotary position embedding, as transformers computes it (so outputs match token for token)."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.services.model_dir import SUPPORTED_ROPE_TYPES, rope_parameters


def _rope_parameters(cfg) -> dict:
    return rope_parameters(cfg.to_dict())


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg, head_dim: int):
        super().__init__()
        params = _rope_parameters(cfg)
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"RoPE scaling {rope_type!r} is not supported")
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, None)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [D/2]
        self.scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [T] -> cos, sin [T, 1, D] for layers.apply_rope_ (computed once per step).

        sin's first half is negated: x*cos + swap_halves(x)*sin is then transformers'
        x*cos + rotate_half(x)*sin exactly (negation is exact), with no negation per layer."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]    # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                          # [T, D]
        cos = (emb.cos() * self.scaling).to(dtype)
        sin = (emb.sin() * self.scaling).to(dtype)
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return cos[:, None, :], sin[:, None, :]
