"""The internal sockets on a network (services/curve.py): one replica whose every ZeroMQ endpoint is
CURVE-protected, its routers finding it through a Redis that wants a password.

- a completion goes through (router -> scheduler -> kvstore / worker, all over CURVE);
- on each of the three listening sockets, a client with no keys, with a key not on the allow-list
  or with the wrong server key gets nothing, the refusal is logged, and the replica keeps serving;
- garbage, structured-but-wrong, out-of-order and oversized frames from an authorized client are
  logged and rejected on each socket, and the replica keeps serving with its blocks back at baseline;
- a server asked to listen on a network address without keys refuses to start, naming the fix;
- a Redis password works, and a wrong one fails start-up in one line that does not print it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq

from pagedserve.services import protocol
from pagedserve.services.curve import MAX_FRAME_BYTES, CurveKeys, make_keys
from router_fakes import free_port

PASSWORD = "s3cret-pw"


def spawn(log: Path, *argv: str, env: dict | None = None) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_CURVE_KEYS"}
    return subprocess.Popen([sys.executable, "-m", "pagedserve.services.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), env={**environ, **(env or {})})


@pytest.fixture(scope="module")
def redis_with_password(tmp_path_factory):
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--requirepass", PASSWORD, "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port, password=PASSWORD, socket_connect_timeout=0.5).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.1)
    yield port
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, CurveKeys]:
    """The replica's keys, and an intruder's: a real keypair of its own, not on the allow-list."""
    root = tmp_path_factory.mktemp("keys")
    make_keys(str(root / "replica"))
    make_keys(str(root / "intruder"))
    return {name: CurveKeys.load(str(root / name)) for name in ("replica", "intruder")}


class Replica:
    def __init__(self, model: str, keys: CurveKeys, redis_port: int, logs: Path):
        from pagedserve.services.worker.model_loader import inspect_model_dir
        import torch
        _, spec = inspect_model_dir(model)
        self.model = model
        self.endpoints = {n: f"tcp://127.0.0.1:{free_port()}" for n in ("kvstore", "worker", "scheduler")}
        self.logs = {n: logs / f"{n}.log" for n in ("kvstore", "worker", "scheduler", "router")}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        redis_url = f"redis://:{PASSWORD}@127.0.0.1:{redis_port}/0"
        kv, worker, sched = self.endpoints["kvstore"], self.endpoints["worker"], self.endpoints["scheduler"]
        curve = ["--curve-keys", keys.folder]
        self.procs = {
            "kvstore": spawn(self.logs["kvstore"], "kvstore", "--endpoint", kv, "--num-device-blocks", "64",
                             "--block-size", "16", "--block-bytes", str(spec.block_bytes(16, torch.float32)), *curve),
            # The worker takes the keys from the environment, the others from the flag: both work.
            "worker": spawn(self.logs["worker"], "worker", "--model", model, "--endpoint", worker,
                            "--kvstore-endpoint", kv, env={"PAGEDSERVE_CURVE_KEYS": keys.folder}),
            "scheduler": spawn(self.logs["scheduler"], "scheduler", "--model", model, "--endpoint", sched,
                               "--kvstore-endpoint", kv, "--worker-endpoint", worker, "--redis-url", redis_url,
                               "--replica-id", f"curve-{self.port}", *curve),
            "router": spawn(self.logs["router"], "router", "--model", model, "--port", str(self.port),
                            "--scheduler-endpoint", "none", "--redis-url", redis_url, *curve),
        }

    def wait_ready(self, within_s: float = 150) -> None:
        deadline = time.monotonic() + within_s
        while True:
            dead = {n: self.log(n) for n, p in self.procs.items() if p.poll() is not None}
            assert not dead, dead
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, {n: self.log(n)[-2000:] for n in self.procs}
            time.sleep(0.3)

    def log(self, name: str) -> str:
        return self.logs[name].read_text()

    def complete(self) -> str:
        body = json.dumps({"model": self.model, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["choices"][0]["text"]

    def kv_stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/v1/kv", timeout=10) as r:   # {replica id: its kv stats}
            (stats,) = json.loads(r.read()).values()
            return stats

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def replica(tiny_llama, keys, redis_with_password, tmp_path_factory):
    r = Replica(tiny_llama, keys["replica"], redis_with_password, tmp_path_factory.mktemp("logs"))
    try:
        r.wait_ready()
        r.baseline = r.complete()
        yield r
    finally:
        r.stop()
    codes = {n: p.returncode for n, p in r.procs.items()}
    assert all(c == 0 for c in codes.values()), (codes, {n: r.log(n)[-1500:] for n, c in codes.items() if c})


def client(endpoint: str, server_public: bytes | None = None, client_keys: tuple | None = None) -> zmq.Socket:
    """A raw DEALER: CURVE when given keys (server public key, (client public, client secret))."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_public is not None:
        sock.curve_serverkey = server_public
        sock.curve_publickey, sock.curve_secretkey = client_keys
    sock.connect(endpoint)
    return sock


def ask(sock: zmq.Socket, frames: list, timeout_ms: int = 5000):
    # A DEALER whose handshake failed has no pipe to queue on: a blocking send would wait forever.
    # (POLLOUT may hold for a pipe that the failed handshake then drops: Again.)
    try:
        if not sock.poll(timeout_ms, zmq.POLLOUT):
            return None
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        return None
    if not sock.poll(timeout_ms):
        return None
    return protocol.decode(sock.recv_multipart())


def authorized(replica, keys, name: str) -> zmq.Socket:
    k = keys["replica"]
    return client(replica.endpoints[name], k.server_public, (k.client_public, k.client_secret))


def wait_for_log(replica, name: str, text: str, count: int = 1, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while replica.log(name).count(text) < count:
        assert time.monotonic() < deadline, f"{name} never logged {text!r}:\n{replica.log(name)[-1500:]}"
        time.sleep(0.1)


def test_a_completion_goes_through_curve_and_a_redis_password(replica):
    assert replica.complete() == replica.baseline


@pytest.mark.parametrize("name", ["kvstore", "worker", "scheduler"])
def test_clients_without_the_right_keys_are_refused_and_the_replica_keeps_serving(replica, keys, name):
    replica_keys, intruder = keys["replica"], keys["intruder"]
    ping = protocol.encode(protocol.Ping("intruder"))
    before = replica.log(name).count("refused a peer")
    attempts = {
        "no keys": client(replica.endpoints[name]),
        "a key not on the allow-list": client(replica.endpoints[name], replica_keys.server_public,
                                              (intruder.client_public, intruder.client_secret)),
        "the wrong server key": client(replica.endpoints[name], intruder.server_public,
                                       (replica_keys.client_public, replica_keys.client_secret)),
    }
    for why, sock in attempts.items():
        assert ask(sock, ping, timeout_ms=500) is None, f"answered a client with {why}"
        sock.close()
    # The first two are refused in the handshake, and logged; a client that has the wrong server key
    # cannot even open it (the server never sees a valid hello: nothing to log but nothing served).
    wait_for_log(replica, name, "refused a peer", before + 2)
    sock = authorized(replica, keys, name)
    assert isinstance(ask(sock, ping), protocol.Pong)
    sock.close()
    assert replica.complete() == replica.baseline


GARBAGE = [
    [b"\xc1garbage"],
    [b""],
    [msgpack.packb({"v": protocol.VERSION, "t": "Ping", "b": {"sender": 7}})],
    [msgpack.packb({"v": protocol.VERSION, "t": "Nope", "b": {}})],
    [msgpack.packb({"v": protocol.VERSION - 1, "t": "Ping", "b": {}})],
]
WRONG = {   # well-formed messages that the socket's owner must refuse without harm
    "kvstore": [protocol.ApplyOps(10**9, []),                          # a step from the future
                protocol.ApplyOps(0, [["free", 1]]),                   # one from the past
                protocol.AddRequest("r", [1], {})],                    # not the kvstore's
    "worker": [protocol.ExecuteStep(1, [protocol.SeqWork(99, [1], 0)]),          # no such table
               protocol.ExecuteStep(1, [], table_updates={5: [0, -1]}),          # a block outside the pool
               protocol.ApplyOps(1, [])],
    "scheduler": [protocol.AddRequest("bad", [10**9], {"max_tokens": 2}),        # a token outside the vocabulary
                  protocol.AddRequest("bad2", [1, 2], {"max_tokens": -5}),
                  protocol.AbortRequest("never-added"),
                  protocol.ApplyOps(1, [])],
}


@pytest.mark.parametrize("name", ["kvstore", "worker", "scheduler"])
def test_garbage_wrong_out_of_order_and_oversized_frames_are_rejected_and_logged(replica, keys, name):
    stats = replica.kv_stats()
    sock = authorized(replica, keys, name)
    for frames in GARBAGE + [protocol.encode(m) for m in WRONG[name]]:
        reply = ask(sock, frames)
        if frames == protocol.encode(protocol.AbortRequest("never-added")):
            assert reply is None          # an abort has no answer, and an unknown one changes nothing
            continue
        assert isinstance(reply, (protocol.Error, protocol.StepResult)), (frames, reply)
        assert reply.error if isinstance(reply, protocol.StepResult) else reply.code in (400, 404, 409)
    # A frame over the limit: refused before it is read whole, the connection dropped and logged.
    drops = replica.log(name).count("dropped its connection")
    sock.send_multipart([b"x" * (MAX_FRAME_BYTES + 1)])
    wait_for_log(replica, name, "dropped its connection", drops + 1)
    sock.close()
    assert "rejected" in replica.log(name) or "refused" in replica.log(name)
    sock = authorized(replica, keys, name)
    assert isinstance(ask(sock, protocol.encode(protocol.Ping("test"))), protocol.Pong)
    sock.close()
    assert replica.complete() == replica.baseline
    after = replica.kv_stats()
    assert after["device_blocks_used"] == stats["device_blocks_used"] == 0, after


def test_a_network_address_without_keys_refuses_to_start(tmp_path):
    endpoint = f"tcp://0.0.0.0:{free_port()}"
    log = tmp_path / "err.log"
    proc = spawn(log, "kvstore", "--endpoint", endpoint, "--block-bytes", "64")
    assert proc.wait(60) == 2
    assert f"refusing to listen on {endpoint} without CURVE keys" in log.read_text()
    assert "pagedserve keys" in log.read_text()


def test_the_scheduler_and_the_worker_refuse_before_waiting_for_peers_or_loading(tiny_llama, monkeypatch):
    """The same check, in-process: each fails before it waits for its peers or loads a model."""
    from pagedserve.services.curve import InsecureEndpoint
    from pagedserve.services.scheduler import service as sservice
    from pagedserve.services.worker import service as wservice
    monkeypatch.delenv("PAGEDSERVE_CURVE_KEYS", raising=False)
    endpoint = f"tcp://0.0.0.0:{free_port()}"
    with pytest.raises(InsecureEndpoint, match="refusing to listen"):
        sservice.SchedulerService(sservice.Config(model=tiny_llama, endpoint=endpoint))
    monkeypatch.setattr(wservice, "start_worker", lambda config: pytest.fail("loaded a model first"))
    assert wservice.run(wservice.Config(model=tiny_llama, endpoint=endpoint)) == 1


def test_a_wrong_redis_password_fails_start_up_without_printing_it(tiny_llama, redis_with_password, capsys):
    from pagedserve.services.router import service as rservice
    url = f"redis://:not-{PASSWORD}@127.0.0.1:{redis_with_password}/0"
    config = rservice.Config(model=tiny_llama, port=free_port(), scheduler_endpoint=None, redis_url=url)
    assert rservice.run(config) == 1
    err = capsys.readouterr().err
    assert "cannot use Redis at redis://:***@127.0.0.1" in err and PASSWORD not in err, err


def test_the_routers_scheduler_client_skips_garbage_and_keeps_listening(caplog):
    """The router's receiving loop: garbage from the scheduler is logged and skipped, and the
    next real update still reaches its request."""
    import asyncio
    import zmq.asyncio
    from pagedserve.services.router.scheduler_client import SchedulerClient

    async def scenario():
        ctx = zmq.asyncio.Context()
        server = ctx.socket(zmq.ROUTER)
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        server.bind(endpoint)
        client = SchedulerClient(endpoint, "router-x", ctx, ping_interval_s=0.1, dead_after_s=30)
        client.start()
        queue = asyncio.Queue()
        client.subscribe("r1", queue)
        try:
            ident, *_ = await asyncio.wait_for(server.recv_multipart(), 10)   # its first ping
            for frames in GARBAGE + [protocol.encode(protocol.RequestUpdate("someone-else", []))]:
                await server.send_multipart([ident, *frames])
            done = protocol.RequestUpdate("r1", [protocol.CompletionDelta(0, [7], [0.0], None, "stop")], True)
            await server.send_multipart([ident, *protocol.encode(done)])
            got = await asyncio.wait_for(queue.get(), 10)
            assert got.finished and got.outputs[0].token_ids == [7]
            assert client.alive
        finally:
            await client.close()
            server.close(linger=0)
            ctx.term()

    asyncio.run(scenario())
    assert sum("malformed message from the scheduler" in r.message for r in caplog.records) == len(GARBAGE)
