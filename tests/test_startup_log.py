"""What a newcomer sees from `pagedserve serve tiny`: a start-up log with no ERROR line and
Ctrl-C (SIGINT to the terminal's foreground process group) that ends it cleanly, exit 0, with no
traceback, its replica named `local` in /ready and in the metrics' engine label; and a router that waits for a scheduler still starting without calling it an error."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pagedserve.loadgen.stack import free_port

REPO = Path(__file__).resolve().parents[1]


def bad_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line or "Error:" in line]


def test_serve_tiny_starts_quietly_and_ctrl_c_ends_it_cleanly(tiny_llama, tmp_path):
    # 'tiny' is .cache/tiny-llama under the working folder: the session's tiny Llama, not rebuilt.
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "tiny-llama").symlink_to(tiny_llama)
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        # A session of its own: the launcher heads a process group, as a shell's foreground job.
        proc = subprocess.Popen([sys.executable, "-m", "pagedserve.services.cli", "serve", "tiny", "--port", str(port)],
                                cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        deadline = time.monotonic() + 240
        while "pagedserve is ready" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(url + "/ready", timeout=10) as r:
            assert json.load(r)["ready_replicas"] == ["local"]
        body = json.dumps({"model": ".cache/tiny-llama", "prompt": "x", "max_tokens": 2}).encode()
        urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body,
                                                      {"Content-Type": "application/json"}), timeout=60).close()
        # The engine label is the replica id /ready gives: the same at every start.
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'vllm:e2e_request_latency_seconds_count{engine="local",model_name=' in metrics
        # What Ctrl-C does, twice, as an impatient user presses it while the stack drains (a
        # router that got both cut its shutdown short with uvicorn's CancelledError traceback).
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = log_path.read_text()
    assert "pagedserve up: stopping" in log and "Finished server process" in log
    assert bad_lines(log) == [], log


def test_a_scheduler_not_yet_up_is_no_error(caplog):
    """Silence before the scheduler's first word is start-up (logged at INFO); silence after it
    is an ERROR."""
    import zmq
    import zmq.asyncio

    from pagedserve.services.router.scheduler_client import SchedulerClient

    async def silent_for(client, seconds: float) -> None:
        client.start()
        await asyncio.sleep(seconds)
        await client.close()

    endpoint = f"tcp://127.0.0.1:{free_port()}"      # nobody listens
    ctx = zmq.asyncio.Context()
    try:
        caplog.set_level(logging.INFO, logger="pagedserve")
        client = SchedulerClient(endpoint, "r0", ctx, ping_interval_s=0.05, dead_after_s=0.2)
        asyncio.run(silent_for(client, 0.6))
        said = [(r.levelno, r.getMessage()) for r in caplog.records if "has not answered" in r.getMessage()]
        assert said and all(level == logging.INFO and "may still be starting" in m for level, m in said)
        caplog.clear()
        client = SchedulerClient(endpoint, "r1", ctx, ping_interval_s=0.05, dead_after_s=0.2)
        client.heard = True                      # as if it had answered once
        asyncio.run(silent_for(client, 0.6))
        assert [r.levelno for r in caplog.records if "has not answered" in r.getMessage()] == [logging.ERROR]
    finally:
        ctx.term()
