"""The router as a process: flags, one-line errors, a clean exit on SIGTERM."""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from router_fakes import free_port
from pagedserve.services.router import service


def _config(*argv):
    parser = argparse.ArgumentParser()
    service.Config.add_arguments(parser)
    return service.Config.from_args(parser.parse_args(list(argv)))


def test_config_from_flags_and_validation():
    cfg = _config("--model", "m", "--port", "9001", "--router-id", "r7", "--api-key", "k1", "--api-key", "k2",
                  "--require-api-key", "--rate-limit", "5")
    assert (cfg.port, cfg.router_id, cfg.api_keys, cfg.rate_limit) == (9001, "r7", ["k1", "k2"], 5)
    assert cfg.scheduler_endpoint == "tcp://127.0.0.1:5602" and cfg.redis_url is None
    assert _config("--model", "m", "--scheduler-endpoint", "none", "--redis-url", "redis://h:1/0").scheduler_endpoint is None
    assert _config("--model", "m").router_id != _config("--model", "m").router_id, "unique default ids"
    for argv, flag in ((["--scheduler-endpoint", "none"], "--scheduler-endpoint"),
                       (["--scheduler-endpoint", "http://x"], "--scheduler-endpoint"),
                       (["--port", "70000"], "--port"), (["--redis-url", "http://x"], "--redis-url"),
                       (["--require-api-key"], "--api-key"), (["--rate-limit", "0"], "--rate-limit"),
                       (["--log-level", "LOUD"], "--log-level")):
        with pytest.raises(ValueError, match=flag):
            _config("--model", "m", *argv)


def test_the_process_serves_and_exits_0_on_sigterm(tiny_llama):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.services.router.service", "--model", tiny_llama,
                             "--port", str(port), "--scheduler-endpoint", "tcp://127.0.0.1:1",
                             "--log-level", "WARNING"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline, "the router did not come up"
                time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_bad_model_folder_is_one_line_and_exit_1(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pagedserve.services.router.service", "--model", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
