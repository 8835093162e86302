"""Request/reply over a ZeroMQ DEALER socket with a deadline: how one process asks another.

A peer that does not answer in time raises PeerTimeout; the socket is then rebuilt so that a late
reply can never be mistaken for the answer to the next question.
"""
from __future__ import annotations

import zmq

from services import protocol


class PeerTimeout(RuntimeError):
    """The peer did not answer in time: it is down, stuck, or unreachable."""


class RpcClient:
    def __init__(self, endpoint: str, timeout_s: float = 10.0, ctx: zmq.Context | None = None):
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def call(self, msg, timeout_s: float | None = None):
        """Send one message and wait for its answer (a decoded protocol message)."""
        self.send(msg)
        return self.receive(timeout_s)

    def send(self, msg) -> None:
        """The first half of a call, for callers that do other work before reading the answer."""
        self.sock.send_multipart(protocol.encode(msg), copy=False)

    def receive(self, timeout_s: float | None = None):
        timeout_ms = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            self.sock.close()
            self.sock = self._connect()
            raise PeerTimeout(f"{self.endpoint} did not answer within {timeout_ms} ms")
        return protocol.decode(self.sock.recv_multipart(copy=False))

    def close(self) -> None:
        self.sock.close()
