"""BlockPool: named shared memory that outlives an unrelated attacher, views, copies."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pagedserve.kvstore.pool import BlockPool, copy_between, copy_within, unique_pool_name

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def pool():
    p = BlockPool.create(unique_pool_name("test"), num_blocks=4, block_bytes=16)
    yield p
    p.close()
    p.unlink()


def test_create_gives_uint8_rows_in_named_segment(pool):
    assert pool.blocks.dtype == torch.uint8
    assert tuple(pool.blocks.shape) == (4, 16)
    assert os.path.exists(f"/dev/shm/{pool.name}")
    with pytest.raises(FileExistsError):
        BlockPool.create(pool.name, 4, 16)


def test_unique_names_differ_and_carry_pid():
    a, b = unique_pool_name("device"), unique_pool_name("device")
    assert a != b and f"-{os.getpid()}-" in a and a.endswith("-device")


def test_separate_process_attaches_writes_and_exits_without_deleting(pool):
    # A fresh interpreter (not a fork): it has its own resource tracker, the case that would
    # delete the segment at exit if attach() did not unregister it.
    child = textwrap.dedent(f"""
        import torch
        from pagedserve.kvstore.pool import BlockPool
        p = BlockPool.attach({pool.name!r}, 4, 16)
        p.blocks[2] = torch.arange(16, dtype=torch.uint8) + 100
        p.close()
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", child], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr and "resource_tracker" not in done.stderr
    assert os.path.exists(f"/dev/shm/{pool.name}")
    assert pool.blocks[2].tolist() == list(range(100, 116))
    again = BlockPool.attach(pool.name, 4, 16)  # the name still resolves, with the same bytes
    assert again.blocks[2].tolist() == list(range(100, 116))
    again.close()


def test_attach_in_same_process_shares_bytes_and_cannot_unlink(pool):
    other = BlockPool.attach(pool.name, 4, 16)
    other.blocks[1].fill_(7)
    assert pool.blocks[1].tolist() == [7] * 16
    with pytest.raises(ValueError):
        other.unlink()
    other.close()
    assert other.blocks is None
    assert pool.blocks[1].tolist() == [7] * 16  # closing one mapping leaves the other alive


def test_attach_checks_size(pool):
    with pytest.raises(ValueError):
        BlockPool.attach(pool.name, 5, 16)


def test_unlink_removes_name():
    p = BlockPool.create(unique_pool_name("gone"), 2, 8)
    p.close()
    p.unlink()
    assert not os.path.exists(f"/dev/shm/{p.name}")
    with pytest.raises(FileNotFoundError):
        BlockPool.attach(p.name, 2, 8)


def test_empty_pool_is_legal():
    p = BlockPool.create(unique_pool_name("empty"), 0, 8)
    assert tuple(p.blocks.shape) == (0, 8)
    p.close()
    p.unlink()


def test_closed_pool_refuses_copies(pool):
    other = BlockPool.attach(pool.name, 4, 16)
    other.close()
    with pytest.raises(ValueError):
        copy_within(other, [(0, 1)])


def test_copy_within_and_between(pool):
    pool.blocks.copy_(torch.arange(64, dtype=torch.uint8).view(4, 16))
    copy_within(pool, [(0, 3), (1, 2)])
    assert pool.blocks[3].tolist() == list(range(16))
    assert pool.blocks[2].tolist() == list(range(16, 32))
    host = BlockPool.create(unique_pool_name("host"), 2, 16)
    try:
        copy_between(pool, host, [(2, 1), (3, 0)])
        assert host.blocks[1].tolist() == list(range(16, 32))
        assert host.blocks[0].tolist() == list(range(16))
    finally:
        host.close()
        host.unlink()



def test_swap_copies_go_as_runs_of_consecutive_blocks():
    from pagedserve.kvstore.pool import _runs
    assert _runs([(3, 7), (4, 8), (5, 9), (9, 1), (6, 10), (10, 2)]) == [(3, 7, 3), (9, 1, 1), (6, 10, 1),
                                                                        (10, 2, 1)]
    assert _runs([(0, 0)]) == [(0, 0, 1)]


def test_pinning_registers_the_whole_segment_portably_and_close_unregisters(monkeypatch):
    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    p = BlockPool.create(unique_pool_name("pin"), num_blocks=4, block_bytes=16)
    try:
        ptr = p.blocks.data_ptr()
        p.pin()
        p.pin()   # once only
        assert calls == [("register", ptr, 64, 1)]   # 1 = cudaHostRegisterPortable: every device
        p.close()
        assert calls[-1] == ("unregister", ptr)
    finally:
        p.close()
        p.unlink()


def test_a_failed_pin_says_which_pool(monkeypatch):
    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            return 2   # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    p = BlockPool.create(unique_pool_name("pin"), num_blocks=4, block_bytes=16)
    try:
        with pytest.raises(RuntimeError, match=f"cannot pin host pool {p.name}.*cudaError 2"):
            p.pin()
    finally:
        p.close()
        p.unlink()
