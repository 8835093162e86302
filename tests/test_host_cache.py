"""The host tier of the prefix cache and the cache that outlives a scheduler (issue 14).

Demoted and promoted blocks keep their bytes on every tensor-parallel rank; the host tier never
takes what a swapped request holds or needs; a random op log (swaps, forks, demotions, promotions
and scheduler restarts) keeps the scheduler's mirror equal to the kvstore's replica, state and bytes;
a restart frees the sequences that were running and keeps the cached blocks; greedy output still
equals transformers when prefix blocks went to the host and back.
"""
from __future__ import annotations

import pytest
import torch

from pagedserve.kvstore.pool import BlockPool, unique_pool_name
from pagedserve.kvstore.replay import RecordingStore
from pagedserve.services.kvstore.service import KVStoreService
from pagedserve.kvstore.store import BlockStore
from pagedserve.services import protocol
from tests import test_replay

B, BLOCK_BYTES, TP = 4, 16, 2


class Pools:
    """TP device pools and TP host pools of one shape, unlinked at the end."""

    def __init__(self, num_device: int, num_host: int, tp: int = TP, block_bytes: int = BLOCK_BYTES):
        self.device = [BlockPool.create(unique_pool_name(f"d{r}"), num_device, block_bytes) for r in range(tp)]
        self.host = [BlockPool.create(unique_pool_name(f"h{r}"), num_host, block_bytes) for r in range(tp)]
        self.num_device, self.num_host = num_device, num_host

    def store(self, host_cache_blocks: int, **kw) -> BlockStore:
        return BlockStore(self.num_device, self.num_host, B, device_pools=self.device, host_pools=self.host,
                          host_cache_blocks=host_cache_blocks, **kw)

    def fill(self, blocks: list[int], generator: torch.Generator) -> list[torch.Tensor]:
        """Random bytes in these device blocks on every rank (what a worker's K/V write does) ->
        a copy of them per rank."""
        out = []
        for p in self.device:
            p.blocks[blocks] = torch.randint(0, 256, (len(blocks), p.block_bytes), dtype=torch.uint8,
                                             generator=generator)
            out.append(p.blocks[blocks].clone())
        return out

    def read(self, blocks: list[int], kind: str = "device") -> list[torch.Tensor]:
        return [p.blocks[blocks].clone() for p in (self.device if kind == "device" else self.host)]

    def close(self) -> None:
        for p in self.device + self.host:
            p.close()
            p.unlink()


@pytest.fixture
def pools():
    made = []

    def make(num_device: int, num_host: int) -> Pools:
        made.append(Pools(num_device, num_host))
        return made[-1]
    yield make
    for p in made:
        p.close()


def computed(store: BlockStore, seq_id: int, tokens: list[int], pools: Pools, gen) -> list[torch.Tensor]:
    """Admit a sequence, 'compute' it (random K/V in its blocks), key its full blocks -> the bytes."""
    assert store.allocate(seq_id, tokens).ok
    blocks = store.block_table(seq_id)
    data = pools.fill(blocks, gen)
    store.mark_computed(seq_id, len(tokens))
    return data


def churn(store: BlockStore, seq_id: int, num_blocks: int, pools: Pools, gen) -> None:
    """A sequence of fresh tokens that takes num_blocks device blocks, writes them and leaves
    (unkeyed): it evicts whatever hashed blocks the LRU hands out."""
    assert store.allocate(seq_id, [1000 + seq_id * 100 + i for i in range(num_blocks * B)]).ok
    pools.fill(store.block_table(seq_id), gen)
    store.free(seq_id)


def test_demote_then_promote_keeps_every_ranks_bytes(pools):
    p, gen = pools(8, 8), torch.Generator().manual_seed(0)
    store = p.store(host_cache_blocks=8)
    prompt = list(range(13))                       # 3 full blocks before the last token
    data = computed(store, 1, prompt, p, gen)
    store.free(1)
    churn(store, 2, 8, p, gen)                     # the whole pool: A's 3 keyed blocks are evicted
    s = store.stats()
    assert s["host_cache_demotions"] == 3 and s["host_blocks_cached"] == 3 and s["device_blocks_cached"] == 0
    r = store.allocate(3, prompt)
    assert r.ok and r.num_cached_tokens == 12 and r.num_host_cached_tokens == 12   # all from the host
    got = p.read(store.block_table(3)[:3])
    for rank in range(TP):
        assert torch.equal(got[rank], data[rank][:3]), f"rank {rank}"
    s = store.stats()
    assert (s["host_cache_promotions"], s["host_hit_tokens"], s["prefix_hit_tokens"]) == (3, 12, 0)
    assert s["host_queries_tokens"] == s["prefix_queries_tokens"] == 13 + 8 * B + 13
    # The host copy stays: evicting the promoted blocks again copies nothing.
    store.free(3)
    churn(store, 4, 8, p, gen)
    assert store.stats()["host_cache_demotions"] == 3 and store.stats()["host_blocks_cached"] == 3
    store.check_invariants()


def test_a_full_host_tier_replaces_its_oldest_block_and_keeps_the_prefix_head(pools):
    """free() releases tail first, so the device LRU demotes a prefix's tail before its head; a
    tier of two blocks then holds the head, which is what still hits."""
    p, gen = pools(8, 8), torch.Generator().manual_seed(1)
    store = p.store(host_cache_blocks=2)
    prompt = list(range(13))
    data = computed(store, 1, prompt, p, gen)
    store.free(1)
    churn(store, 2, 8, p, gen)
    s = store.stats()
    assert s["host_cache_demotions"] == 3 and s["host_blocks_cached"] == 2
    r = store.allocate(3, prompt)
    assert r.ok and r.num_cached_tokens == 2 * B
    got = p.read(store.block_table(3)[:2])
    assert all(torch.equal(got[rank], data[rank][:2]) for rank in range(TP))
    store.check_invariants()


def test_no_host_tier_without_prefix_caching_or_with_size_zero(pools):
    p, gen = pools(8, 8), torch.Generator().manual_seed(2)
    for store in (p.store(host_cache_blocks=0), p.store(host_cache_blocks=8, enable_prefix_caching=False)):
        computed(store, 1, list(range(13)), p, gen)
        store.free(1)
        churn(store, 2, 8, p, gen)
        assert store.stats()["host_cache_demotions"] == 0 and store.stats()["host_blocks_cached"] == 0
        assert store.allocate(3, list(range(13))).num_cached_tokens == 0


def test_the_host_tier_never_takes_what_a_swapped_request_holds_or_needs(pools):
    p, gen = pools(8, 4), torch.Generator().manual_seed(3)
    store = p.store(host_cache_blocks=4)
    prefix = list(range(17))                       # 4 full blocks
    computed(store, 1, prefix, p, gen)
    store.free(1)
    churn(store, 2, 8, p, gen)
    assert store.stats()["host_blocks_cached"] == 4 and store.num_free_host_blocks == 4
    # A request preempted by swapping needs the whole host pool: the tier makes room.
    victim = computed(store, 3, [500 + i for i in range(16)], p, gen)
    assert store.can_swap_out([3])
    r = store.swap_out([3])
    assert r.ok and store.stats()["host_blocks_cached"] == 0
    held = [h for _, h in r.mapping]
    # While it is out, the device evicts keyed blocks again: none may be demoted into its blocks.
    computed(store, 4, [700 + i for i in range(17)], p, gen)
    store.free(4)
    demotions = store.stats()["host_cache_demotions"]
    churn(store, 5, 8, p, gen)
    assert store.stats()["host_cache_demotions"] == demotions   # no free host block: nothing demoted
    assert all(torch.equal(a, b) for a, b in zip(p.read(held, "host"), victim))
    assert store.swap_in([3]).ok
    got = p.read(store.block_table(3))
    assert all(torch.equal(got[rank], victim[rank]) for rank in range(TP))
    store.check_invariants()


def test_a_tier_smaller_than_the_pool_leaves_swapping_the_rest(pools):
    """With a tier of 2 blocks in a host pool of 4, a swapped request of 2 blocks and a full tier
    live side by side; a second swap-out takes tier blocks back."""
    p, gen = pools(8, 4), torch.Generator().manual_seed(4)
    store = p.store(host_cache_blocks=2)
    computed(store, 1, [300 + i for i in range(8)], p, gen)   # 2 blocks, not keyed past the last token
    assert store.swap_out([1]).ok
    computed(store, 2, list(range(13)), p, gen)
    store.free(2)
    churn(store, 3, 8, p, gen)   # the whole device pool: 2's 3 keyed blocks are demoted, the tier keeps 2
    assert store.stats()["host_blocks_cached"] == 2 and store.num_free_host_blocks == 2
    computed(store, 4, [600 + i for i in range(8)], p, gen)
    assert store.swap_out([4]).ok and store.stats()["host_blocks_cached"] == 0
    store.check_invariants()


def test_the_scheduler_waits_for_the_kvstore_when_its_mirror_demoted_or_promoted():
    """A pool-less mirror counts the copies its replica will make; a log with any must be replayed
    before the worker writes the step (a demoted block is handed out in it), so it 'moves bytes'."""
    from pagedserve.services.scheduler.service import _moves_bytes
    mirror = RecordingStore(8, 8, B, host_cache_blocks=8)
    mirror.allocate(1, list(range(13)))
    mirror.mark_computed(1, 13)
    mirror.free(1)
    mirror.drain()
    assert mirror.host_cache_copies == 0
    assert mirror.allocate(2, [500 + i for i in range(32)]).ok   # evicts 1's three keyed blocks
    ops, results = mirror.drain()
    assert mirror.host_cache_copies == 3
    assert not _moves_bytes(ops, results) and _moves_bytes(ops, results, host_copies=3)


# ---- the mirror and the replica, through the kvstore's own service core -------------------------

class ServedDriver(test_replay.Driver):
    """test_replay's random driver, its logs replayed through KVStoreService (msgpack frames, as
    the kvstore process gets them), with a host tier, and with scheduler restarts: the service
    frees every sequence and the new mirror is built from its snapshot."""

    def __init__(self, seed: int, pools, host_cache_blocks: int):
        super().__init__(seed, pools, prefix_caching=True)
        kw = dict(host_cache_blocks=host_cache_blocks)
        n_dev, n_host = test_replay.DEVICE_BLOCKS, test_replay.HOST_BLOCKS
        self.service = KVStoreService(
            lambda: BlockStore(n_dev, n_host, test_replay.B, device_pools=[pools[0]], host_pools=[pools[1]], **kw),
            protocol.PoolInfo(test_replay.B, test_replay.B, n_dev, n_host, [pools[0].name], [pools[1].name],
                              host_cache_blocks=host_cache_blocks))
        self.replica = self.service.store
        self.make_mirror = lambda: RecordingStore(n_dev, n_host, test_replay.B, **kw)
        self.mirror = self.make_mirror()
        self.step, self.restarts = 0, 0

    def call(self, msg):
        return protocol.decode(self.service.handle(protocol.encode(msg)))

    def flush(self) -> None:
        ops, expected = self.mirror.drain()
        self.step += 1
        reply = self.call(protocol.ApplyOps(self.step, ops))
        assert reply.error is None and reply.results == expected
        assert self.mirror.snapshot() == self.replica.snapshot()
        self.check_bytes()
        self.write_new_tokens()

    def restart(self) -> None:
        """The scheduler dies with its requests in flight; a new one resumes from the kvstore."""
        self.flush()
        held = self.replica.stats()
        snap = self.call(protocol.ResumeStore("test"))
        assert snap.released == held["num_sequences"]
        after = self.replica.stats()
        assert after["num_sequences"] == 0 and after["device_blocks_used"] == 0 and after["host_blocks_used"] == 0
        # Every keyed block stays cached; none is lost with the requests that held it.
        assert after["device_blocks_cached"] == held["device_blocks_cached"]
        assert after["host_blocks_cached"] == held["host_blocks_cached"]
        self.mirror = self.make_mirror()
        self.mirror.restore(snap.snapshot)
        assert self.mirror.snapshot() == self.replica.snapshot()
        self.written, self.step = {}, 0
        self.restarts += 1


@pytest.mark.parametrize("host_cache_blocks", [4, test_replay.HOST_BLOCKS])
def test_mirror_equals_replica_across_demotions_promotions_swaps_and_restarts(host_cache_blocks):
    totals = {"host_cache_demotions": 0, "host_cache_promotions": 0, "swap_outs": 0, "host_hit_tokens": 0}
    for seed in range(6):
        made = [BlockPool.create(unique_pool_name(r), n, test_replay.B)
                for r, n in (("device", test_replay.DEVICE_BLOCKS), ("host", test_replay.HOST_BLOCKS))]
        try:
            d = ServedDriver(seed, made, host_cache_blocks)
            for i in range(60):
                for _ in range(d.rng.randint(1, 8)):
                    d.random_op()
                d.flush()
                if i % 20 == 19:
                    d.restart()
            d.replica.check_invariants()
            stats = d.replica.stats()
            for k in totals:
                totals[k] += stats[k]
        finally:
            for p in made:
                p.close()
                p.unlink()
    assert all(v > 0 for v in totals.values()), totals


def test_a_resumed_scheduler_hits_the_prefixes_of_the_one_before(pools):
    """Requests in flight when the scheduler dies: one computed, one half prefilled, one swapped.
    The resume frees all three; the computed prefix is found again by the next scheduler."""
    p = pools(16, 8)
    service = KVStoreService(lambda: p.store(host_cache_blocks=8),
                             protocol.PoolInfo(B, BLOCK_BYTES, 16, 8, [x.name for x in p.device],
                                               [x.name for x in p.host], host_cache_blocks=8))
    mirror = RecordingStore(16, 8, B, host_cache_blocks=8)
    prompt = list(range(21))                       # 5 full blocks before the last token
    mirror.allocate(1, prompt)
    mirror.mark_computed(1, 21)
    mirror.allocate(2, [900 + i for i in range(12)])
    mirror.mark_computed(2, 4)                     # its first block only
    mirror.allocate(3, [800 + i for i in range(8)])
    mirror.swap_out([3])

    def call(msg):
        return protocol.decode(service.handle(protocol.encode(msg)))
    assert call(protocol.ApplyOps(1, mirror.drain()[0])).error is None
    before = service.store.stats()
    snap = call(protocol.ResumeStore("scheduler"))
    assert snap.released == 3
    s = service.store.stats()
    assert s["device_blocks_used"] == 0 and s["host_blocks_used"] == 0 and s["num_sequences"] == 0
    assert s["device_blocks_cached"] == before["device_blocks_cached"] == 6
    fresh = RecordingStore(16, 8, B, host_cache_blocks=8)
    fresh.restore(snap.snapshot)
    r = fresh.allocate(0, prompt + [77])           # the new scheduler's first request, same prefix
    assert r.ok and r.num_cached_tokens == 20
    # The device had 20 of its 22 tokens: the host tier is asked for the other 2 (vLLM's count).
    assert (fresh.stats()["prefix_hit_tokens"], fresh.stats()["host_queries_tokens"]) == (20, 2)
    ops, expected = fresh.drain()
    reply = call(protocol.ApplyOps(1, ops))        # step numbers start again at 1
    assert reply.error is None and reply.results == expected == [[True, 20]]
    assert fresh.snapshot() == service.store.snapshot()


def test_a_snapshot_of_another_shape_is_refused_and_changes_nothing():
    src = BlockStore(8, 4, B, host_cache_blocks=4)
    src.allocate(1, list(range(9)))
    snap = src.snapshot()
    for other in (BlockStore(16, 4, B, host_cache_blocks=4), BlockStore(8, 4, B, host_cache_blocks=0),
                  BlockStore(8, 4, B, enable_prefix_caching=False)):
        before = other.snapshot()
        with pytest.raises(ValueError):
            other.restore(snap)
        assert other.snapshot() == before
    broken = dict(snap, seqs=[[1, [0, 0, 1], list(range(9)), [], "device", 3, [], 0, 9]])
    target = BlockStore(8, 4, B, host_cache_blocks=4)
    with pytest.raises(ValueError):
        target.restore(broken)
    assert target.snapshot() == BlockStore(8, 4, B, host_cache_blocks=4).snapshot()


# ---- greedy output with blocks that went to the host and back -----------------------------------

def test_greedy_output_equals_transformers_after_a_host_round_trip(tiny_llama):
    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig
    from pagedserve.services.sampling_params import SamplingParams
    from tests.test_exactness import hf_greedy
    shared = "class BlockAllocator:\n    def __init__(self, num_blocks):\n        self.free = list(range(num_blocks))\n"
    others = [f"# file {i}: " + " ".join(f"word{i}_{j}" for j in range(40)) for i in range(3)]
    prompts = [shared + "    def allocate(self, n):", *others, shared + "    def free(self, blocks):"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    # 24 blocks of 16 tokens: each of the other prompts fills most of the pool, so the shared
    # prefix's blocks are evicted (demoted) before the last prompt asks for them again.
    with Engine(EngineConfig(model=tiny_llama, block_size=16, num_device_blocks=24, num_host_blocks=32,
                             max_num_seqs=1)) as engine:
        ids = [engine.tokenize(p) for p in prompts]
        outs = [engine.generate([p], params)[0] for p in prompts]   # one at a time, in this order
        stats = engine.stats()
    assert stats["host_cache_demotions"] > 0 and stats["host_cache_promotions"] > 0
    assert stats["host_hit_tokens"] >= 16 * (len(engine.tokenize(shared)) // 16 - 1) > 0
    expected = hf_greedy(tiny_llama, ids, 16)
    for prompt, out, exp in zip(prompts, outs, expected):
        assert out.outputs[0].token_ids == exp, f"mismatch for prompt {prompt!r}"
