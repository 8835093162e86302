"""Property tests of BlockStore: random sequences of operations against a model of the K/V bytes.

The machine drives one store over small shared-memory pools. Every K/V slot a sequence owns is
written with bytes that depend on the sequence's whole prefix (as real K/V does), so a block that
is shared when it should not be, a copy-on-write or swap that copies the wrong block, or a prefix
hit on a block holding other tokens, all show up as a byte mismatch. After every step the machine
also checks the bookkeeping from the outside (refcounts = table references per pool, free + used =
capacity, the one-partial-block rule) and calls the store's own check_invariants().
"""

import hashlib
from collections import Counter

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedserve.kvstore.pool import BlockPool, unique_pool_name
from pagedserve.kvstore.store import BlockStore

B = 4
SLOT = 4             # bytes of K/V per token slot in the test pools
NUM_DEVICE = 16
NUM_HOST = 12
# Prompts share prefixes often: a piece of one of two fixed prompts, then a short random tail from a
# small vocabulary (so tails collide too).
BASES = ([1, 2, 1, 0, 2, 2, 0, 1, 1, 0, 2], [2, 0, 0, 1, 2, 1, 1, 0, 0, 2, 1])
TOKENS = st.builds(lambda base, cut, tail: base[:cut] + tail, st.sampled_from(BASES),
                   st.integers(0, 11), st.lists(st.integers(0, 2), max_size=4)).filter(bool)
SALTS = st.sampled_from([(), ("salt",)])


def next_kv(prev: bytes, token: int, salt: tuple) -> bytes:
    """The K/V bytes of a token: a function of the whole prefix up to it (and the salt)."""
    return hashlib.blake2b(prev + repr((token, salt)).encode(), digest_size=SLOT).digest()


class BlockStoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dev = BlockPool.create(unique_pool_name("prop-d"), NUM_DEVICE, B * SLOT)
        self.host = BlockPool.create(unique_pool_name("prop-h"), NUM_HOST, B * SLOT)
        self.store = BlockStore(NUM_DEVICE, NUM_HOST, B, device_pools=[self.dev], host_pools=[self.host])
        self.kv: dict[int, list[bytes]] = {}       # seq -> expected K/V bytes per position
        self.tokens: dict[int, list[int]] = {}
        self.salt: dict[int, tuple] = {}
        self.groups: dict[int, list[int]] = {}     # request -> its live sequences (swap together)
        self.group_of: dict[int, int] = {}
        self.next_id = 0

    # ---- helpers -----------------------------------------------------------------------

    def pool(self, seq):
        return self.dev if self.store.location(seq) == "device" else self.host

    def slots_view(self, pool):
        return pool.blocks.view(pool.num_blocks, B, SLOT)

    def write(self, seq, start, end):
        """The 'model' writes K/V for positions start..end-1; never into a shared block."""
        for pos, slot in zip(range(start, end), self.store.slot_mapping(seq, start, end)):
            assert self.store.refcount(slot // B) == 1, f"write into shared block {slot // B}"
            self.slots_view(self.dev)[slot // B, slot % B] = torch.tensor(list(self.kv[seq][pos]),
                                                                          dtype=torch.uint8)

    def extend_kv(self, seq, new_tokens):
        prev = self.kv[seq][-1] if self.kv[seq] else b""
        for t in new_tokens:
            prev = next_kv(prev, t, self.salt[seq])
            self.kv[seq].append(prev)
        self.tokens[seq].extend(new_tokens)

    def snapshot(self):
        s = self.store
        return ({q: (s.block_table(q), s.num_tokens(q), s.location(q)) for q in s.seq_ids()},
                [s.refcount(b) for b in range(NUM_DEVICE)],
                [s.refcount(b, "host") for b in range(NUM_HOST)],
                s.evictable_blocks(), s.stats())

    def seqs_on(self, location):
        return sorted(q for q in self.kv if self.store.location(q) == location)

    def groups_on(self, location):
        return sorted(g for g, seqs in self.groups.items() if self.store.location(seqs[0]) == location)

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def forget(self, seq):
        for d in (self.kv, self.tokens, self.salt):
            del d[seq]
        g = self.group_of.pop(seq)
        self.groups[g].remove(seq)
        if not self.groups[g]:
            del self.groups[g]

    # ---- rules -------------------------------------------------------------------------
    # Rules with nothing to act on return at once (rather than use preconditions): with few live
    # sequences most rules would be disabled and Hypothesis would discard the whole example.

    @initialize(prompts=st.lists(TOKENS, min_size=1, max_size=3), salt=SALTS)
    def start_with_some_requests(self, prompts, salt):
        for tokens in prompts:
            self.allocate(tokens, salt)

    @rule(tokens=TOKENS, salt=SALTS, prefilled=st.booleans())
    def allocate(self, tokens, salt, prefilled=True):
        seq = self.new_id()
        promised = self.store.can_allocate(len(tokens))
        before = self.snapshot()
        r = self.store.allocate(seq, tokens, extra_keys=salt)
        assert r.ok or not promised
        if not r.ok:
            assert self.snapshot() == before
            return
        cached = r.num_cached_tokens
        assert cached % B == 0 and cached <= len(tokens) - 1  # never the last token
        self.kv[seq], self.tokens[seq], self.salt[seq] = [], [], salt
        self.extend_kv(seq, tokens)
        # A hit's blocks already hold exactly this prefix's K/V (same tokens, same salt).
        self.check_bytes(seq, upto=cached)
        self.write(seq, cached, len(tokens))
        if prefilled:  # as the scheduler does after the prefill step
            self.store.mark_computed(seq, len(tokens))
        self.groups[seq] = [seq]
        self.group_of[seq] = seq

    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def append(self, data, new_tokens):
        if not self.seqs_on("device"):
            return
        seq = data.draw(st.sampled_from(self.seqs_on("device")))
        self.append_one(seq, new_tokens)

    def append_one(self, seq, new_tokens):
        need = self.store.append_blocks_needed([seq], len(new_tokens))
        free = self.store.num_free_device_blocks
        before = self.snapshot()
        r = self.store.append_slots(seq, new_tokens)
        assert r.ok == (need <= free)
        if not r.ok:
            assert self.snapshot() == before
            return False
        assert free - self.store.num_free_device_blocks == need
        old = len(self.tokens[seq])
        self.extend_kv(seq, new_tokens)
        self.write(seq, old, old + len(new_tokens))
        return True

    @rule(data=st.data())
    def append_group(self, data):
        """One decode step of a whole request: every sequence gains a token; the group count of
        blocks needed (copy-on-write among siblings included) must be exact."""
        if not self.groups_on("device"):
            return
        group = list(self.groups[data.draw(st.sampled_from(self.groups_on("device")))])
        need = self.store.append_blocks_needed(group, 1)
        free = self.store.num_free_device_blocks
        results = [self.append_one(seq, [data.draw(st.integers(0, 2))]) for seq in group]
        if need <= free:
            assert all(results) and free - self.store.num_free_device_blocks == need

    @rule(data=st.data())
    def append_tokens(self, data):
        """A decode step of many requests in one batched call: all of them or none of them, with
        the same block count and copies as one append_slots per sequence."""
        on_device = self.seqs_on("device")
        if not on_device:
            return
        seqs = data.draw(st.lists(st.sampled_from(on_device), min_size=1, max_size=len(on_device), unique=True))
        tokens = [data.draw(st.integers(0, 2)) for _ in seqs]
        need = self.store.append_blocks_needed(seqs, 1)
        free = self.store.num_free_device_blocks
        before = self.snapshot()
        r = self.store.append_tokens(seqs, tokens)
        assert r.ok == (need <= free)
        if not r.ok:
            assert self.snapshot() == before
            return
        assert free - self.store.num_free_device_blocks == need
        assert len(r.copies) == self.store.stats()["cow_copies"] - before[4]["cow_copies"]
        for seq, token in zip(seqs, tokens):
            old = len(self.tokens[seq])
            self.extend_kv(seq, [token])
            self.write(seq, old, old + 1)

    @rule(data=st.data())
    def mark_computed(self, data):
        if not self.seqs_on("device"):
            return
        seq = data.draw(st.sampled_from(self.seqs_on("device")))
        n = len(self.tokens[seq])
        self.store.mark_computed(seq, data.draw(st.one_of(st.just(n), st.integers(0, n))))

    @rule(data=st.data())
    def fork(self, data):
        if not self.kv:
            return
        parent = data.draw(st.sampled_from(sorted(self.kv)))
        child = self.new_id()
        used = self.store.stats()["device_blocks_used"], self.store.stats()["host_blocks_used"]
        self.store.fork(parent, child)
        assert (self.store.stats()["device_blocks_used"], self.store.stats()["host_blocks_used"]) == used
        self.kv[child], self.tokens[child] = list(self.kv[parent]), list(self.tokens[parent])
        self.salt[child] = self.salt[parent]
        g = self.group_of[parent]
        self.groups[g].append(child)
        self.group_of[child] = g

    @rule(data=st.data())
    def free(self, data):
        if not self.kv:
            return
        seq = data.draw(st.sampled_from(sorted(self.kv)))
        self.store.free(seq)
        self.forget(seq)

    @rule(data=st.data())
    def swap_out(self, data):
        if not self.groups_on("device"):
            return
        self.swap(self.groups[data.draw(st.sampled_from(self.groups_on("device")))], "out")

    @rule(data=st.data())
    def swap_in(self, data):
        if not self.groups_on("host"):
            return
        self.swap(self.groups[data.draw(st.sampled_from(self.groups_on("host")))], "in")

    def swap(self, group, direction):
        store = self.store
        distinct = {b for q in group for b in store.block_table(q)}
        promised = store.can_swap_out(group) if direction == "out" else store.can_swap_in(group)
        before = self.snapshot()
        r = store.swap_out(group) if direction == "out" else store.swap_in(group)
        assert r.ok == promised
        if not r.ok:
            assert self.snapshot() == before
            return
        # Each distinct block moves once; bytes are checked by the invariant below.
        assert sorted(src for src, _ in r.mapping) == sorted(distinct)
        assert len({dst for _, dst in r.mapping}) == len(distinct)
        want = "host" if direction == "out" else "device"
        assert all(store.location(q) == want for q in group)

    # ---- invariants --------------------------------------------------------------------

    def check_bytes(self, seq, upto=None):
        n = len(self.tokens[seq]) if upto is None else upto
        if n == 0:
            return
        slots = torch.tensor(self.store.slot_mapping(seq, 0, n))
        got = self.slots_view(self.pool(seq))[slots // B, slots % B]           # [n, SLOT]
        want = torch.tensor([list(v) for v in self.kv[seq][:n]], dtype=torch.uint8)
        assert torch.equal(got, want), f"seq {seq}: K/V bytes differ"

    @invariant()
    def bookkeeping_is_consistent(self):
        s = self.store
        st_ = s.stats()
        for loc, total in (("device", NUM_DEVICE), ("host", NUM_HOST)):
            held = Counter(b for q in s.seq_ids() if s.location(q) == loc for b in s.block_table(q))
            refs = [s.refcount(b, loc) for b in range(total)]
            assert refs == [held[b] for b in range(total)]          # refcount = tables holding it
            used = sum(1 for r in refs if r > 0)
            assert used == st_[f"{loc}_blocks_used"]
            assert st_[f"{loc}_blocks_free"] + used == total
        evictable = s.evictable_blocks()
        assert all(s.refcount(b) == 0 for b in evictable)            # never both free and used
        assert len(set(evictable)) == len(evictable) == st_["device_blocks_evictable"]
        assert st_["device_blocks_peak_used"] >= st_["device_blocks_used"]
        for q in s.seq_ids():
            assert s.token_ids(q) == self.tokens[q]
            # At most one partly filled block: exactly the blocks the tokens need.
            assert len(s.block_table(q)) == -(-len(self.tokens[q]) // B)
        s.check_invariants()

    @invariant()
    def every_sequence_reads_back_its_own_bytes(self):
        for seq in self.kv:
            self.check_bytes(seq)

    def teardown(self):
        try:
            for seq in list(self.kv):
                self.store.free(seq)
            st_ = self.store.stats()
            assert st_["device_blocks_used"] == 0 and st_["device_blocks_free"] == NUM_DEVICE
            assert st_["host_blocks_used"] == 0 and st_["host_blocks_free"] == NUM_HOST
            self.store.check_invariants()
        finally:
            for p in (self.dev, self.host):
                p.close()
                p.unlink()


BlockStoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBlockStoreProperties = BlockStoreMachine.TestCase
