"""The launcher keeps a replica serving through the death or the hang of any of its processes, and
stops it cleanly (a drain, then no process, no shared memory, no run folder left).

One stack (two routers behind a real Redis) takes the faults one after another; each test leaves
it serving again, which is what it checks first; the last one stops it (--shutdown-timeout 0).
"""
from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedserve.loadgen.stack import Stack, alive, children_of
from tests.test_stack import REDIS_URL, redis_available

HANG_S = 3.0


def role_pids(stack: Stack, module: str) -> list[int]:
    """Pids of the launcher's children running `python -m module`."""
    out = []
    for pid in children_of(stack.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() in argv and alive(pid):
            out.append(pid)
    return out


def one_pid(stack: Stack, module: str) -> int:
    pids = role_pids(stack, module)
    assert len(pids) == 1, (module, pids)
    return pids[0]


def wait_ready(url: str, timeout_s: float = 90) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"{url} not ready after {timeout_s} s")


def complete(stack: Stack, url: str | None = None, max_tokens: int = 12) -> str:
    r = httpx.post((url or stack.url) + "/v1/completions", timeout=60,
                   json={"model": stack.model, "prompt": "def fibonacci(n):", "max_tokens": max_tokens,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


class LongStream(threading.Thread):
    """A streamed request long enough to be cut by a fault; records how it ended and when."""

    def __init__(self, stack: Stack, url: str | None = None, max_tokens: int = 1000):
        super().__init__(daemon=True)
        self.stack, self.url, self.max_tokens = stack, url or stack.url, max_tokens
        self.tokens, self.outcome, self.ended_at, self.finish = 0, None, None, None
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        body = {"model": self.stack.model, "prompt": "import os", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    self.outcome = f"http {r.status_code}"
                    return
                for line in r.iter_lines():
                    if '"error"' in line:
                        self.outcome = "error event"
                    elif line.startswith("data: {"):
                        self.tokens += 1
                        self.finish = self.finish or json.loads(line[6:])["choices"][0].get("finish_reason")
                        self.started.set()
                    elif line == "data: [DONE]":
                        self.outcome = self.outcome or "done"
        except httpx.HTTPError as e:
            self.outcome = f"cut: {type(e).__name__}"
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def wait_flowing(self) -> None:
        assert self.started.wait(60) and self.outcome is None, self.outcome


@pytest.fixture(scope="module")
def stack(tiny_llama):
    if not redis_available():
        pytest.fail("no Redis at 127.0.0.1:6379 (.ci/run starts one)")
    s = Stack(tiny_llama, "--redis-url", REDIS_URL, "--num-device-blocks", "256",
              "--hang-timeout", str(HANG_S), "--shutdown-timeout", "0", routers=2)
    s.model = tiny_llama
    s.expected = complete(s)
    yield s
    s.stop()


def fault_then_recover(stack: Stack, module: str, sig: int) -> tuple[LongStream, int, float]:
    """A long stream runs; `sig` goes to the `module` process -> (the stream, the old pid, when)."""
    wait_ready(stack.url)
    stream = LongStream(stack)
    stream.wait_flowing()
    pid = one_pid(stack, module)
    os.kill(pid, sig)
    return stream, pid, time.monotonic()


def assert_failed_cleanly(stream: LongStream, hit: float, within_s: float) -> None:
    stream.join(within_s + 5)
    assert stream.outcome == "error event", stream.outcome
    assert stream.ended_at - hit < within_s, stream.ended_at - hit


def test_a_killed_worker_is_restarted_and_the_replica_serves_again(stack):
    stream, old, hit = fault_then_recover(stack, "pagedserve.services.worker.service", signal.SIGKILL)
    assert_failed_cleanly(stream, hit, 3)
    wait_ready(stack.url)
    assert one_pid(stack, "pagedserve.services.worker.service") != old
    assert complete(stack) == stack.expected


def test_a_killed_kvstore_restarts_the_workers_on_its_new_pools(stack):
    kv_old = one_pid(stack, "pagedserve.services.kvstore.service")
    stream, worker_old, hit = fault_then_recover(stack, "pagedserve.services.kvstore.service", signal.SIGKILL)
    assert_failed_cleanly(stream, hit, 3)
    wait_ready(stack.url)
    assert one_pid(stack, "pagedserve.services.worker.service") != worker_old   # not left on the old pool
    assert one_pid(stack, "pagedserve.services.kvstore.service") != kv_old
    assert not glob.glob(f"/dev/shm/pagedserve-{kv_old}-*")          # the dead one's pools are gone
    assert complete(stack) == stack.expected


def test_a_stuck_worker_is_noticed_by_its_heartbeat_and_replaced(stack):
    stream, old, hit = fault_then_recover(stack, "pagedserve.services.worker.service", signal.SIGSTOP)
    try:
        assert_failed_cleanly(stream, hit, HANG_S + 3)   # not the 120 s step timeout
        deadline = time.monotonic() + HANG_S + 5
        while alive(old):                                 # the launcher kills the stuck one
            assert time.monotonic() < deadline, "the stuck worker was not replaced"
            time.sleep(0.2)
        assert httpx.get(stack.url + "/ready", timeout=5).status_code == 503   # a new one is loading
        assert httpx.get(stack.url + "/health", timeout=5).status_code == 200  # the router lives
    finally:
        if alive(old):
            os.kill(old, signal.SIGKILL)
    wait_ready(stack.url)
    assert complete(stack) == stack.expected


def test_a_killed_scheduler_fails_its_requests_at_once_and_comes_back(stack):
    stream, _, hit = fault_then_recover(stack, "pagedserve.services.scheduler.service", signal.SIGKILL)
    assert_failed_cleanly(stream, hit, 2)      # the routers see the connection drop
    wait_ready(stack.url)
    assert complete(stack) == stack.expected


def metric(url: str, name: str) -> float:
    """The value of one unlabelled-but-for-the-model series in a router's /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert len(values) == 1, (name, values)
    return values[0]


HOST_TIER_COUNTERS = ("vllm:external_prefix_cache_hits_total", "pagedserve:host_cache_demotions_total",
                      "pagedserve:host_cache_promotions_total", "pagedserve:host_cache_bytes_copied_total")


def test_a_restarted_scheduler_finds_the_prefixes_cached_before_it_died(stack):
    """The launcher restarts a killed scheduler; the kvstore keeps its cache (ResumeStore), so a
    prompt seen before the kill is a prefix-cache hit after it (today's vLLM, and our reset, lose it)."""
    wait_ready(stack.url)
    prompt = "def allocate(self, n):\n" + "".join(f"    block_{i} = self.free.pop()\n" for i in range(12))
    body = {"model": stack.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = httpx.post(stack.url + "/v1/completions", json=body, timeout=60)
    assert first.status_code == 200, first.text
    hits = metric(stack.url, "vllm:prefix_cache_hits_total")
    host = {name: metric(stack.url, name) for name in HOST_TIER_COUNTERS}
    pid = one_pid(stack, "pagedserve.services.scheduler.service")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while one_pid_or_none(stack, "pagedserve.services.scheduler.service") in (None, pid):
        assert time.monotonic() < deadline, "the scheduler was not restarted"
        time.sleep(0.2)
    wait_ready(stack.url)
    again = httpx.post(stack.url + "/v1/completions", json=body, timeout=60)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    prompt_tokens = again.json()["usage"]["prompt_tokens"]
    assert metric(stack.url, "vllm:prefix_cache_hits_total") - hits == (prompt_tokens - 1) // 16 * 16 > 0
    # The host tier is on by default (the whole --swap-space): it is asked for what the device
    # missed, in tokens, as vLLM counts its external tiers (all of the first request at least).
    assert metric(stack.url, "vllm:external_prefix_cache_queries_total") >= prompt_tokens
    # The prefix came back from the device pool, which the restart left alone: the host tier
    # neither gave a block back nor took or copied one.
    assert {name: metric(stack.url, name) for name in HOST_TIER_COUNTERS} == host


def one_pid_or_none(stack: Stack, module: str) -> int | None:
    pids = role_pids(stack, module)
    return pids[0] if len(pids) == 1 else None


def test_a_killed_router_is_restarted_while_the_other_serves(stack):
    wait_ready(stack.urls[1])
    routers = role_pids(stack, "pagedserve.services.router.service")
    victim = next(p for p in routers if f"--port\0{stack.port + 1}\0".encode()
                  in Path(f"/proc/{p}/cmdline").read_bytes())
    os.kill(victim, signal.SIGKILL)
    assert complete(stack, stack.urls[0]) == stack.expected   # the other one serves meanwhile
    wait_ready(stack.urls[1])
    assert complete(stack, stack.urls[1]) == stack.expected


# ---- shutdown ---------------------------------------------------------------------------------

def leftovers(stack: Stack, descendants: list[int], kv_pids: list[int], run_dir: str) -> list[str]:
    out = [f"pid {p} alive" for p in descendants if alive(p)]
    out += [f for pid in kv_pids for f in glob.glob(f"/dev/shm/pagedserve-{pid}-*")]
    return out + ([run_dir] if os.path.exists(run_dir) else [])


def run_dir_of(stack: Stack) -> str:
    argv = Path(f"/proc/{one_pid(stack, 'pagedserve.services.kvstore.service')}/cmdline").read_bytes().decode().split("\0")
    return os.path.dirname(argv[argv.index("--endpoint") + 1].removeprefix("ipc://"))


def test_sigterm_drains_then_leaves_nothing_behind(tiny_llama):
    s = Stack(tiny_llama, "--num-device-blocks", "128", "--shutdown-timeout", "30")
    s.model = tiny_llama
    stream = LongStream(s, max_tokens=300)
    stream.wait_flowing()
    descendants, kv, run_dir = children_of(s.proc.pid), [one_pid(s, "pagedserve.services.kvstore.service")], run_dir_of(s)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    r = httpx.post(s.url + "/v1/completions", json={"model": tiny_llama, "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == 503, r.text
    assert httpx.get(s.url + "/ready", timeout=5).status_code == 503
    stream.join(60)
    assert stream.outcome == "done" and stream.finish == "length", (stream.outcome, stream.finish)
    assert s.proc.wait(30) == 0
    assert not leftovers(s, descendants, kv, run_dir)


def test_sigterm_with_timeout_zero_ends_running_requests_within_a_second(stack):
    """The module's stack, last: it runs with --shutdown-timeout 0 (and survived every fault above)."""
    wait_ready(stack.url)
    stream = LongStream(stack)
    stream.wait_flowing()
    descendants, kv, run_dir = children_of(stack.proc.pid), [one_pid(stack, "pagedserve.services.kvstore.service")], run_dir_of(stack)
    stack.proc.send_signal(signal.SIGTERM)
    hit = time.monotonic()
    assert_failed_cleanly(stream, hit, 1.0)
    assert stack.proc.wait(30) == 0
    assert not leftovers(stack, descendants, kv, run_dir)
