"""The worker's sampler: turns one step's logits into one token per sequence. Pure torch, no I/O.

This module owns the order and arithmetic of logit processing (vLLM's):
    grammar bitmask (structured outputs: tokens the grammar forbids to -inf) -> min_tokens (mask EOS and stop_token_ids) -> logit_bias -> repetition penalty (prompt + output tokens)
    -> frequency and presence penalties (output tokens) -> greedy rows: argmax
    -> other rows: temperature -> top-k -> top-p -> min-p -> exponential-race sampling.
Returned logprobs are those of the raw model distribution (log_softmax of the logits before any
processing), as vLLM v1 returns by default.

Randomness:
- A row whose params carry a seed draws its noise from a generator seeded by
  `derive_row_seed(seed, seq_index, number of outputs before this one)`: stateless, so the same row gives the
  same token whatever else is in the batch and after preemption with recompute.
- Rows without a seed share one generator per call, itself seeded from `generator` (a CPU
  torch.Generator the caller owns, e.g. one per worker); when `generator` is None a module-level
  generator seeded from OS entropy on first use stands in.
- Sampling is the exponential race: token = argmax(probs / E) with E ~ Exp(1) i.i.d. per token,
  which picks token i with probability probs[i]. E is drawn as -log(U), U ~ Uniform[0, 1): the
  same law as `exponential_`, about 6x faster on CPU, and never 0 (so no 0/0 on masked tokens).

`sample_on_device` leaves the draw on the logits' device (a Draw) and waits for nothing on a GPU:
the small per-step tensors it builds from Python lists travel through pinned memory without a sync
(`_to_device`), so the worker can launch the next step, whose inputs are these tokens, before it
reads them. `Draw.start_copy` starts their copy back; `Draw.to_host` waits for it. `sample` is the
two in turn. (Still waiting for the device: a step with a top-p row that has no top-k, to learn
whether its nucleus spills past the probe below; penalties and grammars, which no step planned
ahead has; beam candidates.)

Top-k keeps every token whose logit is at least the k-th largest (ties at the boundary are all kept,
as in vLLM). Top-p keeps the smallest prefix of the sorted distribution whose mass reaches p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.services.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_default_source: torch.Generator | None = None


@dataclass
class SamplingRow:
    """One sequence in this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seq_index: int = 0  # which of the request's n samples: seeded samples must differ
    drawn: int = 0      # outputs drawn already, in a step still running, that output_token_ids lacks

    @property
    def num_output(self) -> int:
        return len(self.output_token_ids) + self.drawn


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # raw logprob of each sampled token
    top_logprobs: list[list[tuple[int, float]] | None]  # per row: top-k (id, logprob) if asked, else None


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] -> log_softmax [S, V] float32 (the raw model distribution)."""
    return torch.log_softmax(logits.float(), dim=-1)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row's raw distribution, best first.

    logits [S, V] -> (values [S, k] float32 log-probabilities, ids [S, k] int64).
    For beam search, which needs each beam's top 2*beam_width candidates.
    """
    vocab = logits.shape[-1]
    if not 0 <= k <= vocab:
        raise ValueError(f"k must be in [0, {vocab}], got {k}")
    logits = logits.float()
    # topk of the logits is topk of log_softmax (a per-row shift): no [S, V] temporary needed.
    values, ids = torch.topk(logits, k, dim=-1)  # [S, k]
    return values - torch.logsumexp(logits, dim=-1, keepdim=True), ids


def derive_row_seed(seed: int, seq_index: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, sample index, output length): splitmix64 chained.

    Mixing (rather than e.g. seed + step) keeps nearby inputs from giving correlated streams, and
    keeps (seed, index=1, step=0) apart from (seed, index=0, step=1).
    """
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (seq_index & _MASK64))
    h = _splitmix64(h ^ (step & _MASK64))
    return h >> 1


@dataclass
class Draw:
    """One step's draw, on the logits' device until to_host."""
    token_ids: torch.Tensor             # [S] int64
    logprobs: torch.Tensor              # [S] float32, raw
    top: tuple | None                   # (logprobs [A, k], ids [A, k]) of the rows asking
    asking: list[int]                   # the rows that asked for top logprobs
    ks: list[int]                       # how many each of them asked for
    host: tuple | None = None           # start_copy's pinned copies and its event (CUDA)

    def start_copy(self) -> None:
        """CUDA: start copying the draw to pinned host memory, without waiting (to_host waits)."""
        if self.token_ids.device.type != "cuda" or self.host is not None:
            return
        tensors = [self.token_ids, self.logprobs, *(self.top or ())]
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for dst, src in zip(pinned, tensors):
            dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.host = (pinned, done)

    def to_host(self) -> SamplerOutput:
        self.start_copy()
        if self.host is not None:
            pinned, done = self.host
            done.synchronize()
            token_ids, logprobs, *top = pinned
        else:
            token_ids, logprobs, top = self.token_ids, self.logprobs, self.top
        tops: list[list[tuple[int, float]] | None] = [None] * len(token_ids)
        if self.asking:
            values, ids = top[0].tolist(), top[1].tolist()
            for j, (i, k) in enumerate(zip(self.asking, self.ks)):
                tops[i] = list(zip(ids[j][:k], values[j][:k]))
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs.tolist(), top_logprobs=tops)


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
    num_rows, vocab = raw.shape
    device = raw.device
    processed = raw.clone()  # [S, V]
    if eos_token_id is None:
        eos_ids: tuple[int, ...] = ()
    else:
        eos_ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    if allowed is not None:
        apply_token_bitmask(processed, *allowed)
    _apply_min_tokens(processed, rows, eos_ids)
    _apply_logit_bias(processed, rows)
    _apply_repetition_penalty(processed, rows)
    _apply_frequency_presence_penalties(processed, rows)

    token_ids = torch.empty(num_rows, dtype=torch.long, device=device)  # [S]
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    randoms = [i for i, r in enumerate(rows) if not r.params.greedy]
    if greedy:
        # torch.argmax returns the first maximal index: ties go to the lowest token id.
        token_ids[_index(greedy, device)] = _take_rows(processed, greedy).argmax(dim=-1)
    if randoms:
        token_ids[_index(randoms, device)] = _sample_random(
            _take_rows(processed, randoms), [rows[i] for i in randoms], generator)

    # Raw logprobs: logit - logsumexp equals log_softmax without building an [S, V] tensor.
    lse = torch.logsumexp(raw, dim=-1)  # [S]
    sampled_logprobs = raw.gather(1, token_ids[:, None]).squeeze(1) - lse  # [S]
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    max_k = min(max((rows[i].params.logprobs for i in asking), default=0), vocab)
    top = None
    if asking:
        values, ids = torch.topk(_take_rows(raw, asking), max_k, dim=-1)  # [A, max_k], best first
        top = (values - _take_rows(lse[:, None], asking), ids)
    return Draw(token_ids, sampled_logprobs, top, asking, [rows[i].params.logprobs for i in asking])


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, chosen: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf (in place) the logits of the chosen rows whose bit in bitmask [G, W] is clear.

    One unpack for all G rows: [G, W] -> [G, W, 32] bits -> [G, V]; the other rows are untouched."""
    vocab = logits.shape[1]
    bits = bitmask.to(logits.device, non_blocking=True)[:, :, None] >> _BIT_SHIFTS.to(logits.device)   # [G, W, 32]
    banned = (bits & 1).view(len(chosen), -1)[:, :vocab] == 0   # [G, V]
    sub = _take_rows(logits, chosen)  # [G, V]
    sub.masked_fill_(banned, float("-inf"))
    _put_rows(logits, chosen, sub)


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow], eos_ids: tuple[int, ...]) -> None:
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
        logits[_index(row_idx, logits.device), _index(tok_idx, logits.device)] = float("-inf")


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
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
        rows_t, toks_t = _index(row_idx, logits.device), _index(tok_idx, logits.device)
        logits[rows_t, toks_t] += to_device(biases, logits.dtype, logits.device)


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Divide positive / multiply negative logits of every token seen in prompt or output (in place)."""
    chosen = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not chosen:
        return
    device = logits.device
    seen_tokens = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in chosen]
    seen = _presence_mask(seen_tokens, logits.shape[1], device)  # [R, V]
    penalty = _param_column([rows[i].params.repetition_penalty for i in chosen], device)  # [R, 1]
    sub = _take_rows(logits, chosen)  # [R, V]
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    _put_rows(logits, chosen, torch.where(seen, penalised, sub))


def _apply_frequency_presence_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """logit -= frequency * count + presence * (count > 0), counts over output tokens (in place)."""
    chosen = [i for i, r in enumerate(rows)
              if (r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0)
              and r.output_token_ids]
    if not chosen:
        return
    device = logits.device
    counts = _token_counts([rows[i].output_token_ids for i in chosen], logits.shape[1], device)  # [R, V]
    freq = _param_column([rows[i].params.frequency_penalty for i in chosen], device)  # [R, 1]
    pres = _param_column([rows[i].params.presence_penalty for i in chosen], device)  # [R, 1]
    sub = _take_rows(logits, chosen)  # [R, V]
    sub -= freq * counts + pres * (counts > 0).float()
    _put_rows(logits, chosen, sub)


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow],
                   generator: torch.Generator | None) -> torch.Tensor:
    """logits [R, V] (penalised; modified in place) -> sampled ids [R]."""
    logits.div_(_param_column([r.params.temperature for r in rows], logits.device))
    _apply_top_k_top_p(logits, rows)
    _apply_min_p(logits, rows)
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    noise = _exponential_noise(rows, logits.shape[1], logits.device, generator)  # [R, V]
    return probs.div_(noise).argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
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
    sub = _take_rows(logits, chosen)  # [C, V]
    k = to_device([ks[i] for i in chosen], torch.long, device)[:, None]  # [C, 1]
    # p = 1 rows get an infinite p so that rounding in the prefix sums can never trim them.
    top_p = [rows[i].params.top_p for i in chosen]
    p = _param_column([x if x < 1.0 else float("inf") for x in top_p], device)  # [C, 1]
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
    _put_rows(logits, chosen, sub)


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


def _apply_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Mask (in place) tokens whose probability is below min_p times the row's top probability."""
    chosen = [i for i, r in enumerate(rows) if r.params.min_p > 0.0]
    if not chosen:
        return
    min_p = _param_column([rows[i].params.min_p for i in chosen], logits.device)  # [M, 1]
    sub = _take_rows(logits, chosen)  # [M, V]
    probs = torch.softmax(sub, dim=-1)
    sub.masked_fill_(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    _put_rows(logits, chosen, sub)


def _exponential_noise(rows: list[SamplingRow], vocab: int, device: torch.device,
                       generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) noise [R, V]: seeded rows from their own stateless generator, the rest from one per call."""
    uniform = torch.empty(len(rows), vocab, dtype=torch.float32, device=device)  # [R, V]
    unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
    if unseeded:
        source = generator if generator is not None else _default_generator()
        call_gen = torch.Generator(device=device)
        call_gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=source)))
        if len(unseeded) == len(rows):
            uniform.uniform_(generator=call_gen)
        else:
            draws = torch.rand(len(unseeded), vocab, generator=call_gen, device=device)
            uniform[_index(unseeded, device)] = draws
    for i, r in enumerate(rows):
        if r.params.seed is None:
            continue
        row_gen = torch.Generator(device=device)
        row_gen.manual_seed(derive_row_seed(r.params.seed, r.seq_index, r.num_output))
        # A standalone [V] draw: its values cannot depend on the row's position in the batch.
        uniform[i] = torch.rand(vocab, generator=row_gen, device=device)
    # U in [0, 1) gives -log(U) in (0, inf]: never 0, so masked tokens score 0 / E = 0, not NaN.
    return uniform.log_().neg_()


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
    lengths = torch.tensor([len(t) for t in token_lists], device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    toks = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long, device=device)
    return rows, toks


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A Python list as a tensor on `device`. On a GPU through pinned memory, without waiting: a
    plain torch.tensor(..., device=cuda) waits for everything queued before it (the forward)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)


def _param_column(values: list[float], device: torch.device) -> torch.Tensor:
    """Per-row parameters as a float32 column [R, 1] that broadcasts over the vocabulary."""
    return to_device(values, torch.float32, device)[:, None]


def _take_rows(t: torch.Tensor, chosen: list[int]) -> torch.Tensor:
    """The chosen rows of t: t itself when all are chosen (the common case), else a copy."""
    if len(chosen) == t.shape[0]:
        return t
    return t[_index(chosen, t.device)]


def _put_rows(t: torch.Tensor, chosen: list[int], sub: torch.Tensor) -> None:
    """Write rows computed from _take_rows(t, chosen) back into t (a no-op when sub is t itself)."""
    if sub is t:
        return
    if len(chosen) == t.shape[0]:
        t.copy_(sub)
    else:
        t[_index(chosen, t.device)] = sub


def _default_generator() -> torch.Generator:
    global _default_source
    if _default_source is None:
        _default_source = torch.Generator()
        _default_source.seed()  # OS entropy, taken on first use rather than at import
    return _default_source


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
