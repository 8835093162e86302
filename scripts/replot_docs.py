"""Redraw the committed example figures (docs/paper, docs/loadgen-example) from the results saved
beside them, with the current loadgen/plots.py: seconds, instead of rerunning `loadgen paper`
(6 min) or the replays and sweeps against a server (tens of minutes).

What cannot be redrawn is left as it is: a replay's latency CDFs and throughput need its
requests.jsonl, which the committed examples drop (too large); their server.png comes from
metrics.jsonl. Run at the checkout's root as a module (the root on sys.path, so that the
checkout's own pagedserve is the one imported): python -m scripts.replot_docs
"""
from __future__ import annotations

import json
from pathlib import Path

from pagedserve.loadgen import plots
from pagedserve.loadgen.config import CompareConfig, PaperConfig
from pagedserve.loadgen.paper import paper
from pagedserve.loadgen.report import load_summary, run_title
from pagedserve.loadgen.sweep import compare, load_sweep, write_sweep

DOCS = Path(__file__).resolve().parent.parent / "docs"
# compare folders and the sweeps they put side by side, in the order of their compare.md
COMPARES = {DOCS / "paper/cpu/compare": [DOCS / "paper/cpu" / a for a in ("paged", "orca-oracle", "orca-max")]}


def main() -> None:
    paper(PaperConfig(out=str(DOCS / "paper"), replot=True, progress=False))
    for summary in sorted(DOCS.glob("**/summary.json")):
        folder = summary.parent
        if (folder / "metrics.jsonl").is_file():
            samples = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]
            plots.server_plot(samples, folder / "server.png", run_title(load_summary(folder)))
    for saved in sorted(DOCS.glob("**/sweep.json")):
        write_sweep(load_sweep(saved.parent), saved.parent, plots=True)
    for out, dirs in COMPARES.items():
        compare(CompareConfig(dirs=[str(d) for d in dirs], out=str(out)))
    print(f"redrawn under {DOCS}")


if __name__ == "__main__":
    main()
