"""Heartbeats over real sockets: a main thread that stops making progress (a deadlocked step, with
the GIL released) reads as stuck within the timeout, a ticking one never does; and what restarts
with what in the supervisor."""
from __future__ import annotations

import time

import types

import torch

from pagedserve.services.heartbeat import Heartbeat, HeartbeatWatch
from pagedserve.services.supervisor import Child, restart_set


def watch_for(watch: HeartbeatWatch, seconds: float, tick=None) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if tick:
            tick()
        watch.poke()
        time.sleep(0.05)


def test_a_main_thread_that_stops_ticking_reads_as_stuck(tmp_path):
    beat = Heartbeat(f"ipc://{tmp_path}/beat.sock", "worker", stuck_after_s=0.6)
    watch = HeartbeatWatch(f"ipc://{tmp_path}/beat.sock", stuck_after_s=0.6)
    try:
        watch_for(watch, 1.5, tick=beat.tick)      # progressing: answered, never stuck
        assert watch.answered() and not watch.stuck()
        watch_for(watch, 1.6)                      # the main thread blocks: it still answers, not ready
        assert watch.stuck()
        watch_for(watch, 0.6, tick=beat.tick)      # progress again: no longer stuck
        assert not watch.stuck()
    finally:
        watch.close()
        beat.close()


def test_a_silent_peer_is_stuck_only_after_it_answered_once(tmp_path):
    watch = HeartbeatWatch(f"ipc://{tmp_path}/none.sock", stuck_after_s=0.3)
    watch_for(watch, 0.6)
    assert not watch.answered() and not watch.stuck()    # still starting: the start timeout's business
    beat = Heartbeat(f"ipc://{tmp_path}/none.sock", "kvstore", stuck_after_s=10)
    watch_for(watch, 0.8, tick=beat.tick)
    assert watch.answered()
    beat.close()                                          # gone (as SIGSTOP: no answer at all)
    watch_for(watch, 0.8)
    assert watch.stuck()
    watch.close()


def test_a_step_ticks_once_per_decoder_layer(tiny_llama):
    from pagedserve.services.worker.model_loader import load_model
    from pagedserve.services.worker.service import WorkerService
    from pagedserve.services.worker.tp import SINGLE

    model, spec = load_model(tiny_llama, torch.float32, "cpu", SINGLE)

    class Runner:   # only what tick_per_layer reads
        pass
    runner = Runner()
    runner.model, runner.spec = model, spec
    ticks = []
    pool = types.SimpleNamespace(num_blocks=1)   # the service checks block ids against its size
    WorkerService(runner, None, pool).tick_per_layer(lambda: ticks.append(1))
    hidden = torch.zeros(1, 1)
    for layer in next(m for n, m in model.named_modules() if n.endswith("layers")):
        try:
            layer(hidden)
        except Exception:
            pass      # the hook runs before the layer's own forward
    assert len(ticks) == spec.num_layers


def test_what_restarts_with_what():
    kids = [Child(n, []) for n in ("kvstore", "worker0", "worker1", "scheduler", "router0", "router1")]
    names = lambda who: [c.name for c in who]   # noqa: E731
    assert names(restart_set(kids, kids[0])) == ["kvstore", "worker0", "worker1"]
    assert names(restart_set(kids, kids[2])) == ["worker0", "worker1"]
    assert names(restart_set(kids, kids[3])) == ["scheduler"]
    assert names(restart_set(kids, kids[5])) == ["router1"]
