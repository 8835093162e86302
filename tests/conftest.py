"""Shared fixtures: tiny random-weight models built once per test session (nothing downloaded)."""
from __future__ import annotations

import os

# Before anything imports transformers or triton: never reach a hub; run Triton kernels in the
# interpreter when there is no GPU (it must be set before kernels are decorated).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest

ARCHS = ("llama", "qwen2", "opt")


@pytest.fixture(scope="session", autouse=True)
def cpu_kernel_built():
    """The C++ CPU attention (kernels/cpu_ops.py) built once, before any test starts a worker: the
    first build takes ~10 s, which would otherwise land inside some process's startup timeout
    (later processes, and later sessions, only load it)."""
    from pagedserve.kernels import cpu_ops
    cpu_ops.available()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    from pagedserve.services.tiny_model import build_tiny_model
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: str(build_tiny_model(root / arch, arch=arch, seed=0)) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]
