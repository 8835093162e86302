"""Start `pagedserve up` as a real process tree (for full-stack tests and benchmarks), and tear it down."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def free_port(count: int = 1) -> int:
    """A port p such that p .. p+count-1 were all free a moment ago."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count < 65000 and all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def children_of(pid: int) -> list[int]:
    """Every descendant pid, read from /proc (Linux)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


class Stack:
    def __init__(self, model: str, *flags: str, routers: int = 1, timeout_s: float = 300):
        self.port = free_port(routers)
        self.urls = [f"http://127.0.0.1:{self.port + i}" for i in range(routers)]
        argv = [sys.executable, "-m", "pagedserve.services.cli", "up", "--model", model, "--port", str(self.port),
                "--routers", str(routers), *flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        ready = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.lines.append(line)
                if "pagedserve is ready" in line:
                    ready.set()
        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        try:
            while not ready.wait(0.5):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the stack did not start:\n" + "".join(self.lines[-60:]))
        except BaseException:     # a failed start, or Ctrl-C / SIGTERM while waiting: leave no stack behind
            self.stop()
            raise
        self.pids = children_of(self.proc.pid)

    @property
    def url(self) -> str:
        return self.urls[0]

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
