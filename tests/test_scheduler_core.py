"""The scheduler core with no model and no torch: a block store and a worker that draws token 7.

FCFS order, the token budget and the sequence cap, chunked prefill, which request is preempted
and how (swap or recompute), and sharing (parallel samples fork the prompt's blocks).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

from pagedserve.kvstore.block_table import HOST
from pagedserve.kvstore.store import BlockStore
from pagedserve.services.sampling_params import SamplingParams
from pagedserve.services.scheduler.request import RequestStatus
from pagedserve.services.scheduler.scheduler import Scheduler, SchedulerConfig
from pagedserve.services.steps import SampleResult

B = 4


def make(blocks: int = 64, host: int = 32, **kw) -> tuple[Scheduler, list[float]]:
    clock = [0.0]
    cfg = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 128, **kw})
    return Scheduler(cfg, BlockStore(blocks, host, B), clock=lambda: clock[0]), clock


def params(n_out: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n_out, ignore_eos=True, **{"temperature": 0.0, **kw})


def step(sched: Scheduler, clock: list[float]):
    s = sched.schedule()
    clock[0] += 1.0
    return s, sched.update(s, [SampleResult(w.seq_id, 7) for ws in s.samples for w in ws])


def run_all(sched: Scheduler, clock: list[float]) -> list[str]:
    order = []
    for _ in range(10_000):
        if not sched.has_unfinished():
            return order
        order += [r.request_id for r in step(sched, clock)[1]]
    raise AssertionError("did not finish")


def test_the_core_imports_without_torch():
    code = textwrap.dedent("""
        import sys
        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked")
        sys.meta_path.insert(0, NoTorch())
        import pagedserve.services.scheduler.scheduler
        assert "torch" not in sys.modules
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_fcfs_admission_and_finish_order_under_memory_pressure():
    sched, clock = make(blocks=6)              # 24 slots: one 12-token request at a time, and a bit
    for i in range(4):
        sched.add_request(f"r{i}", [1] * 8, params(4))
    assert run_all(sched, clock) == ["r0", "r1", "r2", "r3"]


def test_token_budget_and_sequence_cap_bound_every_step():
    sched, clock = make(max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(5):
        sched.add_request(f"r{i}", [1] * 4, params(3))
    first, _ = step(sched, clock)
    # 4 + 4 tokens, then the third request's first 2 (a chunk); the cap leaves the rest waiting.
    assert [len(s.token_ids) for s in first.steps] == [4, 4, 2] and len(sched.running) == 3
    assert [r.request_id for r in sched.waiting] == ["r3", "r4"]
    while sched.has_unfinished():
        s, _ = step(sched, clock)
        assert s.num_tokens <= 10 and len(sched.running) <= 3


def test_a_long_prompt_is_prefilled_in_chunks_and_samples_only_at_the_end():
    sched, clock = make(max_num_batched_tokens=8, max_num_seqs=8)
    req = sched.add_request("long", list(range(1, 21)), params(2))
    chunks = []
    while not req.seqs[0].output_token_ids:
        s, _ = step(sched, clock)
        chunks.append((s.num_tokens, bool(s.samples[0])))
    assert chunks == [(8, False), (8, False), (4, True)]


def test_the_newest_running_request_is_preempted_first():
    sched, clock = make(blocks=8, preemption_mode="recompute")   # 32 slots
    for i in range(3):
        sched.add_request(f"r{i}", [1] * 7, params(20))
    preempted = []
    while sched.has_unfinished():
        s, _ = step(sched, clock)
        preempted += [r.request_id for r in s.preempted]
    assert preempted and preempted[0] == "r2" and "r0" not in preempted


def test_swap_keeps_the_blocks_on_the_host_and_recompute_drops_them():
    for mode in ("swap", "recompute"):
        sched, clock = make(blocks=8, preemption_mode=mode)
        reqs = [sched.add_request(f"r{i}", [1] * 7, params(20)) for i in range(3)]
        while not any(r.num_preemptions for r in reqs):
            step(sched, clock)
        victim = next(r for r in reqs if r.num_preemptions)
        if mode == "swap":
            assert victim.status is RequestStatus.SWAPPED and sched.store.location(victim.seqs[0].seq_id) == HOST
            assert sched.stats["swap_outs"] == 1
        else:
            assert victim.status is RequestStatus.WAITING and victim.seqs[0].seq_id not in sched.store
            assert victim.seqs[0].num_computed == 0
        run_all(sched, clock)
        assert all(len(r.finished[0].output_token_ids) == 20 for r in reqs)
        sched.store.check_invariants()


def test_auto_mode_recomputes_short_sequences_and_swaps_long_ones():
    for min_tokens, reason in ((1000, "auto: short sequence is cheaper to recompute"),
                               (1, "auto: long sequence is cheaper to copy than to recompute")):
        sched, clock = make(blocks=8, preemption_mode="auto", auto_swap_min_tokens=min_tokens)
        for i in range(3):
            sched.add_request(f"r{i}", [1] * 7, params(20))
        run_all(sched, clock)
        assert sched.stats[f"preemption_reason[{reason}]"] > 0


def test_parallel_samples_share_the_prompts_blocks():
    sched, clock = make()
    req = sched.add_request("n3", [1] * 9, params(2, n=3, temperature=1.0, seed=1))
    step(sched, clock)                            # the prompt is computed once, then forked
    tables = [sched.store.block_table(s.seq_id) for s in req.seqs]
    assert len(tables) == 3 and tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert sched.store.refcount(tables[0][0]) == 3
    run_all(sched, clock)
    assert len(req.finished) == 3 and sched.store.num_free_device_blocks == 64


def test_the_final_update_carries_vllms_phases_on_the_engines_clock():
    """Queued until admitted, prefill to the first token, decode to the last; a preempted request
    counts its preemptions and keeps its first admission time."""
    from pagedserve.services.scheduler.stepper import RouterView
    sched, clock = make(max_num_seqs=1)
    sched.add_request("a", list(range(6)), params(3))
    sched.add_request("b", list(range(6)), params(2))   # waits while a runs (one sequence at a time)
    finals = {}
    view = RouterView()
    for _ in range(100):
        if not sched.has_unfinished():
            break
        s, done = step(sched, clock)
        for req in done:
            finals[req.request_id] = view.update_for(req)
    a, b = finals["a"], finals["b"]
    # a: admitted at 0, first token after the step ending at 1, last at 3
    assert (a.queued_s, a.prefill_s, a.decode_s, a.inference_s) == (0.0, 1.0, 2.0, 3.0)
    assert b.queued_s == 3.0 and b.prefill_s == 1.0 and b.decode_s == 1.0 and b.num_preemptions == 0
