"""What a model folder decides before anything runs: the serving dtype (the checkpoint's on CUDA,
float32 on CPU, a flag over both) and the kernels' limits, checked at load time on every path."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedserve.services import launcher
from pagedserve.services.engine import Engine
from pagedserve.services.engine_config import EngineConfig
from pagedserve.services.worker.model_loader import ModelLoadError, inspect_model_dir, serving_dtype


def copy_with_config(src: str, dst, **changes) -> str:
    """A copy of a model folder whose config.json has `changes` (None removes a key)."""
    shutil.copytree(src, dst)
    path = dst / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    return str(dst)


@pytest.mark.parametrize("changes,cuda_auto", [
    ({"dtype": "bfloat16"}, torch.bfloat16),
    ({"dtype": None, "torch_dtype": "bfloat16"}, torch.bfloat16),   # the older key
    ({"dtype": "float32"}, torch.float32),
    ({"dtype": None, "torch_dtype": None}, torch.float16),         # names none
])
def test_auto_dtype_is_the_checkpoints_on_cuda_and_float32_on_cpu(tiny_llama, tmp_path, changes, cuda_auto):
    _, spec = inspect_model_dir(copy_with_config(tiny_llama, tmp_path / "m", **changes))
    assert serving_dtype("auto", "cuda", spec) == cuda_auto
    assert serving_dtype("auto", "cuda:1", spec) == cuda_auto
    assert serving_dtype("auto", "cpu", spec) == torch.float32
    assert serving_dtype("float16", "cpu", spec) == torch.float16   # the flag wins
    assert serving_dtype("float32", "cuda", spec) == torch.float32
    with pytest.raises(ValueError, match="--dtype"):
        serving_dtype("fp8", "cuda", spec)


def test_launcher_sizes_blocks_and_starts_workers_with_the_resolved_dtype(tiny_llama, tmp_path):
    model = copy_with_config(tiny_llama, tmp_path / "m", dtype="bfloat16")
    _, spec = inspect_model_dir(model)
    for device, dtype_flag, want in (("cuda", "auto", torch.bfloat16), ("cpu", "auto", torch.float32),
                                     ("cpu", "float16", torch.float16)):
        cfg = launcher.Config(model=model, device=device, dtype=dtype_flag, num_device_blocks=8)
        procs = dict(launcher.process_commands(cfg, model, str(tmp_path)))
        kv, worker = procs["kvstore"], procs["worker0"]
        assert int(kv[kv.index("--block-bytes") + 1]) == spec.block_bytes(cfg.block_size, want)
        assert worker[worker.index("--dtype") + 1] == str(want).removeprefix("torch.")


def test_up_takes_a_dtype_flag():
    import argparse
    p = argparse.ArgumentParser()
    launcher.Config.add_arguments(p)
    assert launcher.config_from_args(p.parse_args(["--dtype", "bfloat16"])).dtype == "bfloat16"
    with pytest.raises(ValueError, match="--dtype"):
        launcher.config_from_args(p.parse_args(["--dtype", "int8"]))


@pytest.mark.parametrize("head_dim", [24, 8, 512])
def test_kernel_limits_are_checked_when_the_folder_is_read_on_every_device(tiny_llama, tmp_path, head_dim):
    model = copy_with_config(tiny_llama, tmp_path / "m", head_dim=head_dim)
    with pytest.raises(ModelLoadError, match="power of two in \\[16, 256\\]"):
        inspect_model_dir(model)
    with pytest.raises(ModelLoadError, match="head_dim"):   # the offline engine, on CPU
        Engine(EngineConfig(model=model, device="cpu"))
    cfg = launcher.Config(model=model, num_device_blocks=8)
    with pytest.raises(ModelLoadError, match="head_dim"):   # `pagedserve up`, before any process starts
        launcher.process_commands(cfg, model, str(tmp_path))
