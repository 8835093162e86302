"""What pagedserve installs cannot collide with another distribution's import names (issue 25).

transformers >= 5.25 imports Hugging Face's `kernels`; our kernels/ folder once had the same import
name and broke every model import from the repository root, and `pip install .` overwrote theirs.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP_FOLDERS = ("kernels", "kvstore", "services", "loadgen")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def run_python(python: str, code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def test_the_top_level_folders_are_not_importable_packages_of_their_own():
    # A root folder with an __init__.py shadows a same-named distribution for any Python started here.
    for folder in TOP_FOLDERS:
        assert not (ROOT / folder / "__init__.py").exists(), folder


def test_pyproject_lists_every_package_folder_under_pagedserve():
    mapping = PYPROJECT["package-dir"]
    folders = {f"pagedserve.{sub}": sub for sub in TOP_FOLDERS}
    assert mapping == {"pagedserve": "pagedserve", **folders}
    found = {"pagedserve"}
    for name, folder in folders.items():
        for d in {p.parent for p in (ROOT / folder).rglob("*.py")}:
            found.add(".".join([name, *d.relative_to(ROOT / folder).parts]))
    assert set(PYPROJECT["packages"]) == found
    assert {p.split(".")[0] for p in PYPROJECT["packages"]} == {"pagedserve"}


def test_no_import_name_we_install_is_provided_by_another_distribution():
    ours = md.distribution("pagedserve")
    names = {n for n in (ours.read_text("top_level.txt") or "").split()} | {"pagedserve"}
    owners = md.packages_distributions()
    for name in names:
        assert set(owners.get(name, ["pagedserve"])) == {"pagedserve"}, (name, owners.get(name))
    for name in (*TOP_FOLDERS, "pagedserve"):   # nor any of the folders' names, by anyone's install
        assert "pagedserve" not in owners.get(name, []) or name == "pagedserve", name


def test_transformers_and_our_worker_load_from_the_repository_root():
    # transformers >= 5.25 requires Hugging Face's kernels: it must be the one found from the root.
    md.distribution("kernels")
    code = ("import kernels; kernels.CUDAProperties\n"
            "from transformers import LlamaConfig, AutoModelForCausalLM\n"
            "import tempfile\n"
            "from pagedserve.services.tiny_model import build_tiny_model\n"
            "from pagedserve.services.worker.model_loader import load_model\n"
            "d = build_tiny_model(tempfile.mkdtemp() + '/m', arch='llama', seed=0)\n"
            "AutoModelForCausalLM.from_pretrained(d)\n"
            "model, spec = load_model(d)\n"
            "print('ok', spec.architecture)\n")
    r = run_python(sys.executable, code, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[0] == "ok"


def _copy_distribution(dist: md.Distribution, site: Path) -> None:
    """Installs `dist` into `site` as pip would have: its files as RECORD lists them."""
    base = Path(dist.locate_file(""))
    for f in dist.files or []:
        src = base / f
        if src.is_file() and ".." not in f.parts:
            (site / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, site / f)


def test_pip_install_beside_transformers_leaves_hugging_faces_kernels_intact(tmp_path):
    """`pip install .` into a venv that holds transformers >= 5.25 and its `kernels`."""
    # Built from a copy: setuptools leaves build/ and *.egg-info beside the sources it builds.
    source, wheels = tmp_path / "source", tmp_path / "wheels"
    for name in ("pyproject.toml", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    for folder in ("pagedserve", *TOP_FOLDERS):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = wheels.glob("pagedserve-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site = Path(run_python(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                           tmp_path).stdout.strip())
    # Hugging Face's kernels really installed there, in the same site-packages our wheel goes to.
    _copy_distribution(md.distribution("kernels"), site)
    r = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # transformers and the rest reached through a .pth to this venv's site-packages: written after
    # the install, or pip would find this venv's own pagedserve there and install nothing.
    here = Path(md.distribution("transformers").locate_file(""))
    (site / "this_venv.pth").write_text(f"{here}\n")
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"pagedserve"}
    code = ("import kernels; kernels.CUDAProperties\n"
            "from transformers import LlamaConfig, AutoModelForCausalLM\n"
            "import pagedserve, pagedserve.services.cli, pagedserve.kvstore.store\n"
            "from pagedserve.kernels import ops, cpu_ops\n"
            "from pagedserve.loadgen import traces\n"
            "from pathlib import Path\n"
            "assert (Path(cpu_ops.__file__).parent / 'csrc' / 'paged_attention_cpu.cpp').is_file()\n"
            "assert list((Path(traces.__file__).parent / 'traces').glob('*.csv'))\n"
            "print(pagedserve.__path__)\n")
    r = run_python(python, code, cwd=tmp_path)     # out of the checkout: the installed copy
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str([str(site / "pagedserve")])
