"""A model folder, read without torch: what every process must know of a model before its weights
(layers, heads, context length, EOS ids, vocabulary), and the refusal of a folder that cannot be
served. The scheduler reads the folder with this alone and never loads torch; the worker's loader
(services/worker/model_loader.py) adds transformers' config object, which it builds the model from.

transformers' config classes import torch, so config.json is read here as JSON. Where config.json
leaves a field out, transformers' default for that model type applies (DEFAULTS);
tests/test_model_dir.py checks every value read here against AutoConfig's, with full and with
minimal config.json files of every architecture served.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pagedserve.services.head_split import head_shard

# config.json's `architectures` name -> its model_type (the key of DEFAULTS). The worker's
# MODEL_REGISTRY has a model for each (tests/test_model_dir.py).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "OPTForCausalLM": "opt"}
# transformers 5's defaults of the fields read here (use_sliding_window True: Llama's and Mistral's
# configs have no such switch, their window always applies). head_dim None: hidden_size // heads; kv heads
# None: as many as query heads.
_LLAMA = {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048, "eos_token_id": 2,
          "sliding_window": None, "use_sliding_window": True}
DEFAULTS = {
    "llama": _LLAMA,
    "mistral": {**_LLAMA, "num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {**_LLAMA, "vocab_size": 151936, "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "eos_token_id": None, "use_sliding_window": False},
    "opt": {**_LLAMA, "vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12},
}
# Checked against transformers (positions past the original length included). dynamic and
# longrope rescale with the sequence's current length, which cached K/V cannot follow.
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class ModelLoadError(Exception):
    """The folder cannot be served: missing files, unsupported architecture, bad weights."""


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
        return head_shard(num_heads, self.num_kv_heads, SimpleNamespace(rank=0, size=tp_size)).num_kv_heads

    def block_bytes(self, block_size: int, dtype, tp_size: int = 1) -> int:
        """Bytes of one KV block of one rank (dtype: a torch.dtype, or its name): K and V for every
        layer and for that rank's KV heads (see docs/INTERFACES.md). Every rank's block has the
        same size."""
        itemsize = DTYPE_BYTES[dtype] if isinstance(dtype, str) else dtype.itemsize
        return self.num_layers * 2 * block_size * self.kv_heads_per_rank(tp_size) * self.head_dim * itemsize


# Bytes per element of the dtypes served (DTYPES in config_fields, "auto" resolved).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def serving_dtype_name(requested: str, device: str, spec: ModelSpec) -> str:
    """The dtype weights and KV blocks are served in, by name; every process that sizes or views
    the pool (launcher, kvstore flags, worker, offline engine) asks this one function (the worker's
    model_loader.serving_dtype turns the name into torch's dtype).

    "auto": on CUDA the checkpoint's own dtype (float16 when config.json names none, or names one
    the kernels do not serve); on CPU float32, since half-precision matmuls are ~100x slower there."""
    if requested != "auto" and requested not in DTYPE_BYTES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPE_BYTES)}, got {requested!r}")
    if requested != "auto":
        return requested
    if not device.startswith("cuda"):
        return "float32"
    return spec.checkpoint_dtype if spec.checkpoint_dtype in DTYPE_BYTES else "float16"


def context_length(asked: int | None, spec: ModelSpec) -> int:
    """--max-model-len as served: the model's own when not given; above the model's, refused (as
    vLLM does) rather than quietly cut: positions past it were never trained."""
    if asked is not None and asked > spec.max_model_len:
        raise ModelLoadError(f"--max-model-len {asked} is above the model's context length "
                             f"({spec.max_model_len}, max_position_embeddings in config.json)")
    return asked or spec.max_model_len


def rope_parameters(cfg: dict[str, Any]) -> dict:
    """The RoPE settings of a config (config.json's dict, or a transformers config's __dict__)."""
    # transformers 5 keeps them in `rope_parameters`; 4.x wrote rope_theta + rope_scaling.
    params = cfg.get("rope_parameters")
    if params:
        return dict(params)
    params = dict(cfg.get("rope_scaling") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


def read_model_dir(model_dir: str | Path) -> ModelSpec:
    """Validate the folder and return its ModelSpec without touching the weights (or torch)."""
    path = Path(model_dir)
    raw = _read_config(path)
    archs = raw.get("architectures") or []
    supported = [a for a in archs if a in ARCHITECTURES]
    if not supported:
        raise ModelLoadError(f"unsupported architecture {archs or raw.get('model_type')!r}; "
                             f"supported: {', '.join(sorted(ARCHITECTURES))}")
    rope_type = rope_parameters(raw).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        # dynamic and longrope change every position's rotation with the sequence's length, which
        # K/V already in the cache cannot follow: refused rather than served wrongly.
        raise ModelLoadError(f"RoPE scaling {rope_type!r} is not supported; supported: "
                             f"{', '.join(sorted(SUPPORTED_ROPE_TYPES))}")
    field = _fields(raw, ARCHITECTURES[supported[0]], path)
    num_heads = field("num_attention_heads")
    max_len = field("max_position_embeddings")
    window = field("sliding_window")
    if window and raw.get("use_sliding_window", DEFAULTS[ARCHITECTURES[supported[0]]]["use_sliding_window"]):
        max_len = min(max_len, window)  # no sliding-window attention here: stay inside the window
    spec = ModelSpec(
        path=str(path), architecture=supported[0], num_layers=field("num_hidden_layers"),
        num_kv_heads=field("num_key_value_heads") or num_heads,
        head_dim=field("head_dim") or field("hidden_size") // num_heads, vocab_size=field("vocab_size"),
        max_model_len=max_len, eos_token_ids=_eos_ids(path, field("eos_token_id")),
        num_attention_heads=num_heads, checkpoint_dtype=_checkpoint_dtype(raw))
    from pagedserve.kernels.limits import check_attention_shape   # pure arithmetic, no torch
    try:
        # Here, on every device: a model the CPU path serves must not fail on its first CUDA step.
        check_attention_shape(spec.head_dim, num_heads, spec.num_kv_heads)
    except ValueError as e:
        raise ModelLoadError(f"{path} cannot be served by the paged-attention kernels: {e}") from None
    return spec


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {path} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"model folder {path} has no *.safetensors weights")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path / 'config.json'} is not a JSON object")
    return raw


# Fields config.json may set to null (or leave out, where transformers' default is null).
_NULLABLE = frozenset({"num_key_value_heads", "head_dim", "sliding_window", "eos_token_id"})


def _fields(raw: dict, model_type: str, path: Path):
    """field(name): config.json's value, else transformers' default; a wrong type is refused."""
    defaults = DEFAULTS[model_type]

    def field(name: str):
        value = raw.get(name, defaults[name])
        if value is None and name in _NULLABLE:
            return None
        if name == "eos_token_id" and isinstance(value, (int, list)):
            return value
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelLoadError(f"cannot read {path / 'config.json'}: {name} must be a positive integer, "
                                 f"got {value!r}")
        return value
    return field


def _checkpoint_dtype(raw: dict) -> str:
    # transformers >= 4.56 writes "dtype"; older checkpoints say "torch_dtype".
    value = raw.get("dtype") or raw.get("torch_dtype") or ""
    return str(value).removeprefix("torch.")


def _eos_ids(path: Path, config_eos) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [config_eos]
    gen = path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)
