"""The sampler's randomness: Exp(1) noise for the exponential race, per row or per call.

- A row whose params carry a seed draws its noise from a generator seeded by
  `derive_row_seed(seed, seq_index, number of outputs before this one)`: stateless, so the same row gives the
  same token whatever else is in the batch and after preemption with recompute.
- Rows without a seed share one generator per call, itself seeded from `generator` (a CPU
  torch.Generator the caller owns, e.g. one per worker); when `generator` is None a module-level
  generator seeded from OS entropy on first use stands in.
- Sampling is the exponential race: token = argmax(probs / E) with E ~ Exp(1) i.i.d. per token,
  which picks token i with probability probs[i]. E is drawn as -log(U), U ~ Uniform[0, 1): the
  same law as `exponential_`, about 6x faster on CPU, and never 0 (so no 0/0 on masked tokens).
"""

from __future__ import annotations

import torch

from pagedserve.services.worker.sampling_rows import SamplingRow, index_tensor

_MASK64 = (1 << 64) - 1
_default_source: torch.Generator | None = None


def derive_row_seed(seed: int, seq_index: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, sample index, output length): splitmix64 chained.

    Mixing (rather than e.g. seed + step) keeps nearby inputs from giving correlated streams, and
    keeps (seed, index=1, step=0) apart from (seed, index=0, step=1).
    """
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (seq_index & _MASK64))
    h = _splitmix64(h ^ (step & _MASK64))
    return h >> 1



def exponential_noise(rows: list[SamplingRow], vocab: int, device: torch.device,
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
            uniform[index_tensor(unseeded, device)] = draws
    for i, r in enumerate(rows):
        if r.params.seed is None:
            continue
        row_gen = torch.Generator(device=device)
        row_gen.manual_seed(derive_row_seed(r.params.seed, r.seq_index, r.num_output))
        # A standalone [V] draw: its values cannot depend on the row's position in the batch.
        uniform[i] = torch.rand(vocab, generator=row_gen, device=device)
    # U in [0, 1) gives -log(U) in (0, inf]: never 0, so masked tokens score 0 / E = 0, not NaN.
    return uniform.log_().neg_()


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
