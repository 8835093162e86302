"""`loadgen` as a user runs it (the installed console script, in its own process, from another
folder) against a scripted server whose timing is known, and against the real stack."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.loadgen.stack import Stack, free_port

LOADGEN = [sys.executable, "-m", "pagedserve.loadgen.cli"]
REPO = Path(__file__).resolve().parents[1]
FILES = ("summary.json", "requests.jsonl", "metrics.jsonl", "report.md", "latency_cdf.png", "throughput.png",
         "server.png")


class FakeServer:
    def __init__(self, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedserve.loadgen.fake_server", "--port", str(self.port), *flags],
                                     stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert "fake server on" in self.proc.stdout.readline()

    def stop(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def fake(request):
    servers = []

    def start(*flags):
        servers.append(FakeServer(*flags))
        return servers[-1]
    yield start
    for s in servers:
        s.stop()


def loadgen(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([*LOADGEN, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def wait_in_flight(url: str, timeout_s: float = 60) -> None:
    """Until the scripted server has requests streaming (a busy machine starts loadgen slowly)."""
    import urllib.request
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        if float(text.split("vllm:num_requests_running", 1)[1].split()[1]) > 0:
            return
        time.sleep(0.1)
    raise AssertionError("loadgen sent nothing")


def test_replay_measures_the_scripted_timing(fake, tmp_path):
    """TTFT = 0.1 s + 1 ms per prompt token, then one event every 30 ms: half of the requests have
    10-token prompts (TTFT 110 ms), half 200 (300 ms); a TTFT SLO of 200 ms keeps exactly half."""
    server = fake("--ttft", "0.1", "--ttft-per-token", "0.001", "--itl", "0.03")
    trace = tmp_path / "two-sizes.jsonl"
    trace.write_text("".join(json.dumps({"input_length": 10 if i % 2 else 200, "output_length": 6}) + "\n"
                             for i in range(16)))
    loadgen("replay", "--url", server.url, "--trace", str(trace), "--rate", "8", "--out", "r",
            "--goodput", "ttft:200", "--percentiles", "50,99", "--no-progress", cwd=tmp_path)
    out = tmp_path / "r"
    assert all((out / f).is_file() and (out / f).stat().st_size > 0 for f in FILES)
    s = json.loads((out / "summary.json").read_text())
    assert s["completed"] == 16 and s["failed"] == 0
    assert s["total_input_tokens"] == 8 * 10 + 8 * 200 and s["total_output_tokens"] == 16 * 6
    assert s["mean_ttft_ms"] == pytest.approx(205, abs=25)
    assert s["median_tpot_ms"] == pytest.approx(30, abs=6)
    assert s["median_itl_ms"] == pytest.approx(30, abs=6)
    assert s["mean_e2el_ms"] == pytest.approx(205 + 5 * 30, abs=35)
    assert s["request_goodput"] == pytest.approx(s["request_throughput"] / 2, rel=0.01)
    assert s["mean_normalized_latency_s_per_token"] == pytest.approx((0.205 + 0.15) / 6, rel=0.15)
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
                "p99_ttft_ms", "std_e2el_ms", "p50_itl_ms"):
        assert key in s
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 16 and all(len(r["token_times"]) == 6 for r in records)
    samples = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert samples and max(x["running"] for x in samples) >= 1
    assert "| TTFT |" in (out / "report.md").read_text()


def test_errors_are_counted_by_kind_and_never_end_the_run(fake, tmp_path):
    server = fake("--fail-every", "3", "--error-every", "5", "--short-by", "1", "--no-metrics")
    loadgen("replay", "--url", server.url, "--trace", "random", "--input-len", "8", "--output-len", "4",
            "--num-requests", "15", "--out", "r", "--no-progress", cwd=tmp_path)
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    # Requests 3, 6, 9, 12, 15 get a 503; of the others 5 and 10 end with an error event.
    assert s["errors"] == {"http_503": 5, "stream_error": 2} and s["completed"] == 8
    assert s["short_outputs"] == 8 and s["metrics_available"] is False
    report = (tmp_path / "r" / "report.md").read_text()
    assert "fewer output tokens than asked" in report and "no /metrics" in report


def test_a_server_that_is_not_there_is_one_line(tmp_path):
    p = loadgen("replay", "--url", f"http://127.0.0.1:{free_port()}", "--no-progress", cwd=tmp_path, check=False)
    assert p.returncode == 2 and "is the server up?" in p.stderr and p.stderr.count("\n") == 1


def test_connection_errors_midway_are_counted(fake, tmp_path):
    server = fake("--itl", "0.05")
    p = subprocess.Popen([*LOADGEN, "replay", "--url", server.url, "--trace", "random", "--input-len", "4",
                          "--output-len", "40", "--num-requests", "30", "--rate", "20", "--out", "r",
                          "--no-progress"], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_in_flight(server.url)
    server.stop()                  # the server dies under load: cut streams, then refused connections
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["failed"] > 0 and set(s["errors"]) <= {"disconnect", "connect", "client"}, s["errors"]
    assert s["completed"] + s["failed"] == 30


def test_ctrl_c_stops_sending_and_writes_a_summary(fake, tmp_path):
    server = fake("--itl", "0.2")
    p = subprocess.Popen([*LOADGEN, "replay", "--url", server.url, "--trace", "random", "--input-len", "4",
                          "--output-len", "50", "--num-requests", "200", "--rate", "10", "--grace", "0.5",
                          "--out", "r", "--no-progress"], cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    wait_in_flight(server.url)
    time.sleep(1)
    started = time.monotonic()
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=60)
    assert p.returncode == 130 and time.monotonic() - started < 15
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["interrupted"] is True
    assert 0 < s["completed"] + s["failed"] < 200 and s["errors"].get("interrupted", 0) > 0
    # The requests cut short keep what they had: when they went out and the tokens they got.
    cut = [json.loads(x) for x in (tmp_path / "r" / "requests.jsonl").read_text().splitlines()]
    cut = [r for r in cut if r["error"] == "interrupted"]
    assert cut and all(r["send"] is not None for r in cut) and any(r["token_times"] for r in cut)
    assert "interrupted" in (tmp_path / "r" / "report.md").read_text()


def test_sweep_auto_finds_saturation_then_compare(fake, tmp_path):
    server = fake("--ttft", "0.02", "--itl", "0.01")
    common = ["--url", server.url, "--trace", "random", "--input-len", "8", "--output-len", "5",
              "--num-requests", "12", "--no-progress"]
    run = loadgen("sweep", *common, "--rates", "auto", "--auto-points", "2", "--max-normalized-latency", "1",
                  "--out", "sw", cwd=tmp_path)
    # Each run, and the sweep once its rates are known, say how long they take before they start.
    said = [line for line in run.stderr.splitlines() if line.startswith("loadgen")]
    assert said[0] == "loadgen: 12 requests of random, all at once", said
    assert said[1].startswith("loadgen sweep: 2 rates x 12 requests: arrivals alone take about "), said
    result = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    rates = [float(r["rate"]) for r in result["rows"]]
    assert rates[0] == float("inf") and len(rates) == 3
    saturated = result["rows"][0]["request_throughput"]
    assert rates[1:] == [float(f"{saturated * k / 2:.3g}") for k in (1, 2)]
    assert result["sustained_rate"] == rates[2]
    assert all((tmp_path / "sw" / r["dir"] / "summary.json").is_file() for r in result["rows"])
    assert (tmp_path / "sw" / "sweep.png").is_file() and "Highest rate" in (tmp_path / "sw" / "sweep.md").read_text()
    loadgen("sweep", *common, "--rates", "5,10", "--out", "sw2", "--no-plots", cwd=tmp_path)
    loadgen("replay", *common, "--rate", "7", "--out", "one", cwd=tmp_path)
    loadgen("compare", "sw", "sw2", "one", "--labels", "a", "b", "c", "--out", "cmp", cwd=tmp_path)
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert all(f"| {label} |" in table for label in "abc") and (tmp_path / "cmp" / "compare.png").is_file()
    assert table.count("| b |") == 2 and "| c | 7 |" in table


def test_replay_against_the_stack(tiny_llama, tmp_path):
    """The README's command, shortened, against `pagedserve up`: every token asked comes back, the
    server's KV usage is read while it runs, and a Mooncake trace's shared prefixes hit its cache."""
    stack = Stack(tiny_llama, "--num-device-blocks", "512")
    try:
        loadgen("replay", "--url", stack.url, "--trace", "sharegpt", "--rate", "inf", "--num-requests", "8",
                "--out", "r", "--no-progress", "--metrics-interval", "0.2", cwd=tmp_path)
        s = json.loads((tmp_path / "r" / "summary.json").read_text())
        assert s["completed"] == 8 and s["failed"] == 0 and s["short_outputs"] == 0
        assert s["server"]["max_model_len"] == 1024
        records = [json.loads(x) for x in (tmp_path / "r" / "requests.jsonl").read_text().splitlines()]
        assert all(r["prompt_tokens"] == r["input_len"] for r in records)
        samples = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
        assert any(x["kv_cache_usage"] for x in samples)
        loadgen("replay", "--url", stack.url, "--trace", "mooncake-conversation", "--trace-times", "--speed", "50",
                "--num-requests", "12", "--out", "m", "--no-progress", "--no-plots", "--metrics-interval", "0.2",
                cwd=tmp_path)
        samples = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
        assert samples[-1]["prefix_cache_hits"] > 0
        assert json.loads((tmp_path / "m" / "summary.json").read_text())["completed"] == 12
    finally:
        stack.stop()
