"""A GPU step's time, by a roofline: what `loadgen simulate`'s worker charges for one scheduled step.

A step takes the larger of its compute time and its memory time, plus a fixed overhead (kernel
launches, the sampler, the host side of the engine), plus, with tensor parallelism, two all-reduces
per layer (after attention and after the MLP), plus the step's swap traffic over the host link
(bytes at the link's bandwidth and a fixed latency per block copied) and its copy-on-write copies
(each block read and written once at HBM bandwidth).

- compute: 2 FLOPs per weight per token (the dense layers), 2 * vocab * hidden per sampled row
  (the LM head runs only on rows that sample), and the attention scores and weighted sums:
  4 * hidden FLOPs per (query token, key position) pair per layer, over the keys it attends to.
- memory: every weight once per step, every attended sequence's whole KV once per layer (read),
  this step's tokens' K and V (written), and the activations (ACTIVATION_PASSES reads and writes of
  a hidden-sized vector per token per layer).
Peak FLOPs and bandwidth are derated by the efficiencies (what tuned kernels reach on A100s).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

ACTIVATION_PASSES = 16   # hidden-sized reads+writes per token per layer (norms, residuals, QKV, MLP)
# A swapped block is one cudaMemcpyAsync between the device pool and the pinned host pool (the
# kvstore copies one block row, every layer's K and V, at a time: kvstore/pool.py copy_between), and
# a PCIe copy costs a fixed ~10 us beyond its bytes (the driver's launch, DMA setup and completion;
# small pinned copies measure 5-15 us). Charged per block, an upper bound where runs of consecutive
# blocks merge into one copy. Beside an OPT-13B block's bytes it is small (16 tokens are 12.8 MB,
# 0.5 ms at 25 GB/s); the paper's slow small-block swaps (Fig. 19) come from vLLM's layout of the
# time, one copy per block per layer for K and for V (80 per OPT-13B block), which a row per block
# does not have.
PCIE_BLOCK_LATENCY_S = 10e-6


class BlockMoves(NamedTuple):
    """A step's block copies by kind, as the block store's op results give them."""
    swap_out: int = 0     # device pool -> host pool
    swap_in: int = 0      # host pool -> device pool
    copied: int = 0       # copy-on-write, device -> device

    @classmethod
    def of(cls, blocks: "int | BlockMoves") -> "BlockMoves":
        """A plain int (step_time's older form) is that many blocks swapped, counted as swap-outs."""
        return blocks if isinstance(blocks, BlockMoves) else cls(swap_out=blocks)


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden: int
    ffn: int
    vocab: int
    max_model_len: int = 2048
    dtype_bytes: int = 2
    kv_hidden: int | None = None          # K (and V) width per token per layer; None: hidden (MHA)

    @property
    def num_params(self) -> int:
        kv = self.kv_hidden or self.hidden
        per_layer = 2 * self.hidden * self.hidden + 2 * self.hidden * kv + 2 * self.hidden * self.ffn
        return self.num_layers * per_layer + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * (self.kv_hidden or self.hidden) * self.dtype_bytes

    @classmethod
    def from_config(cls, path: str | Path) -> "ModelShape":
        """From a Hugging Face config.json (OPT, Llama and most decoder-only models)."""
        c = json.loads(Path(path).read_text())
        hidden = c.get("hidden_size") or c["n_embd"]
        heads = c.get("num_attention_heads") or c["n_head"]
        kv_heads = c.get("num_key_value_heads", heads)
        return cls(name=c.get("_name_or_path") or Path(path).parent.name,
                   num_layers=c.get("num_hidden_layers") or c["n_layer"], hidden=hidden,
                   ffn=c.get("ffn_dim") or c.get("intermediate_size") or 4 * hidden, vocab=c["vocab_size"],
                   max_model_len=c.get("max_position_embeddings", 2048),
                   kv_hidden=hidden * kv_heads // heads)


@dataclass(frozen=True)
class Hardware:
    name: str
    num_gpus: int
    flops: float                 # peak dense fp16 FLOP/s per GPU
    mem_bw: float                # HBM bytes/s per GPU
    link_bw: float = 300e9       # all-reduce bus bytes/s per GPU (NVLink)
    link_latency_s: float = 8e-6  # per all-reduce
    host_bw: float = 25e9        # swap traffic, bytes/s over PCIe
    swap_block_latency_s: float = 0.0   # fixed cost per block swapped (PCIE_BLOCK_LATENCY_S on real GPUs)
    step_overhead_s: float = 2e-3
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8


@dataclass(frozen=True)
class Preset:
    name: str
    model: ModelShape
    hardware: Hardware
    kv_cache_bytes: int          # the KV pool, all GPUs together (the paper's Table 1)
    description: str = ""
    request_overhead_s: float = 0.0   # the API's path beside the steps: none in the roofline presets
    event_s: float = 0.0              # one token's SSE event to the client: none in the roofline presets
    admission_s_per_token: float = 0.0   # a prompt's admission beside the GPU: none in the roofline presets

    def num_kv_tokens(self) -> int:
        return self.kv_cache_bytes // self.model.kv_bytes_per_token

    # What `loadgen simulate` reads of any server it simulates (profiled_cost.ProfiledServer too).
    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def priced_by(self, block_size: int) -> None:
        return None              # the roofline, not a measured profile (ProfiledServer.priced_by)

    def cost_model(self) -> "CostModel":
        return CostModel(self)


GiB = 1 << 30
A100_40G = Hardware("A100-40GB", 1, 312e12, 1.555e12, swap_block_latency_s=PCIE_BLOCK_LATENCY_S)
OPT_13B = ModelShape("OPT-13B", 40, 5120, 20480, 50272)
OPT_66B = ModelShape("OPT-66B", 64, 9216, 36864, 50272)
OPT_175B = ModelShape("OPT-175B", 96, 12288, 49152, 50272)
PRESETS = {
    "opt-13b-a100-40g": Preset("opt-13b-a100-40g", OPT_13B, A100_40G, 12 * GiB,
                               "OPT-13B on one A100-40GB: 26 GB of weights, 12 GiB of KV (800 KiB a token)"),
    "opt-66b-4xa100": Preset("opt-66b-4xa100", OPT_66B, replace(A100_40G, name="4xA100-40GB", num_gpus=4),
                             21 * GiB, "OPT-66B on four A100-40GB (tensor parallel): 132 GB of weights, 21 GiB of KV"),
    "opt-175b-8xa100-80g": Preset("opt-175b-8xa100-80g", OPT_175B,
                                  replace(A100_40G, name="8xA100-80GB", num_gpus=8, mem_bw=2.0e12),
                                  264 * GiB, "OPT-175B on eight A100-80GB: 346 GB of weights, 264 GiB of KV"),
}


def custom_preset(config_json: str, flops: float, mem_bw: float, kv_cache_bytes: int, num_gpus: int = 1) -> Preset:
    model = ModelShape.from_config(config_json)
    hardware = Hardware("custom", num_gpus, flops, mem_bw, swap_block_latency_s=PCIE_BLOCK_LATENCY_S)
    return Preset("custom", model, hardware, kv_cache_bytes,
                  f"{model.name} from {config_json}")


class CostModel:
    def __init__(self, preset: Preset):
        self.model, self.hw = preset.model, preset.hardware

    def step_time(self, seqs: list[tuple[int, int]], num_sampled: int, swap_blocks: int | BlockMoves = 0,
                  block_tokens: int = 16) -> float:
        """Seconds for one step. seqs: (query tokens, context tokens including them) per sequence;
        num_sampled: rows that run the LM head; swap_blocks: the blocks copied to or from the host
        (an int) or the step's BlockMoves (swaps and copy-on-write copies)."""
        m, hw = self.model, self.hw
        tokens = sum(q for q, _ in seqs)
        # Query token j of a chunk of q ending at position ctx attends to ctx - q + j + 1 keys.
        pairs = sum(q * (ctx - q) + q * (q + 1) // 2 for q, ctx in seqs)
        flops = 2 * (m.num_params - m.vocab * m.hidden) * tokens + 2 * m.vocab * m.hidden * num_sampled \
            + 4 * m.hidden * m.num_layers * pairs
        kv_token = m.kv_bytes_per_token
        data = m.weight_bytes + kv_token * sum(ctx for _, ctx in seqs) + kv_token * tokens \
            + ACTIVATION_PASSES * tokens * m.hidden * m.dtype_bytes * m.num_layers
        n = hw.num_gpus
        compute = flops / (n * hw.flops * hw.compute_efficiency)
        memory = data / (n * hw.mem_bw * hw.memory_efficiency)
        t = max(compute, memory) + hw.step_overhead_s
        if n > 1 and tokens:
            ring = 2 * (n - 1) / n * tokens * m.hidden * m.dtype_bytes / hw.link_bw + hw.link_latency_s
            t += 2 * m.num_layers * ring
        moves, block_bytes = BlockMoves.of(swap_blocks), block_tokens * kv_token
        swapped = moves.swap_out + moves.swap_in       # the same link and bytes either way
        if swapped:
            t += swapped * (block_bytes / hw.host_bw + hw.swap_block_latency_s)
        if moves.copied:   # read and write each block; a tensor-parallel GPU copies its own shard
            t += moves.copied * 2 * block_bytes / (n * hw.mem_bw * hw.memory_efficiency)
        return t
