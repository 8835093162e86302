"""ModelRunner.prepare's persistent step buffers equal the per-step build from Python lists they
replaced (`listed_prepare` below, the old prepare kept as the reference), on random sequences of
steps: sequences joining, prefill chunks beside decodes, tables growing in place, a last block
replaced (copy-on-write), a whole table replaced (swapped back in), sequences paused and finished."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedserve.kernels import ops
from pagedserve.services.worker.model_loader import ModelSpec
from pagedserve.services.worker.model_runner import ModelRunner, SeqStep

B, NUM_BLOCKS, MAX_LEN, MAX_TOKENS = 4, 50, 64, 40
MAX_SEQS = MAX_TOKENS   # each sequence has a token in the step


def listed_prepare(steps: list[SeqStep], block_size: int):
    """The old ModelRunner.prepare: one torch.tensor per field from Python lists, every step."""
    ids, positions, slots, seq_lens, qsl, logits_rows = [], [], [], [], [0], []
    tables = torch.zeros((len(steps), max(len(s.block_table) for s in steps)), dtype=torch.int32)
    for i, s in enumerate(steps):
        end = s.start_pos + len(s.token_ids)
        ids.extend(s.token_ids)
        positions.extend(range(s.start_pos, end))
        slots.extend(s.block_table[p // block_size] * block_size + p % block_size
                     for p in range(s.start_pos, end))
        seq_lens.append(end)
        qsl.append(qsl[-1] + len(s.token_ids))
        tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        if s.wants_logits:
            logits_rows.append(qsl[-1] - 1)
    return dict(ids=torch.tensor(ids), positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
                block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                max_query_len=max(len(s.token_ids) for s in steps),
                logits_indices=torch.tensor(logits_rows, dtype=torch.int64))


def make_runner(**kw) -> ModelRunner:
    spec = ModelSpec(path="", architecture="LlamaForCausalLM", num_layers=1, num_kv_heads=1, head_dim=4,
                     vocab_size=100, max_model_len=MAX_LEN, eos_token_ids=(0,))
    pool = torch.zeros((NUM_BLOCKS, spec.block_bytes(B, torch.float32)), dtype=torch.uint8)
    return ModelRunner(None, spec, pool, B, max_num_batched_tokens=MAX_TOKENS, **kw)


def assert_same(runner: ModelRunner, steps: list[SeqStep]) -> None:
    ids, positions, meta, logits_indices = runner.prepare(steps)
    want = listed_prepare(steps, B)
    got = dict(ids=ids, positions=positions, logits_indices=logits_indices, **vars(meta))
    tables = got.pop("block_tables")
    assert tables.shape == (len(steps), runner.max_blocks) and tables.dtype == torch.int32
    width = want["block_tables"].shape[1]
    assert torch.equal(tables[:, :width], want.pop("block_tables"))
    assert not tables[:, width:].any()                       # zero-padded to the fixed width
    assert got.pop("max_query_len") == want.pop("max_query_len")
    for name, expected in want.items():
        assert got[name].dtype == expected.dtype, name
        assert torch.equal(got[name], expected), name


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_prepare_equals_the_listed_build_on_random_steps(data):
    runner = make_runner()
    draw = data.draw
    blocks = st.integers(0, NUM_BLOCKS - 1)
    seqs: dict[int, list] = {}        # seq id -> [table, tokens computed, prompt length]
    next_id = 0
    for _ in range(draw(st.integers(1, 14))):
        for _ in range(draw(st.integers(0, 3))):          # sequences join
            if len(seqs) < 10:
                seqs[next_id] = [[], 0, draw(st.integers(1, 30))]
                next_id += 1
        steps, tokens = [], 0
        for seq_id in list(seqs):
            table, done, prompt = seqs[seq_id]
            what = draw(st.sampled_from(["run"] * 6 + ["pause", "finish", "cow", "swap"]))
            if what == "finish" or done >= MAX_LEN - 1:
                del seqs[seq_id]
                continue
            if what == "pause" or len(steps) == MAX_SEQS or tokens == MAX_TOKENS:
                continue
            n = (min(draw(st.integers(1, prompt - done)), MAX_TOKENS - tokens, MAX_LEN - 1 - done)
                 if done < prompt else 1)
            need = -(-(done + n) // B) + draw(st.integers(0, 1))       # sometimes a block ahead
            if what == "cow" and table:
                table[-1] = draw(blocks)
            if what == "swap" and table:
                table = seqs[seq_id][0] = [draw(blocks) for _ in table]   # a new list
            table += [draw(blocks) for _ in range(max(0, need - len(table)))]   # grows in place
            steps.append(SeqStep(seq_id, [draw(st.integers(0, 99)) for _ in range(n)], done, table,
                                 wants_logits=done + n >= prompt or draw(st.booleans())))
            seqs[seq_id][1] = done + n
            tokens += n
        if steps:
            assert_same(runner, steps)
    assert len(runner.row_of) <= MAX_SEQS


def test_rows_stay_with_their_sequences_and_are_freed_when_absent():
    runner = make_runner()
    a, b = SeqStep(7, [1], 0, [3]), SeqStep(9, [1, 2], 0, [4])
    runner.prepare([a, b])
    assert runner.row_of == {7: 1, 9: 2}
    runner.prepare([SeqStep(9, [3], 2, [4]), SeqStep(7, [2], 1, [3])])   # order changes, rows do not
    assert runner.row_of == {7: 1, 9: 2}
    assert_same(runner, [SeqStep(11, [5, 6, 7, 8, 9], 0, [1, 2]), SeqStep(7, [2], 1, [3])])
    assert runner.row_of == {7: 1, 11: 2}


def test_a_step_beyond_the_buffers_is_refused():
    runner = make_runner()
    with pytest.raises(ValueError, match="sequences in a step.*max_num_batched_tokens"):
        runner.prepare([SeqStep(i, [1], 0, [i]) for i in range(MAX_SEQS + 1)])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        runner.prepare([SeqStep(0, [1] * (MAX_TOKENS + 1), 0, list(range(-(-(MAX_TOKENS + 1) // B))))])
    with pytest.raises(ValueError, match="max_model_len"):
        runner.prepare([SeqStep(0, [1], 0, [0] * (runner.max_blocks + 1))])
    with pytest.raises(ValueError, match="covers 4 slots"):
        runner.prepare([SeqStep(0, [1, 2], 3, [0])])
    assert_same(runner, [SeqStep(0, [1, 2], 3, [0, 1])])   # a refused step leaves nothing wrong behind


@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_attention_reads_the_fixed_width_table_as_the_tight_one(impl):
    """The kernels take the runner's fixed-width table (stale entries past a sequence's blocks
    never read) and give what they give on a table exactly as wide as the longest sequence."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(NUM_BLOCKS, B, 2, 16, generator=gen) for _ in range(2))
    seq_lens = torch.tensor([9, 1, 13], dtype=torch.int32)
    tight = torch.randint(0, NUM_BLOCKS, (3, 4), generator=gen, dtype=torch.int32)
    wide = torch.full((3, 17), NUM_BLOCKS * 10, dtype=torch.int32)    # junk outside the pool
    wide[:, :4] = tight
    for s, n in enumerate(seq_lens.tolist()):
        wide[s, -(-n // B):4] = NUM_BLOCKS * 10
    q = torch.randn(3, 4, 16, generator=gen)
    want = ops.paged_decode_attention(q, k_cache, v_cache, tight, seq_lens, 0.25, impl="reference")
    got = ops.paged_decode_attention(q, k_cache, v_cache, wide, seq_lens, 0.25, impl=impl)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    qsl = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    q = torch.randn(7, 4, 16, generator=gen)
    want = ops.paged_attention(q, k_cache, v_cache, tight, seq_lens, qsl, 0.25, 3, impl="reference")
    got = ops.paged_attention(q, k_cache, v_cache, wide, seq_lens, qsl, 0.25, 3, impl=impl)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
