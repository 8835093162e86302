"""use_beam_search with one beam (n 1, no best_of) is greedy search, as vLLM's beam_width 1.

Black-box finding: the router passed beam_width 1 (which the engine runs as plain sampling, no
beam search) with the default temperature 1, so four identical `{"use_beam_search": true, "n": 1}`
requests gave four different texts, while n 2 was deterministic.
"""
from __future__ import annotations

import pytest

from pagedserve.services.router.openai_schema import CompletionRequest, sampling_params


def _params(**fields):
    req = CompletionRequest.model_validate({"prompt": "def f(", "max_tokens": 6, **fields})
    params, n = sampling_params(req, max_tokens=6, logprobs=None, vocab_size=2048, max_stop_strings=4)
    return params, n


@pytest.mark.parametrize("fields", [{}, {"temperature": 1.0}, {"temperature": 0.7, "seed": 3}])
def test_one_beam_is_greedy(fields):
    params, n = _params(use_beam_search=True, n=1, **fields)
    assert n == 1 and params.beam_width == 1 and not params.use_beam_search
    assert params.greedy and params.temperature == 0.0


def test_wider_beams_and_plain_sampling_keep_their_temperature():
    params, _ = _params(use_beam_search=True, n=2)
    assert params.beam_width == 2 and params.use_beam_search
    params, _ = _params(use_beam_search=True, n=1, best_of=3)
    assert params.beam_width == 3 and params.n == 1
    params, _ = _params(n=1)
    assert params.temperature == 1.0 and not params.greedy
    params, _ = _params(n=1, temperature=0.5)
    assert params.temperature == 0.5
