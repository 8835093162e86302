"""Heartbeats: how a supervisor (the launcher) or a waiting peer (the scheduler) tells a process that
is stuck from one that is merely busy, within seconds rather than after a step timeout.

`Heartbeat` is the beating side: a thread with its own ROUTER socket that answers every Ping with a
Pong whose `ready` says whether the process's main thread has made progress (`tick()`) within
`stuck_after_s`. A process that is stopped (SIGSTOP) or that holds the GIL forever does not answer
at all; one whose main thread is blocked (a deadlocked step, with the GIL released) answers
ready=False. The main thread only assigns a float per tick: nothing to slow a step down.

`HeartbeatWatch` is the watching side, never blocking: each `poke()` reads the Pongs that arrived
and sends a new Ping once a second; `stuck()` says the peer has given no good answer for
`stuck_after_s` (counted from its first answer, so a process still loading its model is not stuck).
"""
from __future__ import annotations

import threading
import time

import zmq

from pagedserve.services import protocol

PING_EVERY_S = 0.5


class Heartbeat:
    def __init__(self, endpoint: str, role: str, stuck_after_s: float, ctx: zmq.Context | None = None):
        self.role, self.stuck_after_s = role, stuck_after_s
        self.last_tick = time.monotonic()
        self._stop = threading.Event()
        self._sock = (ctx or zmq.Context.instance()).socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)          # in the caller's thread: a taken endpoint fails at start
        self._thread = threading.Thread(target=self._serve, name=f"heartbeat {endpoint}", daemon=True)
        self._thread.start()

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    def progressing(self) -> bool:
        return time.monotonic() - self.last_tick < self.stuck_after_s

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100, zmq.POLLIN):
                continue
            identity, *frames = self._sock.recv_multipart()
            try:
                protocol.decode(frames)
            except protocol.ProtocolError:
                continue      # a heartbeat socket answers Pings only; anything else is dropped
            self._sock.send_multipart([identity, *protocol.encode(
                protocol.Pong(self.role, time.time(), self.role, self.progressing()))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._sock.close()


class HeartbeatWatch:
    def __init__(self, endpoint: str, stuck_after_s: float, ctx: zmq.Context | None = None):
        self.endpoint, self.stuck_after_s = endpoint, stuck_after_s
        self.ctx = ctx or zmq.Context.instance()
        self.first_ok: float | None = None
        self.last_ok: float | None = None
        self.last_ping = 0.0
        self._sock = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)    # no Pings queued for a peer that is not there
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(self.endpoint)
        return sock

    def restart(self) -> None:
        """The peer was replaced: forget what the old one said (a new one gets its start grace)."""
        self._sock.close()
        self._sock = self._connect()
        self.first_ok = self.last_ok = None

    def poke(self) -> None:
        now = time.monotonic()
        while self._sock.poll(0, zmq.POLLIN):
            try:
                pong = protocol.decode(self._sock.recv_multipart())
            except protocol.ProtocolError:
                continue
            if isinstance(pong, protocol.Pong) and pong.ready:
                self.last_ok = now
                self.first_ok = self.first_ok or now
        if now - self.last_ping >= PING_EVERY_S:
            self.last_ping = now
            try:
                self._sock.send_multipart(protocol.encode(protocol.Ping("heartbeat", time.time())), zmq.NOBLOCK)
            except zmq.Again:
                pass      # not connected (the peer is gone) or a backlog: silence decides

    def answered(self) -> bool:
        return self.first_ok is not None

    def silent_for(self) -> float:
        return 0.0 if self.last_ok is None else time.monotonic() - self.last_ok

    def stuck(self) -> bool:
        return self.last_ok is not None and self.silent_for() > self.stuck_after_s

    def close(self) -> None:
        self._sock.close()
