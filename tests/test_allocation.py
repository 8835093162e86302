"""The block store's allocation policies (paged and the paper's Orca baselines) and the Fig. 2
split of the KV cache, on the store alone, through the op-log replica, and under the scheduler."""
from __future__ import annotations

import pytest

from pagedserve.kvstore.allocator import ALLOCATIONS, OrcaPolicy, make_policy
from pagedserve.kvstore.replay import RecordingStore, apply_ops
from pagedserve.kvstore.store import BlockStore
from pagedserve.services.sampling_params import SamplingParams
from pagedserve.services.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerError
from pagedserve.services.steps import SampleResult

B = 4


def orca(mode: str, blocks: int = 16, max_len: int = 32) -> BlockStore:
    return BlockStore(blocks, 8, B, policy=OrcaPolicy(mode, max_len))


def contiguous(table: list[int]) -> bool:
    return table == list(range(table[0], table[0] + len(table)))


@pytest.mark.parametrize("mode,final,want", [("max", 9, 8), ("pow2", 9, 4), ("oracle", 9, 3)])
def test_each_orca_policy_reserves_one_contiguous_region_freed_only_at_the_end(mode, final, want):
    s = orca(mode)
    assert s.allocate(1, [1] * 5, max_total_tokens=final).ok
    table = s.block_table(1)
    assert len(table) == want and contiguous(table)
    for _ in range(final - 5):                       # decode into the region: no block changes hands
        assert s.append_tokens([1], [2]).ok
    assert s.block_table(1) == table and s.num_free_device_blocks == 16 - want
    s.check_invariants()
    s.free(1)
    assert s.num_free_device_blocks == 16
    s.check_invariants()


def test_paged_reserves_only_what_its_tokens_fill():
    s = BlockStore(16, 0, B, policy=make_policy("paged", 32))
    assert s.allocate(1, [1] * 5, max_total_tokens=30).ok
    assert len(s.block_table(1)) == 2


def test_orca_never_swaps_and_has_no_prefix_cache():
    s = BlockStore(16, 8, B, enable_prefix_caching=True, policy=OrcaPolicy("oracle", 32))
    assert not s.enable_prefix_caching
    s.allocate(1, list(range(9)), max_total_tokens=12)
    s.mark_computed(1, 8)
    assert s.allocate(2, list(range(9)), max_total_tokens=12).num_cached_tokens == 0
    assert not s.can_swap_out([1])
    r = s.swap_out([1])
    assert not r.ok and "never swaps" in r.reason and s.location(1) == "device"


def test_a_region_needs_one_free_run_and_the_short_runs_count_as_external_fragmentation():
    s = orca("oracle", blocks=12)
    for seq in range(4):                             # four regions of 3 blocks: the pool is full
        assert s.allocate(seq, [1] * 3, max_total_tokens=12).ok
    s.free(0)
    s.free(2)                                        # free runs of 3 and 3 blocks: 6 free in all
    assert s.num_free_device_blocks == 6
    assert not s.can_allocate(3, max_total_tokens=16)   # 4 blocks: no run is that long
    r = s.allocate(9, [1] * 3, max_total_tokens=16)
    assert not r.ok and "contiguous" in r.reason and 9 not in s
    u = s.kv_usage(waiting_tokens=3, waiting_final=16)
    assert u["external_fragmentation"] == 6 * B and u["free"] == 0
    assert sum(u.values()) - u["table_slots"] == 12 * B
    assert s.kv_usage(waiting_tokens=3, waiting_final=12)["external_fragmentation"] == 0   # 3 fit
    assert s.allocate(9, [1] * 3, max_total_tokens=12).ok and s.block_table(9) == [0, 1, 2]  # first fit
    s.check_invariants()


def test_kv_usage_splits_every_slot_into_the_five_parts():
    s = orca("max", blocks=16, max_len=16)           # a region of 4 blocks = 16 slots
    s.allocate(1, [1] * 5, max_total_tokens=10)      # 5 tokens, 5 more to come, 6 never used
    u = s.kv_usage()
    assert u == {"token_states": 5, "reserved": 5, "internal_fragmentation": 6,
                 "external_fragmentation": 0, "free": 12 * B, "table_slots": 16}
    p = BlockStore(16, 0, B)                         # paged: only the last block's tail is empty
    p.allocate(1, [1] * 5, max_total_tokens=6)       # 8 slots held: 5 filled, 1 to come, 2 never
    p.fork(1, 2)                                     # a shared block counts once
    assert p.kv_usage() == {"token_states": 5, "reserved": 1, "internal_fragmentation": 2,
                            "external_fragmentation": 0, "free": 14 * B, "table_slots": 16}


@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_the_replica_replays_every_policy_to_the_same_state(allocation):
    mirror = RecordingStore(48, 8, B, policy=make_policy(allocation, 32))
    replica = BlockStore(48, 8, B, policy=make_policy(allocation, 32))
    for seq in range(5):
        assert mirror.allocate(seq, [seq] * (3 + seq), max_total_tokens=9 + seq).ok
    mirror.free(1)
    mirror.free(3)
    mirror.allocate(7, [7] * 6, max_total_tokens=12)
    mirror.append_tokens([0, 2, 4, 7], [1, 1, 1, 1])
    ops, results = mirror.drain()
    assert apply_ops(replica, ops) == results
    assert {i: replica.block_table(i) for i in replica.seq_ids()} == \
        {i: mirror.block_table(i) for i in mirror.seq_ids()}
    replica.check_invariants()


# ---- under the scheduler (no model: every draw is token 7) -------------------------------------

def run(sched: Scheduler, clock: list[float], max_steps: int = 10_000) -> list:
    finished, waits = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        step = sched.schedule()
        waits.append(len(sched.waiting))
        results = [SampleResult(w.seq_id, 7) for ws in step.samples for w in ws]
        clock[0] += 1.0
        finished += sched.update(step, results)
    return finished, waits


def make(allocation: str, blocks: int, batching: str = "iteration", **kw):
    clock = [0.0]
    store = RecordingStore(blocks, 0, B, policy=make_policy(allocation, 32))
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32, batching=batching,
                          kv_usage_interval_s=0.0, **kw)
    return Scheduler(cfg, store, clock=lambda: clock[0]), clock


def test_under_orca_a_request_that_does_not_fit_waits_and_runs_later():
    sched, clock = make("orca-oracle", blocks=6)     # 24 slots: one 20-token region at a time
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for i in range(3):
        sched.add_request(f"r{i}", [1] * 10, params, true_output_len=10)
    finished, waits = run(sched, clock)
    assert [r.request_id for r in finished] == ["r0", "r1", "r2"]
    assert all(not r.error and len(r.finished[0].output_token_ids) == 10 for r in finished)
    assert max(waits) == 2 and sched.stats["preemptions"] == 0
    sched.store.check_invariants()


def test_orca_reserving_policies_need_the_true_output_length():
    sched, _ = make("orca-oracle", blocks=6)
    with pytest.raises(SchedulerError, match="true_output_len"):
        sched.add_request("r", [1, 2], SamplingParams(max_tokens=4))
    make("orca-max", blocks=6)[0].add_request("r", [1, 2], SamplingParams(max_tokens=4))   # max: no


def test_paged_batches_more_than_orca_max_in_the_same_memory():
    avg = {}
    for allocation in ("paged", "orca-max"):
        sched, clock = make(allocation, blocks=16)   # orca-max: 8 blocks per request, 2 at a time
        for i in range(8):
            sched.add_request(f"r{i}", [1] * 3, SamplingParams(max_tokens=5, ignore_eos=True), true_output_len=5)
        run(sched, clock)
        avg[allocation] = sched.kv_breakdown()["avg_batched_requests"]
    assert avg["orca-max"] == pytest.approx(2.0, abs=0.3) and avg["paged"] > 2 * avg["orca-max"]


def test_request_batching_admits_only_when_the_batch_has_finished():
    sched, clock = make("orca-max", blocks=64, batching="request")
    lengths = [2, 9, 3]
    for i, n in enumerate(lengths):
        sched.add_request(f"a{i}", [1] * 3, SamplingParams(max_tokens=n, ignore_eos=True))
    first = sched.schedule()
    assert len(first.requests) == 3                  # one batch, admitted together
    sched.add_request("late", [1] * 3, SamplingParams(max_tokens=2, ignore_eos=True))
    sched.update(first, [SampleResult(w.seq_id, 7) for ws in first.samples for w in ws])
    finished, _ = run(sched, clock)
    order = [r.request_id for r in finished]
    assert order.index("late") > order.index("a1")  # it waited for the longest of the batch
    assert finished[-1].first_token_time >= max(r.finish_time for r in finished[:-1])


def test_kv_breakdown_sums_to_one_over_time():
    sched, clock = make("orca-pow2", blocks=16)
    for i in range(6):
        sched.add_request(f"r{i}", [1] * 5, SamplingParams(max_tokens=6, ignore_eos=True), true_output_len=6)
    run(sched, clock)
    kb = sched.kv_breakdown()
    assert sum(kb["cache"].values()) == pytest.approx(1.0)
    assert sum(kb["allocated"].values()) == pytest.approx(1.0)
    assert kb["cache"]["internal_fragmentation"] > 0 and kb["cache"]["reserved"] > 0
    assert kb["seconds"] > 0


def test_idle_time_counts_as_an_empty_pool():
    sched, clock = make("paged", blocks=16)
    for i in range(2):
        sched.add_request(f"r{i}", [1] * 3, SamplingParams(max_tokens=5, ignore_eos=True))
        run(sched, clock)
        clock[0] += 1000.0            # nothing runs: no step samples the pool meanwhile
    assert sched.kv_breakdown()["cache"]["free"] > 0.99
