"""CUDA IPC between the kvstore process and a worker (this test plays the worker): the pool and
both events travel as handles, copy-on-write and swap copies land byte for byte as a CPU copy
says, and the ordering contract's events are what the worker waits on. Only where CUDA is present
(`make gpu-check` runs it)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")

from test_kvstore_service import BLOCK_BYTES, DEVICE_BLOCKS, HOST_BLOCKS, B, free_port, start, stop, wait_ready  # noqa: E402

from pagedserve.services.kvstore.attach import attach_pools  # noqa: E402
from pagedserve.services.kvstore.client import KVStoreClient  # noqa: E402
from pagedserve.kvstore.cuda_sync import StepSync  # noqa: E402
from pagedserve.kvstore.replay import RecordingStore  # noqa: E402
from pagedserve.kvstore.store import BlockStore  # noqa: E402


def test_cow_and_swap_bytes_over_cuda_ipc():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = start(endpoint, "--device", "cuda", "--tp-size", "1", "--log-level", "WARNING")
    client = KVStoreClient(endpoint, timeout_s=30)
    device = host = []
    try:
        wait_ready(proc, client)
        info = client.pool_info()
        assert info.device == "cuda" and len(info.ipc_handles) == len(info.step_event_handles) == 1
        (device,), (host,) = attach_pools(info, "device"), attach_pools(info, "host")
        assert device.blocks.is_cuda and tuple(device.blocks.shape) == (DEVICE_BLOCKS, BLOCK_BYTES)
        sync = StepSync(info.event_handles[0], info.step_event_handles[0], "cuda:0")
        mirror, step = RecordingStore(DEVICE_BLOCKS, HOST_BLOCKS, B), 0

        def apply():
            nonlocal step
            ops, expected = mirror.drain()
            step += 1
            reply = client.apply(step, ops)
            assert reply.error is None and reply.results == expected

        mirror.allocate(1, list(range(1, 2 * B - 1)))        # a full block and a partly filled one
        apply()
        table = mirror.block_table(1)
        written = torch.randint(0, 255, (len(table), BLOCK_BYTES), dtype=torch.uint8)   # the CPU copy
        with sync.step():                                     # the worker's step writes the K/V
            device.blocks[torch.tensor(table, device="cuda")] = written.cuda()
        mirror.fork(1, 2)
        copies = mirror.append_slots(2, [99]).copies         # writes the shared partial block
        assert copies == [(table[1], mirror.block_table(2)[1])]
        apply()
        with sync.step():
            assert torch.equal(device.blocks[copies[0][1]].cpu(), written[1])
        mapping = mirror.swap_out([1]).mapping
        apply()
        sync.copies_done.synchronize()                        # host bytes are the kvstore's copy stream's
        assert torch.equal(host.blocks[[h for _, h in mapping]], written)
        back = mirror.swap_in([1]).mapping
        apply()
        with sync.step():
            assert torch.equal(device.blocks[[d for _, d in back]].cpu(), written)
    finally:
        for p in (device, host):
            if p:
                p.close()
        client.close()
        code, err = stop(proc)
        assert code == 0, err
