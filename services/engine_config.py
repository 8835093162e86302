"""The offline engine's one validated configuration object; `pagedserve generate` takes its flags."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.services import config_fields as cf
from pagedserve.services.config_fields import allocation_check, at_least
from pagedserve.services.flags import ConfigError, ProcessConfig, opt

__all__ = ["ConfigError", "EngineConfig", "EngineOptions"]


@dataclass(kw_only=True)
class EngineOptions:
    """The engine's settings that the offline engine and `pagedserve serve`/`up` both take: written
    once here, inherited by EngineConfig and by the launcher's Config (services/launcher.py), with
    their checks across fields."""
    dtype: str = cf.dtype()
    block_size: int = cf.block_size()
    num_device_blocks: int | None = cf.num_device_blocks()
    kv_cache_memory_bytes: int | None = cf.kv_cache_memory_bytes()
    kv_cache_memory_gib: float | None = cf.kv_cache_memory_gib()
    gpu_memory_utilization: float = cf.gpu_memory_utilization()
    swap_space_gib: float = cf.swap_space()
    kv_offloading_size: float | None = cf.kv_offloading_size()
    preemption_mode: str = cf.preemption_mode()
    enable_prefix_caching: bool = opt(True, "find full KV blocks again by the hash of their tokens",
                                      aliases=["--prefix-caching"])
    max_num_seqs: int = cf.max_num_seqs()
    max_num_batched_tokens: int = cf.max_num_batched_tokens()
    max_model_len: int | None = cf.max_model_len()
    allocation: str = cf.allocation()
    batching: str = cf.batching()
    enforce_eager: bool = cf.enforce_eager()
    async_scheduling: bool = cf.async_scheduling()

    def cross_check(self) -> str | None:
        return (cf.batch_limits_check(self.max_num_seqs, self.max_num_batched_tokens)
                or allocation_check(self.allocation, self.batching) or cf.kv_pool_check(self))


@dataclass(kw_only=True)
class EngineConfig(EngineOptions, ProcessConfig):
    model: str = cf.model("a local Hugging Face folder (config.json, safetensors, tokenizer), or 'tiny': "
                          "pagedserve generate builds .cache/tiny-llama on first use, as serve does")
    device: str = cf.device()
    num_host_blocks: int | None = opt(None, "host KV blocks (default: from --swap-space)", check=at_least(0))
    seed: int = 0                          # set by code: `generate --seed` seeds the sampling instead

    def device_blocks(self, block_bytes: int) -> int:
        return self.num_device_blocks or cf.kv_pool_bytes(self) // block_bytes

    def host_blocks(self, block_bytes: int) -> int:
        if self.num_host_blocks is not None:
            return self.num_host_blocks
        return int(self.swap_space_gib * (1 << 30)) // block_bytes
