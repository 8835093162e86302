#!/usr/bin/env python3
"""`make gpu-check`: the GPU path checked in one run on one CUDA machine, one table at the end.

Runs with the machine's own Python (its torch and triton; never the Makefile's .venv). What that
Python lacks of scripts/gpu-requirements.txt comes from the wheels `make gpu-wheels` downloaded
into .whl/gpu (carried with the tree: the GPU machine has no network), installed without network
into .whl/site, and only the distributions it lacks (so its own torch, numpy, ... stay).

Sections, each a subprocess with its own time limit, the whole under BUDGET_S:
  kernels    pytest tests/test_kernels.py (compiled, not interpreted) and tests/test_gpu_kernels.py
             (head_dim 64/128, GQA, blocks 16/32, fp16/bf16, contexts to 8k)
  ipc        pytest tests/test_gpu_ipc.py tests/test_cuda_sync.py: the pool and events over CUDA
             IPC, copy-on-write and swap bytes against a CPU copy
             (these three pytest runs go side by side: Triton's compiles are CPU-bound)
  benchmark  python -m pagedserve.kernels.benchmark: paged vs contiguous SDPA, decode and prefill (a figure)
  server     python -m pagedserve.loadgen.gpu_e2e: a 1B-shaped Llama served on the GPU against transformers,
             preemption under a small pool, a replay at a few rates

Exit status: 0 every check passed; 1 a check failed or ran out of time (the table says which);
2 the set-up failed (wheels missing); 77 there is no CUDA device here, so nothing was run.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS, SITE = REPO / ".whl" / "gpu", REPO / ".whl" / "site"
BUDGET_S = 285            # the machine's start and one rerun must fit in its 15 minutes
NO_CUDA = 77


def cuda_missing() -> str | None:
    """None when a CUDA device is usable, else the one line that says why not."""
    try:
        import torch
    except ImportError as e:
        return f"gpu-check: torch does not import with {sys.executable} ({e}); nothing was run"
    if not torch.cuda.is_available():
        return (f"gpu-check: no CUDA device here (torch {torch.__version__} sees none); nothing was run "
                f"(exit {NO_CUDA})")
    return None


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def install_missing() -> list[str]:
    """Install, from WHEELS into SITE, the distributions this Python lacks -> their names."""
    SITE.mkdir(parents=True, exist_ok=True)
    sys.path.append(str(SITE))   # after the machine's own site-packages: its versions win
    importlib.invalidate_caches()
    wheels = sorted(WHEELS.glob("*.whl"))
    missing = [w for w in wheels if not _installed(w.name.split("-")[0])]
    if not wheels and any(not _installed(d) for d in ("pyzmq", "fastapi", "uvicorn")):
        raise SystemExit(f"gpu-check: {WHEELS} holds no wheels and this Python lacks pyzmq/fastapi/uvicorn: "
                         f"run `make gpu-wheels` on a machine with network first (exit 2)")
    if not missing:
        return []
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if pip.returncode == 0:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--target", str(SITE), "--upgrade", *map(str, missing)], check=True)
    else:   # no pip: a wheel is a zip of its site-packages files
        for w in missing:
            with zipfile.ZipFile(w) as z:
                z.extractall(SITE)
    importlib.invalidate_caches()
    return [w.name.split("-")[0] for w in missing]


def start(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    """In a session of its own, so that at the time limit its whole tree goes (a served stack too)."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    proc.began = time.monotonic()
    return proc


def finish(proc: subprocess.Popen, deadline: float, term_grace_s: float = 0.0) -> tuple[int | None, float]:
    """-> (exit code, or None if stopped at the deadline; seconds since it started). At the deadline
    its process group gets SIGTERM and term_grace_s to leave through its finally blocks (0: none),
    then SIGKILL, which also takes whatever of the tree outlived it."""
    try:
        code = proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        code = None
        if term_grace_s > 0:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(term_grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
    return code, time.monotonic() - proc.began


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def pytest_row(section: str, what: str, code, seconds: float, log: Path) -> dict:
    text = log.read_text(errors="replace")
    summary = re.findall(r"=+ (.*(?:passed|failed|error|skipped).*) in [0-9.]+s", text)
    figure = summary[-1] if summary else (text.strip().splitlines() or ["no output"])[-1][:120]
    failed = [line.split(" - ")[0][7:] for line in text.splitlines() if line.startswith("FAILED ")]
    if failed:
        figure += "; " + ", ".join(f.split("::")[-1] for f in failed[:3])
    if code is None:
        figure = f"out of time after {seconds:.0f} s; {figure}"
    return {"section": section, "check": what, "ok": code == 0, "figure": f"{figure} ({seconds:.0f} s)"}


def benchmark_rows(code, seconds: float, out: Path, log: Path) -> list[dict]:
    if code != 0 or not out.exists():
        tail = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1][:120]
        return [{"section": "benchmark", "check": "pagedserve.kernels.benchmark ran", "ok": False,
                 "figure": "out of time" if code is None else tail}]
    data = json.loads(out.read_text())
    rows = [{"section": "benchmark", "check": "paged == contiguous on every cell (max |diff| < 2e-2)",
             "ok": all(r["max_abs_diff"] < 2e-2 for r in data["rows"]), "figure": f"{seconds:.0f} s"}]
    for kind in ("decode", "prefill", "prefix"):
        cells = [r for r in data["rows"] if r["kind"] == kind]
        # the kernel path of each cell (e.g. split16, tile128x64) when the benchmark names one
        ratios = ", ".join(f"{r['batch']}x{r['context']}: {r['ratio']:.2f}"
                           + (f" {r['path']}" if r.get("path") else "") for r in cells)
        rows.append({"section": "benchmark", "check": f"{kind} paged / contiguous SDPA time "
                     f"({data['dtype']}, block {data['block_size']}; goal <= 1.10)", "ok": None, "figure": ratios})
    return rows


def table(rows: list[dict]) -> str:
    mark = {True: "ok", False: "FAIL", None: "-"}
    widths = [max(len(r[k]) for r in rows) for k in ("section", "check")]
    lines = [f"{'section':<{widths[0]}}  {'check':<{widths[1]}}  {'result':<6}  figure"]
    lines += [f"{r['section']:<{widths[0]}}  {r['check']:<{widths[1]}}  {mark[r['ok']]:<6}  {r['figure']}"
              for r in rows]
    return "\n".join(lines)


def main() -> int:
    why = cuda_missing()
    if why:
        print(why, flush=True)
        return NO_CUDA
    began = time.monotonic()
    deadline = began + BUDGET_S
    installed = install_missing()
    import torch
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(SITE)]), HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.pop("TRITON_INTERPRET", None)
    # Every package the sections import, as they will import them (a wheel that needs a newer
    # dependency than the machine has shows here, not as a puzzle inside a section).
    probe = subprocess.run([sys.executable, "-c", "import zmq, msgpack, fastapi, uvicorn, redis, httpx, aiohttp, tqdm, "
                            "prometheus_client, transformers, tokenizers, safetensors, pytest, triton"],
                           cwd=REPO, env=env, capture_output=True, text=True)
    rows = [{"section": "setup", "check": "CUDA device and packages", "ok": probe.returncode == 0,
             "figure": f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
                       f"installed from wheels: {', '.join(installed) or 'nothing'}"
                       + ("" if probe.returncode == 0 else
                          f"; {(probe.stderr.strip().splitlines() or ['import failed'])[-1][:120]}")}]
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    py = [sys.executable]
    tests = {"kernels: tests/test_kernels.py compiled": ["tests/test_kernels.py"],
             "graphs: CUDA graphs decode as eager (tests/test_gpu_graphs.py)": ["tests/test_gpu_graphs.py"],
             "kernels: real sizes (tests/test_gpu_kernels.py)": ["tests/test_gpu_kernels.py"],
             "ipc: pool + events over CUDA IPC, COW/swap bytes": ["tests/test_gpu_ipc.py", "tests/test_cuda_sync.py"]}
    running = {what: (start(py + ["-m", "pytest", "-q", "-p", "no:cacheprovider", *files], env,
                            work / f"pytest{i}.log"), work / f"pytest{i}.log")
               for i, (what, files) in enumerate(tests.items())}
    test_deadline = began + 150
    for what, (proc, log) in running.items():
        code, seconds = finish(proc, test_deadline)
        rows.append(pytest_row(what.split(":")[0], what.split(": ", 1)[1], code, seconds, log))
    out, log = work / "bench.json", work / "bench.log"
    code, seconds = finish(start(py + ["-m", "pagedserve.kernels.benchmark", "--repeats", "20", "--json", str(out)], env, log),
                           min(deadline, time.monotonic() + 45))
    rows += benchmark_rows(code, seconds, out, log)
    out, log = work / "e2e.json", work / "e2e.log"
    code, seconds = finish(start(py + ["-m", "pagedserve.loadgen.gpu_e2e", "--json", str(out), "--rates", "4,16,0"], env, log),
                           deadline)
    if out.exists():
        rows += json.loads(out.read_text())
    if code != 0 and not any(r["section"] == "server" and r["ok"] is False for r in rows):
        rows.append({"section": "server", "check": "pagedserve.loadgen.gpu_e2e finished", "ok": False,
                     "figure": f"out of time after {seconds:.0f} s" if code is None else f"exit {code}"})
    rows.append({"section": "total", "check": "wall time", "ok": time.monotonic() - began <= BUDGET_S + 15,
                 "figure": f"{time.monotonic() - began:.0f} s (logs in {work})"})
    print(table(rows), flush=True)
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
