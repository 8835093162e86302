"""Read a local Hugging Face model folder (config.json + safetensors) into a paged model.

Everything that can be wrong with a folder is reported as ModelLoadError with one clear line,
before any weight is read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.kernels.limits import check_attention_shape
from pagedserve.services.config_fields import DTYPES
from pagedserve.services.worker.models import MODEL_REGISTRY
from pagedserve.services.worker.tp import (SINGLE, PackedPart, TensorParallel, TPConfigError, head_shard, read_shard,
                                          read_slice)


class ModelLoadError(Exception):
    """The folder cannot be served: missing files, unsupported architecture, bad weights."""


def context_length(asked: int | None, spec) -> int:
    """--max-model-len as served: the model's own when not given; above the model's, refused (as
    vLLM does) rather than quietly cut: positions past it were never trained."""
    if asked is not None and asked > spec.max_model_len:
        raise ModelLoadError(f"--max-model-len {asked} is above the model's context length "
                             f"({spec.max_model_len}, max_position_embeddings in config.json)")
    return asked or spec.max_model_len


@dataclass(frozen=True)
class ModelSpec:
    """What the rest of the system needs to know about a model, without its weights."""
    path: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_attention_heads: int = 0         # query heads; 0: as many as KV heads (no GQA)
    checkpoint_dtype: str = ""           # config.json's dtype / torch_dtype ("" when it names none)

    def kv_heads_per_rank(self, tp_size: int = 1) -> int:
        """KV heads in one tensor-parallel rank's pool; TPConfigError if the heads do not split."""
        if tp_size == 1:
            return self.num_kv_heads
        num_heads = self.num_attention_heads or self.num_kv_heads
        return head_shard(num_heads, self.num_kv_heads, TensorParallel(0, tp_size)).num_kv_heads

    def block_bytes(self, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
        """Bytes of one KV block of one rank: K and V for every layer and for that rank's KV heads
        (see docs/INTERFACES.md). Every rank's block has the same size."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * block_size * self.kv_heads_per_rank(tp_size) * self.head_dim * itemsize




def serving_dtype(requested: str, device: str, spec: ModelSpec) -> torch.dtype:
    """The dtype weights and KV blocks are served in; every process that sizes or views the pool
    (launcher, kvstore flags, worker, offline engine) asks this one function.

    "auto": on CUDA the checkpoint's own dtype (float16 when config.json names none, or names one
    the kernels do not serve); on CPU float32, since half-precision matmuls are ~100x slower there."""
    if requested not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
    if requested != "auto":
        return getattr(torch, requested)
    if torch.device(device).type == "cpu":
        return torch.float32
    return getattr(torch, spec.checkpoint_dtype) if spec.checkpoint_dtype in DTYPES[1:] else torch.float16


def _checkpoint_dtype(raw: dict) -> str:
    # transformers >= 4.56 writes "dtype"; older checkpoints say "torch_dtype".
    value = raw.get("dtype") or raw.get("torch_dtype") or ""
    return str(value).removeprefix("torch.")


def _eos_ids(path: Path, cfg) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [getattr(cfg, "eos_token_id", None)]
    gen = path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


def inspect_model_dir(model_dir: str | Path):
    """Validate the folder and return (hf_config, ModelSpec) without touching the weights."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {path} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"model folder {path} has no *.safetensors weights")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    archs = raw.get("architectures") or []
    supported = [a for a in archs if a in MODEL_REGISTRY]
    if not supported:
        raise ModelLoadError(f"unsupported architecture {archs or raw.get('model_type')!r}; "
                             f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
    from transformers import AutoConfig
    try:
        cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad config
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from None
    from pagedserve.services.worker.models.rope import SUPPORTED_ROPE_TYPES, rope_type_of
    rope_type = rope_type_of(cfg)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        # dynamic and longrope change every position's rotation with the sequence's length, which
        # K/V already in the cache cannot follow: refused rather than served wrongly.
        raise ModelLoadError(f"RoPE scaling {rope_type!r} is not supported; supported: "
                             f"{', '.join(sorted(SUPPORTED_ROPE_TYPES))}")
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    max_len = cfg.max_position_embeddings
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        max_len = min(max_len, window)  # no sliding-window attention here: stay inside the window
    spec = ModelSpec(
        path=str(path), architecture=supported[0], num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
        vocab_size=cfg.vocab_size, max_model_len=max_len, eos_token_ids=_eos_ids(path, cfg),
        num_attention_heads=num_heads, checkpoint_dtype=_checkpoint_dtype(raw))
    try:
        # Here, on every device: a model the CPU path serves must not fail on its first CUDA step.
        check_attention_shape(spec.head_dim, num_heads, spec.num_kv_heads)
    except ValueError as e:
        raise ModelLoadError(f"{path} cannot be served by the paged-attention kernels: {e}") from None
    return cfg, spec


def checkpoint_targets(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Parameter, PackedPart | None]]:
    """Checkpoint tensor name -> (the parameter it loads into, None or its part of a merged one).

    A merged parameter `...self_attn.qkv_proj.weight` is filled from the checkpoint's unchanged
    `...self_attn.q_proj.weight`, `k_proj` and `v_proj` (tp.MergedColumnParallelLinear)."""
    targets: dict[str, tuple[torch.nn.Parameter, PackedPart | None]] = {}
    for pname, param in model.named_parameters():
        parts = getattr(param, "packed_parts", None)
        if parts is None:
            targets[pname] = (param, None)
            continue
        module, _, leaf = pname.rpartition(".")            # "model.layers.0.self_attn.qkv_proj", "weight"
        parent = module.rpartition(".")[0]
        for part in parts:
            targets[f"{parent}.{part.name}.{leaf}" if parent else f"{part.name}.{leaf}"] = (param, part)
    return targets


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               tp: TensorParallel = SINGLE):
    """Build the paged model for the folder and load its safetensors weights -> (model, spec).

    With tp.size > 1 the model is rank tp.rank's shard and only that rank's slices are read."""
    from safetensors import safe_open

    cfg, spec = inspect_model_dir(model_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MODEL_REGISTRY[spec.architecture](cfg, tp)
    except TPConfigError as e:
        raise ModelLoadError(f"cannot split {model_dir} over {tp.size} ranks: {e}") from None
    finally:
        torch.set_default_dtype(previous)
    targets = checkpoint_targets(model)
    loaded: set[str] = set()
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name not in targets:
                    continue  # e.g. rotary inv_freq buffers some checkpoints carry
                param, part = targets[name]
                if part is None:
                    dst, tensor = param, read_shard(f, name, param)   # the whole tensor when unsharded
                else:   # one of q/k/v (gate/up): its rows of the merged parameter
                    dst, tensor = param.narrow(0, part.offset, part.length), read_slice(f, name, part.tp_slice)
                if tensor.shape != dst.shape:
                    raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(dst.shape)}")
                with torch.no_grad():
                    dst.copy_(tensor)
                loaded.add(name)
    # Tied parameters appear under one name in named_parameters(); the checkpoint may hold either.
    missing = [n for n in targets if n not in loaded]
    if missing:
        raise ModelLoadError(f"weights missing from {model_dir}: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
    return model.eval(), spec


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # missing/invalid tokenizer files raise several types
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {e}") from None
