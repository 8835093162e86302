"""The worker's sampler: turns one step's logits into one token per sequence. Pure torch, no I/O.

This module owns the order of logit processing (vLLM's; the arithmetic of each processor is
services/worker/logits_processors.py's):
    grammar bitmask (structured outputs: tokens the grammar forbids to -inf)
    -> allowed_token_ids (every token outside the whitelist to -inf)
    -> min_tokens (mask EOS and stop_token_ids) -> logit_bias -> repetition penalty (prompt + output tokens)
    -> frequency and presence penalties (output tokens) -> greedy rows: argmax
    -> other rows: temperature -> top-k -> top-p -> min-p -> exponential-race sampling.
Returned logprobs are those of the raw model distribution (log_softmax of the logits before any
processing), as vLLM v1 returns by default (services/worker/logprobs.py).

Sampling is the exponential race: token = argmax(probs / E) with E ~ Exp(1) i.i.d. per token,
which picks token i with probability probs[i]. The noise E is services/worker/sampling_noise.py's: a
row with a seed gets the same token whatever else is in the batch and after preemption with
recompute; rows without one draw from `generator` (a CPU torch.Generator the caller owns).

`sample_on_device` leaves the draw on the logits' device (a Draw) and waits for nothing on a GPU:
the small per-step tensors it builds from Python lists travel through pinned memory without a sync
(`to_device`, services/worker/sampling_rows.py), so the worker can launch the next step, whose
inputs are these tokens, before it reads them. `Draw.start_copy` starts their copy back;
`Draw.to_host` waits for it. `sample` is the two in turn. (Still waiting for the device: a step
with a top-p row that has no top-k, to learn whether its nucleus spills past the probe in
logits_processors.py; penalties and grammars, which no step planned ahead has; beam candidates.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.services.worker.logits_processors import (apply_allowed_token_ids, apply_frequency_presence_penalties,
                                                          apply_logit_bias, apply_min_p, apply_min_tokens,
                                                          apply_repetition_penalty, apply_token_bitmask,
                                                          apply_top_k_top_p)
from pagedserve.services.worker.logprobs import Draw, SamplerOutput, compute_logprobs, draw_of, top_logprobs
from pagedserve.services.worker.sampling_noise import derive_row_seed, exponential_noise
from pagedserve.services.worker.sampling_rows import SamplingRow, index_tensor, param_column, take_rows, to_device

# The sampler's names, wherever they live: the worker core, the offline engine and tests import them from here.
__all__ = ["Draw", "SamplerOutput", "SamplingRow", "apply_token_bitmask", "compute_logprobs", "derive_row_seed",
           "sample", "sample_on_device", "to_device", "top_logprobs"]


def sample(logits: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | Sequence[int] | None,
           generator: torch.Generator | None = None,
           allowed: tuple[list[int], torch.Tensor] | None = None) -> SamplerOutput:
    """Sample one token per row: sample_on_device, then to_host."""
    return sample_on_device(logits, rows, eos_token_id, generator, allowed).to_host()


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | Sequence[int] | None,
                     generator: torch.Generator | None = None,
                     allowed: tuple[list[int], torch.Tensor] | None = None) -> Draw:
    """Sample one token per row, left on the device. logits [S, V] (one row per entry of `rows`)
    are not modified.

    `eos_token_id`: the model's EOS id, or several (some models end on any of a few), or None;
    only min_tokens uses it.
    `generator`: CPU generator that seeds this call's randomness for rows without a seed (see the
    module docstring); seeded rows ignore it.
    `allowed`: (row indices, int32 bitmask [G, ceil(V/32)]) of the rows a grammar constrains; bit t
    of a row set means token t is allowed (services/worker/guides.py builds it).
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
    raw = logits.float()  # [S, V]
    num_rows = raw.shape[0]
    device = raw.device
    processed = raw.clone()  # [S, V]
    if eos_token_id is None:
        eos_ids: tuple[int, ...] = ()
    else:
        eos_ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    if allowed is not None:
        apply_token_bitmask(processed, *allowed)
    apply_allowed_token_ids(processed, rows)
    apply_min_tokens(processed, rows, eos_ids)
    apply_logit_bias(processed, rows)
    apply_repetition_penalty(processed, rows)
    apply_frequency_presence_penalties(processed, rows)

    token_ids = torch.empty(num_rows, dtype=torch.long, device=device)  # [S]
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    randoms = [i for i, r in enumerate(rows) if not r.params.greedy]
    if greedy:
        # torch.argmax returns the first maximal index: ties go to the lowest token id.
        token_ids[index_tensor(greedy, device)] = take_rows(processed, greedy).argmax(dim=-1)
    if randoms:
        token_ids[index_tensor(randoms, device)] = _sample_random(
            take_rows(processed, randoms), [rows[i] for i in randoms], generator)

    return draw_of(raw, token_ids, rows)


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow],
                   generator: torch.Generator | None) -> torch.Tensor:
    """logits [R, V] (penalised; modified in place) -> sampled ids [R]."""
    logits.div_(param_column([r.params.temperature for r in rows], logits.device))
    apply_top_k_top_p(logits, rows)
    apply_min_p(logits, rows)
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    noise = exponential_noise(rows, logits.shape[1], logits.device, generator)  # [R, V]
    return probs.div_(noise).argmax(dim=-1)
