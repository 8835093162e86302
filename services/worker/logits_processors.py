"""The sampler's logits processors: each masks or shifts, in place, the logits [S, V] of the rows
whose params ask for it, and leaves the other rows untouched. services/worker/sampler.py applies
them in vLLM's order; their arithmetic is vLLM's.

Top-k keeps every token whose logit is at least the k-th largest (ties at the boundary are all kept,
as in vLLM). Top-p keeps the smallest prefix of the sorted distribution whose mass reaches p.
"""

from __future__ import annotations

import torch

from pagedserve.services.worker.sampling_rows import (SamplingRow, index_tensor, param_column, put_rows, take_rows,
                                                      to_device)


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, chosen: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf (in place) the logits of the chosen rows whose bit in bitmask [G, W] is clear.

    One unpack for all G rows: [G, W] -> [G, W, 32] bits -> [G, V]; the other rows are untouched."""
    vocab = logits.shape[1]
    bits = bitmask.to(logits.device, non_blocking=True)[:, :, None] >> _BIT_SHIFTS.to(logits.device)   # [G, W, 32]
    banned = (bits & 1).view(len(chosen), -1)[:, :vocab] == 0   # [G, V]
    sub = take_rows(logits, chosen)  # [G, V]
    sub.masked_fill_(banned, float("-inf"))
    put_rows(logits, chosen, sub)


def apply_allowed_token_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Set to -inf (in place) every logit outside a row's allowed_token_ids (vLLM's whitelist)."""
    chosen = [i for i, r in enumerate(rows) if r.params.allowed_token_ids]
    if not chosen:
        return
    vocab = logits.shape[1]
    # The scheduler refuses ids past the vocabulary; dropped here too, so that a peer that let one
    # through cannot fail the whole step with an index error.
    allowed = _presence_mask([[t for t in rows[i].params.allowed_token_ids if t < vocab] for i in chosen],
                             vocab, logits.device)  # [A, V]
    sub = take_rows(logits, chosen)  # [A, V]
    sub.masked_fill_(~allowed, float("-inf"))
    put_rows(logits, chosen, sub)


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow], eos_ids: tuple[int, ...]) -> None:
    """Forbid EOS and the stop tokens while a row has fewer than min_tokens outputs (in place)."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        if r.num_output >= r.params.min_tokens:
            continue
        banned = set(r.params.stop_token_ids).union(eos_ids)
        row_idx.extend([i] * len(banned))
        tok_idx.extend(banned)
    if row_idx:
        logits[index_tensor(row_idx, logits.device), index_tensor(tok_idx, logits.device)] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Add each row's logit_bias to its tokens' logits (in place); ids past the vocabulary are skipped."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    biases: list[float] = []
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        for token_id, bias in r.params.logit_bias.items():
            if token_id < vocab:
                row_idx.append(i)
                tok_idx.append(token_id)
                biases.append(bias)
    if row_idx:
        rows_t, toks_t = index_tensor(row_idx, logits.device), index_tensor(tok_idx, logits.device)
        logits[rows_t, toks_t] += to_device(biases, logits.dtype, logits.device)


def apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Divide positive / multiply negative logits of every token seen in prompt or output (in place)."""
    chosen = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not chosen:
        return
    device = logits.device
    seen_tokens = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in chosen]
    seen = _presence_mask(seen_tokens, logits.shape[1], device)  # [R, V]
    penalty = param_column([rows[i].params.repetition_penalty for i in chosen], device)  # [R, 1]
    sub = take_rows(logits, chosen)  # [R, V]
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    put_rows(logits, chosen, torch.where(seen, penalised, sub))


def apply_frequency_presence_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """logit -= frequency * count + presence * (count > 0), counts over output tokens (in place)."""
    chosen = [i for i, r in enumerate(rows)
              if (r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0)
              and r.output_token_ids]
    if not chosen:
        return
    device = logits.device
    counts = _token_counts([rows[i].output_token_ids for i in chosen], logits.shape[1], device)  # [R, V]
    freq = param_column([rows[i].params.frequency_penalty for i in chosen], device)  # [R, 1]
    pres = param_column([rows[i].params.presence_penalty for i in chosen], device)  # [R, 1]
    sub = take_rows(logits, chosen)  # [R, V]
    sub -= freq * counts + pres * (counts > 0).float()
    put_rows(logits, chosen, sub)



def apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Mask (to -inf, in place) tokens outside each row's top-k and then its top-p nucleus.

    Each row's filter reduces to a cutoff logit (the smallest one kept); the row is then masked
    below it, so no unsorting scatter is needed, and ties at the cutoff are all kept.
    Sorting the whole vocabulary is the expensive part (~3 ms per 32k-token row on one CPU core),
    so only the best max(top_k, _TOP_P_PROBE) logits are ranked; a top-p row without a top-k whose
    nucleus turns out wider than that is redone on a full sort.
    """
    vocab = logits.shape[1]
    device = logits.device
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    chosen = [i for i, r in enumerate(rows) if ks[i] < vocab or r.params.top_p < 1.0]
    if not chosen:
        return
    sub = take_rows(logits, chosen)  # [C, V]
    k = to_device([ks[i] for i in chosen], torch.long, device)[:, None]  # [C, 1]
    # p = 1 rows get an infinite p so that rounding in the prefix sums can never trim them.
    top_p = [rows[i].params.top_p for i in chosen]
    p = param_column([x if x < 1.0 else float("inf") for x in top_p], device)  # [C, 1]
    width = min(vocab, max(ks[i] if ks[i] < vocab else _TOP_P_PROBE for i in chosen))
    any_top_p = any(x < 1.0 for x in top_p)
    cutoff, spilled = _cutoffs(sub, _ranked(sub, width), k, p, any_top_p)  # [C, 1], [C]
    # Only a top-p row without a top-k can spill past the probe; asking whether one did waits for
    # the device, so it is asked only when there is such a row.
    if any(ks[i] >= vocab and rows[i].params.top_p < 1.0 for i in chosen) and bool(spilled.any()):
        again = spilled.nonzero().flatten()
        redo = sub[again]  # [C', V]
        cutoff[again] = _cutoffs(redo, _ranked(redo, vocab), k[again], p[again], any_top_p)[0]
    sub.masked_fill_(sub < cutoff, float("-inf"))
    put_rows(logits, chosen, sub)


# How many best tokens a top-p row without a top-k first looks for its nucleus in.
_TOP_P_PROBE = 1024


def _ranked(logits: torch.Tensor, width: int) -> torch.Tensor:
    """logits [C, V] -> the `width` largest of each row, best first [C, width]."""
    if width < logits.shape[1]:
        return torch.topk(logits, width, dim=-1).values
    return torch.sort(logits, dim=-1, descending=True).values


def _cutoffs(logits: torch.Tensor, ranked: torch.Tensor, k: torch.Tensor,
             p: torch.Tensor, any_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row smallest kept logit [C, 1] after top-k then top-p, and which rows need a wider ranking [C].

    logits [C, V]; ranked [C, W] the W best of each row; k [C, 1] (k > W only for rows without a
    top-k, which then have k = V); p [C, 1] (inf: no top-p); any_top_p: whether a row has one
    (known on the host: asking the device would wait for it).
    """
    width = ranked.shape[1]
    has_k = k <= width  # [C, 1]
    cutoff = torch.where(has_k, ranked.gather(1, k.clamp(max=width) - 1),
                         torch.full_like(ranked[:, :1], float("-inf")))  # [C, 1] the k-th largest logit
    if not any_top_p:
        return cutoff, torch.zeros_like(has_k[:, 0])
    masked = ranked.masked_fill(ranked < cutoff, float("-inf"))  # [C, W]
    # top-p acts on the top-k law; a row without a top-k may not hold its whole law in `ranked`,
    # so it is normalised over its full row.
    norm = torch.where(has_k, torch.logsumexp(masked, dim=-1, keepdim=True),
                       torch.logsumexp(logits, dim=-1, keepdim=True))  # [C, 1]
    cum = (masked - norm).exp().cumsum(dim=-1)  # [C, W]
    # Exclusive prefix mass, taken from one cumsum so that it never decreases along the row.
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    num_kept = (mass_before < p).sum(dim=-1, keepdim=True)  # [C, 1] >= 1: mass_before[:, 0] = 0 < p
    cutoff = torch.maximum(cutoff, ranked.gather(1, num_kept - 1))
    spilled = (~has_k & (cum[:, -1:] < p))[:, 0]  # the nucleus goes on past the ranked tokens
    return cutoff, spilled


def apply_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Mask (in place) tokens whose probability is below min_p times the row's top probability."""
    chosen = [i for i, r in enumerate(rows) if r.params.min_p > 0.0]
    if not chosen:
        return
    min_p = param_column([rows[i].params.min_p for i in chosen], logits.device)  # [M, 1]
    sub = take_rows(logits, chosen)  # [M, V]
    probs = torch.softmax(sub, dim=-1)
    sub.masked_fill_(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    put_rows(logits, chosen, sub)



def _presence_mask(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] bool: True where the token occurs in that row's list."""
    mask = torch.zeros(len(token_lists), vocab, dtype=torch.bool, device=device)
    rows, toks = _flatten(token_lists, device)
    mask[rows, toks] = True
    return mask


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32: occurrences of each token in that row's list."""
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    rows, toks = _flatten(token_lists, device)
    counts.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.float32), accumulate=True)
    return counts


def _flatten(token_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Built on the host and moved with to_device: a whitelist, unlike the penalties, needs no
    # history, so its steps may be planned ahead and must not wait for the device here.
    rows = [i for i, ts in enumerate(token_lists) for _ in ts]
    toks = [t for ts in token_lists for t in ts]
    return index_tensor(rows, device), index_tensor(toks, device)

