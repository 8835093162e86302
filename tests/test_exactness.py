"""Greedy output of the paged engine equals transformers' greedy generate, token for token."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import ops
from pagedserve.services.engine import Engine
from pagedserve.services.engine_config import EngineConfig
from pagedserve.services.sampling_params import SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os",
    "class BlockAllocator:\n    def __init__(self, num_blocks):\n        self.free = list(range(num_blocks))",
    "x",
    "# Copyright 2023. All rights reserved.\n# Licensed under the Apache License",
    "for i in range(10):\n    print(i",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "return {key: value for key, value in sorted(items.items()) if value is not None}\n",
    "async def handler(request):\n    body = await request.json()\n    return web.json_response(body)",
]
MAX_NEW = 32


def hf_greedy(model_dir: str, prompt_ids: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                               do_sample=False, num_beams=1)
        outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
@pytest.mark.parametrize("block_size", [16])
def test_greedy_matches_transformers(tiny_model_dirs, arch, block_size):
    model_dir = tiny_model_dirs[arch]
    # The CPU serving path is the C++ kernel (kernels/cpu_ops.py); the compiler is on every CI machine.
    assert ops.resolve_impl(torch.zeros(1), None) == "cpu"
    with Engine(EngineConfig(model=model_dir, block_size=block_size, num_device_blocks=256)) as engine:
        ids = [engine.tokenize(p) for p in PROMPTS]
        assert len({len(i) for i in ids}) >= 8, "prompts must have different lengths"
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
        stats = engine.stats()
        assert stats["device_blocks_used"] == 0
    expected = hf_greedy(model_dir, ids, MAX_NEW)
    for prompt, out, exp in zip(PROMPTS, outs, expected):
        assert out.outputs[0].token_ids == exp, f"{arch}: mismatch for prompt {prompt!r}"


def test_allowed_token_ids_greedy_matches_transformers_prefix_constraint(tiny_model_dirs):
    """allowed_token_ids is transformers' prefix_allowed_tokens_fn with a fixed list: every other
    logit to -inf, then argmax."""
    from transformers import AutoModelForCausalLM
    model_dir, allowed = tiny_model_dirs["llama"], [10, 11, 57, 300]
    with Engine(EngineConfig(model=model_dir, block_size=16, num_device_blocks=64)) as engine:
        ids = [engine.tokenize(p) for p in PROMPTS[:3]]
        outs = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=12, temperature=0.0,
                                                           allowed_token_ids=allowed))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt_ids, out in zip(ids, outs):
        x = torch.tensor([prompt_ids])
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                               num_beams=1, prefix_allowed_tokens_fn=lambda batch, sent: allowed)
        assert out.outputs[0].token_ids == y[0, len(prompt_ids):].tolist()
