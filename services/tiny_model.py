"""Build a tiny random-weight model folder that transformers and pagedserve both load offline.

The folder holds config.json, model.safetensors, a byte-level BPE tokenizer trained here with
`tokenizers` on the Python standard library's sources (nothing is downloaded), and a chat
template. Tests and the default demo use these in place of real checkpoints.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

ARCHS = ("llama", "qwen2", "opt")
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
TINY_DIR = Path(".cache/tiny-llama")   # what the model name 'tiny' means to serve, up and generate
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


class TinyModelError(Exception):
    """A tiny model cannot be written where asked."""


def _training_files(limit: int = 170) -> list[str]:
    # Sorted so that the trained vocabulary is the same on every machine with this Python.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))
    return files[:limit]


def train_tokenizer(vocab_size: int):
    """A byte-level BPE with BOS prepended, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_training_files(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str, vocab_size: int, max_len: int, hidden_size: int = 128):
    """Small but not degenerate: GQA for llama/qwen2, biases for qwen2 and opt.

    hidden_size scales the widths (MLP 2x hidden, 4 heads of hidden/4); benchmarks use 256."""
    from transformers import LlamaConfig, OPTConfig, Qwen2Config

    if hidden_size < 8 or hidden_size % 4:
        raise TinyModelError(f"hidden_size must be a multiple of 4 and at least 8, got {hidden_size}")
    h = hidden_size

    common = dict(vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                  max_position_embeddings=max_len)
    if arch == "llama":
        return LlamaConfig(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4,
                           tie_word_embeddings=False, architectures=["LlamaForCausalLM"], **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"],
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)
    if arch == "opt":
        return OPTConfig(hidden_size=h, ffn_dim=2 * h, num_hidden_layers=2, num_attention_heads=4,
                         word_embed_proj_dim=h, do_layer_norm_before=True, dropout=0.0,
                         architectures=["OPTForCausalLM"], **common)
    raise TinyModelError(f"unsupported architecture {arch!r}; choose one of {', '.join(ARCHS)}")


def build_tiny_model(out_dir: str | os.PathLike, arch: str = "llama", seed: int = 0,
                     vocab_size: int = 2048, max_len: int = 1024, hidden_size: int = 128,
                     overrides: dict | None = None, device: str = "cpu") -> Path:
    """Write the folder; refuses a non-empty one so nothing of the user's is overwritten.

    `overrides` set config fields after the tiny defaults (the GPU check builds a 1B-shaped Llama:
    more layers, heads and MLP width); `device` is where the random weights are drawn (a GPU draws
    a billion of them in a moment; the CPU takes tens of seconds)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise TinyModelError(f"unsupported architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TinyModelError(f"{out} exists and is not an empty folder")
    tokenizer = train_tokenizer(vocab_size)
    config = tiny_config(arch, len(tokenizer), max_len, hidden_size)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def resolve_model(model: str) -> str:
    """A model folder as given, or for 'tiny' the tiny Llama in TINY_DIR (built on first use)."""
    if model != "tiny":
        return model
    if not (TINY_DIR / "config.json").exists():
        print(f"building the tiny model in {TINY_DIR} (first use only) ...", file=sys.stderr, flush=True)
        build_tiny_model(TINY_DIR, arch="llama")
    return str(TINY_DIR)
