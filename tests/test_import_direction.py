"""Imports flow one way: kernels -> kvstore (the block-store core) -> services (the wire and process
plumbing, then the roles) -> loadgen. And torch stays out of the processes that do not compute:
the scheduler imports none, and the router none at import time (docs/ARCHITECTURE.md).

The walk is static (every import statement of every module, at any depth in the file, lazy ones
included), so a back-edge is found even on a path no test runs."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "kvstore", "services", "loadgen")   # bottom to top


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: the project writes absolute imports, keep it so
                out.append((node.lineno, "." * node.level + (node.module or "")))
            elif node.module:
                out.append((node.lineno, node.module))
    return out


def layer_of(module: str) -> str | None:
    """pagedserve.<layer>... -> layer; a bare top-level folder name counts too (a second module
    object for the same file: also a defect, caught below)."""
    parts = module.split(".")
    if parts[0] == "pagedserve" and len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return None


def back_edges() -> list[str]:
    found = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT)
            for line, module in imported_modules(path):
                if module.startswith("."):
                    found.append(f"{rel}:{line}: relative import {module}")
                elif module.split(".")[0] in LAYERS:
                    found.append(f"{rel}:{line}: imports {module} by its folder name, not pagedserve.{module}")
                else:
                    target = layer_of(module)
                    if target is not None and LAYERS.index(target) > LAYERS.index(layer):
                        found.append(f"{rel}:{line}: {layer} imports {module}, a layer above it")
    return found


def test_imports_flow_from_kernels_to_loadgen_only():
    assert back_edges() == []


def test_the_walk_finds_a_planted_back_edge(tmp_path, monkeypatch):
    # The check itself can fail: a kvstore module that imports services (as client.py did).
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    (tmp_path / "kvstore" / "bad.py").write_text("def f():\n    from pagedserve.services import protocol\n")
    (tmp_path / "kernels" / "worse.py").write_text("import services.rpc\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert back_edges() == [
        "kernels/worse.py:1: imports services.rpc by its folder name, not pagedserve.services.rpc",
        "kvstore/bad.py:2: kvstore imports pagedserve.services, a layer above it"]


@pytest.mark.parametrize("module", ["pagedserve.services.scheduler.service", "pagedserve.services.scheduler.scheduler",
                                    "pagedserve.services.router.service", "pagedserve.services.router.app",
                                    "pagedserve.services.router.model_info", "pagedserve.kvstore.store",
                                    "pagedserve.kvstore.replay"])
def test_processes_that_do_not_compute_import_no_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", f"{module} imports torch"
