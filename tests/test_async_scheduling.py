"""Async scheduling: a step planned while the one before it runs (its inputs the tokens still being
drawn) gives exactly what a step planned after it gives.

The offline engine plans ahead in the served scheduler's order (plan N+1, run N, apply N, run
N+1), so these runs drive the scheduler core, the block store and the worker core as the served
stack does; the served stack itself runs with async scheduling on in every stack test.
"""
from __future__ import annotations

import pytest

from pagedserve.services.protocol import PENDING_TOKEN
from pagedserve.services.sampling_params import SamplingParams
from pagedserve.services.steps import SeqStep
from pagedserve.services.worker.worker_core import PendingTokenError
from tests.test_engine import PROMPTS, make_engine  # noqa: F401  (the fixture)


def tokens(outputs) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in outputs]


def frequent_tokens(engine, k: int) -> list[int]:
    """The k tokens the tiny model draws most under greedy: stop tokens that do stop requests."""
    counts: dict[int, int] = {}
    for r in engine.generate(PROMPTS[:8], SamplingParams(max_tokens=24, temperature=0.0)):
        for t in r.outputs[0].token_ids:
            counts[t] = counts.get(t, 0) + 1
    return sorted(counts, key=counts.get, reverse=True)[:k]


def mixed_params(stops: list[int]) -> list[SamplingParams]:
    """Greedy requests ending by a stop token, by max_tokens (1 to 29), or by both."""
    return [SamplingParams(max_tokens=1 + (7 * i) % 29, temperature=0.0,
                           stop_token_ids=stops if i % 3 else []) for i in range(len(PROMPTS))]


def test_greedy_equals_the_synchronous_engine_with_stops_and_admissions(make_engine):
    sync = make_engine(async_scheduling=False, num_device_blocks=512, max_num_seqs=5)
    ahead = make_engine(num_device_blocks=512, max_num_seqs=5)   # 16 prompts: admitted as others end
    params = mixed_params(frequent_tokens(sync, 2))
    want = tokens(sync.generate(PROMPTS, params))
    assert any(len(t[0]) < p.max_tokens for t, p in zip(want, params)), "no request stopped on a token"
    got = ahead.generate(PROMPTS, params)
    assert tokens(got) == want
    stats = ahead.scheduler.stats
    assert stats["steps_planned_ahead"] > 0.5 * sum(len(t[0]) for t in want) / 5
    # One row for nothing per request a token stopped short of its max_tokens (the step after its
    # stop was already running); a request that ends by length never gets that row.
    stopped = sum(1 for r, p in zip(got, params)
                  if r.outputs[0].finish_reason == "stop" and len(r.outputs[0].token_ids) < p.max_tokens)
    assert stopped > 0 and stats["ahead_rows_dropped"] == stopped
    assert sync.scheduler.stats["steps_planned_ahead"] == 0


def test_seeded_samples_and_logprobs_equal_the_synchronous_engine(make_engine):
    """The worker counts a planned-ahead draw's place in the output (seeded rows, min_tokens)."""
    sync = make_engine(async_scheduling=False, num_device_blocks=512)
    ahead = make_engine(num_device_blocks=512)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7 + i, n=1 + i % 2, logprobs=2,
                             min_tokens=3) for i in range(6)]
    a, b = sync.generate(PROMPTS[:6], params), ahead.generate(PROMPTS[:6], params)
    assert tokens(b) == tokens(a)
    flat = [lp for r in b for o in r.outputs for lp in o.logprobs]
    assert flat == pytest.approx([lp for r in a for o in r.outputs for lp in o.logprobs])
    assert ahead.scheduler.stats["steps_planned_ahead"] > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_under_preemption_tokens_equal_a_roomy_engine(make_engine, mode):
    roomy = make_engine(async_scheduling=False, num_device_blocks=512)
    tight = make_engine(num_device_blocks=24, preemption_mode=mode)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    assert tokens(tight.generate(PROMPTS[:10], params)) == tokens(roomy.generate(PROMPTS[:10], params))
    assert tight.scheduler.stats["preemptions"] > 0
    assert tight.scheduler.stats["steps_planned_ahead"] > 0


def test_blocks_filled_ahead_are_keyed_by_their_real_tokens(make_engine):
    """Every decode slot taken ahead holds PENDING_TOKEN until its token is known; the full blocks
    of a generated text are found again by a prompt that repeats it (a placeholder hashed into a
    key would make them miss)."""
    ahead = make_engine(num_device_blocks=512)
    first = ahead.generate(PROMPTS[:4], SamplingParams(max_tokens=48, temperature=0.0))
    again = [r.prompt_token_ids + r.outputs[0].token_ids for r in first]
    before = ahead.store.stats()["prefix_hit_tokens"]
    second = ahead.generate(again, SamplingParams(max_tokens=4, temperature=0.0))
    hit = ahead.store.stats()["prefix_hit_tokens"] - before
    bs = ahead.store.block_size
    # the last prompt token is always computed: every full block before it hits
    assert hit == sum((len(ids) - 1) // bs * bs for ids in again)
    cold = make_engine(async_scheduling=False, num_device_blocks=512, enable_prefix_caching=False)
    assert tokens(second) == tokens(cold.generate(again, SamplingParams(max_tokens=4, temperature=0.0)))


def test_a_sequence_freed_while_a_step_planned_ahead_uses_it_keeps_its_blocks_until_that_step(make_engine):
    """Driven by hand in the served order: plan N, launch N, plan N+1 ahead, launch N+1 (its input
    the draw of N, still unread), then finish and apply N, then N+1."""
    engine = make_engine(num_device_blocks=512, async_scheduling=False)   # engine.step() plans none ahead
    sched, worker = engine.scheduler, engine.worker
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0))
    other = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.0))
    for _ in range(3):
        engine.step()
    cur = sched.schedule()
    launched = worker.launch(cur.steps, cur.samples)
    nxt = sched.schedule_ahead(cur)
    assert nxt is not None and all(s.token_ids == [PENDING_TOKEN] for s in nxt.steps)
    launched_next = worker.launch(nxt.steps, nxt.samples)
    seq_id = sched.requests[rid].seqs[0].seq_id
    assert sched.abort(rid)
    assert seq_id in engine.store            # held: the step planned ahead still writes its blocks
    sched.update(cur, worker.finish(launched))
    assert seq_id in engine.store
    drawn = worker.finish(launched_next)
    sched.update(nxt, drawn)
    assert seq_id not in engine.store        # released with that step
    sched.pop_finished(rid)
    # the other request's tokens are those of a run without any of this
    while sched.has_unfinished():
        engine.step()
    alone = make_engine(num_device_blocks=512).generate([PROMPTS[1]], SamplingParams(max_tokens=30, temperature=0.0))
    assert sched.pop_finished(other).finished[0].output_token_ids == alone[0].outputs[0].token_ids
    engine.store.check_invariants()


def test_a_pending_token_without_a_draw_before_it_fails_the_step(make_engine):
    engine = make_engine(num_device_blocks=64)
    engine.store.allocate(999, [1, 2, 3])
    step = SeqStep(999, [PENDING_TOKEN], 3, engine.store.block_table(999))
    with pytest.raises(PendingTokenError, match="drew none"):
        engine.worker.execute([step], [[]])
    engine.store.free(999)


def test_nothing_is_planned_ahead_for_what_needs_the_last_tokens(make_engine):
    """Beams, grammars, penalties and prompt logprobs read the tokens of the step before: those
    steps wait for them (and still equal the synchronous engine)."""
    sync = make_engine(async_scheduling=False, num_device_blocks=512)
    ahead = make_engine(num_device_blocks=512)
    for params in (SamplingParams(max_tokens=8, temperature=0.0, n=2, beam_width=2),
                   SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3),
                   SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=1)):
        before = ahead.scheduler.stats["steps_planned_ahead"]
        assert tokens(ahead.generate(PROMPTS[:2], params)) == tokens(sync.generate(PROMPTS[:2], params))
        assert ahead.scheduler.stats["steps_planned_ahead"] == before
