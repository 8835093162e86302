"""Faults across processes: a worker that dies mid-request is noticed, and the requests in flight
fail fast with an error instead of hanging; the scheduler then reports itself not ready."""
from __future__ import annotations

import subprocess
import sys
import time

import zmq

from services import protocol
from services.sampling_params import SamplingParams


def start(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_worker_death_fails_requests_fast(tiny_llama, tmp_path):
    from services.worker.model_loader import inspect_model_dir
    import torch
    _, spec = inspect_model_dir(tiny_llama)
    kv, worker, sched = (f"ipc://{tmp_path}/{n}.sock" for n in ("kv", "worker", "sched"))
    procs = [start("kvstore", "--endpoint", kv, "--num-device-blocks", "256", "--num-host-blocks", "0",
                   "--block-size", "16", "--block-bytes", str(spec.block_bytes(16, torch.float32))),
             start("worker", "--model", tiny_llama, "--endpoint", worker, "--kvstore-endpoint", kv),
             start("scheduler", "--model", tiny_llama, "--endpoint", sched, "--kvstore-endpoint", kv,
                   "--worker-endpoint", worker)]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sched)
    try:
        deadline = time.monotonic() + 120
        while True:   # wait until the scheduler answers (it waits for its peers first)
            sock.send_multipart(protocol.encode(protocol.Ping("test")))
            if sock.poll(1000):
                assert protocol.decode(sock.recv_multipart()).ready
                break
            assert time.monotonic() < deadline, [p.stderr.read() for p in procs if p.poll() is not None]
        params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True).to_dict()
        sock.send_multipart(protocol.encode(protocol.AddRequest("long", list(range(10, 40)), params)))
        first = protocol.decode(sock.recv_multipart())
        while isinstance(first, protocol.Pong):                  # answers to the start-up pings
            first = protocol.decode(sock.recv_multipart())
        assert isinstance(first, (protocol.RequestUpdates, protocol.RequestUpdate))   # tokens flow
        procs[1].kill()                                          # the worker dies mid-request
        killed = time.monotonic()
        final = None
        while final is None and time.monotonic() - killed < 20:
            if not sock.poll(1000):
                continue
            msg = protocol.decode(sock.recv_multipart())
            updates = msg.updates if isinstance(msg, protocol.RequestUpdates) else [msg]
            final = next((u for u in updates if isinstance(u, protocol.RequestUpdate) and u.finished), None)
        assert final is not None and final.error, "the request hung after its worker died"
        assert time.monotonic() - killed < 10
        sock.send_multipart(protocol.encode(protocol.Ping("test")))
        pong = None
        while not isinstance(pong, protocol.Pong):
            assert sock.poll(5000)
            pong = protocol.decode(sock.recv_multipart())
        assert not pong.ready
    finally:
        sock.close()
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait(30)
