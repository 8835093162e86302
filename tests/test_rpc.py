"""services.rpc: answers, deadlines, and a peer that dies mid-question failing at once."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from services import protocol
from services.rpc import PeerTimeout, RpcClient

PEER = textwrap.dedent("""
    import sys, zmq
    from services import protocol
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(sys.argv[1])
    print("up", flush=True)
    while True:
        ident, *frames = sock.recv_multipart()
        msg = protocol.decode(frames)
        if msg.sender == "die":
            raise SystemExit(3)          # a peer that dies in the middle of a question
        if msg.sender == "answer":
            sock.send_multipart([ident, *protocol.encode(protocol.Pong("peer"))])
        # anything else: never answered
""")


@pytest.fixture
def peer(tmp_path):
    endpoint = f"ipc://{tmp_path}/peer.sock"
    proc = subprocess.Popen([sys.executable, "-c", PEER, endpoint], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    yield endpoint
    proc.kill()
    proc.wait()


def test_answer_and_deadline(peer):
    client = RpcClient(peer, timeout_s=5)
    assert isinstance(client.call(protocol.Ping("answer")), protocol.Pong)
    start = time.monotonic()
    with pytest.raises(PeerTimeout, match="did not answer"):
        client.call(protocol.Ping("silent"), timeout_s=0.5)
    assert time.monotonic() - start < 3
    assert isinstance(client.call(protocol.Ping("answer")), protocol.Pong)   # the late reply is gone
    client.close()


def test_peer_dying_mid_question_fails_at_once(peer):
    client = RpcClient(peer, timeout_s=60)
    assert isinstance(client.call(protocol.Ping("answer")), protocol.Pong)
    start = time.monotonic()
    with pytest.raises(PeerTimeout, match="dropped the connection"):
        client.call(protocol.Ping("die"))
    assert time.monotonic() - start < 10, "waited for the deadline instead of noticing the drop"
    client.close()
