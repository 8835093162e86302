"""README.md as a newcomer follows it: every code block marked `<!-- runnable -->` (the line before
its fence) runs, as written, in a folder laid out like the repository, against a `pagedserve serve
tiny` of the test's own; a block that fails fails `make test`. Long runs go in short forms
(SHORT_FORMS: fewer requests, seconds instead of minutes). The README's links stay inside the
repository, the module names it and docs/DESIGN.md give import, and the metric names of its PromQL
examples are in /metrics."""
from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pagedserve.loadgen.stack import free_port

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MARKER = "<!-- runnable -->"
README_PORT = "127.0.0.1:8000"
# (pattern, replacement): what makes a long block short; the rest of the block runs as written.
SHORT_FORMS = [(r"--num-requests \d+", "--num-requests 6"), (r"--duration \d+", "--duration 2"),
               (r"--rates auto", "--rates auto --auto-points 2")]


def blocks(text: str) -> list[tuple[int, str, str, bool]]:
    """(line number, language, code, marked runnable) of every fenced block."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```") and len(lines[i]) > 3:
            start, lang = i, lines[i][3:].split()[0]
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            found.append((start + 1, lang, "\n".join(lines[start + 1:end]) + "\n", before == MARKER))
            i = end
        i += 1
    return found


RUNNABLE = [(line, lang, code) for line, lang, code, marked in blocks(README.read_text()) if marked]


def test_the_readme_marks_its_runnable_blocks():
    assert len(RUNNABLE) >= 6 and {lang for _, lang, _ in RUNNABLE} == {"bash", "python"}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A folder that looks like the repository (its top-level entries linked, .venv the running
    interpreter's), so relative paths in the README resolve, while outputs land here."""
    root = tmp_path_factory.mktemp("readme")
    for entry in REPO.iterdir():
        if entry.name not in (".git", ".venv"):
            (root / entry.name).symlink_to(entry)
    (root / ".venv").symlink_to(sys.prefix)
    return root


@pytest.fixture(scope="module")
def server(sandbox):
    """`pagedserve serve tiny` from the repository (it serves .cache/tiny-llama, built there on
    first use as `make serve` does), on a free port that the blocks' 8000 is changed to."""
    port = free_port()
    log = open(sandbox / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.services.cli", "serve", "tiny", "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env())
    try:
        deadline = time.monotonic() + 300
        while "pagedserve is ready" not in (sandbox / "serve.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (sandbox / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()


def env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")


@pytest.mark.parametrize("line,lang,code", RUNNABLE, ids=[f"line{line}" for line, _, _ in RUNNABLE])
def test_a_runnable_block_runs(line, lang, code, sandbox, request):
    if README_PORT in code:
        code = code.replace(README_PORT, request.getfixturevalue("server"))
    elif "tiny-llama" in code:
        request.getfixturevalue("server")       # the model folder it builds
    for pattern, short in SHORT_FORMS:
        code = re.sub(pattern, short, code)
    argv = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    res = subprocess.run(argv, cwd=sandbox, env=env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, f"README.md line {line}:\n{code}\n--- stdout\n{res.stdout[-3000:]}\n" \
                                f"--- stderr\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, res.stderr[-3000:]


def test_promql_examples_name_metrics_we_export(server):
    """Each metric a PromQL block names is in /metrics (after a request, so the histograms exist)."""
    body = b'{"model": ".cache/tiny-llama", "prompt": "x", "max_tokens": 2}'
    urllib.request.urlopen(urllib.request.Request(f"http://{server}/v1/completions", body,
                                                  {"Content-Type": "application/json"}), timeout=60).close()
    with urllib.request.urlopen(f"http://{server}/metrics", timeout=10) as r:
        exported = {line.split("{")[0].split()[0] for line in r.read().decode().splitlines()
                    if line and not line.startswith("#")}
    names = {name for _, lang, code, _ in blocks(README.read_text()) if lang == "promql"
             for name in re.findall(r"\b(?:vllm|pagedserve):[a-z_0-9]+", code)}
    assert names and names <= exported, names - exported


def test_links_stay_inside_the_repository_and_lead_somewhere():
    for doc in (README, REPO / "docs" / "DESIGN.md", REPO / "benchmarks" / "peers" / "README.md"):
        text = doc.read_text()
        assert "../shared" not in text, doc
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(REPO) and path.exists(), f"{doc.name}: {target}"


def resolves(name: str) -> bool:
    """A module, or a module's attribute (pagedserve.services.guided.spec.make)."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        return obj is not None
    return False


def test_module_names_in_the_docs_import():
    for doc in (README, REPO / "docs" / "DESIGN.md"):
        for name in set(re.findall(r"(?<![\w/.-])pagedserve(?:\.[a-z_0-9]+)+", doc.read_text())):
            assert resolves(name), f"{doc.name}: {name}"
