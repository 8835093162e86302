"""services/model_dir.py reads config.json without torch (the scheduler never loads it); what it
reads must be what transformers reads, for every architecture served, whether config.json spells a
field out or leaves it to transformers' default."""
from __future__ import annotations

import json
import shutil

import pytest

from pagedserve.services.model_dir import ARCHITECTURES, DEFAULTS, ModelLoadError, read_model_dir
from pagedserve.services.worker.models import MODEL_REGISTRY

# What config.json of each type must keep for its architecture to be known; all else may go.
KEEP = {"architectures", "model_type"}
# Fields whose default is left to transformers in the minimal variants, one at a time and all at once.
READ = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "max_position_embeddings", "sliding_window", "use_sliding_window", "eos_token_id",
        "rope_parameters", "rope_scaling", "rope_theta")


def spec_by_transformers(path: str) -> dict:
    """The fields of ModelSpec as transformers' AutoConfig gives them (the reading before this module)."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    heads = cfg.num_attention_heads
    max_len = cfg.max_position_embeddings
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        max_len = min(max_len, window)
    eos = cfg.eos_token_id
    return {"num_layers": cfg.num_hidden_layers, "num_attention_heads": heads,
            "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            "vocab_size": cfg.vocab_size, "max_model_len": max_len,
            "eos_token_ids": tuple(dict.fromkeys(eos if isinstance(eos, list) else [] if eos is None else [eos]))}


def ours(path: str) -> dict:
    spec = read_model_dir(path)
    return {k: getattr(spec, k) for k in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
                                          "vocab_size", "max_model_len", "eos_token_ids")}


def variant(src: str, dst, drop=(), **set_) -> str:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").unlink(missing_ok=True)   # EOS from config.json alone
    raw = json.loads((dst / "config.json").read_text())
    for key in drop:
        raw.pop(key, None)
    raw.update(set_)
    (dst / "config.json").write_text(json.dumps(raw))
    return str(dst)


def test_every_architecture_served_is_read_here_and_has_transformers_defaults():
    assert set(ARCHITECTURES) == set(MODEL_REGISTRY)
    from transformers import AutoConfig
    for arch, model_type in ARCHITECTURES.items():
        cfg = AutoConfig.for_model(model_type)
        for name, default in DEFAULTS[model_type].items():
            theirs = getattr(cfg, name, None)
            if default is None and name in ("head_dim", "num_key_value_heads"):
                continue   # derived from other fields by transformers; compared through the specs below
            if theirs is None and name == "use_sliding_window":
                theirs = True   # no such switch: the window, where there is one, always applies
            assert theirs == default, f"{model_type}.{name}: transformers {theirs!r}, ours {default!r}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
def test_the_spec_equals_transformers_reading_of_the_same_folder(tiny_model_dirs, tmp_path, arch):
    src = tiny_model_dirs[arch]
    raw = json.loads(open(f"{src}/config.json").read())
    cases = {"as built": variant(src, tmp_path / "full")}
    for name in READ:
        if name in raw and name not in KEEP:
            # Left out: transformers' default, except where the tiny model cannot be served then
            # (e.g. 32 heads of a 128-wide model); both readers must still agree on what they read.
            cases[f"no {name}"] = variant(src, tmp_path / f"no-{name}", drop=[name])
    cases["mistral-like window"] = variant(src, tmp_path / "window", sliding_window=64, max_position_embeddings=4096)
    cases["window off"] = variant(src, tmp_path / "off", sliding_window=64, use_sliding_window=False)
    cases["null window"] = variant(src, tmp_path / "null", sliding_window=None)
    cases["eos list"] = variant(src, tmp_path / "eos", eos_token_id=[3, 5, 3])
    compared = 0
    for what, path in cases.items():
        try:
            theirs = spec_by_transformers(path)
        except Exception:   # transformers refuses it (e.g. Qwen2's layer_types no longer match)
            continue
        try:
            got = ours(path)
        except ModelLoadError:
            # Refused here only for what the kernels cannot serve (e.g. 32 default heads of a
            # 128-wide model): the loader refused it before too.
            with pytest.raises(ModelLoadError, match="cannot be served by the paged-attention kernels"):
                read_model_dir(path)
            continue
        assert got == theirs, what
        compared += 1
    assert compared >= 6


def test_a_mistral_config_with_minimal_fields_reads_as_transformers_does(tiny_llama, tmp_path):
    raw = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 256,
           "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 300}
    path = variant(tiny_llama, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    assert ours(path) == spec_by_transformers(path)
    assert read_model_dir(path).max_model_len == 4096   # Mistral's default window bounds the context


@pytest.mark.parametrize("bad,why", [
    ({"num_hidden_layers": "2"}, "num_hidden_layers must be a positive integer"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"num_attention_heads": True}, "num_attention_heads must be a positive integer"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "RoPE scaling 'dynamic'"),
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
])
def test_a_config_that_cannot_be_served_is_refused_in_one_line(tiny_llama, tmp_path, bad, why):
    with pytest.raises(ModelLoadError, match=why):
        read_model_dir(variant(tiny_llama, tmp_path / "m", **bad))


def test_config_json_that_is_not_an_object_is_refused(tiny_llama, tmp_path):
    path = variant(tiny_llama, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="not a JSON object"):
        read_model_dir(path)
