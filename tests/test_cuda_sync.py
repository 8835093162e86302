"""The CUDA device contexts and the ordering contract (kvstore/cuda_sync.py), on a machine without a
GPU: torch.cuda's device, stream and event API is replaced by a fake that behaves as torch's does
where it matters (an Event is created lazily on the *current* device by ipc_handle(), on the
stream's device by record(), and recording it on another device's stream fails; torch.cuda.stream
makes its stream's device current) and logs every call with the device current at the time.
"""
from __future__ import annotations

import contextlib

import types

import pytest
import torch

from pagedserve.kvstore import cuda_sync
from pagedserve.kvstore.cuda_sync import CopySync, StepSync
from pagedserve.services import protocol
from pagedserve.services.worker.service import WorkerService
from pagedserve.services.worker.worker_core import WorkerCore


class FakeCuda:
    def __init__(self):
        self.current = 0
        self.log: list[tuple] = []
        self.current_streams: dict[int, FakeStream] = {}

    def index(self, device) -> int:
        if device is None:
            return self.current
        device = torch.device(device)
        assert device.type == "cuda", f"a CUDA call got a {device.type} device"
        return self.current if device.index is None else device.index

    def current_stream(self, device=None) -> "FakeStream":
        i = self.index(device)
        return self.current_streams.setdefault(i, FakeStream(self, i, default=True))


class FakeStream:
    def __init__(self, fake: FakeCuda, device: int, default: bool = False):
        self.fake, self.device_index, self.default = fake, device, default

    @property
    def device(self):
        return torch.device("cuda", self.device_index)

    def wait_event(self, event) -> None:
        self.fake.log.append(("wait", self, event, self.fake.current))


class FakeEvent:
    def __init__(self, fake: FakeCuda, device: int | None = None):
        self.fake, self.device_index = fake, device

    def record(self, stream=None) -> None:
        stream = stream or self.fake.current_stream()
        if self.device_index is None:
            self.device_index = stream.device_index
        if self.device_index != stream.device_index:
            raise RuntimeError(f"Event device {self.device_index} does not match recording stream's "
                               f"device {stream.device_index}")
        self.fake.log.append(("record", stream, self, self.fake.current))

    def ipc_handle(self) -> bytes:
        if self.device_index is None:
            self.device_index = self.fake.current
        self.fake.log.append(("ipc_handle", None, self, self.fake.current))
        return bytes([self.device_index])


@pytest.fixture
def fake(monkeypatch) -> FakeCuda:
    fake = FakeCuda()

    @contextlib.contextmanager
    def device(d):
        previous, fake.current = fake.current, fake.index(d)
        try:
            yield
        finally:
            fake.current = previous

    @contextlib.contextmanager
    def stream(s):
        previous_device, previous = fake.current, fake.current_streams.get(s.device_index)
        fake.current = s.device_index          # as torch.cuda.set_stream does
        fake.current_streams[s.device_index] = s
        try:
            yield
        finally:
            fake.current_streams[s.device_index] = previous or FakeStream(fake, s.device_index, True)
            fake.current = previous_device

    class Event(FakeEvent):
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            super().__init__(fake)

        @classmethod
        def from_ipc_handle(cls, device, handle):
            event = cls()
            event.device_index = fake.index(device)
            assert handle[0] == event.device_index, "opened an event of another device"
            return event

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(fake, fake.index(device)))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    return fake


DEVICES = ["cuda:0", "cuda:1"]   # two tensor-parallel ranks in one kvstore


def test_kvstore_events_live_on_their_ranks_device(fake):
    sync = CopySync(DEVICES)
    copies, steps = sync.event_handles()   # used to create every event on the current device (0)
    assert [e.device_index for e in sync.copies_done] == [0, 1]
    assert [e.device_index for e in sync.step_done] == [0, 1]
    assert [s.device_index for s in sync.streams] == [0, 1]
    assert all(entry[3] == entry[2].device_index for entry in fake.log)   # every call under its device
    with sync.copies():   # records on rank 1's stream: raised when the event was made on device 0
        pass
    # A worker of each rank opens the handles of its own device.
    for rank, device in enumerate(DEVICES):
        worker = StepSync(copies[rank], steps[rank], device)
        assert worker.copies_done.device_index == worker.step_done.device_index == rank


def test_kvstore_copies_wait_for_the_steps_and_then_record(fake):
    sync = CopySync(DEVICES)
    fake.log.clear()
    seen = []
    with sync.copies():
        for rank, device in enumerate(DEVICES):
            with cuda_sync.on_device(device):     # what pool code does around each pool's copy
                seen.append(torch.cuda.current_stream(device))
        fake.log.append(("copy",))
    assert seen == sync.streams                  # the copies go on the copy streams, not the default
    ops = [(e[0], e[1].device_index) if e[0] != "copy" else ("copy",) for e in fake.log]
    assert ops == [("wait", 0), ("wait", 1), ("copy",), ("record", 0), ("record", 1)]
    waits = [e[2] for e in fake.log if e[0] == "wait"]
    records = [e[2] for e in fake.log if e[0] == "record"]
    assert waits == sync.step_done and records == sync.copies_done
    assert fake.current == 0                     # the stream contexts gave the current device back


def test_worker_step_waits_for_copies_then_records_then_meets_the_others(fake):
    kv = CopySync(DEVICES)
    copies, steps = kv.event_handles()
    met = []
    worker = StepSync(copies[1], steps[1], "cuda:1", barrier=lambda: met.append(len(fake.log)))
    fake.log.clear()
    with pytest.raises(ValueError):
        with worker.step():
            fake.log.append(("forward",))
            raise ValueError("a model error")   # what the step enqueued still runs: record anyway
    assert [e[0] for e in fake.log] == ["wait", "forward", "record"]
    assert fake.log[0][1].device_index == 1 and fake.log[0][2] is worker.copies_done
    assert fake.log[2][1].device_index == 1 and fake.log[2][2] is worker.step_done
    assert met == [3]                            # the barrier comes after the record


class FakeRunner:
    """Logs the forward; returns no logits (no row wanted them)."""

    spec = types.SimpleNamespace(vocab_size=8)     # token ids are checked against it

    def __init__(self, fake: FakeCuda):
        self.fake = fake

    def execute(self, steps, compute_logits=True, prompt_logprobs=None, device_ids=None):
        self.fake.log.append(("forward",))
        return torch.empty(0, 8) if compute_logits else None

    def close(self):
        pass


@pytest.mark.parametrize("rank", [0, 1])
def test_a_step_that_samples_nothing_still_records_on_every_rank(fake, rank):
    """A non-final prefill chunk wants no token: rank 0 used to answer without any event, and
    ranks > 0 never had one; now both record step_done after the forward, before answering."""
    kv = CopySync(DEVICES)
    copies, steps = kv.event_handles()
    runner = FakeRunner(fake)
    core = WorkerCore(runner, eos_token_ids=(2,)) if rank == 0 else None
    pool = types.SimpleNamespace(num_blocks=8)     # the service checks block ids against the pool's size
    service = WorkerService(runner, core, pool=pool, sync=StepSync(copies[rank], steps[rank], DEVICES[rank]))
    msg = protocol.ExecuteStep(1, [protocol.SeqWork(7, [5, 6, 7], 0, samples=[])],
                               table_updates={7: [0, 3]})
    fake.log.clear()
    reply = service.run_step(msg)
    assert reply.error is None and reply.results == []
    assert [e[0] for e in fake.log] == ["wait", "forward", "record"]
    assert fake.log[0][2] is service.sync.copies_done and fake.log[2][2] is service.sync.step_done


def test_no_sync_on_cpu_is_a_no_op():
    sync = cuda_sync.NoSync()
    assert sync.event_handles() == ([], [])
    with sync.copies(), sync.step():
        pass



def test_a_replay_that_fails_midway_still_records_copies_done(fake):
    sync = CopySync(DEVICES)
    fake.log.clear()
    with pytest.raises(RuntimeError):
        with sync.copies():
            fake.log.append(("copy",))
            raise RuntimeError("the replica diverged after some copies")
    assert [e[0] for e in fake.log] == ["wait", "wait", "copy", "record", "record"]
