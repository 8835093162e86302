#!/usr/bin/env python3
"""`make gpu-bench`: the GPU speed of issue 30 measured in one run on one CUDA machine, eager and
CUDA graphs side by side, one table at the end.

Runs as `make gpu-check` does (scripts/gpu_check.py, whose set-up it imports): the machine's own
Python, what that Python lacks installed without network from the wheels in .whl/gpu, exit 77 at
once where no CUDA device is. The model is the random-weight 1B-shaped Llama of
loadgen/gpu_e2e.py (16 layers, hidden 2048, 32/8 heads of 64) in bfloat16, built once into
.cache/gpu-check-llama-1b (gpu-check's). Sections, each a subprocess with its own time limit, the
whole under BUDGET_S:

  profile  the offline engine (services/engine.py) decoding at batch 1, 16, 64, 256: host ms per
           whole engine step split into schedule / worker / update; forward + logits (the runner's
           execute less its prepare, on one step's inputs); GPU busy ms and kernel launches per
           step from torch.profiler; eager and graphs
  offline  paged vs Orca-Oracle as ../shared/gpu-baseline/gpu_paper.py runs them: a 256 MiB KV
           pool, 400 ShareGPT-like requests (lengths halved) all at once: output tok/s and the
           share of the cache holding token states; paged eager and graphs, Orca-Oracle graphs
  served   the whole stack (`pagedserve up`, bf16) at saturation through loadgen's client: output
           tok/s and TPOT, eager and graphs, their ratio

Eager means EngineConfig(enforce_eager=True) and `--enforce-eager` on the serve command line (vLLM's
meaning: no CUDA graphs); where this checkout has no such setting, one row says so and only the
default runs. Every figure also goes to a JSON file: --json, else $OUT/gpu-bench.json when $OUT is
set (the device tool brings $OUT back).

--cpu-smoke runs the same code on CPU with tiny sizes (the tiny model in float32, batch 1 and 2, a
few requests; the profiler's CPU figures stand for the GPU's; no graphs), so a test checks that the
table and the JSON come out (tests/test_gpu_bench.py).

Exit status: 0 every section ran to its end (a missed target is a figure, not a failure); 1 a
section failed or ran out of time (the table says which); 2 the set-up failed; 77 no CUDA device
here and no --cpu-smoke, so nothing was run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402  (its set-up: cuda_missing, install_missing, the wheel folders)
# The two halves of the bench (and the names tests/test_gpu_bench.py reaches through this script):
from gpu_bench_report import (  # noqa: E402,F401
    offline_rows, profile_rows, row, section_rows, served_rows, table)
from gpu_bench_sections import (  # noqa: E402,F401
    engine_config, measure_batch, profile_figures, run_section, sizes, union_ms)

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = gpu_check.NO_CUDA
STOP_GRACE_S = 20.0   # a section at its time limit leaves through its finally blocks (a served stack stops)
BUDGET_S = 270            # the machine's start and one rerun must fit in its 15 minutes

# Each section's share of the budget, in order; a section also stops at the overall deadline.
LIMITS_S = {"model": 30, "profile": 70, "offline": 85, "served": 85}
SMOKE_LIMITS_S = {"model": 60, "profile": 60, "offline": 60, "served": 90}   # caps; it takes ~1 minute


# ------------------------------------------------------------------------------------------------
# The orchestrator: sections as subprocesses, one table, one JSON
# ------------------------------------------------------------------------------------------------

def json_path(arg: str | None) -> Path | None:
    if arg:
        return Path(arg)
    out = os.environ.get("OUT")
    return Path(out) / "gpu-bench.json" if out else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU, no graphs (a test runs it)")
    p.add_argument("--json", default=None, help="every figure (default $OUT/gpu-bench.json when $OUT is set)")
    p.add_argument("--sections", default="profile,offline,served", help="which, in order (all by default)")
    p.add_argument("--section", help=argparse.SUPPRESS)   # internal: run one section in this process
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.section:
        return run_section(args)
    smoke = args.cpu_smoke
    began = time.monotonic()
    installed: list[str] = []
    if not smoke:
        why = gpu_check.cuda_missing()
        if why:
            print(why.replace("gpu-check:", "gpu-bench:", 1), flush=True)
            return NO_CUDA
        installed = gpu_check.install_missing()
    import torch
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(gpu_check.SITE)]), HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.pop("TRITON_INTERPRET", None)
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    limits = SMOKE_LIMITS_S if smoke else LIMITS_S
    budget = sum(limits.values())
    deadline = began + budget
    device = "CPU smoke run (tiny model, float32, no graphs)" if smoke else torch.cuda.get_device_name(0)
    rows = [row("setup", "machine", f"{device}, torch {torch.__version__}, installed from wheels: "
                f"{', '.join(installed) or 'nothing'}")]
    result = {"device": device, "torch": torch.__version__, "smoke": smoke, "sections": {}, "rows": rows}
    work = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    py = [sys.executable, str(Path(__file__).resolve())] + (["--cpu-smoke"] if smoke else [])
    # The model first (built once; a later run finds it), then the sections in order.
    out, log = work / "model.json", work / "model.log"
    code, seconds = gpu_check.finish(gpu_check.start(py + ["--section", "model", "--json", str(out)], env, log),
                                     min(deadline, time.monotonic() + limits["model"]), STOP_GRACE_S)
    data = json.loads(out.read_text()) if out.exists() else {}
    model = (data.get("runs") or [{}])[0].get("model")
    result["sections"]["model"] = data
    if not model:
        rows += section_rows("model", code, seconds, data, log, smoke)
    else:
        rows.append(row("setup", "model", f"{model} ({seconds:.0f} s)", "ready", True))
        section_end = time.monotonic()
        for name in args.sections.split(","):
            section_end += limits[name]
            out, log = work / f"{name}.json", work / f"{name}.log"
            code, seconds = gpu_check.finish(
                gpu_check.start(py + ["--section", name, "--model", model, "--json", str(out)], env, log),
                min(deadline, max(section_end, time.monotonic() + limits[name] / 2)), STOP_GRACE_S)
            data = json.loads(out.read_text()) if out.exists() and out.stat().st_size else {}
            result["sections"][name] = data
            rows += section_rows(name, code, seconds, data, log, smoke)
    total = time.monotonic() - began
    rows.append(row("total", "wall time", f"{total:.0f} s (logs in {work})", f"<= {budget + 15} s",
                    total <= budget + 15))
    result["wall_s"] = round(total, 1)
    text = table(rows)
    path = json_path(args.json)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str))
    print(text, flush=True)
    if path is not None:
        print(f"gpu-bench: every figure in {path}", flush=True)
    return 0 if all(r["ok"] is not False for r in rows if not r["goal"]) else 1


if __name__ == "__main__":
    sys.exit(main())
