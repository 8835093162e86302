"""`make gpu-check` where no GPU is: one line and exit 77 at once; and its parts that need no GPU
(installing only the missing wheels, reading pytest's summary, the table)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """scripts/NAME.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gpu_check():
    return load_script("gpu_check")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this would run the whole check")
@pytest.mark.parametrize("target", ["gpu-check", "gpu-bench"])
@pytest.mark.parametrize("via_make", [False, True])
def test_without_cuda_one_line_and_exit_77(via_make, target):
    argv = (["make", "-s", target, f"GPU_PY={sys.executable}"] if via_make
            else [sys.executable, f"scripts/{target.replace('-', '_')}.py"])
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert res.stdout.splitlines() == [f"{target}: no CUDA device here (torch {torch.__version__} sees none); "
                                       f"nothing was run (exit 77)"]
    assert res.returncode == (2 if via_make else 77)   # make reports a failed recipe as 2 ("Error 77")


def fake_wheel(folder: Path, dist: str) -> Path:
    path = folder / f"{dist}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/__init__.py", "VALUE = 42\n")
        info = f"{dist}-1.0.dist-info"
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_only_the_distributions_this_python_lacks_are_installed(gpu_check, tmp_path, monkeypatch):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    fake_wheel(wheels, "pagedserve_gpu_check_probe")
    fake_wheel(wheels, "msgpack")        # present here: must not be shadowed by the wheel
    monkeypatch.setattr(gpu_check, "WHEELS", wheels)
    monkeypatch.setattr(gpu_check, "SITE", site)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert gpu_check.install_missing() == ["pagedserve_gpu_check_probe"]
    assert (site / "pagedserve_gpu_check_probe" / "__init__.py").exists() and not (site / "msgpack").exists()
    assert gpu_check.install_missing() == []    # a rerun finds it in the site folder


def test_pytest_summary_and_table(gpu_check, tmp_path):
    log = tmp_path / "log"
    log.write_text("....F\nFAILED tests/test_gpu_kernels.py::test_decode_at_real_sizes[64-16-dtype0] - x\n"
                   "===== 1 failed, 4 passed in 12.30s =====\n")
    row = gpu_check.pytest_row("kernels", "real sizes", 1, 12.3, log)
    assert row["ok"] is False and row["figure"].startswith("1 failed, 4 passed; test_decode_at_real_sizes")
    text = gpu_check.table([row, {"section": "benchmark", "check": "decode", "ok": None, "figure": "1.05"}])
    lines = text.splitlines()
    assert len(lines) == 3 and "FAIL" in lines[1] and lines[2].split()[0] == "benchmark"
