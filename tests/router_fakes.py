"""Test doubles for the router tests: a fake scheduler on a real ZeroMQ ROUTER socket, and a router
served by uvicorn in a thread on a free port.

The fake scheduler answers like the real one (services/scheduler/service.py) with deterministic
tokens: choice j's k-th token is script[(j + k) % len(script)], its logprob -0.5 - 0.01 k, and its
top alternatives the next script tokens. It records every message it receives.
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import zmq

from pagedserve.services import protocol
from pagedserve.services.sampling_params import SamplingParams


@dataclass
class _Active:
    request_id: str
    owner: bytes
    params: SamplingParams
    prompt_len: int
    produced: dict = field(default_factory=dict)     # choice -> tokens so far
    done: set = field(default_factory=set)
    produced_before: bool = False


class FakeScheduler(threading.Thread):
    def __init__(self, script: list[int], token_delay_s: float = 0.0, tokens_per_update: int = 1,
                 stats: dict | None = None):
        super().__init__(daemon=True)
        self.script = list(script)
        self.token_delay_s = token_delay_s
        self.tokens_per_update = tokens_per_update
        self.ready = True
        self.silent = False          # answer nothing at all (a hung scheduler)
        self.reject_with: protocol.Error | None = None
        self.stats = stats or {"num_requests_running": 0, "num_requests_waiting": 3, "num_requests_swapped": 0,
                               "kv_cache_usage_perc": 0.25, "num_preemptions": 7, "prefix_cache_queries": 100,
                               "prefix_cache_hits": 40, "ready": True,
                               "kv": {"device_blocks_total": 64, "device_blocks_used": 16}}
        self.received: list[tuple[bytes, object]] = []
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.active: dict[str, _Active] = {}

    # ---- what the tests look at ----------------------------------------------------------------
    def messages(self, kind: type) -> list:
        with self._lock:
            return [m for _, m in self.received if isinstance(m, kind)]

    def senders(self, kind: type) -> list[bytes]:
        with self._lock:
            return [who for who, m in self.received if isinstance(m, kind)]

    def wait_for(self, kind: type, count: int = 1, timeout_s: float = 5.0) -> list:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.messages(kind)
            if len(found) >= count:
                return found
            time.sleep(0.01)
        raise AssertionError(f"the fake scheduler got {len(self.messages(kind))} {kind.__name__}, wanted {count}")

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.sock.close()
        self._ctx.term()

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        next_tick = time.monotonic()
        while not self._halt.is_set():
            timeout = max(0.0, next_tick - time.monotonic()) if self.active else 0.02
            if self.sock.poll(int(timeout * 1000) + 1, zmq.POLLIN):
                while self.sock.poll(0, zmq.POLLIN):
                    who, *frames = self.sock.recv_multipart()
                    msg = protocol.decode(frames)
                    with self._lock:
                        self.received.append((who, msg))
                    if not self.silent:
                        self._handle(who, msg)
            if self.active and time.monotonic() >= next_tick and not self.silent:
                self._step()
                next_tick = time.monotonic() + self.token_delay_s

    def _send(self, who: bytes, msg) -> None:
        self.sock.send_multipart([who, *protocol.encode(msg)])

    def _handle(self, who: bytes, msg) -> None:
        if isinstance(msg, protocol.Ping):
            self._send(who, protocol.Pong("replica-0", time.time(), "scheduler", self.ready))
        elif isinstance(msg, protocol.GetStats):
            self._send(who, protocol.StatsReply(dict(self.stats, ready=self.ready, engine="replica-0",
                                                          exporter=bool(msg.router_id))))
        elif isinstance(msg, protocol.AddRequest):
            if self.reject_with is not None:
                self._send(who, protocol.Error(self.reject_with.message, self.reject_with.code,
                                               request_id=msg.request_id))
                return
            params = SamplingParams.from_dict(msg.params)
            self.active[msg.request_id] = _Active(msg.request_id, who, params, len(msg.prompt_token_ids))
        elif isinstance(msg, protocol.AbortRequest):
            req = self.active.pop(msg.request_id, None)
            if req is not None:   # the owner hears of it, whoever asked (as the real scheduler does)
                outs = [protocol.CompletionDelta(j, [], finish_reason="abort")
                        for j in range(req.params.n) if j not in req.done]
                self._send(req.owner, protocol.RequestUpdate(req.request_id, outs, True, None, req.prompt_len))

    def _token(self, choice: int, k: int) -> int:
        return self.script[(choice + k) % len(self.script)]

    def _delta(self, req: _Active, j: int, start: int, count: int) -> protocol.CompletionDelta:
        p = req.params
        ids, lps, tops, finish = [], [], [], None
        for k in range(start, start + count):
            tid = self._token(j, k)
            ids.append(tid)
            lps.append(-0.5 - 0.01 * k)
            tops.append([[self._token(j, k + t + 1), -1.0 - t] for t in range(p.logprobs or 0)])
            if k + 1 >= p.max_tokens:
                finish = "length"
            if tid in p.stop_token_ids:
                finish = "stop"
            if finish:
                break
        return protocol.CompletionDelta(j, ids, lps, tops if p.logprobs is not None else None, finish,
                                        sum(lps) - 0.1 * j)

    def _step(self) -> None:
        for rid in list(self.active):
            req = self.active[rid]
            p = req.params
            if p.use_beam_search:   # one final update with the n best
                outs = [self._delta(req, j, 0, p.max_tokens) for j in range(p.n)]
                self._send(req.owner, protocol.RequestUpdate(rid, outs, True, None, req.prompt_len))
                del self.active[rid]
                continue
            outs = []
            for j in range(p.n):
                if j in req.done:
                    continue
                start = req.produced.get(j, 0)
                d = self._delta(req, j, start, self.tokens_per_update)
                req.produced[j] = start + len(d.token_ids)
                if d.finish_reason:
                    req.done.add(j)
                outs.append(d)
            finished = len(req.done) == p.n
            # Prompt logprobs (when asked) come with the first update, as the real scheduler sends them.
            scored = [[-1.0 - 0.1 * k, k + 1, []] for k in range(req.prompt_len - 1)] \
                if p.prompt_logprobs is not None and not req.produced_before else None
            req.produced_before = True
            self._send(req.owner, protocol.RequestUpdate(rid, outs, finished, None, req.prompt_len, 0, scored))
            if finished:
                del self.active[rid]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterServer:
    """create_app(...) served by uvicorn in a daemon thread."""

    def __init__(self, app):
        import uvicorn
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def ctx(self):
        return self.app.state.ctx

    def __enter__(self) -> "RouterServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the router did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
