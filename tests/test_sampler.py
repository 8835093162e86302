"""The worker's sampler: processing order and arithmetic, logprobs, seeds, and the sampled law."""

import math

import pytest
import torch

from pagedserve.services.sampling_params import SamplingParams
from pagedserve.services.worker.sampler import (SamplingRow, compute_logprobs, derive_row_seed, sample,
                                     top_logprobs)

V = 64


def row(prompt=(), output=(), seq_index=0, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params).validate(), list(prompt), list(output), seq_index)


def gen(seed=0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows, vocab=V, seed=0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=gen(seed)) * 3  # [S, V]


def test_greedy_is_argmax_and_leaves_logits_alone():
    logits = random_logits(8)
    before = logits.clone()
    out = sample(logits, [row(temperature=0) for _ in range(8)], eos_token_id=None)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert torch.equal(logits, before)


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.zeros(1, V)
    logits[0, [5, 9, 40]] = 2.0
    assert sample(logits, [row(temperature=0)], None).token_ids == [5]


def test_beam_search_rows_are_greedy():
    logits = random_logits(3)
    out = sample(logits, [row(beam_width=2, temperature=1.0) for _ in range(3)], None, gen())
    assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=3, top_p=1e-6),
                                    dict(min_p=1.0), dict(temperature=1e-6)])
def test_filters_that_leave_one_token_equal_greedy(params):
    logits = random_logits(32)
    out = sample(logits, [row(seq_index=i, **params) for i in range(32)], None, gen())
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def _draws(logits_row, params, count, seed=0):
    """Token counts [V] from `count` unseeded rows sampled in one call with a fixed generator."""
    logits = logits_row.expand(count, -1).contiguous()
    out = sample(logits, [row(**params) for _ in range(count)], None, gen(seed))
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[1])


def test_top_k_samples_only_the_k_best():
    logits_row = random_logits(1)[0]
    counts = _draws(logits_row, dict(top_k=5), 2000)
    best5 = set(logits_row.topk(5).indices.tolist())
    assert set(counts.nonzero().flatten().tolist()) == best5  # all five appear, nothing else does


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    counts = _draws(probs.log(), dict(top_p=0.7), 2000)
    assert counts[2] == 0 and counts[3] == 0  # 0.5 + 0.3 already reaches 0.7
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.04
    counts = _draws(probs.log(), dict(top_p=0.81), 2000)
    assert counts[2] > 0 and counts[3] == 0


def test_top_p_applies_to_the_top_k_distribution():
    # After top_k=2 the kept law is (0.4/0.7, 0.3/0.7) = (0.57, 0.43): top_p=0.5 keeps token 0 only.
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    counts = _draws(probs.log(), dict(top_k=2, top_p=0.5), 500)
    assert counts.tolist() == [500, 0, 0, 0]
    # Over the full law 0.4 + 0.3 < 0.75 would keep token 2; over the top-3 law (0.44, 0.33, 0.22)
    # 0.44 + 0.33 already reaches 0.75.
    counts = _draws(probs.log(), dict(top_k=3, top_p=0.75), 1000)
    assert counts[2] == 0 and counts[3] == 0 and counts[1] > 0
    counts = _draws(probs.log(), dict(top_p=0.75), 1000)
    assert counts[2] > 0 and counts[3] == 0
    # The same in one batch, where the top-p-only rows make the sampler sort the whole vocabulary.
    rows = [row(top_k=3, top_p=0.75) if i % 2 else row(top_p=0.75) for i in range(1000)]
    out = sample(probs.log().expand(1000, -1).contiguous(), rows, None, gen())
    with_k = torch.bincount(torch.tensor(out.token_ids[1::2]), minlength=4)
    without_k = torch.bincount(torch.tensor(out.token_ids[0::2]), minlength=4)
    assert with_k[2] == 0 and with_k[3] == 0 and with_k[1] > 0
    assert without_k[2] > 0 and without_k[3] == 0


def test_min_p_never_samples_a_masked_token():
    probs = torch.tensor([0.40, 0.30, 0.15, 0.10, 0.03, 0.02])
    counts = _draws(probs.log(), dict(min_p=0.2), 4000)  # threshold 0.2 * 0.40 = 0.08
    assert counts[4] == 0 and counts[5] == 0
    assert all(counts[i] > 0 for i in range(4))
    kept = probs[:4] / probs[:4].sum()
    assert torch.allclose(counts[:4].float() / 4000, kept, atol=0.03)


def test_sampling_frequencies_follow_the_softmax():
    logits_row = torch.tensor([1.0, 0.0, -0.5, 2.0])
    expected = torch.softmax(logits_row, dim=-1)
    counts = _draws(logits_row, dict(), 4000)
    # One standard deviation is at most sqrt(0.25 / 4000) = 0.008: 0.03 is about 4 of them.
    assert torch.allclose(counts.float() / 4000, expected, atol=0.03)


def test_seeded_rows_follow_the_softmax_across_sample_indices():
    # Seeded streams must be as good as the shared one: vary seq_index under one request seed.
    logits_row = torch.tensor([1.0, 0.0, -0.5, 2.0])
    rows = [row(seed=7, seq_index=i) for i in range(4000)]
    out = sample(logits_row.expand(4000, -1).contiguous(), rows, None)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits_row, dim=-1), atol=0.03)


def test_temperature_sharpens_and_flattens():
    logits_row = torch.tensor([1.0, 0.0, -0.5, 2.0])
    cold = _draws(logits_row, dict(temperature=0.25), 2000).float() / 2000
    hot = _draws(logits_row, dict(temperature=4.0), 2000).float() / 2000
    assert torch.allclose(cold, torch.softmax(logits_row / 0.25, dim=-1), atol=0.03)
    assert torch.allclose(hot, torch.softmax(logits_row / 4.0, dim=-1), atol=0.04)
    assert cold[3] > 0.95 and hot[3] < 0.45


def test_repetition_penalty_matches_hand_computation():
    # Seen tokens 1 (positive logit: divided) and 2 (negative: multiplied); rp=2 makes token 0 win.
    logits = torch.tensor([[1.5, 2.0, -1.0, 0.0]])
    out = sample(logits, [row(prompt=[1], output=[2], temperature=0, repetition_penalty=2.0)], None)
    assert out.token_ids == [0]  # 2.0 / 2 = 1.0 < 1.5
    # rp < 1 rewards seen tokens: -1.0 * 0.1 = -0.1 beats 0.0 for token 3 once 0 and 1 are gone.
    logits = torch.tensor([[-5.0, -5.0, -1.0, -0.5]])
    out = sample(logits, [row(output=[2], temperature=0, repetition_penalty=0.1)], None)
    assert out.token_ids == [2]


def test_frequency_and_presence_penalties_match_hand_computation():
    # Output has token 0 three times and token 1 once; prompt tokens are not counted.
    # token 0: 3.0 - 0.5*3 - 0.25 = 1.25; token 1: 1.6 - 0.5 - 0.25 = 0.85; token 2: 1.2 (prompt only).
    logits = torch.tensor([[3.0, 1.6, 1.2, 1.0]])
    params = dict(temperature=0, frequency_penalty=0.5, presence_penalty=0.25)
    assert sample(logits, [row(prompt=[2, 2, 2], output=[0, 1, 0, 0], **params)], None).token_ids == [0]
    # One more 0 in the output: 3.0 - 2.0 - 0.25 = 0.75 < 1.2.
    assert sample(logits, [row(prompt=[2], output=[0, 1, 0, 0, 0], **params)], None).token_ids == [2]
    # Check the exact processed law: with temperature 1 the sampled frequencies follow it.
    expected_logits = torch.tensor([3.0 - 1.5 - 0.25, 1.6 - 0.5 - 0.25, 1.2, 1.0])
    rows = [row(output=[0, 1, 0, 0], frequency_penalty=0.5, presence_penalty=0.25) for _ in range(4000)]
    out = sample(logits.expand(4000, -1).contiguous(), rows, None, gen(3))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(expected_logits, dim=-1), atol=0.03)


def test_penalties_apply_per_row():
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]]).repeat(2, 1)
    rows = [row(output=[0], temperature=0, presence_penalty=1.0), row(output=[0], temperature=0)]
    assert sample(logits, rows, None).token_ids == [1, 0]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]])  # eos = 1, stop token 2
    params = dict(temperature=0, min_tokens=2, max_tokens=10, stop_token_ids=[2])
    assert sample(logits, [row(output=[], **params)], eos_token_id=1).token_ids == [3]
    assert sample(logits, [row(output=[4], **params)], eos_token_id=1).token_ids == [3]
    assert sample(logits, [row(output=[4, 4], **params)], eos_token_id=1).token_ids == [1]
    # Random rows never draw a masked token either.
    rows = [row(output=[], min_tokens=1, stop_token_ids=[2], seq_index=i) for i in range(500)]
    out = sample(logits.expand(500, -1).contiguous(), rows, eos_token_id=1, generator=gen())
    assert not {1, 2} & set(out.token_ids)


def test_logprobs_are_of_the_raw_distribution():
    logits = random_logits(4)
    raw = torch.log_softmax(logits, dim=-1)
    rows = [row(temperature=0, logprobs=5, repetition_penalty=1.5, prompt=[0, 1]),
            row(temperature=0.7, top_k=3, logprobs=0, seq_index=1),
            row(min_p=0.3),
            row(logprobs=20, top_p=0.5)]
    out = sample(logits, rows, None, gen())
    for i, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
        assert logprob == pytest.approx(raw[i, token].item(), abs=1e-5)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] is None
    for i, k in [(0, 5), (3, 20)]:
        tops = out.top_logprobs[i]
        assert len(tops) == k
        values = [v for _, v in tops]
        assert values == sorted(values, reverse=True)
        expected = raw[i].topk(k)
        assert [t for t, _ in tops] == expected.indices.tolist()
        assert values == pytest.approx(expected.values.tolist(), abs=1e-5)


def test_compute_logprobs_and_top_logprobs_helpers():
    logits = random_logits(3)
    logprobs = compute_logprobs(logits)
    assert logprobs.dtype == torch.float32
    assert torch.allclose(logprobs, torch.log_softmax(logits, dim=-1))
    values, ids = top_logprobs(logits, 4)
    assert values.shape == ids.shape == (3, 4)
    assert torch.allclose(values, logprobs.gather(1, ids), atol=1e-5)
    assert torch.equal(ids, logprobs.topk(4).indices)
    assert bool((values[:, :-1] >= values[:, 1:]).all())
    with pytest.raises(ValueError):
        top_logprobs(logits, V + 1)


def test_seeded_row_is_reproducible_alone_and_in_any_batch():
    logits = random_logits(6, vocab=1000)
    target = row(seed=42, output=[3, 4, 5], temperature=1.3, top_p=0.95)
    alone = sample(logits[2:3], [target], None).token_ids[0]
    assert sample(logits[2:3], [target], None).token_ids[0] == alone
    others = [row(), row(temperature=0), row(seed=1, top_k=5), row(min_p=0.1), row(seed=42)]
    for position in (0, 3, 5):
        rows = others[:position] + [target] + others[position:]
        batch = torch.cat([logits[:position], logits[2:3], logits[position:5]])
        assert sample(batch, rows, None, gen(position)).token_ids[position] == alone


def test_seeded_draws_are_stateless_in_the_output_length():
    # Recompute after preemption replays the same (seed, index, length): the same token.
    logits = random_logits(1, vocab=1000)
    tokens = {n: sample(logits, [row(seed=5, output=[0] * n)], None).token_ids[0] for n in range(12)}
    replay = {n: sample(logits, [row(seed=5, output=[9] * n)], None).token_ids[0] for n in range(12)}
    assert tokens == replay  # depends on the output's length, not its contents
    assert len(set(tokens.values())) > 1  # but each step draws afresh


def test_different_sample_indices_and_seeds_draw_differently():
    logits = torch.zeros(1, 1000)  # uniform: two independent draws collide with probability 1/1000
    draws = [sample(logits, [row(seed=11, seq_index=i)], None).token_ids[0] for i in range(8)]
    assert len(set(draws)) >= 7
    draws = [sample(logits, [row(seed=s)], None).token_ids[0] for s in range(8)]
    assert len(set(draws)) >= 7
    assert derive_row_seed(1, 1, 0) != derive_row_seed(1, 0, 1)
    assert 0 <= derive_row_seed(-3, 2**70, 5) < 2**63


def test_unseeded_rows_vary_between_calls_and_follow_the_generator():
    logits = torch.zeros(1, 1000)
    draws = [sample(logits, [row()], None).token_ids[0] for _ in range(8)]
    assert len(set(draws)) >= 7
    a = sample(logits.expand(16, -1).contiguous(), [row() for _ in range(16)], None, gen(9)).token_ids
    b = sample(logits.expand(16, -1).contiguous(), [row() for _ in range(16)], None, gen(9)).token_ids
    assert a == b  # a caller-owned generator makes the unseeded path reproducible
    assert len(set(a)) >= 14  # and rows in one call get independent noise


def test_mixed_batch_dispatches_each_row_by_its_params():
    logits = random_logits(4, vocab=500)
    rows = [row(temperature=0), row(top_k=1), row(temperature=0, presence_penalty=2.0, output=[7]),
            row(seed=3, top_p=1e-6)]
    logits[2, 7] = 100.0  # penalised by 2.0 only: still the argmax
    out = sample(logits, rows, None, gen())
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert len(out.logprobs) == 4 and out.top_logprobs == [None] * 4
    assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)


def test_rejects_logits_that_do_not_match_the_rows():
    with pytest.raises(ValueError):
        sample(torch.zeros(2, V), [row()], None)


def test_filters_apply_only_to_their_own_rows():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    kinds = [dict(min_p=0.6), dict(top_k=1), dict(), dict(temperature=0, repetition_penalty=10.0, prompt=[0])]
    rows = [row(**kinds[i % 4]) for i in range(1200)]
    out = sample(probs.log().expand(1200, -1).contiguous(), rows, None, gen())
    seen = [set(out.token_ids[k::4]) for k in range(4)]
    assert seen[0] == {0, 1}  # 0.2 and 0.1 fall under 0.6 * 0.4
    assert seen[1] == {0}
    assert seen[2] == {0, 1, 2, 3}
    assert seen[3] == {1}  # log(0.4) * 10 drops token 0 below the rest


def _reference_keep(logits_row, top_k, top_p):
    """Tokens that top-k then top-p keep, computed one row at a time in float64 on a full sort."""
    order = torch.argsort(logits_row, descending=True, stable=True)
    ranked = logits_row[order].double()
    if 0 < top_k < len(ranked):
        ranked[top_k:] = float("-inf")
    probs = torch.softmax(ranked, dim=0)
    mass_before = torch.cumsum(probs, dim=0) - probs
    keep = torch.zeros(len(ranked), dtype=torch.bool)
    keep[order[(mass_before < top_p) & torch.isfinite(ranked)]] = True
    return keep


def test_top_k_top_p_masks_match_a_per_row_full_sort():
    # V > the sampler's probe width (1024), so a flat top-p row must fall back to a full sort
    # while a peaked one finds its nucleus among the best tokens.
    from pagedserve.services.worker.logits_processors import apply_top_k_top_p

    vocab = 3000
    cases = [(0.5, 0, 0.9), (4.0, 0, 0.9), (4.0, 50, 0.8), (1.0, 2000, 0.95), (2.0, 10, 1.0),
             (2.0, 0, 1.0), (0.5, 0, 0.3), (3.0, 1, 0.5)]  # (logit scale, top_k, top_p)
    logits = torch.cat([torch.randn(1, vocab, generator=gen(i)) * scale
                        for i, (scale, _, _) in enumerate(cases)])  # [8, V]
    rows = [row(top_k=k, top_p=p) for _, k, p in cases]
    processed = logits.clone()
    apply_top_k_top_p(processed, rows)
    for i, (_, k, p) in enumerate(cases):
        expected = _reference_keep(logits[i], k, p)
        assert torch.equal(torch.isfinite(processed[i]), expected), f"case {cases[i]}"
        assert torch.equal(processed[i][expected], logits[i][expected])  # kept logits untouched
    assert _reference_keep(logits[0], 0, 0.9).sum() > 1024  # the fallback path was taken
    assert _reference_keep(logits[1], 0, 0.9).sum() < 1024  # and the probe path too


def test_min_tokens_masks_every_eos_id_given():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])
    params = dict(temperature=0, min_tokens=1)
    assert sample(logits, [row(**params)], eos_token_id=(1, 2)).token_ids == [3]
    assert sample(logits, [row(**params)], eos_token_id=[1]).token_ids == [2]
    assert sample(logits, [row(**params)], eos_token_id=None).token_ids == [1]


def test_logit_bias_moves_greedy_and_leaves_returned_logprobs_raw():
    logits = random_logits(3)
    best = logits.argmax(dim=-1).tolist()
    worst = logits.argmin(dim=-1).tolist()
    rows = [row(temperature=0, logit_bias={worst[0]: 100.0}), row(temperature=0, logit_bias={best[1]: -100.0}),
            row(temperature=0, logit_bias={V + 5: 100.0})]       # past the vocabulary: no effect
    out = sample(logits, rows, eos_token_id=None)
    assert out.token_ids[0] == worst[0]
    assert out.token_ids[1] == logits[1].clone().index_fill_(0, torch.tensor([best[1]]), -1e9).argmax().item()
    assert out.token_ids[2] == best[2]
    raw = compute_logprobs(logits)
    assert out.logprobs[0] == pytest.approx(raw[0, worst[0]].item(), abs=1e-5)


def test_allowed_token_ids_mask_greedy_and_random_rows_and_leave_returned_logprobs_raw():
    logits = random_logits(4)
    allowed = [3, 17, V - 1]
    rows = [row(temperature=0, allowed_token_ids=allowed), row(temperature=1.0, seed=5, allowed_token_ids=allowed),
            row(temperature=0), row(temperature=0, allowed_token_ids=[V + 5, 3])]   # past the vocabulary: dropped
    out = sample(logits, rows, eos_token_id=None, generator=gen())
    best_allowed = max(allowed, key=lambda t: logits[0, t].item())
    assert out.token_ids[0] == best_allowed
    assert out.token_ids[2] == logits[2].argmax().item()     # a row without a whitelist is untouched
    assert out.token_ids[3] == 3
    raw = compute_logprobs(logits)
    assert out.logprobs[0] == pytest.approx(raw[0, best_allowed].item(), abs=1e-5)
    for seed in range(200):   # random rows draw only whitelisted tokens
        draw = sample(logits[1:2], [row(temperature=2.0, seed=seed, allowed_token_ids=allowed)], eos_token_id=None)
        assert draw.token_ids[0] in allowed


def test_allowed_token_ids_come_before_min_tokens_and_logit_bias():
    """vLLM's order: the whitelist first, so a bias on a token outside it cannot bring it back."""
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])
    out = sample(logits, [row(temperature=0, min_tokens=1, allowed_token_ids=[1, 2], logit_bias={3: 100.0})],
                 eos_token_id=1)
    assert out.token_ids == [2]
