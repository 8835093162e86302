"""Benchmark: what putting the kvstore in its own process costs per step, with a model that does nothing.

For each batch size (running sequences in decode), a real kvstore process is started and the real
Scheduler core plans on a RecordingStore mirror, as the scheduler process does. A fake worker
answers each scheduled sample with a token at once. Per decode step it times:
  exchange   what the step spends on the kvstore: encoding and sending ApplyOps, then waiting for
             and checking the reply; the replay itself overlaps building the worker's step, as in
             the scheduler process (services/scheduler/step_pipeline.py)
  step       the whole control plane of a step, in the scheduler process's order: schedule, send
             the op log, build and encode the ExecuteStep (services.scheduler.stepper.WorkerView),
             check the kvstore's reply, decode the worker's StepResult, update, and build and encode
             the routers' RequestUpdates (the fake worker's own encoding is not counted)
and, to say where the time goes, the scheduler core alone (schedule + update), the replay alone
(apply_ops in this process on a pool-less replica, the kvstore's share of the exchange), and the
whole step by phase: schedule, send ops (drain and send the op log), worker step (build and encode
the ExecuteStep), reply wait (the kvstore's answer, checked), decode (the StepResult), update,
router (build and encode the RequestUpdates).

    python -m pagedserve.loadgen.bench_control_plane [--seqs 1 64 256] [--steps 200] [--prompt-len 32] [--profile]
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16


@dataclass
class Timings:
    seqs: int
    ops_per_step: list[int] = field(default_factory=list)
    exchange: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    core: list[float] = field(default_factory=list)
    replay: list[float] = field(default_factory=list)
    # the whole step by phase, in order: name -> seconds per step
    phases: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in PHASES})


PHASES = ("schedule", "send ops", "worker step", "reply wait", "decode", "update", "router")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start_kvstore(endpoint: str, num_blocks: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pagedserve.services.kvstore.service", "--endpoint", endpoint, "--num-device-blocks",
            str(num_blocks), "--num-host-blocks", "0", "--block-size", str(BLOCK_SIZE),
            "--block-bytes", "16", "--log-level", "WARNING"]
    return subprocess.Popen(argv, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))


def wait_ready(client, proc: subprocess.Popen) -> None:
    from pagedserve.services.kvstore.client import PeerTimeout
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the kvstore exited with {proc.returncode}")
        try:
            return client.ping()
        except PeerTimeout:
            if time.monotonic() > deadline:
                raise


def run_batch(num_seqs: int, steps: int, prompt_len: int, endpoint: str, profile) -> Timings:
    from pagedserve.services.kvstore.client import KVStoreClient
    from pagedserve.kvstore.replay import RecordingStore, apply_ops
    from pagedserve.kvstore.store import BlockStore
    from pagedserve.services import protocol
    from pagedserve.services.sampling_params import SamplingParams
    from pagedserve.services.scheduler.scheduler import Scheduler, SchedulerConfig
    from pagedserve.services.scheduler.stepper import RouterView, WorkerView
    from pagedserve.services.protocol import SampleResult

    max_len = prompt_len + steps + 64
    num_blocks = num_seqs * (-(-max_len // BLOCK_SIZE)) + 8
    proc = start_kvstore(endpoint, num_blocks)
    client = KVStoreClient(endpoint, timeout_s=10)
    try:
        wait_ready(client, proc)
        mirror = RecordingStore(num_blocks, 0, BLOCK_SIZE)
        local = BlockStore(num_blocks, 0, BLOCK_SIZE)   # the replay alone, timed in this process
        sched = Scheduler(SchedulerConfig(max_num_seqs=max(num_seqs, 1), max_num_batched_tokens=2048,
                                          max_model_len=max_len + 1),
                          store=mirror, clock=time.monotonic)   # the scheduler process's clock: the KV
        # usage split is sampled every kv_usage_interval_s, not every step (a step counter as the
        # clock made every step sample it, 0.3-0.7 ms at 256 sequences that the server does not pay)
        rng = random.Random(num_seqs)
        params = SamplingParams(max_tokens=max_len - prompt_len, ignore_eos=True, temperature=0.0)
        for i in range(num_seqs):
            sched.add_request(f"r{i}", [rng.randrange(10, 30000) for _ in range(prompt_len)], params)
        view, routers, t = WorkerView(), RouterView(), Timings(num_seqs)
        owner = {f"r{i}": b"router-0" for i in range(num_seqs)}   # one router owns every request
        for step_no in itertools.count(1):
            # In the order the scheduler process runs a decode step: the op log goes out, the
            # worker's step is built while the kvstore replays, then the reply is checked.
            t0 = time.perf_counter()
            scheduled = sched.schedule()
            t1 = time.perf_counter()
            ops, expected = mirror.drain()
            client.send_apply(step_no, ops)
            sent = time.perf_counter()
            protocol.encode(view.execute_step(step_no, scheduled, mirror, sched.live_request_ids))
            built = time.perf_counter()
            # The worker's side, not timed: a token for every wanted sample, as StepResult frames.
            frames = protocol.encode(protocol.StepResult(step_no, [
                SampleResult(r.seq_id, (r.seq_id * 7 + step_no) % 30000 + 10)
                for wanted in scheduled.samples for r in wanted]))
            t3 = time.perf_counter()
            reply = client.receive_apply(step_no)
            if reply.results != expected or reply.error:
                raise RuntimeError(f"step {step_no}: the kvstore diverged: {reply.error}")
            t2 = time.perf_counter()
            results = protocol.decode(frames).results
            t6 = time.perf_counter()
            sched.update(scheduled, results)
            t5 = time.perf_counter()
            # What the routers are sent: one RequestUpdates message (one router here).
            for batch in routers.updates_for(scheduled.requests, owner).values():
                protocol.encode(batch)
            t4 = time.perf_counter()
            r0 = time.perf_counter()
            apply_ops(local, ops)
            r1 = time.perf_counter()
            in_decode = len(scheduled.steps) == num_seqs and scheduled.num_tokens == num_seqs
            if in_decode and step_no > 10:   # admitted, prefilled, and a few warm-up decode steps
                t.ops_per_step.append(len(ops))
                t.exchange.append((sent - t1) + (t2 - t3))   # what the step spends on the kvstore
                t.step.append((built - t0) + (t4 - t3))
                t.core.append((t1 - t0) + (t5 - t6))
                t.replay.append(r1 - r0)
                for name, dt in zip(PHASES, (t1 - t0, sent - t1, built - sent, t2 - t3, t6 - t2, t5 - t6, t4 - t5)):
                    t.phases[name].append(dt)
                if profile is not None and len(t.step) == 1:
                    profile.enable()
                if len(t.step) >= steps:
                    break
        if profile is not None:
            profile.disable()
        return t
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)


def _import_cores() -> None:
    # Imported before timing (and before an optional gc.freeze) so that neither pays for imports.
    import pagedserve.kvstore.replay, pagedserve.services.kvstore.client  # noqa: F401
    import pagedserve.services.scheduler.scheduler, pagedserve.services.scheduler.stepper  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedserve.loadgen.bench_control_plane", description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 64, 256], help="running sequences per step")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per batch size")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--profile", action="store_true", help="cProfile the timed steps of the largest batch")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() after the imports, as a server would after start-up (the kvstore does)")
    args = p.parse_args(argv)
    _import_cores()
    if args.gc_freeze:
        import gc
        gc.freeze()
    profile = None
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-") as run_dir:
        for n in args.seqs:
            if args.profile and n == max(args.seqs):
                import cProfile
                profile = cProfile.Profile()
            rows.append(run_batch(n, args.steps, args.prompt_len, f"ipc://{run_dir}/kvstore-{n}.sock",
                                  profile if n == max(args.seqs) else None))
    ms = 1e3
    print(f"control plane per decode step, {args.steps} steps, block size {BLOCK_SIZE}, "
          f"prompt {args.prompt_len} tokens, ipc socket, gc.freeze {'on' if args.gc_freeze else 'off'} "
          f"(ms; median / p99)")
    print(f"{'seqs':>5} {'ops/step':>8} {'exchange':>15} {'whole step':>15} {'sched core':>15} {'replay':>15}")
    for t in rows:
        cells = [f"{statistics.median(xs) * ms:6.3f} / {pct(xs, 0.99) * ms:6.3f}"
                 for xs in (t.exchange, t.step, t.core, t.replay)]
        print(f"{t.seqs:>5} {statistics.mean(t.ops_per_step):>8.1f} " + " ".join(f"{c:>15}" for c in cells))
    print(f"\nwhere the whole step goes, median ms per phase: " + ", ".join(PHASES))
    for t in rows:
        print(f"{t.seqs:>5} " + " ".join(f"{statistics.median(t.phases[name]) * ms:7.3f}" for name in PHASES))
    if profile is not None:
        import pstats
        pstats.Stats(profile).sort_stats(os.environ.get("SORT", "cumulative")).print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
