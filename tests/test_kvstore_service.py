"""The kvstore as a process: real subprocess, real sockets, pools attached from this process."""
import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from pagedserve.services.kvstore import service
from pagedserve.services.kvstore.attach import attach_pools
from pagedserve.services.kvstore.client import KVStoreClient, KVStoreError, PeerTimeout
from pagedserve.kvstore.replay import RecordingStore
from pagedserve.kvstore.store import BlockStore
from pagedserve.services import protocol

REPO = Path(__file__).resolve().parents[1]
B, DEVICE_BLOCKS, HOST_BLOCKS, BLOCK_BYTES, TP = 4, 32, 16, 8, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(endpoint: str, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pagedserve.services.kvstore.service", "--endpoint", endpoint,
            "--num-device-blocks", str(DEVICE_BLOCKS), "--num-host-blocks", str(HOST_BLOCKS),
            "--block-size", str(B), "--block-bytes", str(BLOCK_BYTES), "--tp-size", str(TP), *extra]
    # The caller's PYTHONPATH stays after the repository: `make gpu-check` brings packages in it.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(argv, cwd=REPO, env=dict(os.environ, PYTHONPATH=path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen, client: KVStoreClient, within_s: float = 90.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            client._rpc.call(protocol.Ping("test"), timeout_s=0.5)
            return
        except PeerTimeout:
            assert time.monotonic() < deadline, "the kvstore did not come up"


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


class Session:
    """One kvstore process shared by the tests below, and the mirror that tracks it."""

    def __init__(self):
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.proc = start(self.endpoint, "--log-level", "WARNING")
        self.client = KVStoreClient(self.endpoint, timeout_s=10)
        wait_ready(self.proc, self.client)
        self.mirror = RecordingStore(DEVICE_BLOCKS, HOST_BLOCKS, B)
        self.step = 0
        self.next_seq = 0

    def new_seq(self) -> int:
        self.next_seq += 1
        return self.next_seq

    def sync(self) -> protocol.ApplyOpsReply:
        ops, expected = self.mirror.drain()
        self.step += 1
        reply = self.client.apply(self.step, ops)
        assert reply.error is None and reply.results == expected
        assert reply.num_free_device_blocks == self.mirror.num_free_device_blocks
        return reply


def replica_stats(client: KVStoreClient) -> dict:
    """The kvstore's stats less the one key a mirror cannot have: bytes (it has no pools)."""
    stats = client.stats()
    copied = stats.pop("host_cache_bytes_copied")
    assert copied == (stats["host_cache_demotions"] + stats["host_cache_promotions"]) * BLOCK_BYTES * TP
    return stats


@pytest.fixture(scope="module")
def kv():
    s = Session()
    yield s
    s.client.close()
    code, err = stop(s.proc)
    assert code == 0, err


def test_ping_and_pool_info(kv):
    assert kv.client.ping().role == "kvstore"
    info = kv.client.pool_info()
    assert (info.block_size, info.block_bytes, info.num_device_blocks, info.num_host_blocks) == \
           (B, BLOCK_BYTES, DEVICE_BLOCKS, HOST_BLOCKS)
    assert info.device == "cpu" and info.enable_prefix_caching
    names = info.device_pool_names + info.host_pool_names
    assert len(info.device_pool_names) == len(info.host_pool_names) == TP and len(set(names)) == 2 * TP
    assert all(n.startswith(f"pagedserve-{kv.proc.pid}-") and os.path.exists(f"/dev/shm/{n}") for n in names)


def test_attached_pools_see_copy_on_write_and_swap_bytes(kv):
    info = kv.client.pool_info()
    device, host = attach_pools(info, "device"), attach_pools(info, "host")
    try:
        parent, child = kv.new_seq(), kv.new_seq()
        kv.mirror.allocate(parent, [1, 2, 3, 4, 5, 6])   # a full block and a partly filled one
        kv.sync()
        table = kv.mirror.block_table(parent)
        for rank, pool in enumerate(device):   # the worker writes the K/V of the prompt
            for i, b in enumerate(table):
                pool.blocks[b] = torch.full((BLOCK_BYTES,), 10 * rank + i + 1, dtype=torch.uint8)
        kv.mirror.fork(parent, child)
        copies = kv.mirror.append_slots(child, [7]).copies   # writes the shared partial block
        assert copies == [(table[1], kv.mirror.block_table(child)[1])]
        kv.sync()
        for rank, pool in enumerate(device):
            assert pool.blocks[copies[0][1]].tolist() == [10 * rank + 2] * BLOCK_BYTES
        mapping = kv.mirror.swap_out([parent]).mapping
        kv.sync()
        for rank, pool in enumerate(host):
            assert [pool.blocks[h][0].item() for _, h in mapping] == [10 * rank + 1, 10 * rank + 2]
        kv.mirror.free(parent)
        kv.mirror.free(child)
        kv.sync()
    finally:
        for p in device + host:
            p.close()


def test_recorded_log_replays_with_equal_results_and_stats(kv):
    ids = [kv.new_seq() for _ in range(6)]
    prompt = list(range(100, 111))
    for i, s in enumerate(ids):
        assert kv.mirror.allocate(s, prompt + [i], ("salt",) if i % 2 else ()).ok
        kv.mirror.mark_computed(s, len(prompt) + 1)
    kv.sync()
    for step in range(5):
        for s in ids:
            kv.mirror.append_slots(s, [step])
            kv.mirror.mark_computed(s, kv.mirror.num_tokens(s))
        kv.sync()
    kv.mirror.swap_out(ids[:2])
    kv.mirror.free(ids[2])
    kv.sync()
    assert kv.mirror.stats()["prefix_hit_tokens"] > 0
    assert replica_stats(kv.client) == kv.mirror.stats()
    kv.mirror.swap_in(ids[:2])
    for s in ids[:2] + ids[3:]:
        kv.mirror.free(s)
    kv.sync()
    assert replica_stats(kv.client) == kv.mirror.stats()


def test_a_step_is_applied_once(kv):
    s = kv.new_seq()
    kv.mirror.allocate(s, [1, 2, 3])
    kv.sync()
    before = kv.client.stats()
    for step in (kv.step, kv.step - 1):   # a resend of the last step, and an older one
        with pytest.raises(KVStoreError) as e:
            kv.client.apply(step, [["free", s]])
        assert e.value.code == 409
    assert kv.client.stats() == before
    kv.mirror.free(s)
    kv.sync()


def raw_call(endpoint: str, frames: list[bytes]):
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no answer"
        return protocol.decode(sock.recv_multipart())


@pytest.mark.parametrize("frames, code", [
    ([b"\xc1garbage"], 400),
    ([b""], 400),
    ([msgpack.packb([1, 2])], 400),
    ([msgpack.packb({"v": 99, "t": "Ping", "b": {}})], 400),
    ([msgpack.packb({"v": protocol.VERSION, "t": "Launch", "b": {}})], 400),
    ([msgpack.packb({"v": protocol.VERSION, "t": "ApplyOps", "b": {"step": "x", "ops": []}})], 400),
    (lambda step: protocol.encode(protocol.ApplyOps(step + 1, [["free", 12345]])), 400),   # unknown sequence
    (lambda step: protocol.encode(protocol.ApplyOps(step + 1, [["explode", 1]])), 400),
    (lambda step: protocol.encode(protocol.ApplyOps(step + 2, [])), 409),      # from the future: one was lost
    (lambda step: protocol.encode(protocol.ApplyOps(step, [])), 409),          # from the past: applied already
    (protocol.encode(protocol.AbortRequest("r1")), 404),                       # not for the kvstore
])
def test_malformed_messages_get_an_error_and_the_service_carries_on(kv, frames, code):
    before = kv.client.stats()
    reply = raw_call(kv.endpoint, frames(kv.step) if callable(frames) else frames)
    assert isinstance(reply, protocol.Error) and reply.code == code
    assert kv.client.ping().role == "kvstore"
    assert kv.client.stats() == before
    kv.sync()   # a rejected log does not use up its step number: the next one still applies


def test_client_times_out_on_a_silent_peer():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as silent:
        silent.setsockopt(zmq.LINGER, 0)
        silent.bind(endpoint)
        client = KVStoreClient(endpoint, timeout_s=0.2, ctx=ctx)
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout):
            client.stats()
        assert time.monotonic() - t0 < 2
        client.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_unlinks_every_segment(sig, tmp_path):
    endpoint = f"ipc://{tmp_path}/kvstore.sock"
    proc = start(endpoint)
    client = KVStoreClient(endpoint, timeout_s=10)
    wait_ready(proc, client)
    info = client.pool_info()
    attached = attach_pools(info)   # a worker still mapping a pool must not keep its name alive
    client.close()
    mine = f"/dev/shm/pagedserve-{proc.pid}-*"
    assert len(glob.glob(mine)) == 2 * TP
    code, err = stop(proc, sig)
    assert code == 0, err
    assert glob.glob(mine) == []
    assert "leaked" not in err and "Traceback" not in err
    assert attached[0].blocks.sum().item() == 0   # the mapping itself stays valid until closed
    for p in attached:
        p.close()


def test_port_in_use_exits_nonzero_with_one_line():
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        proc = start(f"tcp://127.0.0.1:{port}")
        _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "cannot bind" in lines[0] and "in use" in lines[0], err
    assert glob.glob(f"/dev/shm/pagedserve-{proc.pid}-*") == []


def test_bad_flags_exit_nonzero_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        service.main(["--bogus"])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--bogus" in err[0], err
    for argv, needle in ((["--num-device-blocks", "many"], "--num-device-blocks: 'many' is not an integer"),
                         (["--block-bytes", "0"], "--block-bytes 0: must be positive"),
                         (["--block-bytes", "8", "--device", "tpu"], "--device")):
        assert service.main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_every_pool_is_warmed_up_before_the_first_answer(monkeypatch):
    """The copy kernel's first compile must not happen inside the loop, under the scheduler's 5 s
    peer timeout: run() warms every device pool up before it answers anyone."""
    from pagedserve.kvstore import pool as pool_module
    warmed, release = [], threading.Event()

    def slow_warm_up(pool):
        warmed.append(pool.name)
        release.wait(30)
        pool_module.warm_up(pool)

    monkeypatch.setattr(service, "warm_up", slow_warm_up)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = service.Config(num_device_blocks=4, block_bytes=BLOCK_BYTES, block_size=B, tp_size=2,
                            endpoint=endpoint, log_level="WARNING")
    stop_event = threading.Event()
    thread = threading.Thread(target=service.run, args=(config, stop_event))
    thread.start()
    client = KVStoreClient(endpoint, timeout_s=5)
    try:
        with pytest.raises(PeerTimeout):
            client.ping(timeout_s=1.0)           # bound, but warming up: no answer yet
        assert len(warmed) == 1
        release.set()
        assert client.ping(timeout_s=10).ready
        assert len(warmed) == 2                  # one per rank's device pool
    finally:
        release.set()
        stop_event.set()
        thread.join(30)
        client.close()


def test_warm_up_copies_scratch_rows_of_the_pools_size_and_leaves_the_pool_alone(monkeypatch):
    from pagedserve.kvstore import pool as pool_module
    seen = []
    real = pool_module.copy_blocks
    monkeypatch.setattr(pool_module, "copy_blocks",
                        lambda blocks, src, dst: seen.append((blocks.shape, blocks.device)) or real(blocks, src, dst))
    p = pool_module.BlockPool.create(pool_module.unique_pool_name("warm"), 3, 40)
    try:
        p.blocks.copy_(torch.arange(120, dtype=torch.uint8).view(3, 40))
        before = p.blocks.clone()
        pool_module.warm_up(p)
        assert seen == [((2, 40), p.blocks.device)]
        assert torch.equal(p.blocks, before)
    finally:
        p.close()
        p.unlink()
