"""A soak with faults: mixed traffic through a real `pagedserve up` stack while its processes are
killed (SIGKILL) and paused (SIGSTOP, then SIGCONT) at random; then the books are checked.

Traffic: streamed completions, n > 1, beam search, stop strings, streamed chat, and clients that
cut their connection after a few events. A client that cannot connect to a router tries the next
one, as a load balancer would. Every request ends as one outcome:
- `ok`, or `cut` (the client left on purpose);
- a clean error: an OpenAI-shaped HTTP error (`http_503`, ...) or an error event in a stream
  (`stream_error`);
- `router_died`: the connection dropped while the router holding it was being killed (nothing
  else could have answered it);
- a problem: `hung` (no end within the request deadline), `disconnect` (a connection dropped with
  no fault to explain it), `bad_response`, `connect` (no router took it).
Afterwards the stack must serve again, its block pool be back at its baseline (no sequence, no
used block), and once stopped no process, shared-memory segment or run folder may be left.

    python -m pagedserve.loadgen.soak --duration 180            (make soak)
tests/test_soak.py runs a short form in `make test`.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import glob
import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pagedserve.loadgen.stack import Stack, alive, children_of

ROLES = {"worker": "pagedserve.services.worker.service", "kvstore": "pagedserve.services.kvstore.service",
         "scheduler": "pagedserve.services.scheduler.service", "router": "pagedserve.services.router.service"}
CLEAN = {"ok", "cut", "stream_error", "router_died"}       # and every http_NNN with an OpenAI body
KINDS = ("stream", "n", "beam", "stop", "chat", "cut")


@dataclass
class Fault:
    role: str
    signal: str               # KILL or STOP
    pid: int
    at: float                 # monotonic
    paused_s: float = 0.0
    recovered_s: float | None = None
    port: int | None = None   # a router's


@dataclass
class Report:
    requests: collections.Counter = field(default_factory=collections.Counter)   # by kind
    outcomes: collections.Counter = field(default_factory=collections.Counter)   # by outcome
    faults: list[Fault] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    kv_before: dict = field(default_factory=dict)
    kv_after: dict = field(default_factory=dict)

    def figures(self) -> str:
        rec = [f.recovered_s for f in self.faults if f.recovered_s is not None]
        by_fault = collections.Counter(f"{f.signal} {f.role}" for f in self.faults)
        lines = [f"requests: {sum(self.requests.values())}  ({', '.join(f'{k} {v}' for k, v in sorted(self.requests.items()))})",
                 f"outcomes: {', '.join(f'{k} {v}' for k, v in sorted(self.outcomes.items()))}",
                 f"faults: {len(self.faults)}  ({', '.join(f'{k} {v}' for k, v in sorted(by_fault.items()))})"]
        if rec:
            lines.append(f"recovery to ready, s: min {min(rec):.1f}, median {statistics.median(rec):.1f}, "
                         f"max {max(rec):.1f}")
        for f in self.faults:
            lines.append(f"  {f.signal:4} {f.role:9} pid {f.pid}" + (f" paused {f.paused_s:.1f} s" if f.paused_s else "")
                         + (f", ready again after {f.recovered_s:.1f} s" if f.recovered_s is not None else ""))
        lines.append(f"kv before: {self.kv_before}")
        lines.append(f"kv after:  {self.kv_after}")
        lines.append("problems: " + ("none" if not self.problems else ""))
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


def role_pids(launcher_pid: int, role: str) -> list[int]:
    want = ROLES[role].encode()
    out = []
    for pid in children_of(launcher_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in argv and alive(pid):
            out.append(pid)
    return out


def router_port(pid: int) -> int | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        return int(argv[argv.index("--port") + 1])
    except (OSError, ValueError, IndexError):
        return None


class Soak:
    def __init__(self, stack: Stack, model: str, duration_s: float, seed: int, concurrency: int,
                 hang_timeout_s: float, request_deadline_s: float = 90.0):
        self.stack, self.model, self.duration_s = stack, model, duration_s
        self.rng = random.Random(seed)
        self.concurrency, self.hang_timeout_s, self.deadline_s = concurrency, hang_timeout_s, request_deadline_s
        self.report = Report()
        self.seen_pids: set[int] = set(stack.pids)
        self.kvstore_pids: set[int] = set()
        self.run_dir: str | None = None
        self.stop_traffic = asyncio.Event()

    # ---- traffic --------------------------------------------------------------------------------
    def body(self, kind: str) -> tuple[str, dict]:
        r = self.rng
        prompt = r.choice(["def fibonacci(n):", "import os\nimport sys", "class Scheduler:", "while True:"])
        if kind == "chat":
            return "/v1/chat/completions", {"model": self.model, "stream": True, "max_tokens": r.randint(4, 48),
                                            "messages": [{"role": "user", "content": prompt}]}
        body = {"model": self.model, "prompt": prompt, "max_tokens": r.randint(4, 64), "temperature": 0}
        if kind in ("stream", "cut"):
            body.update(stream=True, ignore_eos=True, max_tokens=r.randint(8, 400))
        elif kind == "n":
            body.update(n=3, temperature=0.8, seed=r.randint(0, 1000))
        elif kind == "beam":
            body.update(use_beam_search=True, best_of=3, n=2, max_tokens=16)
        elif kind == "stop":
            body.update(stop=["\n", ":"], max_tokens=48)
        return "/v1/completions", body

    async def client(self, session: aiohttp.ClientSession, number: int) -> None:
        i = number
        while not self.stop_traffic.is_set():
            kind = self.rng.choice(KINDS)
            self.report.requests[kind] += 1
            start = time.monotonic()
            try:
                outcome = await asyncio.wait_for(self.one(session, kind, i), self.deadline_s)
            except asyncio.TimeoutError:
                outcome = "hung"
            if outcome.startswith("disconnect@"):   # a router died under it, or a real problem
                port = int(outcome.split("@")[1])
                outcome = "router_died" if self.router_fault_during(port, start, time.monotonic()) else "disconnect"
            self.report.outcomes[outcome] += 1
            if outcome not in CLEAN and not outcome.startswith("http_"):
                self.report.problems.append(f"a {kind} request ended as {outcome}")
            if outcome == "http_503":
                await asyncio.sleep(0.5)   # as a client honouring Retry-After, not a busy loop
            i += 1

    async def one(self, session: aiohttp.ClientSession, kind: str, i: int) -> str:
        path, body = self.body(kind)
        urls = self.stack.urls[i % len(self.stack.urls):] + self.stack.urls[:i % len(self.stack.urls)]
        for url in urls:     # as a load balancer: a router that refuses the connection is skipped
            try:
                async with session.post(url + path, json=body) as resp:
                    return await self.read(resp, kind, int(url.rsplit(":", 1)[1]))
            except aiohttp.ClientConnectorError:
                await asyncio.sleep(0.2)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError):
                return f"disconnect@{url.rsplit(':', 1)[1]}"
        return "connect"

    async def read(self, resp: aiohttp.ClientResponse, kind: str, port: int) -> str:
        if resp.status != 200:
            try:
                err = (await resp.json(content_type=None))["error"]
                assert isinstance(err["message"], str) and err["code"] == resp.status
            except Exception:
                return "bad_response"
            return f"http_{resp.status}"
        if not body_streams(kind):
            data = await resp.json(content_type=None)
            return "ok" if data.get("choices") else "bad_response"
        events = 0
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "ok"
            if '"error"' in line and "error" in json.loads(line[6:]):
                return "stream_error"
            events += 1
            if kind == "cut" and events >= 3:
                return "cut"      # leaving the `async with` closes the connection mid-stream
        return f"disconnect@{port}"

    def router_fault_during(self, port: int, start: float, end: float) -> bool:
        return any(f.role == "router" and f.port == port and start - 1 <= f.at <= end for f in self.report.faults)

    # ---- faults ---------------------------------------------------------------------------------
    def scan(self) -> None:
        for pid in children_of(self.stack.proc.pid):
            self.seen_pids.add(pid)
        self.kvstore_pids.update(role_pids(self.stack.proc.pid, "kvstore"))

    async def faults(self, session: aiohttp.ClientSession) -> None:
        end = time.monotonic() + self.duration_s
        while time.monotonic() < end:
            await asyncio.sleep(self.rng.uniform(1.0, 3.0))
            self.scan()
            role = self.rng.choice(list(ROLES))
            pids = role_pids(self.stack.proc.pid, role)
            if not pids:
                continue
            pid = self.rng.choice(pids)
            fault = Fault(role, self.rng.choice(["KILL", "STOP"]), pid, time.monotonic(),
                          port=router_port(pid) if role == "router" else None)
            self.report.faults.append(fault)
            try:
                if fault.signal == "KILL":
                    os.kill(pid, signal.SIGKILL)
                else:   # shorter than the hang timeout (it resumes) or longer (the launcher replaces it)
                    fault.paused_s = self.rng.uniform(0.3, 2 * self.hang_timeout_s)
                    os.kill(pid, signal.SIGSTOP)
                    await asyncio.sleep(fault.paused_s)
                    if alive(pid):
                        os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            fault.recovered_s = await self.wait_ready(session, fault.at)
            if fault.recovered_s is None:
                self.report.problems.append(f"not ready within 120 s of {fault.signal} {role}")
                return
        self.stop_traffic.set()

    async def wait_ready(self, session: aiohttp.ClientSession, since: float, limit_s: float = 120.0) -> float | None:
        while time.monotonic() - since < limit_s:
            await asyncio.sleep(0.25)
            self.scan()
            try:
                statuses = []
                for url in self.stack.urls:
                    async with session.get(url + "/ready", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        statuses.append(r.status)
                if all(s == 200 for s in statuses):
                    return time.monotonic() - since
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
        return None

    async def kv(self, session: aiohttp.ClientSession) -> dict:
        async with session.get(self.stack.url + "/v1/kv") as r:
            kv = await r.json()
        return {k: kv.get(k) for k in ("num_sequences", "device_blocks_used", "host_blocks_used",
                                      "device_blocks_total")}

    async def run(self) -> Report:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            self.scan()
            self.run_dir = run_dir_of(self.stack.proc.pid)
            self.report.kv_before = await self.kv(session)
            clients = [asyncio.create_task(self.client(session, n)) for n in range(self.concurrency)]
            try:
                await self.faults(session)
            finally:
                self.stop_traffic.set()
                await asyncio.gather(*clients)
            if await self.wait_ready(session, time.monotonic()) is None:
                self.report.problems.append("not ready after the soak")
                return self.report
            self.report.kv_after = await self.settled_kv(session)
        return self.report

    async def settled_kv(self, session: aiohttp.ClientSession) -> dict:
        """The pool once the last frees reached the kvstore (a heartbeat, ~1 s): at the baseline."""
        deadline = time.monotonic() + 15
        while True:
            kv = await self.kv(session)
            if kv == self.report.kv_before or time.monotonic() > deadline:
                if kv != self.report.kv_before:
                    self.report.problems.append(f"the pool is not back at its baseline: {kv} vs "
                                                f"{self.report.kv_before}")
                return kv
            await asyncio.sleep(0.5)


def body_streams(kind: str) -> bool:
    return kind in ("stream", "cut", "chat")


def run_dir_of(launcher_pid: int) -> str | None:
    for pid in role_pids(launcher_pid, "kvstore"):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        return os.path.dirname(argv[argv.index("--endpoint") + 1].removeprefix("ipc://"))
    return None


def stop_and_check(stack: Stack, soak: Soak) -> None:
    """Stop the stack (SIGTERM, a drain); nothing it ever started may be left."""
    soak.scan()
    code = stack.stop()
    if code != 0:
        soak.report.problems.append(f"the launcher exited with code {code}")
    time.sleep(0.5)
    soak.report.problems += [f"process {p} outlived the launcher" for p in soak.seen_pids if alive(p)]
    soak.report.problems += [f"shared memory {f} left behind" for pid in soak.kvstore_pids
                             for f in glob.glob(f"/dev/shm/pagedserve-{pid}-*")]
    if soak.run_dir and os.path.exists(soak.run_dir):
        soak.report.problems.append(f"run folder {soak.run_dir} left behind")


def soak(model: str, duration_s: float, redis_url: str, seed: int = 0, concurrency: int = 6,
         hang_timeout_s: float = 3.0, routers: int = 2, num_device_blocks: int = 256) -> Report:
    stack = Stack(model, "--redis-url", redis_url, "--num-device-blocks", str(num_device_blocks),
                  "--hang-timeout", str(hang_timeout_s), "--shutdown-timeout", "5", routers=routers)
    s = Soak(stack, model, duration_s, seed, concurrency, hang_timeout_s)
    try:
        asyncio.run(s.run())
    finally:
        stop_and_check(stack, s)
    return s.report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedserve.loadgen.soak", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="a local model folder, or 'tiny'")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of faults and traffic")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/9")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--hang-timeout", type=float, default=3.0)
    args = p.parse_args(argv)
    from pagedserve.services.tiny_model import resolve_model
    report = soak(resolve_model(args.model), args.duration, args.redis_url, args.seed, args.concurrency,
                  args.hang_timeout)
    print(report.figures())
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
