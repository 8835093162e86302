"""BeamSearch against transformers' beam search, and its beam-id / fork / free protocol.

The model-driven tests run a tiny random Llama with a plain full-recompute loop (no KV cache) and
compare BeamSearch.results() token for token, and scores closely, with model.generate(num_beams=k).
Random models rarely emit their EOS, so most cases declare as EOS a token that greedy decoding does
produce, which makes finished hypotheses, early stopping and length penalties matter. A randomised
test replaces the model's log-probabilities (in both loops, through the same hook HF's logits
processors use) by peaked pseudo-random ones that are a function of the sequence and favour EOS, to
cover many configurations and EOS-heavy searches cheaply.
"""
from __future__ import annotations

import itertools
import random
import zlib

import pytest

from pagedserve.services.scheduler.beam_search import BeamSearch, BeamSearchError

torch = pytest.importorskip("torch")

# (prompt, which greedy token to declare EOS): chosen so that some hypotheses end with it and some
# run to max_new_tokens, and so that early_stopping True / False / "never" give different results.
CASES = (("x = [1, 2", 3), ("return self.", 0))
MAX_NEW = 10


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # The model is tiny: a second intra-op thread only spins, and on a busy 2-core machine that
    # made these tests ~20x slower. Restored for the rest of the session.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_and_prompts(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompts = [tok(p).input_ids for p, _ in CASES]
    return model, prompts


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, num_beams=1, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def _hf_beams(model, prompt, k, lp, es, max_new, eos_ids, n, rewrite=None) -> list[tuple[list[int], float]]:
    from transformers import LogitsProcessor, LogitsProcessorList

    class Rewrite(LogitsProcessor):
        def __call__(self, input_ids, scores):  # [B, T], [B, V] log-probabilities
            return rewrite(input_ids.tolist(), scores)

    extra = {"logits_processor": LogitsProcessorList([Rewrite()])} if rewrite else {}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, num_beams=k, max_new_tokens=max_new, length_penalty=lp, early_stopping=es,
            num_return_sequences=n, eos_token_id=list(eos_ids), return_dict_in_generate=True,
            output_scores=True, **extra)
    # beam_indices is -1 past each hypothesis' own length (the rest of `sequences` is padding).
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(out.sequences[i, len(prompt):len(prompt) + lengths[i]].tolist(), float(out.sequences_scores[i]))
            for i in range(n)]


def _our_beams(model, prompt, k, lp, es, max_new, eos_ids, n, rewrite=None) -> list[tuple[list[int], float]]:
    """Drive BeamSearch like the scheduler would, mirroring its sequence table to check the protocol."""
    ids = itertools.count(100)
    bs = BeamSearch(beam_width=k, length_penalty=lp, early_stopping=es, max_new_tokens=max_new,
                    prompt_len=len(prompt), eos_token_ids=tuple(eos_ids), new_beam_id=lambda: next(ids),
                    num_return=n)
    bs.start(0)
    table = {0: list(prompt)}           # sequence id -> its tokens, as the block store would hold them
    while True:
        beams = bs.running()
        assert table == {b.beam_id: list(prompt) + b.token_ids for b in beams}
        with torch.no_grad():
            # all running beams have the same length: one batch, no padding, no cache
            rows = [list(prompt) + b.token_ids for b in beams]
            logits = model(torch.tensor(rows)).logits[:, -1]                                    # [B, V]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            if rewrite:
                logprobs = rewrite(rows, logprobs)
            top_lp, top_tok = logprobs.topk(bs.candidates_per_beam, dim=-1)                     # [B, C]
        res = bs.step({b.beam_id: list(zip(top_tok[i].tolist(), top_lp[i].tolist()))
                       for i, b in enumerate(beams)})
        forks = {new: list(table[parent]) for new, parent, _, _ in res.running if new != parent}
        assert not set(forks) & set(table), "a fork must get a fresh sequence id"
        table.update(forks)                              # forks first, from the parents' state
        for new, _, token, _ in res.running:
            table[new].append(token)
        for seq_id in res.freed:
            del table[seq_id]
        if res.done:
            assert table == {} and res.running == [] and bs.running() == []
            return bs.results()


def _assert_same(ours, theirs):
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs):
        assert a == pytest.approx(b, abs=1e-4, rel=1e-5)


@pytest.fixture(scope="module")
def eos_of_prompt(model_and_prompts):
    """Per prompt, an EOS id that the search meets: a token that greedy decoding produces."""
    model, prompts = model_and_prompts
    return [_greedy(model, p, pos + 1)[pos] for p, (_, pos) in zip(prompts, CASES)]


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("es", [False, True, "never"])
@pytest.mark.parametrize("lp", [1.0, 0.0, 2.0, -0.5])
def test_matches_transformers_with_reachable_eos(model_and_prompts, eos_of_prompt, k, es, lp):
    model, prompts = model_and_prompts
    for prompt, eos in zip(prompts, eos_of_prompt):
        args = (model, prompt, k, lp, es, MAX_NEW, (eos,), k)
        _assert_same(_our_beams(*args), _hf_beams(*args))


def test_reachable_eos_really_finishes_hypotheses(model_and_prompts, eos_of_prompt):
    # Guards the test above against silently degenerating into max-length-only searches.
    model, prompts = model_and_prompts
    ended_with_eos = ran_to_max = 0
    early_stopping_mattered = False
    for prompt, eos in zip(prompts, eos_of_prompt):
        by_es = {es: _our_beams(model, prompt, 4, 1.0, es, MAX_NEW, (eos,), 4) for es in (False, True)}
        early_stopping_mattered |= by_es[False] != by_es[True]
        for tokens, _ in by_es[False] + by_es[True]:
            ended_with_eos += tokens[-1] == eos
            ran_to_max += tokens[-1] != eos and len(tokens) == MAX_NEW
    assert ended_with_eos and ran_to_max and early_stopping_mattered


@pytest.mark.parametrize("k,n", [(2, 1), (4, 2), (4, 4)])
def test_matches_transformers_to_max_length(model_and_prompts, k, n):
    # The model's own EOS (rarely produced): the search runs to max_new_tokens and the last step's
    # running beams become the finished ones.
    model, prompts = model_and_prompts
    for prompt in prompts:
        args = (model, prompt, k, 1.0, False, MAX_NEW, (2,), n)
        ours = _our_beams(*args)
        assert len(ours) == n and all(len(tokens) == MAX_NEW for tokens, _ in ours)
        _assert_same(ours, _hf_beams(*args))


def test_matches_transformers_with_two_eos_ids(model_and_prompts, eos_of_prompt):
    # Two EOS ids widen the kept continuations to 3 * k.
    model, prompts = model_and_prompts
    for prompt, eos in zip(prompts, eos_of_prompt):
        second = _greedy(model, prompt, 2)[1]
        for es in (False, "never"):
            args = (model, prompt, 4, 1.0, es, MAX_NEW, (eos, second), 3)
            _assert_same(_our_beams(*args), _hf_beams(*args))


def _synthetic_rewrite(seed: int, eos_ids, sharpness: float, eos_bias: float):
    """Log-probabilities that depend only on the sequence: peaked, EOS-favouring, tie-free in practice."""
    def rewrite(rows: list[list[int]], scores):
        out = []
        for row in rows:
            gen = torch.Generator().manual_seed(zlib.crc32(repr((seed, row)).encode()))
            logits = torch.randn(scores.shape[-1], generator=gen) * sharpness                   # [V]
            logits[list(eos_ids)] += eos_bias
            out.append(torch.log_softmax(logits, dim=-1))
        return torch.stack(out)                                                               # [B, V]
    return rewrite


@pytest.mark.parametrize("seed", range(40))
def test_matches_transformers_on_random_configurations(model_and_prompts, seed):
    model, _ = model_and_prompts
    rng = random.Random(seed)
    k = rng.choice([2, 3, 4])
    n = rng.randint(1, k)
    lp = rng.choice([1.0, 0.0, 2.0, -0.5, 0.7])
    es = rng.choice([False, True, "never"])
    max_new = rng.randint(1, 12)
    eos_ids = rng.sample(range(3, model.config.vocab_size), rng.choice([1, 1, 2]))
    prompt = [1] + [rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(1, 6))]
    rewrite = _synthetic_rewrite(seed, eos_ids, sharpness=rng.choice([0.5, 2.0, 5.0]),
                                 eos_bias=rng.uniform(0.0, 6.0))
    args = (model, prompt, k, lp, es, max_new, eos_ids, n, rewrite)
    _assert_same(_our_beams(*args), _hf_beams(*args))


# ---- the core alone, with hand-made candidates ----

def _search(k=2, lp=1.0, es=False, max_new=5, eos=(9,), n=None, **kw):
    ids = itertools.count(10)
    bs = BeamSearch(beam_width=k, length_penalty=lp, early_stopping=es, max_new_tokens=max_new,
                    prompt_len=3, eos_token_ids=eos, new_beam_id=lambda: next(ids), num_return=n or k, **kw)
    bs.start(0)
    return bs


def test_first_continuation_keeps_parent_id_and_dead_parents_are_freed():
    bs = _search(k=2)
    assert bs.candidates_per_beam == 4
    res = bs.step({0: [(5, -0.1), (6, -0.2), (7, -3.0), (8, -4.0)]})
    assert res.running == [(0, 0, 5, pytest.approx(-0.1)), (10, 0, 6, pytest.approx(-0.2))]
    assert res.freed == [] and not res.done
    # both continuations now come from beam 10: it keeps its id, 0 dies, 11 is forked from 10
    res = bs.step({0: [(1, -5.0), (2, -6.0)], 10: [(3, -0.1), (4, -0.3)]})
    assert [(new, parent, tok) for new, parent, tok, _ in res.running] == [(10, 10, 3), (11, 10, 4)]
    assert res.freed == [0]
    assert [b.token_ids for b in bs.running()] == [[6, 3], [6, 4]]


def test_eos_beyond_top_k_is_dropped_and_eos_in_top_k_finishes():
    bs = _search(k=2, es=True)
    # EOS (9) ranked third of the kept four: neither running nor finished
    res = bs.step({0: [(5, -0.1), (6, -0.2), (9, -0.3), (7, -0.4)]})
    assert [tok for _, _, tok, _ in res.running] == [5, 6]
    # EOS best from beam 0: a finished hypothesis of length 2; 4 and 3 keep running
    res = bs.step({0: [(9, -0.05), (4, -0.5)], 10: [(3, -0.1), (2, -0.9)]})
    assert [tok for _, _, tok, _ in res.running] == [3, 4] and not res.done
    # with early_stopping=True the search ends once k hypotheses finished
    res = bs.step({0: [(9, -0.01), (1, -2.0)], 10: [(9, -0.01), (1, -2.0)]})
    assert res.done and sorted(res.freed) == [0, 10] and res.running == []
    (t1, s1), (t2, s2) = bs.results()
    assert t1 == [5, 9] and s1 == pytest.approx(-0.15 / 2)
    assert t2 == [6, 3, 9] and s2 == pytest.approx(-0.31 / 3)


def test_ties_go_to_the_earlier_beam_then_the_lower_token():
    bs = _search(k=2)
    bs.step({0: [(5, -1.0), (6, -1.0), (7, -2.0), (8, -2.0)]})
    assert [b.token_ids for b in bs.running()] == [[5], [6]]
    res = bs.step({0: [(4, -1.0), (3, -3.0)], 10: [(2, -1.0), (1, -3.0)]})
    assert [b.token_ids for b in bs.running()] == [[5, 4], [6, 2]]
    assert res.freed == []


def test_max_length_turns_the_best_running_into_results_and_respects_max_model_len():
    bs = _search(k=2, max_new=50, max_model_len=5, n=1)   # prompt 3 + 2 generated reaches 5
    bs.step({0: [(5, -0.1), (6, -0.2), (7, -3.0), (8, -4.0)]})
    res = bs.step({0: [(1, -1.0), (2, -2.0)], 10: [(3, -0.1), (4, -0.3)]})
    assert res.done and sorted(res.freed) == [0, 10]
    assert bs.results() == [([6, 3], pytest.approx(-0.3 / 2))]


def test_misuse_is_refused():
    with pytest.raises(BeamSearchError):
        _search(k=1)                    # HF's num_beams=1 is greedy decoding
    with pytest.raises(BeamSearchError):
        _search(k=2, n=3)
    with pytest.raises(BeamSearchError):
        _search(es="sometimes")
    bs = _search(k=2)
    with pytest.raises(BeamSearchError):
        bs.results()
    with pytest.raises(BeamSearchError):
        bs.step({})
    with pytest.raises(BeamSearchError):
        bs.start(1)


def test_scores_are_float32_sums_like_hf():
    # -1 - 2**-24 rounds to -1.0 in float32: the two continuations tie and the earlier beam wins.
    # In float64 the second beam's would be ahead.
    bs = _search(k=2)
    bs.step({0: [(5, -1.0), (6, -1.0), (7, -3.0), (8, -4.0)]})
    bs.step({0: [(7, -2.0 ** -24), (1, -9.0)], 10: [(8, 0.0), (2, -9.0)]})
    assert [(b.token_ids, b.cum_logprob) for b in bs.running()] == [([5, 7], -1.0), ([6, 8], -1.0)]


def test_running_score_equal_to_worst_finished_cannot_improve():
    bs = _search(k=2, eos=(1, 2))          # two EOS ids: 6 candidates per beam
    res = bs.step({0: [(1, -0.5), (2, -0.5), (5, -0.5), (6, -0.5), (7, -2.0), (8, -3.0)]})
    assert res.done and bs.results() == [([1], -0.5), ([2], -0.5)]


@pytest.mark.parametrize("es,lp,logprob_of_4,done", [
    (False, 1.0, -4.9, True),      # best running -5.0 / 2 is not above the worst finished -1.8
    ("never", 1.0, -4.9, False),   # ... but -5.0 / 4 (max length) is
    ("never", -0.5, -0.9, False),  # lp <= 0: "never" uses the current length, -1.0 * 2**0.5 > -1.8
    (True, 1.0, -0.9, True),       # two finished: done whatever the running beams could do
])
def test_early_stopping_heuristics(es, lp, logprob_of_4, done):
    bs = _search(k=2, lp=lp, es=es, max_new=4)
    # step 1: EOS (9) second best -> one finished hypothesis [9] of length 1, score -1.8
    res = bs.step({0: [(5, -0.1), (9, -1.8), (6, -2.0), (7, -3.0)]})
    assert not res.done
    # step 2: [5, 9] finishes (cum -0.7), [5, 4] is the best running beam
    res = bs.step({0: [(9, -0.6), (4, logprob_of_4)], 10: [(3, -4.0), (2, -5.0)]})
    assert res.done is done
    if done:
        assert [tokens for tokens, _ in bs.results()] == [[5, 9], [9]]
