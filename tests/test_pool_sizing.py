"""Sizing the KV pool from free GPU memory after the workers' profiling pass (services/kvstore/sizing.py,
services/worker/profile.py), on CPU: the arithmetic with a fake memory reader, the hand-over order
over real sockets, and the profile pass on a tiny model with fake allocator statistics."""
from __future__ import annotations

import threading

import pytest
import torch
import zmq

from pagedserve.services.kvstore import service as kvservice
from pagedserve.services.kvstore import sizing
from pagedserve.services.kvstore.client import KVStoreClient, KVStoreError
from pagedserve.services.kvstore.sizing import PoolSizing, device_blocks_for
from pagedserve.services import launcher, protocol
from pagedserve.services.worker import startup as wstartup
from pagedserve.services.worker.model_loader import load_model
from pagedserve.services.worker.profile import profile_batch, warm_up_and_profile

GIB, MIB = 1 << 30, 1 << 20


def test_blocks_are_what_is_free_less_the_reserve_and_the_share_left_to_others():
    # 100 GiB device, 80 free (weights, contexts), a 2 GiB activation reserve, 90 %: 10 GiB stay free.
    assert device_blocks_for(100 * GIB, 80 * GIB, 2 * GIB, 0.9, MIB) == 68 * 1024
    assert device_blocks_for(100 * GIB, 80 * GIB, 2 * GIB, 1.0, 3 * MIB) == 78 * 1024 // 3
    assert device_blocks_for(100 * GIB, 5 * GIB, 0, 0.9, MIB) == 0   # others use too much: none


def test_sizing_waits_for_every_rank_then_takes_the_least_over_the_devices():
    free = {"cuda:0": (60 * GIB, 100 * GIB), "cuda:1": (50 * GIB, 100 * GIB)}
    s = PoolSizing(2, 0.9, MIB, ["cuda:0", "cuda:1"], read_memory=free.__getitem__)
    info = s.handle(protocol.GetPoolInfo())
    assert isinstance(info, protocol.Error) and info.code == 503 and info.param == sizing.WAITING
    assert "[0, 1]" in info.message
    assert s.handle(protocol.Ping()).ready is False
    s.handle(protocol.ReportMemory(1, 4 * GIB))
    assert not s.done and "[0]" in s.handle(protocol.GetPoolInfo()).message
    assert s.handle(protocol.ReportMemory(2, 0)).code == 400          # no rank 2 in a group of 2
    s.handle(protocol.ReportMemory(0, 1 * GIB))
    assert s.done
    assert s.num_device_blocks() == min(49, 36) * 1024               # rank 1: 50 - 4 - 10 GiB


def test_no_room_is_an_error_naming_the_flag():
    s = PoolSizing(1, 0.5, MIB, ["cuda:0"], read_memory=lambda d: (40 * GIB, 100 * GIB))
    s.handle(protocol.ReportMemory(0, 0))
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.5"):
        s.num_device_blocks()


def test_the_kvstore_answers_not_yet_until_every_rank_reported(monkeypatch):
    """Over sockets: the kvstore binds and waits; a worker's first GetPoolInfo reads 'profile, then
    report'; the scheduler's pings say not ready; once both ranks reported, the pools are sized."""
    monkeypatch.setattr(sizing, "read_device_memory", lambda device: (30 * GIB, 40 * GIB))
    endpoint = "inproc://sizing-test"
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    config = kvservice.Config(num_device_blocks=0, block_bytes=64 * MIB, tp_size=2, device="cuda",
                              gpu_memory_utilization=0.75, endpoint=endpoint).validate()
    stop, result = threading.Event(), []
    thread = threading.Thread(target=lambda: result.append(kvservice._size_device_pools(sock, config, stop)))
    thread.start()
    try:
        worker_cfg = wstartup.Config(model="m", kvstore_endpoint=endpoint, tp_size=2, block_size=16)
        assert wstartup.fetch_pool_info(worker_cfg) is None     # profile first, then report
        with KVStoreClient(endpoint, timeout_s=5) as client:
            assert client.ping().ready is False
            client.report_memory(0, 2 * GIB)
            with pytest.raises(KVStoreError) as e:
                client.pool_info()
            assert e.value.code == 503 and "[1]" in str(e.value)
            client.report_memory(1, 1 * GIB)
        thread.join(10)
    finally:
        stop.set()
        thread.join(10)
        sock.close()
    assert result == [(30 * GIB - 2 * GIB - 10 * GIB) // (64 * MIB)]


def test_kvstore_flags_for_sizing():
    with pytest.raises(ValueError, match="needs --device cuda"):
        kvservice.Config(block_bytes=1, gpu_memory_utilization=0.9).validate()
    with pytest.raises(ValueError, match="--num-device-blocks"):
        kvservice.Config(block_bytes=1, num_device_blocks=0, device="cuda").validate()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        kvservice.Config(block_bytes=1, device="cuda", gpu_memory_utilization=1.5).validate()


def test_launcher_lets_the_kvstore_size_cuda_pools_after_the_profile(tiny_llama, tmp_path):
    cfg = launcher.Config(model=tiny_llama, device="cuda", gpu_memory_utilization=0.8,
                          max_num_batched_tokens=512, max_num_seqs=32)
    procs = dict(launcher.process_commands(cfg, tiny_llama, str(tmp_path)))
    kv, worker = procs["kvstore"], procs["worker0"]
    assert kv[kv.index("--gpu-memory-utilization") + 1] == "0.8"
    assert kv[kv.index("--num-device-blocks") + 1] == "0"
    assert worker[worker.index("--profile-tokens") + 1] == "512"
    assert worker[worker.index("--profile-seqs") + 1] == "32"
    names = [n for n, _ in launcher.process_commands(cfg, tiny_llama, str(tmp_path))]
    assert names.index("kvstore") < names.index("worker0") < names.index("scheduler")
    cpu = dict(launcher.process_commands(launcher.Config(model=tiny_llama), tiny_llama, str(tmp_path)))
    assert "--gpu-memory-utilization" not in cpu["kvstore"]
    assert int(cpu["kvstore"][cpu["kvstore"].index("--num-device-blocks") + 1]) > 0


def test_profile_batch_is_the_largest_step_then_a_decode():
    num_blocks, prefill, decode = profile_batch(num_tokens=100, num_seqs=8, block_size=16)
    assert sum(len(s.token_ids) for s in prefill) == 100 and len(prefill) == 8
    assert [len(s.token_ids) for s in decode] == [1] * 8
    tables = [b for s in prefill for b in s.block_table]
    assert sorted(tables) == list(range(num_blocks))                 # disjoint, all of the scratch pool
    for p, d in zip(prefill, decode):
        assert d.start_pos == len(p.token_ids) and len(p.block_table) * 16 >= d.start_pos + 1
    assert len(profile_batch(3, 8, 16)[1]) == 3                        # no empty sequences


class FakeMemory:
    def __init__(self):
        self.calls = []

    def start(self):
        self.calls.append("start")
        return 1000

    def peak(self):
        self.calls.append("peak")
        return 1000 + 4096

    def release(self):
        self.calls.append("release")


@pytest.mark.parametrize("samples", [True, False])
def test_profile_pass_runs_the_model_and_reports_the_peak_over_the_start(tiny_llama, monkeypatch, samples):
    from pagedserve.services.worker import profile
    model, spec = load_model(tiny_llama)
    ran = []
    real = profile.ModelRunner.execute
    monkeypatch.setattr(profile.ModelRunner, "execute",
                        lambda self, steps, **kw: ran.append(len(steps)) or real(self, steps, **kw))
    memory = FakeMemory()
    reserve = warm_up_and_profile(model, spec, torch.float32, "cpu", 16, 1, num_tokens=64, num_seqs=4,
                                  samples=samples, memory=memory)
    assert reserve == 4096 and memory.calls == ["start", "peak", "release"]
    assert ran == [4, 4]                                               # the prefill, then the decode


def test_up_refuses_a_utilization_outside_zero_to_one():
    import argparse
    p = argparse.ArgumentParser()
    launcher.Config.add_arguments(p)
    assert launcher.config_from_args(p.parse_args(["--gpu-memory-utilization", "0.5"])).gpu_memory_utilization == 0.5
    for bad in ("0", "1.2"):
        with pytest.raises(ValueError, match="--gpu-memory-utilization"):
            launcher.config_from_args(p.parse_args(["--gpu-memory-utilization", bad]))


def test_worker_profiles_then_reports_then_maps_the_pool(tiny_llama, monkeypatch):
    """The hand-over on the worker's side: load, profile, report the reserve, wait for PoolInfo,
    and only then map the pool (which a sizing kvstore has not made before the report)."""
    from pagedserve.kvstore.pool import BlockPool, unique_pool_name
    from pagedserve.services.worker.model_loader import inspect_model_dir
    from pagedserve.services.worker.tp import SINGLE
    _, spec = inspect_model_dir(tiny_llama)
    block_bytes = spec.block_bytes(16, torch.float32)
    pool = BlockPool.create(unique_pool_name("order"), 8, block_bytes)
    info = protocol.PoolInfo(block_size=16, block_bytes=block_bytes, num_device_blocks=8, num_host_blocks=0,
                             device_pool_names=[pool.name], host_pool_names=[])
    order = []
    monkeypatch.setattr(wstartup, "warm_up_and_profile", lambda *a, **k: order.append("profile") or 123)
    monkeypatch.setattr(wstartup, "report_and_wait",
                        lambda config, reserve: order.append(("report", reserve)) or info)
    real_attach = wstartup.attach_device_pool
    monkeypatch.setattr(wstartup, "attach_device_pool",
                        lambda info, rank: order.append("attach") or real_attach(info, rank))
    config = wstartup.Config(model=tiny_llama).validate()
    service = wstartup.build_service(config, None, SINGLE)
    try:
        assert order == ["profile", ("report", 123), "attach"]
    finally:
        service.close()
        pool.close()
        pool.unlink()
