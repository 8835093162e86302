"""Llama family over the paged KV cache: Llama, Mistral and Qwen2 (q/k/v bias) in one module.

Parameter names follow the Hugging Face checkpoints so safetensors load without renaming.
Numerics follow transformers' modeling_llama (RMSNorm in float32, rotate-half RoPE) so greedy
decoding matches it token for token.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from pagedserve.services.worker.attn_metadata import AttentionMetadata
from pagedserve.services.worker.models.attention import paged_attention_layer
from pagedserve.services.worker.models.rope import RotaryEmbedding
from pagedserve.services.worker.tp import (SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel, head_shard,
                                split)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LlamaAttention(nn.Module):
    """This rank's query heads and KV heads (all of them when tp.size == 1)."""

    def __init__(self, cfg, bias: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        shard = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        h = cfg.hidden_size
        self.q_proj = ColumnParallelLinear(h, shard.num_heads * D, shard.q_start * D, bias, tp)
        self.k_proj = ColumnParallelLinear(h, shard.num_kv_heads * D, shard.kv_start * D, bias, tp)
        self.v_proj = ColumnParallelLinear(h, shard.num_kv_heads * D, shard.kv_start * D, bias, tp)
        # Qwen2 has bias on q/k/v only; Llama's attention_bias covers o_proj too.
        self.o_proj = RowParallelLinear(shard.num_heads * D, shard.q_start * D, h,
                                        bool(getattr(cfg, "attention_bias", False)), tp)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]                                               # x: [T, hidden]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)   # [T, Hq, D]
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(q, k, cos, sin)
        o = paged_attention_layer(q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, tp: TensorParallel = SINGLE):
        super().__init__()
        h = cfg.hidden_size
        i = split(cfg.intermediate_size, tp.size, "intermediate_size")   # this rank's features
        start = tp.rank * i
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_proj = ColumnParallelLinear(h, i, start, bias, tp)
        self.up_proj = ColumnParallelLinear(h, i, start, bias, tp)
        self.down_proj = RowParallelLinear(i, start, h, bias, tp)
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, qkv_bias: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, qkv_bias, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg, qkv_bias: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)   # replicated on every rank
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, qkv_bias, tp)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Qwen2 is this model with bias on q/k/v; Mistral is this model (sliding window capped away).

    With tp.size > 1 this is one rank's shard (services.worker.tp); lm_head stays whole."""

    def __init__(self, cfg, tp: TensorParallel = SINGLE):
        super().__init__()
        qkv_bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        self.model = LlamaModel(cfg, qkv_bias, tp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)   # replicated
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary = RotaryEmbedding(cfg, head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)                      # [T, D] each
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()                             # [R, vocab]
