"""What a step asks of the worker and what the worker answers: the records the scheduler core and
the worker share. No torch here, so the scheduler core (and the simulator that drives it) imports
without the model stack; the worker's modules re-export these names.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.services.protocol import SampleResult
from pagedserve.services.sampling_params import SamplingParams

__all__ = ["SampleRequest", "SampleResult", "SeqStep"]


@dataclass(slots=True)
class SeqStep:
    """One sequence's share of a step."""
    seq_id: int
    token_ids: list[int]       # tokens whose K/V this step computes
    start_pos: int             # position of token_ids[0] = tokens already in the cache
    block_table: list[int]     # physical blocks covering positions [0, start_pos + len(token_ids))
    wants_logits: bool = True  # False for a prefill chunk that is not the prompt's last
    prompt_logprobs: int = -1  # k >= 0: score each token's successor in the prompt, with top-k
    next_token: int = -1       # the prompt token after this chunk (-1: the chunk ends the prompt)


@dataclass(slots=True)
class SampleRequest:
    """One token to draw from a step's logits row (a row can serve several: the n samples of a prompt)."""
    seq_id: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seq_index: int = 0
    beam_candidates: int = 0     # > 0: return this many top raw logprobs instead of sampling
    params_key: str = ""         # the request's params on the worker (its grammar matchers go with them)
    has_history: bool = True     # False: output_token_ids only stands in for the count (not sent)
