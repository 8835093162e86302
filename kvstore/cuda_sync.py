"""CUDA only: the kvstore's own copy streams and the interprocess events the workers wait on.

UNTESTED in this repository's CI and sessions so far (no GPU was available): the CPU path never
builds these objects. The contract:
- every block operation the kvstore replays (copy-on-write copies, swap copies) is enqueued on the
  kvstore's stream for that device, never on the default stream;
- after each ApplyOps the kvstore records one interprocess event per device on that stream, and only
  then replies; the scheduler sends the step to the workers after that reply;
- before each step a worker makes its compute stream wait on that event (cudaStreamWaitEvent waits
  for the most recent record), so the step reads blocks only after the copies it depends on.
The reverse order needs no event: a worker answers a step only after sampling, which synchronizes
its stream, so the kvstore never copies a block the previous step is still writing.
"""
from __future__ import annotations

import base64
import contextlib

import torch


class CopySync:
    """One copy stream and one interprocess event per CUDA device of the kvstore's pools."""

    def __init__(self, devices: list[str]):
        self.streams, self.events = [], []
        for device in devices:
            with torch.cuda.device(device):
                self.streams.append(torch.cuda.Stream())
                self.events.append(torch.cuda.Event(interprocess=True))

    def event_handles(self) -> list[str]:
        """Per rank, the event's IPC handle as base64 text (msgpack carries it in PoolInfo)."""
        return [base64.b64encode(bytes(e.ipc_handle())).decode("ascii") for e in self.events]

    @contextlib.contextmanager
    def copies(self):
        """Run the block operations inside on the copy streams, then record the events."""
        with contextlib.ExitStack() as stack:
            for s in self.streams:
                stack.enter_context(torch.cuda.stream(s))
            yield
        for s, e in zip(self.streams, self.events):
            e.record(s)


class NoSync:
    """CPU pools: copies are synchronous memcpys in shared memory; nothing to wait for."""

    def event_handles(self) -> list[str]:
        return []

    def copies(self):
        return contextlib.nullcontext()


def open_event(handle: str, device: str):
    """Worker side: the kvstore's event for this rank's device."""
    return torch.cuda.Event.from_ipc_handle(torch.device(device), base64.b64decode(handle))
