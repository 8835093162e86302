"""The offline engine: block store, model runner and (soon) scheduler cores in one process.

Owns the pools it creates (and unlinks them on close), the tokenizer and the model. The same cores
run in separate processes in the served stack; here they are plain objects called in turn.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstore.pool import BlockPool, unique_pool_name
from kvstore.store import BlockStore
from services.engine_config import ConfigError, EngineConfig
from services.greedy import greedy_generate
from services.sampling_params import SamplingParams
from services.worker.model_loader import ModelLoadError, inspect_model_dir, load_model
from services.worker.model_runner import ModelRunner


class PromptTooLongError(ValueError):
    """A prompt that does not fit the model's context (or the whole KV pool)."""


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids,
                "text": self.text, "finish_reason": self.finish_reason, **self.extra}


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # missing/invalid tokenizer files raise several types
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {e}") from None


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config.validate()
        _, spec = inspect_model_dir(config.model)   # fail on a bad folder before loading anything
        self.tokenizer = load_tokenizer(config.model)
        self.dtype = getattr(torch, config.dtype)
        self.model, self.spec = load_model(config.model, self.dtype, config.device)
        self.max_model_len = min(config.max_model_len or spec.max_model_len, spec.max_model_len)
        block_bytes = spec.block_bytes(config.block_size, self.dtype)
        num_device = config.num_device_blocks or config.blocks_for(config.kv_cache_memory_gib, block_bytes)
        num_host = config.num_host_blocks if config.num_host_blocks is not None \
            else config.blocks_for(config.swap_space_gib, block_bytes)
        if num_device < 1:
            raise ConfigError("the KV cache budget is smaller than one block")
        self.device_pool = BlockPool.create(unique_pool_name("device"), num_device, block_bytes, config.device)
        self.host_pool = BlockPool.create(unique_pool_name("host"), num_host, block_bytes, "cpu")
        self.store = BlockStore(num_device, num_host, config.block_size,
                                enable_prefix_caching=config.enable_prefix_caching,
                                device_pools=[self.device_pool], host_pools=[self.host_pool])
        self.runner = ModelRunner(self.model, spec, self.device_pool.blocks, config.block_size,
                                  self.dtype, config.device)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise PromptTooLongError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; this model's maximum context is "
                                     f"{self.max_model_len} tokens including at least one generated")
        return ids

    def generate(self, prompts: list[str | list[int]], params: SamplingParams) -> list[RequestOutput]:
        params.validate()
        ids = [self.tokenize(p) for p in prompts]
        outs = greedy_generate(self.runner, self.store, ids, params.max_tokens,
                               () if params.ignore_eos else self.spec.eos_token_ids, self.max_model_len)
        return [RequestOutput(p, o, self.tokenizer.decode(o, skip_special_tokens=params.skip_special_tokens))
                for p, o in zip(ids, outs)]

    def stats(self) -> dict:
        return self.store.stats()

    def close(self) -> None:
        self.runner = None
        for pool in (self.device_pool, self.host_pool):
            pool.close()
            pool.unlink()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
