"""The C++ paged attention for CPU (kernels/csrc/paged_attention_cpu.cpp), built on first use.

This module owns building and loading that kernel and the Python side of its two calls; their
semantics are kernels/reference.py's, which stays the fallback. The K/V cache write is here too (a
row copy per head; one op, so a recorded decode graph replays it whatever the slots); the block copy
is the reference's (the kvstore copies blocks and must never trigger a build).

Why C++: the reference gathers every sequence's blocks into a contiguous copy each layer each step
(index_select: 28 % of an offline run) before calling SDPA on it. The kernel reads each block where
the table says it is, with an online softmax over blocks, so no copy of the context is made.

Build: torch.utils.cpp_extension.load compiles it with the machine's C++ compiler the first time a
process asks for it (~10 s; only torch/library.h is included, not torch/extension.h, which takes
~40 s) into TORCH_EXTENSIONS_DIR or else <repo>/.cache/torch_extensions. The directory's name
carries a digest of the CPU's feature flags and the torch version, because the code is compiled
for the machine it is built on (-march=native) and must not be picked up on another. Later
processes find the build there and only load it. Where it cannot be built (no compiler, no ninja,
an error) one warning says why and `available()` is False: the dispatch then uses the reference.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path

import torch

from pagedserve.kernels import reference

log = logging.getLogger("pagedserve.kernels")

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.cpp"
_NAME = "pagedserve_cpu"

copy_blocks = reference.copy_blocks

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool once tried; "why": the reason it is not


def _cpu_digest() -> str:
    """A digest of what -march=native compiles for: the CPU's feature flags, and torch's version."""
    features = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            features = next((line for line in f if line.startswith(("flags", "Features"))), features)
    except OSError:
        pass
    key = f"{platform.machine()} {features} {torch.__version__}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def build_directory() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"
    return base / f"{_NAME}_{_cpu_digest()}"


def _compile_flags() -> list[str]:
    # -march=native is what makes the plain loops AVX-512 / NEON where the CPU has them; gcc and
    # clang accept it on x86_64 and aarch64. Elsewhere the build is portable -O3.
    native = ["-march=native"] if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64") else []
    return ["-O3", *native]


def _missing_tool() -> str | None:
    """Why a build cannot even start, or None."""
    from torch.utils import cpp_extension
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if not cpp_extension.is_ninja_available():
        # cpp_extension runs `ninja` from PATH; the pip package (a dependency) puts it in the
        # environment's bin folder, which is not on PATH when .venv/bin/python runs unactivated.
        try:
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        if not cpp_extension.is_ninja_available():
            return "ninja is not on PATH (torch.utils.cpp_extension builds with it)"
    return None


def _build() -> None:
    from torch.utils import cpp_extension
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / f"{_NAME}.so").exists():  # the one slow start: say so before it
        log.warning("compiling the CPU paged-attention kernel into %s (first use on this machine; "
                    "~10 s, once)", directory)
    started = time.monotonic()
    cpp_extension.load(name=_NAME, sources=[str(SOURCE)], extra_cflags=_compile_flags(),
                       build_directory=str(directory), is_python_module=False, verbose=False)
    log.info("CPU paged-attention kernel loaded in %.1f s from %s", time.monotonic() - started, directory)


def available() -> bool:
    """Whether the C++ kernel is loaded in this process, building it on the first call."""
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                why = _missing_tool()
                if why is None:
                    try:
                        _build()
                    except Exception as e:  # a failed build is a slower server, not a dead one
                        why = f"the build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
                if why is not None:
                    log.warning("CPU paged-attention kernel unavailable, using the PyTorch reference "
                                "(it gathers each sequence's K/V every step): %s", why)
                _state["why"] = why
                _state["ok"] = why is None
    return bool(_state["ok"])


def unavailable_reason() -> str | None:
    """Why available() is False (None when it is True or not yet asked)."""
    return _state.get("why")  # type: ignore[return-value]


_NO_QUERY_STARTS = torch.empty(0, dtype=torch.int32)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(device="cpu", dtype=torch.int32).contiguous()


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """As reference.write_kv_cache: key, value [T, Hkv, D] into their slots; a negative slot skips."""
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    torch.ops.pagedserve_cpu.write_kv_cache(key.to(k_cache.dtype), value.to(v_cache.dtype), k_cache, v_cache,
                                            slot_mapping.to(device="cpu", dtype=torch.int64).contiguous())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    max_query_len: int) -> torch.Tensor:
    """As reference.paged_attention: q [T, Hq, D] over the paged cache -> [T, Hq, D]."""
    del max_query_len  # the kernel tiles each sequence's queries itself
    return torch.ops.pagedserve_cpu.paged_attention(
        q, k_cache, v_cache, _int32(block_tables), _int32(seq_lens), _int32(query_start_loc), scale)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """As reference.paged_decode_attention: q [S, Hq, D], one query per sequence -> [S, Hq, D]."""
    return torch.ops.pagedserve_cpu.paged_attention(
        q, k_cache, v_cache, _int32(block_tables), _int32(seq_lens), _NO_QUERY_STARTS, scale)
