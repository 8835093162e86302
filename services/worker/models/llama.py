"""Llama family over the paged KV cache: Llama, Mistral and Qwen2 (q/k/v bias) in one module.

Parameter names follow the Hugging Face checkpoints, except q/k/v and gate/up, each merged into one
matmul (qkv_proj, gate_up_proj) that the loader fills from the checkpoint's unchanged tensors.
A layer runs as nano-vllm's: residual add fused into RMSNorm, RoPE in place on q and k at once,
SiLU-and-mul in one function (models/layers.py). Numerics follow transformers' modeling_llama
(RMSNorm in float32, rotate-half RoPE) so greedy decoding matches it token for token.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.services.worker.attn_metadata import AttentionMetadata
from pagedserve.services.worker.models.attention import paged_attention_layer
from pagedserve.services.worker.models.layers import apply_rope_, rms_norm, silu_and_mul
from pagedserve.services.worker.models.rope import RotaryEmbedding
from pagedserve.services.worker.tp import (SINGLE, MergedColumnParallelLinear, RowParallelLinear, TensorParallel,
                                head_shard, split)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """-> (RMSNorm(x + residual), x + residual); x is overwritten when residual is given."""
        return rms_norm(x, self.weight, self.eps, residual)


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
        # One matmul for this rank's q, k and v heads, loaded from the checkpoint's q/k/v_proj.
        self.qkv_proj = MergedColumnParallelLinear(h, [("q_proj", shard.num_heads * D, shard.q_start * D),
                                                       ("k_proj", shard.num_kv_heads * D, shard.kv_start * D),
                                                       ("v_proj", shard.num_kv_heads * D, shard.kv_start * D)],
                                                   bias, tp)
        # Qwen2 has bias on q/k/v only; Llama's attention_bias covers o_proj too.
        self.o_proj = RowParallelLinear(shard.num_heads * D, shard.q_start * D, h,
                                        bool(getattr(cfg, "attention_bias", False)), tp)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        T, D = x.shape[0], self.head_dim                             # x: [T, hidden]
        qkv = self.qkv_proj(x).view(T, self.num_heads + 2 * self.num_kv_heads, D)
        apply_rope_(qkv[:, :self.num_heads + self.num_kv_heads], cos, sin)   # q and k side by side
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)  # views
        o = paged_attention_layer(q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, tp: TensorParallel = SINGLE):
        super().__init__()
        h = cfg.hidden_size
        i = split(cfg.intermediate_size, tp.size, "intermediate_size")   # this rank's features
        start = tp.rank * i
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(h, [("gate_proj", i, start), ("up_proj", i, start)], bias, tp)
        self.down_proj = RowParallelLinear(i, start, h, bias, tp)
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, qkv_bias: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, qkv_bias, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """-> (this layer's MLP output, the residual stream before it): the residual add is left
        to the next norm (nano-vllm's way); residual is None for the first layer."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta), residual)
        return self.mlp(h), residual


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
        cos, sin = self.rotary(positions, x.dtype)                      # [T, 1, D] each
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()                             # [R, vocab]
