"""Request/reply over a ZeroMQ DEALER socket with a deadline: how one process asks another.

A peer that does not answer in time raises PeerTimeout; so does a peer whose connection drops while
we wait (seen through a ZeroMQ socket monitor), at once rather than at the deadline: a worker that
dies mid-step fails the step in milliseconds, not after the step timeout. Either way the socket is
rebuilt, so that a late reply can never be mistaken for the answer to the next question. A reply
that does not decode raises BadReply (a PeerTimeout: the caller treats the peer as broken) and
rebuilds the socket too: the reply and the question are no longer known to pair up.

The socket is set up by services.curve.SocketGuard: CURVE when the process has keys, and a limit
on the frames it takes.

`on_wait`, if given, runs at least every WAIT_SLICE_S while an answer is awaited: a caller that
waits is alive (it ticks its own heartbeat), and may give up early (it raises PeerTimeout, e.g.
when the peer's heartbeat says it is stuck).
"""
from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from pagedserve.services import protocol
from pagedserve.services.curve import SocketGuard


WAIT_SLICE_S = 0.25


class PeerTimeout(RuntimeError):
    """The peer did not answer in time, or its connection dropped: it is down, stuck, or unreachable."""


class BadReply(PeerTimeout):
    """The peer answered with something that is not a protocol message."""


PLAIN = SocketGuard(None)   # no keys: loopback and ipc peers


class RpcClient:
    def __init__(self, endpoint: str, timeout_s: float = 10.0, ctx: zmq.Context | None = None,
                 on_wait=None, guard: SocketGuard | None = None):
        self.endpoint = endpoint
        self.on_wait = on_wait
        self.guard = guard or PLAIN
        self.timeout_ms = int(timeout_s * 1000)
        self.ctx = ctx or zmq.Context.instance()
        self.sock, self.monitor = self._connect()
        self.asked = False       # a question sent on this connection waits for its answer

    def _connect(self) -> tuple[zmq.Socket, zmq.Socket]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.guard.connect(sock, self.endpoint)
        return sock, monitor

    def _reconnect(self) -> None:
        self.close()
        self.sock, self.monitor = self._connect()
        self.asked = False

    def reset(self) -> None:
        """Drop the connection and every question asked on it: no answer to them is read."""
        self._reconnect()

    def call(self, msg, timeout_s: float | None = None):
        """Send one message and wait for its answer (a decoded protocol message)."""
        self.send(msg)
        return self.receive(timeout_s)

    def send(self, msg) -> None:
        """The first half of a call, for callers that do other work before reading the answer."""
        self._drain_monitor()   # connection events from before this question say nothing about it
        self.sock.send_multipart(protocol.encode(msg), copy=False)
        self.asked = True

    def receive(self, timeout_s: float | None = None, keep_question: bool = False):
        """The answer. A timeout drops the connection, so that a late answer is never read as the
        next question's; with keep_question it keeps it, and the question stands (a peer still
        starting answers it when it can)."""
        timeout_ms = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_ms / 1000
        while (left := int((deadline - time.monotonic()) * 1000)) > 0:
            if self.on_wait is not None:
                try:
                    self.on_wait()
                except PeerTimeout:
                    self._reconnect()
                    raise
                left = min(left, int(WAIT_SLICE_S * 1000))
            ready = dict(poller.poll(left))
            if self.sock in ready:
                frames = self.sock.recv_multipart(copy=False)
                self.asked = False
                try:
                    return protocol.decode(frames)
                except protocol.ProtocolError as e:
                    self._reconnect()
                    raise BadReply(f"{self.endpoint} answered with a malformed message: {e}") from None
            if self.monitor in ready and self._disconnected():
                self._reconnect()
                raise PeerTimeout(f"{self.endpoint} dropped the connection before answering")
        if not keep_question:
            self._reconnect()
        raise PeerTimeout(f"{self.endpoint} did not answer within {timeout_ms} ms")

    def _disconnected(self) -> bool:
        gone = False
        while self.monitor.poll(0, zmq.POLLIN):
            gone |= recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED
        return gone

    def _drain_monitor(self) -> None:
        while self.monitor.poll(0, zmq.POLLIN):
            recv_monitor_message(self.monitor)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()
