"""OPT (the paper's model) over the paged KV cache.

Follows transformers' modeling_opt: learned positions offset by 2, pre- or post-LayerNorm
(do_layer_norm_before), ReLU MLP, optional project_in/out when word_embed_proj_dim differs from
hidden_size, lm_head tied to the token embedding. q/k/v run as one matmul (qkv_proj), loaded from
the checkpoint's unchanged q/k/v_proj.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from pagedserve.services.worker.attn_metadata import AttentionMetadata
from pagedserve.services.worker.models.attention import paged_attention_layer
from pagedserve.services.worker.tp import (SINGLE, ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear,
                                TensorParallel, head_shard, split)

POSITION_OFFSET = 2  # OPT's learned position table starts at index 2 (a fairseq legacy)
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class OPTAttention(nn.Module):
    """This rank's heads (all of them when tp.size == 1); OPT has as many KV heads as query heads."""

    def __init__(self, cfg, tp: TensorParallel = SINGLE):
        super().__init__()
        h = cfg.hidden_size
        shard = head_shard(cfg.num_attention_heads, cfg.num_attention_heads, tp)
        self.num_heads = shard.num_heads
        self.head_dim = D = h // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        bias = getattr(cfg, "enable_bias", True)
        local, start = shard.num_heads * D, shard.q_start * D
        self.qkv_proj = MergedColumnParallelLinear(
            h, [("q_proj", local, start), ("k_proj", local, start), ("v_proj", local, start)], bias, tp)
        self.out_proj = RowParallelLinear(local, start, h, bias, tp)

    def forward(self, x, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]                                                # x: [T, hidden]
        qkv = self.qkv_proj(x).view(T, 3 * self.num_heads, self.head_dim)
        q, k, v = qkv.split(self.num_heads, dim=1)                   # [T, H, D] views
        o = paged_attention_layer(q, k, v, kv_cache, meta, self.scale)
        return self.out_proj(o.reshape(T, -1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg, tp: TensorParallel = SINGLE):
        super().__init__()
        affine = getattr(cfg, "layer_norm_elementwise_affine", True)
        bias = getattr(cfg, "enable_bias", True)
        self.pre_norm = cfg.do_layer_norm_before
        self.self_attn = OPTAttention(cfg, tp)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        ffn = split(cfg.ffn_dim, tp.size, "ffn_dim")   # this rank's features
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, ffn, tp.rank * ffn, bias, tp)
        self.fc2 = RowParallelLinear(ffn, tp.rank * ffn, cfg.hidden_size, bias, tp)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        if cfg.activation_function not in ACTIVATIONS:
            raise ValueError(f"unsupported activation_function {cfg.activation_function!r}")
        self.act = ACTIVATIONS[cfg.activation_function]

    def forward(self, x, kv_cache, meta):
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, kv_cache, meta)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.fc2(self.act(self.fc1(h)))
        return x if self.pre_norm else self.final_layer_norm(x)


class OPTDecoder(nn.Module):
    """Embeddings, positions and project_in/out are replicated on every rank; layers are sharded."""

    def __init__(self, cfg, tp: TensorParallel = SINGLE):
        super().__init__()
        proj = cfg.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(cfg.vocab_size, proj)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size)
        self.project_in = nn.Linear(proj, cfg.hidden_size, bias=False) if proj != cfg.hidden_size else None
        self.project_out = nn.Linear(cfg.hidden_size, proj, bias=False) if proj != cfg.hidden_size else None
        keep_final = cfg.do_layer_norm_before and not getattr(cfg, "_remove_final_layer_norm", False)
        affine = getattr(cfg, "layer_norm_elementwise_affine", True)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine) if keep_final else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))


class OPTModel(nn.Module):
    def __init__(self, cfg, tp: TensorParallel = SINGLE):
        super().__init__()
        self.decoder = OPTDecoder(cfg, tp)


class OPTForCausalLM(nn.Module):
    """With tp.size > 1 this is one rank's shard (services.worker.tp); lm_head stays whole."""

    def __init__(self, cfg, tp: TensorParallel = SINGLE):
        super().__init__()
        self.model = OPTModel(cfg, tp)
        self.lm_head = nn.Linear(cfg.word_embed_proj_dim, cfg.vocab_size, bias=False)   # replicated
        if getattr(cfg, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, word_embed_proj_dim]."""
        d = self.model.decoder
        x = d.embed_tokens(input_ids)
        if d.project_in is not None:
            x = d.project_in(x)
        x = x + d.embed_positions(positions + POSITION_OFFSET)
        for layer, kv_cache in zip(d.layers, kv_caches):
            x = layer(x, kv_cache, meta)
        if d.final_layer_norm is not None:
            x = d.final_layer_norm(x)
        if d.project_out is not None:
            x = d.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()                            # [R, vocab]
