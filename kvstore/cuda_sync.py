"""CUDA only: the kvstore's copy streams and the interprocess events that order its copies against
the workers' steps. THE ORDERING CONTRACT is written here and nowhere else; the code of both sides
(CopySync for the kvstore, StepSync for a worker rank) is below it.

Not yet run on a GPU in this repository (no GPU was lent to the sessions so far); tests fake the
CUDA API (tests/test_cuda_sync.py) and `make gpu-check` runs it for real.

Objects. For every tensor-parallel rank r (one device, one device pool), the kvstore creates two
interprocess events on that device, and hands their handles to the workers in PoolInfo:
- copies_done[r]: "every block copy the kvstore has enqueued so far on device r";
- step_done[r]:   "every kernel worker rank r has enqueued so far";
and one copy stream per device. Both events are recorded once when made, so that each exists on its
own device (a torch Event is created lazily on the *current* device otherwise) and a first wait is
a no-op.

The contract, for every step and every rank:
1. kvstore, each ApplyOps: for each device r, its copy stream waits on step_done[r]; every
   copy-on-write and swap copy of device r's pools is enqueued on that stream (never the default
   stream); copies_done[r] is recorded on it, also when the replay failed partway. Only then
   does the kvstore reply.
2. worker rank r, each ExecuteStep (whether it samples or not, whether it fails or not): its
   compute stream waits on copies_done[r]; the step's kernels are enqueued; step_done[r] is
   recorded on the compute stream. With tp_size > 1 the ranks then meet in a barrier on the CPU
   control group; only after it does rank 0 answer the scheduler.
Why the waits see the right records (cudaStreamWaitEvent waits for the most recent record at the
time it is called, so each record must be enqueued, on the host, before the wait that needs it):
- a step that reads copied blocks is sent by the scheduler only after the kvstore's reply to the
  ApplyOps that copies them (it waits for that reply whenever the ops move bytes), and the reply
  follows the record of 1.; a step whose ops move no bytes may wait on an older record and needs
  no newer one;
- the next ApplyOps reaches the kvstore only after the scheduler has rank 0's StepResult, which
  follows the barrier of 2., which follows every rank's record of step_done: so no copy overwrites
  (or swaps out) a block that any rank's kernels of an earlier step still read or write.
  One exception, async scheduling (services/scheduler/scheduler.py, schedule_ahead): the ops of a
  step planned while step N runs reach the kvstore before N's StepResult. They swap nothing and
  copy on write nothing N touches (N's sequences write only blocks they own alone; a shared one was
  copied when N was planned): their copies are the host tier's, into blocks no sequence holds and
  out of blocks no sequence holds, and a sequence of N freed meanwhile keeps its blocks until the
  steps planned ahead that use it are answered. So what such a copy touches, N does not.
Nothing here synchronizes a host thread with the GPU: sampling does (rank 0 reads the tokens), but
the contract does not rely on it.

On CPU (NoSync) copies are synchronous memcpys in shared memory and a forward is synchronous on
the host: every rank's KV writes of a step precede its last all_reduce, which rank 0 passes before
it answers, so the same order holds with no events.
"""
from __future__ import annotations

import base64
import contextlib

import torch

from pagedserve.kernels.device import on_device


def _handle(event) -> str:
    return base64.b64encode(bytes(event.ipc_handle())).decode("ascii")


class CopySync:
    """The kvstore's side: one copy stream and the two events of every CUDA device of its pools."""

    def __init__(self, devices: list[str]):
        self.devices = [torch.device(d) for d in devices]
        self.streams, self.copies_done, self.step_done = [], [], []
        for device in self.devices:
            with on_device(device):
                stream = torch.cuda.Stream(device)
                copies, step = torch.cuda.Event(interprocess=True), torch.cuda.Event(interprocess=True)
                copies.record(stream)   # created here, on this device (see the module docstring)
                step.record(stream)
            self.streams.append(stream)
            self.copies_done.append(copies)
            self.step_done.append(step)

    def event_handles(self) -> tuple[list[str], list[str]]:
        """Per rank, the IPC handles of (copies_done, step_done) as base64 text for PoolInfo."""
        copies, steps = [], []
        for device, c, s in zip(self.devices, self.copies_done, self.step_done):
            with on_device(device):
                copies.append(_handle(c))
                steps.append(_handle(s))
        return copies, steps

    @contextlib.contextmanager
    def copies(self):
        """Contract step 1: the block operations inside run on the copy streams after the workers'
        last steps, and copies_done is recorded after them. Pool code guards on its pool's device
        (kernels.device.on_device), so it enqueues on that device's current stream: the copy stream."""
        try:
            with contextlib.ExitStack() as stack:
                for device, stream, step in zip(self.devices, self.streams, self.step_done):
                    with on_device(device):
                        stream.wait_event(step)
                    # torch.cuda.stream(s) also makes s's device current: harmless, every call guards.
                    stack.enter_context(torch.cuda.stream(stream))
                yield
        finally:   # also after a failed replay: the copies it did enqueue are covered too
            for device, stream, event in zip(self.devices, self.streams, self.copies_done):
                with on_device(device):
                    event.record(stream)


class StepSync:
    """A worker rank's side (contract step 2), from the handles the kvstore sent in PoolInfo."""

    def __init__(self, copies_handle: str, step_handle: str, device: str, barrier=None):
        self.device = torch.device(device)
        self.barrier = barrier   # tp_size > 1: the control group's barrier; None alone
        with on_device(self.device):
            self.copies_done = torch.cuda.Event.from_ipc_handle(self.device, base64.b64decode(copies_handle))
            self.step_done = torch.cuda.Event.from_ipc_handle(self.device, base64.b64decode(step_handle))

    @contextlib.contextmanager
    def step(self):
        """Wrap one step's work: wait for the kvstore's copies, then record step_done (even when
        the step failed: what it enqueued still runs), then meet the other ranks."""
        with on_device(self.device):
            torch.cuda.current_stream(self.device).wait_event(self.copies_done)
        try:
            yield
        finally:
            with on_device(self.device):
                self.step_done.record(torch.cuda.current_stream(self.device))
            if self.barrier is not None:
                self.barrier()


class NoSync:
    """CPU pools and CPU workers: nothing to wait for (see the last paragraph of the contract)."""

    def event_handles(self) -> tuple[list[str], list[str]]:
        return [], []

    def copies(self):
        return contextlib.nullcontext()

    def step(self):
        return contextlib.nullcontext()
