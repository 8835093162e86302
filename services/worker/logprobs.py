"""Logprobs of the raw model distribution (log_softmax of the logits before any processing, as
vLLM v1 returns by default), and a step's draw with them (Draw), on the device until to_host.

`Draw.start_copy` starts the copy back to the host without waiting; `Draw.to_host` waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.services.worker.sampling_rows import SamplingRow, take_rows


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


def draw_of(raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> Draw:
    """The draw of token_ids [S] from raw logits [S, V] float32, with their raw logprobs and the top
    logprobs of the rows asking for them; left on the device."""
    vocab = raw.shape[1]
    # Raw logprobs: logit - logsumexp equals log_softmax without building an [S, V] tensor.
    lse = torch.logsumexp(raw, dim=-1)  # [S]
    sampled_logprobs = raw.gather(1, token_ids[:, None]).squeeze(1) - lse  # [S]
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    max_k = min(max((rows[i].params.logprobs for i in asking), default=0), vocab)
    top = None
    if asking:
        values, ids = torch.topk(take_rows(raw, asking), max_k, dim=-1)  # [A, max_k], best first
        top = (values - take_rows(lse[:, None], asking), ids)
    return Draw(token_ids, sampled_logprobs, top, asking, [rows[i].params.logprobs for i in asking])
