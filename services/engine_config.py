"""The engine's one validated configuration object (offline engine, scheduler and kvstore share it)."""
from __future__ import annotations

from dataclasses import dataclass

from services.worker.model_loader import DTYPES

PREEMPTION_MODES = ("swap", "recompute", "auto")
ALLOCATIONS = ("paged", "orca-max", "orca-pow2", "orca-oracle")   # kvstore.allocator.make_policy's names
BATCHING = ("iteration", "request")


class ConfigError(ValueError):
    """A setting is out of range; the message names the flag."""


@dataclass
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str = "auto"                    # auto: float32 on CPU, the checkpoint's on CUDA (serving_dtype)
    block_size: int = 16
    num_device_blocks: int | None = None   # None: size from kv_cache_memory_gib
    kv_cache_memory_gib: float = 0.25
    gpu_memory_utilization: float = 0.9    # the served stack on CUDA (kvstore/sizing.py); the offline engine uses kv_cache_memory_gib
    swap_space_gib: float = 0.25           # host pool for swapped-out blocks
    num_host_blocks: int | None = None     # None: size from swap_space_gib
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None       # None: the model's own
    seed: int = 0
    allocation: str = "paged"              # the block store's policy; orca-* are the paper's baselines
    batching: str = "iteration"            # request: FasterTransformer-style, a batch runs until all finish

    def validate(self) -> "EngineConfig":
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
            raise ConfigError(f"--block-size must be a power of two, got {bs}")
        if bs > 256:
            raise ConfigError(f"--block-size must be at most 256, got {bs}")
        if self.num_device_blocks is not None and self.num_device_blocks < 1:
            raise ConfigError(f"--num-device-blocks must be at least 1, got {self.num_device_blocks}")
        if self.num_host_blocks is not None and self.num_host_blocks < 0:
            raise ConfigError(f"--num-host-blocks must be >= 0, got {self.num_host_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space_gib < 0:
            raise ConfigError(f"--swap-space must be >= 0, got {self.swap_space_gib}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"--preemption-mode must be one of {', '.join(PREEMPTION_MODES)}, "
                              f"got {self.preemption_mode!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("--max-num-batched-tokens must be at least --max-num-seqs "
                              f"({self.max_num_batched_tokens} < {self.max_num_seqs})")
        check_allocation(self.allocation, self.batching)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        return self

    def blocks_for(self, memory_gib: float, block_bytes: int) -> int:
        return int(memory_gib * (1 << 30)) // block_bytes


def check_allocation(allocation: str, batching: str) -> None:
    """The one check of --allocation and --batching, for every process that takes them."""
    if allocation not in ALLOCATIONS:
        raise ConfigError(f"--allocation must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}")
    if batching not in BATCHING:
        raise ConfigError(f"--batching must be one of {', '.join(BATCHING)}, got {batching!r}")
    if batching == "request" and allocation != "orca-max":
        # FasterTransformer reserves the model's whole length per request, as Orca Max does.
        raise ConfigError("--batching request sizes its batches as Orca Max reserves memory: "
                          "use it with --allocation orca-max")
