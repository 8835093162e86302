"""Faults across processes: a worker that dies mid-request is noticed, and the requests in flight
fail fast with an error instead of hanging; the scheduler then reports itself not ready."""
from __future__ import annotations

import subprocess
import sys
import time

import zmq

from pagedserve.services import protocol
from pagedserve.services.sampling_params import SamplingParams


def start(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagedserve.services.cli", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def engine_processes(model: str, tmp_path, *scheduler_flags: str) -> tuple[list[subprocess.Popen], str]:
    """kvstore, worker and scheduler as separate processes (no launcher) -> (procs, scheduler endpoint)."""
    from pagedserve.services.worker.model_loader import inspect_model_dir
    import torch
    _, spec = inspect_model_dir(model)
    kv, worker, sched = (f"ipc://{tmp_path}/{n}.sock" for n in ("kv", "worker", "sched"))
    procs = [start("kvstore", "--endpoint", kv, "--num-device-blocks", "256", "--num-host-blocks", "0",
                   "--block-size", "16", "--block-bytes", str(spec.block_bytes(16, torch.float32))),
             start("worker", "--model", model, "--endpoint", worker, "--kvstore-endpoint", kv),
             start_scheduler(model, sched, kv, worker, *scheduler_flags)]
    return procs, sched


def start_scheduler(model: str, sched: str, kv: str, worker: str, *flags: str) -> subprocess.Popen:
    return start("scheduler", "--model", model, "--endpoint", sched, "--kvstore-endpoint", kv,
                 "--worker-endpoint", worker, *flags)


def connect_when_ready(sched: str, procs: list[subprocess.Popen]) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sched)
    deadline = time.monotonic() + 120
    while True:   # the scheduler answers once its peers do
        sock.send_multipart(protocol.encode(protocol.Ping("test")))
        if sock.poll(1000) and protocol.decode(sock.recv_multipart()).ready:
            return sock
        assert time.monotonic() < deadline, [p.stderr.read() for p in procs if p.poll() is not None]
        time.sleep(0.2)


def run_to_end(sock: zmq.Socket, request_id: str, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True).to_dict()
    sock.send_multipart(protocol.encode(protocol.AddRequest(request_id, list(range(10, 40)), params)))
    tokens: list[int] = []
    while True:
        assert sock.poll(60000), "no answer"
        msg = protocol.decode(sock.recv_multipart())
        if isinstance(msg, protocol.RequestUpdates):   # single new tokens come as columns
            tokens += [t.token_id for t in msg.tokens if t.request_id == request_id]
        for u in msg.updates if isinstance(msg, protocol.RequestUpdates) else [msg]:
            if isinstance(u, protocol.RequestUpdate) and u.request_id == request_id:
                assert not u.error, u.error
                tokens += [t for d in u.outputs for t in d.token_ids]
                if u.finished:
                    return tokens


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        p.wait(30)


def engine_stats(sock: zmq.Socket) -> dict:
    sock.send_multipart(protocol.encode(protocol.GetStats()))
    while True:
        assert sock.poll(10000), "no StatsReply"
        msg = protocol.decode(sock.recv_multipart())
        if isinstance(msg, protocol.StatsReply):
            return msg.stats


def test_restarted_scheduler_resumes_from_the_kvstore_and_hits_the_cache(tiny_llama, tmp_path):
    """A scheduler killed outright, a long request in flight, and started again against the same
    kvstore and worker: the kvstore frees what the dead one held, the new mirror is built from the
    kvstore's state (ResumeStore), and the same prompt hits the prefix cached before the kill."""
    procs, sched = engine_processes(tiny_llama, tmp_path)
    try:
        sock = connect_when_ready(sched, procs)
        first = run_to_end(sock, "before", 20)
        hits_before = engine_stats(sock)["prefix_cache_hits"]
        params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True).to_dict()
        sock.send_multipart(protocol.encode(protocol.AddRequest("in-flight", list(range(50, 90)), params)))
        while not isinstance(protocol.decode(sock.recv_multipart()), protocol.RequestUpdates):
            assert sock.poll(30000)
        assert engine_stats(sock)["kv"]["num_sequences"] == 1
        sock.close()
        procs[2].kill()
        procs[2].wait()
        procs[2] = start_scheduler(tiny_llama, sched, *(f"ipc://{tmp_path}/{n}.sock" for n in ("kv", "worker")))
        sock = connect_when_ready(sched, procs)
        kv = engine_stats(sock)["kv"]
        assert kv["num_sequences"] == 0 and kv["device_blocks_used"] == 0   # the request in flight was freed
        assert kv["device_blocks_cached"] >= 1
        assert run_to_end(sock, "after", 20) == first
        # The 30-token prompt's first block (16 tokens) was cached before the kill: a hit now.
        assert engine_stats(sock)["prefix_cache_hits"] == hits_before + 16
        sock.close()
    finally:
        stop(procs)


def test_worker_death_fails_requests_fast(tiny_llama, tmp_path):
    procs, sched = engine_processes(tiny_llama, tmp_path)
    sock = connect_when_ready(sched, procs)
    try:
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
        # A new worker in the dead one's place: the replica comes back by itself and serves again.
        procs[1] = start("worker", "--model", tiny_llama, "--endpoint", f"ipc://{tmp_path}/worker.sock",
                         "--kvstore-endpoint", f"ipc://{tmp_path}/kv.sock")
        sock.close()
        sock = connect_when_ready(sched, procs)
        assert len(run_to_end(sock, "after-restart", 8)) == 8
    finally:
        sock.close()
        stop(procs)


def test_a_router_that_reads_late_loses_no_update(tiny_llama, tmp_path):
    """Three 900-token requests run one after another (~2700 steps, an update message each) while
    their router reads nothing: once it reads, every token and every end is there (a ROUTER socket
    used to drop what passed its send limit, silently: requests hung or came back short)."""
    procs, sched = engine_processes(tiny_llama, tmp_path, "--max-num-seqs", "1")
    sock = connect_when_ready(sched, procs)
    try:
        params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True).to_dict()
        for rid in ("a", "b", "c"):
            sock.send_multipart(protocol.encode(protocol.AddRequest(rid, list(range(10, 40)), params)))
        watcher = zmq.Context.instance().socket(zmq.DEALER)
        watcher.setsockopt(zmq.LINGER, 0)
        watcher.connect(sched)
        deadline = time.monotonic() + 240
        while True:      # wait (on another socket) until the engine is idle again
            watcher.send_multipart(protocol.encode(protocol.GetStats()))
            assert watcher.poll(30000)
            stats = protocol.decode(watcher.recv_multipart()).stats
            if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0:
                break
            assert time.monotonic() < deadline
            time.sleep(0.5)
        watcher.close()
        tokens = {"a": 0, "b": 0, "c": 0}
        ended = set()
        while len(ended) < 3:
            assert sock.poll(10000), f"updates lost: {tokens}, ended {ended}"
            msg = protocol.decode(sock.recv_multipart())
            if not isinstance(msg, protocol.RequestUpdates):
                continue
            for t in msg.tokens:
                tokens[t.request_id] += 1
            for u in msg.updates:
                tokens[u.request_id] += sum(len(d.token_ids) for d in u.outputs)
                if u.finished:
                    ended.add(u.request_id)
        assert tokens == {"a": 900, "b": 900, "c": 900}
    finally:
        sock.close()
        stop(procs)


def test_a_kvstore_that_pauses_past_the_timeout_is_resynced_not_left_diverged(tiny_llama, tmp_path):
    """SIGSTOP the kvstore mid-request for longer than the peer timeout: the request fails; after
    SIGCONT the scheduler resets both block stores and serves again, with nothing leaked."""
    import signal
    procs, sched = engine_processes(tiny_llama, tmp_path)
    sock = connect_when_ready(sched, procs)
    try:
        params = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True).to_dict()
        for i in range(6):
            sock.send_multipart(protocol.encode(protocol.AddRequest(f"long{i}", list(range(10 + i, 40)), params)))
        assert sock.poll(60000)
        time.sleep(0.5)
        procs[0].send_signal(signal.SIGSTOP)
        time.sleep(12)
        procs[0].send_signal(signal.SIGCONT)
        sock.close()
        sock = connect_when_ready(sched, procs)
        assert len(run_to_end(sock, "after", 8)) == 8
        time.sleep(2.5)        # a heartbeat: the frees of the last step reach the kvstore
        sock.send_multipart(protocol.encode(protocol.GetStats()))
        reply = None
        while not isinstance(reply, protocol.StatsReply):
            assert sock.poll(10000)
            reply = protocol.decode(sock.recv_multipart())
        kv = reply.stats["kv"]
        assert kv["num_sequences"] == 0 and kv["device_blocks_used"] == 0, kv
    finally:
        sock.close()
        stop(procs)


def test_a_garbled_or_mismatched_worker_reply_fails_the_request_not_the_scheduler(tiny_llama, tmp_path):
    """A worker whose answer to a step does not decode, or answers another step: the request in
    that step ends with an error and the scheduler lives on (a ProtocolError escaping its loop used
    to end the process)."""
    import threading
    from pagedserve.services.worker.model_loader import inspect_model_dir
    import torch
    _, spec = inspect_model_dir(tiny_llama)
    kv, worker, sched = (f"ipc://{tmp_path}/{n}.sock" for n in ("kv", "worker", "sched"))
    replies = iter([lambda step: [b"\xc1garbage"],
                    lambda step: protocol.encode(protocol.StepResult(step + 7, []))])
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.bind(worker)
    done = threading.Event()

    def serve():
        while not done.is_set():
            if not fake.poll(100):
                continue
            ident, *frames = fake.recv_multipart()
            msg = protocol.decode(frames)
            if isinstance(msg, protocol.ExecuteStep):
                fake.send_multipart([ident, *next(replies, lambda s: [b"\xc1"])(msg.step)])
            else:
                fake.send_multipart([ident, *protocol.encode(protocol.Pong("worker", role="worker"))])
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    procs = [start("kvstore", "--endpoint", kv, "--num-device-blocks", "64", "--block-size", "16",
                   "--block-bytes", str(spec.block_bytes(16, torch.float32))),
             start_scheduler(tiny_llama, sched, kv, worker)]
    try:
        for request_id in ("garbled", "mismatched"):
            sock = connect_when_ready(sched, procs)
            params = SamplingParams(max_tokens=4, temperature=0).to_dict()
            sock.send_multipart(protocol.encode(protocol.AddRequest(request_id, [10, 11, 12], params)))
            final = None
            while final is None:
                assert sock.poll(30000), "the request hung"
                msg = protocol.decode(sock.recv_multipart())
                updates = msg.updates if isinstance(msg, protocol.RequestUpdates) else [msg]
                final = next((u for u in updates if isinstance(u, protocol.RequestUpdate) and u.finished), None)
            assert final.error, final
            sock.close()
            assert procs[1].poll() is None, procs[1].stderr.read()
    finally:
        stop(procs)
        done.set()
        thread.join()
        fake.close(linger=0)
