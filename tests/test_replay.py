"""Op-log replay: a pool-less mirror recorded by RecordingStore and a replica with pools stay equal.

The random driver also plays the worker: after each batch it writes every sequence's new tokens
into the replica's device pool, so copy-on-write copies, swaps and prefix hits are checked on the
bytes (each slot must hold its token), not only on the bookkeeping.
"""
import random

import pytest
import torch

from pagedserve.kvstore.pool import BlockPool, unique_pool_name
from pagedserve.kvstore.replay import (OPS, RecordingStore, ReplayError, ReplicaDiverged, apply_ops,
                            encode_result)
from pagedserve.kvstore.store import AllocResult, AppendResult, BlockStore, SwapResult

B, DEVICE_BLOCKS, HOST_BLOCKS = 4, 24, 12


@pytest.fixture
def pools():
    made = [BlockPool.create(unique_pool_name(role), n, B) for role, n in
            (("device", DEVICE_BLOCKS), ("host", HOST_BLOCKS))]
    yield made
    for p in made:
        p.close()
        p.unlink()


def mirror(**kw) -> RecordingStore:
    return RecordingStore(DEVICE_BLOCKS, HOST_BLOCKS, B, **kw)


def replica(pools, **kw) -> BlockStore:
    return BlockStore(DEVICE_BLOCKS, HOST_BLOCKS, B, device_pools=[pools[0]], host_pools=[pools[1]], **kw)


def slot_byte(token: int) -> int:
    return token % 251 + 1   # never 0: a slot nobody wrote reads 0


class Driver:
    """Random block operations on a mirror, replayed in batches on a replica with pools."""

    def __init__(self, seed: int, pools, prefix_caching: bool):
        self.rng = random.Random(seed)
        self.mirror = mirror(enable_prefix_caching=prefix_caching)
        self.replica = replica(pools, enable_prefix_caching=prefix_caching)
        self.pools = pools
        self.written: dict[int, int] = {}   # seq id -> tokens whose bytes are in the pool
        self.next_id = 0
        self.prefixes = [[self.rng.randrange(50) for _ in range(9)] for _ in range(3)]

    def seqs(self, location=None) -> list[int]:
        return [s for s in self.mirror.seq_ids() if location is None or self.mirror.location(s) == location]

    def random_op(self) -> None:
        rng, m = self.rng, self.mirror
        kind = rng.choice(OPS + ("allocate", "allocate", "append_slots", "bad"))
        if m.num_free_device_blocks < 4 and rng.random() < 0.4:
            kind = "free"   # keep memory churning, so the LRU evicts and the tail of a run is not all failures
        dev, host = self.seqs("device"), self.seqs("host")
        if kind == "allocate":
            prompt = rng.choice(self.prefixes)[:rng.randint(1, 9)] + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
            seq_id, self.next_id = self.next_id, self.next_id + 1
            r = m.allocate(seq_id, prompt, rng.choice([(), ("salt",)]))
            if r.ok:
                self.written[seq_id] = r.num_cached_tokens
        elif kind == "append_slots" and dev:
            m.append_slots(rng.choice(dev), [rng.randrange(50) for _ in range(rng.randint(0, 3))])
        elif kind == "append_tokens" and dev:   # a decode step's batch; forked blocks copy on write
            ids = rng.sample(dev, rng.randint(1, min(4, len(dev))))
            m.append_tokens(ids, [rng.randrange(50) for _ in ids])
        elif kind == "mark_computed" and dev:
            s = rng.choice(dev)
            m.mark_computed(s, rng.randint(0, self.written[s]))
        elif kind == "fork" and self.seqs():
            parent, child = rng.choice(self.seqs()), self.next_id
            self.next_id += 1
            m.fork(parent, child)
            self.written[child] = self.written[parent]
        elif kind == "free" and self.seqs():
            s = rng.choice(self.seqs())
            m.free(s)
            del self.written[s]
        elif kind == "swap_out" and dev:
            m.swap_out(rng.sample(dev, rng.randint(1, min(2, len(dev)))))
        elif kind == "swap_in" and host:
            m.swap_in(rng.sample(host, rng.randint(1, min(2, len(host)))))
        elif kind == "bad":   # a programming error raises on the mirror and must not be recorded
            with pytest.raises(ValueError):
                m.free(10_000)

    def flush(self) -> None:
        ops, expected = self.mirror.drain()
        assert apply_ops(self.replica, ops) == expected
        assert self.mirror.stats() == self.replica.stats()
        for s in self.seqs():
            assert self.replica.block_table(s) == self.mirror.block_table(s)
            assert self.replica.location(s) == self.mirror.location(s)
        self.check_bytes()
        self.write_new_tokens()

    def slots(self, s: int, end: int) -> tuple[torch.Tensor, list[int]]:
        pool = self.pools[0] if self.replica.location(s) == "device" else self.pools[1]
        return pool.blocks.view(-1), self.replica.slot_mapping(s, 0, end)

    def check_bytes(self) -> None:
        for s in self.seqs():
            flat, slots = self.slots(s, self.written[s])
            tokens = self.replica.token_ids(s)
            assert flat[slots].tolist() == [slot_byte(t) for t in tokens[:len(slots)]], f"seq {s}"

    def write_new_tokens(self) -> None:
        for s in self.seqs("device"):
            n = self.replica.num_tokens(s)
            flat, slots = self.slots(s, n)
            tokens = self.replica.token_ids(s)
            for p in range(self.written[s], n):
                flat[slots[p]] = slot_byte(tokens[p])
            self.written[s] = n


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_random_logs_replay_to_identical_state_and_bytes(seed, prefix_caching, pools):
    d = Driver(seed, pools, prefix_caching)
    for _ in range(60):
        for _ in range(d.rng.randint(1, 8)):
            d.random_op()
        d.flush()
    d.replica.check_invariants()
    stats = d.replica.stats()
    # The driver must actually exercise sharing, swapping and (with caching) prefix hits.
    assert stats["cow_copies"] > 0 and stats["swap_outs"] > 0 and stats["swap_ins"] > 0
    assert (stats["prefix_hit_tokens"] > 0) == prefix_caching


def test_a_batch_append_that_takes_new_blocks_is_one_op_in_the_log():
    # append_tokens grows a sequence past its block through BlockStore.append_slots: the mirror
    # (a subclass) must log the batch once, not also each append_slots inside it.
    m = RecordingStore(4, 0, B)
    assert m.allocate(0, list(range(B))).ok and m.allocate(1, [1]).ok   # 0's block is full
    m.drain()
    assert m.append_tokens([0, 1], [7, 8]).ok
    ops, results = m.drain()
    assert ops == [["append_tokens", [0, 1], [7, 8]]] and results == [[True, []]]
    assert 0 in m and m.block_size == B and m.num_free_device_blocks == 1


def test_only_state_changes_are_recorded():
    m = RecordingStore(2, 0, B)
    assert m.allocate(0, list(range(5))).ok                      # 2 blocks
    assert not m.allocate(1, [1]).ok                             # pool full: changes nothing
    assert not m.append_slots(0, [1, 2, 3, 4]).ok                # needs a third block
    m.append_slots(0, [])                                        # empty
    m.mark_computed(0, 3)                                        # no full block yet
    m.mark_computed(0, 4)                                        # registers block 0
    m.mark_computed(0, 5)                                        # nothing new to register
    ops, results = m.drain()
    assert ops == [["allocate", 0, [0, 1, 2, 3, 4], [], None], ["mark_computed", 0, 4]]
    assert results == [[True, 0], None]
    assert m.drain() == ([], [])


def test_encode_result_uses_plain_lists():
    assert encode_result(AllocResult(True, 16)) == [True, 16]
    assert encode_result(AppendResult(True, [(1, 2)])) == [True, [[1, 2]]]
    assert encode_result(SwapResult(False, [], "full")) == [False, []]
    assert encode_result(None) is None
    with pytest.raises(TypeError):
        encode_result(3)


def snapshot(store: BlockStore):
    return store.stats(), {s: (store.block_table(s), store.num_tokens(s)) for s in store.seq_ids()}


@pytest.mark.parametrize("bad", [
    "not a list", [["nope", 1]], [[]], [[3]], [["free"]], [["free", 0, 1]], [["free", "0"]],
    [["free", True]], [["allocate", 5, []]], [["allocate", 5, [1, "x"]]], [["allocate", 0, [1]]],
    [["allocate", 5, [1], [{"k": 1}]]], [["allocate", 5, [1], [], -1]], [["append_slots", 9, [1]]],
    [["mark_computed", 0, 6]], [["swap_in", [0]]], [["swap_out", [0, 0]]], [["fork", 0, 0]],
    # Valid ops first, then one that is wrong *given them*: none of the batch may apply.
    [["append_slots", 0, [7]], ["free", 0], ["append_slots", 0, [1]]],
    [["fork", 0, 1], ["swap_out", [0, 1]], ["mark_computed", 1, 1]],
    [["allocate", 2, [1, 2]], ["allocate", 2, [3]]],
])
def test_malformed_logs_change_nothing(bad, pools):
    store = replica(pools)
    assert store.allocate(0, [1, 2, 3, 4, 5]).ok
    before = snapshot(store)
    with pytest.raises(ReplayError):
        apply_ops(store, bad)
    assert snapshot(store) == before


def test_a_replica_that_drifted_reports_where(pools):
    m = mirror()
    m.allocate(0, list(range(DEVICE_BLOCKS * B)))
    m.free(0)
    m.allocate(1, [1, 2])
    m.append_slots(1, [3])
    ops, _ = m.drain()
    store = replica(pools)
    store.allocate(7, [1] * B * 2)   # an op the mirror never saw: the replica lacks two blocks
    with pytest.raises(ReplicaDiverged) as e:
        apply_ops(store, ops)
    assert e.value.index == 1 and e.value.results == [[False, 0]]


def test_the_scheduler_waits_for_the_kvstore_exactly_when_bytes_move():
    from pagedserve.services.scheduler.service import _moves_bytes
    no_copy = [True, []]
    assert not _moves_bytes([["append_tokens", [1, 2], [5, 6]], ["append_slots", 3, [7]], ["free", 4]],
                            [no_copy, no_copy, None])
    assert _moves_bytes([["append_tokens", [1, 2], [5, 6]]], [[True, [[2, 8, 9]]]])   # copy-on-write
    assert _moves_bytes([["append_slots", 3, [7]]], [[True, [[8, 9]]]])
    assert _moves_bytes([["swap_in", [3]]], [[True, [[1, 2]]]])


def test_a_request_id_that_comes_back_is_sampled_with_its_own_params():
    """A request finishes and is forgotten; a new one with the same id (a client's X-Request-Id)
    arrives before the next step: the worker must get and use the new params, not its cached old ones."""
    from pagedserve.services import protocol
    from pagedserve.services.sampling_params import SamplingParams
    from pagedserve.services.scheduler.scheduler import Scheduler, SchedulerConfig
    from pagedserve.services.scheduler.stepper import WorkerView
    from pagedserve.services.worker.step_inputs import StepInputs
    from pagedserve.services.worker.worker_core import SampleResult
    store = RecordingStore(64, 0, 16)
    core = Scheduler(SchedulerConfig(max_model_len=512, vocab_size=1000), store, clock=lambda: 0.0)
    view, worker = WorkerView(), StepInputs()

    def step():
        s = core.schedule()
        msg = protocol.decode(protocol.encode(view.execute_step(1, s, store, core.live_request_ids)))
        worker.apply_deltas(msg)
        _, samples = worker.build(msg)
        worker.drop_params(msg)
        return core.update(s, [SampleResult(w.seq_id, 5, -1.0) for ws in samples for w in ws]), samples

    core.add_request("job-1", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0))
    finished, _ = step()
    for r in finished:
        core.requests.pop(r.request_id)       # as the scheduler process forgets a finished request
    core.add_request("job-1", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.9, logit_bias={7: 100.0}))
    _, samples = step()
    params = samples[0][0].params
    assert (params.temperature, params.logit_bias, params.max_tokens) == (0.9, {7: 100.0}, 8)
    assert len(worker.params) == 1
