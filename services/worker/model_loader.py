"""Read a local Hugging Face model folder (config.json + safetensors) into a paged model.

Everything that can be wrong with a folder is reported as ModelLoadError with one clear line,
before any weight is read.
"""
from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.services.model_dir import (ModelLoadError, ModelSpec, context_length, read_model_dir,  # noqa: F401
                                          serving_dtype_name)
from pagedserve.services.worker.models import MODEL_REGISTRY
from pagedserve.services.worker.tp import SINGLE, PackedPart, TensorParallel, TPConfigError, read_shard, read_slice


def serving_dtype(requested: str, device: str, spec: ModelSpec) -> torch.dtype:
    """torch's dtype for model_dir.serving_dtype_name (the one decision, made without torch)."""
    return getattr(torch, serving_dtype_name(requested, str(device), spec))


def inspect_model_dir(model_dir: str | Path):
    """(transformers' config, ModelSpec): the folder checked and read by services/model_dir.py, and
    the config object the model is built from (it imports torch, which the spec alone does not)."""
    spec = read_model_dir(model_dir)
    from transformers import AutoConfig
    try:
        cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad config
        raise ModelLoadError(f"cannot read {Path(model_dir) / 'config.json'}: {e}") from None
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
