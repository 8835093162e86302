"""pagedserve.services.rpc: answers, deadlines, and a peer that dies mid-question failing at once."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from pagedserve.services import protocol
from pagedserve.services.rpc import PeerTimeout, RpcClient

PEER = textwrap.dedent("""
    import sys, zmq
    from pagedserve.services import protocol
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
        if msg.sender == "garbage":
            sock.send_multipart([ident, b"\\xc1not msgpack"])
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


def test_a_malformed_reply_is_bad_reply_and_the_next_call_pairs_up(peer):
    """A peer that answers with garbage: BadReply (a PeerTimeout, so callers treat the peer as
    broken, never a ProtocolError escaping their loop), and the socket is rebuilt."""
    from pagedserve.services.rpc import BadReply
    client = RpcClient(peer, timeout_s=5)
    with pytest.raises(BadReply, match="malformed"):
        client.call(protocol.Ping("garbage"))
    assert isinstance(client.call(protocol.Ping("answer")), protocol.Pong)
    client.close()
