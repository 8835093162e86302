"""The worker's I/O-free core: run a scheduled step on the model and sample from its logits.

Owns nothing but what ModelRunner owns (weights, its views of the device pool), the sampler's
generator, and the tokens of its last step's draws: a step planned ahead (async scheduling) gives a
sequence PENDING_TOKEN as its input, the token that sequence drew in the step before. The worker
process and the offline engine both call `execute`.
"""
from __future__ import annotations

import torch

from pagedserve.services.protocol import PENDING_TOKEN, WAITS_FOR_GRAMMAR
from pagedserve.services.steps import SampleRequest, SampleResult  # noqa: F401  (re-exported)
from pagedserve.services.worker.model_runner import ModelRunner, SeqStep
from pagedserve.services.worker.guides import Guides
from pagedserve.services.worker.sampler import SamplingRow, sample, top_logprobs


class PendingTokenError(ValueError):
    """A step's input is a sequence's last draw, but that sequence drew nothing in the last step."""


class WorkerCore:
    def __init__(self, runner: ModelRunner, eos_token_ids: tuple[int, ...], seed: int = 0,
                 guides: Guides | None = None):
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator().manual_seed(seed)
        self.guides = guides      # structured outputs; None: a request with a constraint is refused
        self.last_draws: dict[int, int] = {}   # seq id -> the token it drew in the last step

    def fill_pending(self, items) -> None:
        """Replace each PENDING_TOKEN input of `items` (SeqStep or SeqWork: .seq_id, .token_ids) by
        the token its sequence drew in the last step; PendingTokenError if it drew none."""
        draws = self.last_draws
        for item in items:
            tokens = item.token_ids
            if tokens and tokens[0] == PENDING_TOKEN:
                token = draws.get(item.seq_id)
                if token is None or len(tokens) != 1:
                    raise PendingTokenError(f"seq {item.seq_id}: its input is the token it drew in the last "
                                            "step, but it drew none there" if token is None else
                                            f"seq {item.seq_id}: a pending token must be the step's only one")
                item.token_ids = [token]

    def execute(self, steps: list[SeqStep], samples: list[list[SampleRequest]],
                prompt_logprobs: dict | None = None) -> list[SampleResult]:
        """samples[i] are the draws wanted from steps[i]'s last logits (empty: none wanted);
        prompt logprobs of the steps that ask go into the prompt_logprobs dict given."""
        try:
            self.fill_pending(steps)
        finally:
            self.last_draws = {}    # a failed step leaves no draws to take
        for step, wanted in zip(steps, samples):
            step.wants_logits = bool(wanted)
        reqs = [r for wanted in samples for r in wanted]
        draw = [j for j, r in enumerate(reqs) if not r.beam_candidates]
        # The grammar masks of this step's guided rows fill while the forward pass runs.
        masks = self._start_masks([reqs[j] for j in draw])
        try:
            logits = self.runner.execute(steps, prompt_logprobs=prompt_logprobs)   # [R, vocab], one row per wanting step
        finally:
            allowed, waiting = (None, ()) if masks is None else _split(masks.result())
        rows = [i for i, wanted in enumerate(samples) if wanted for _ in wanted]
        if not reqs:
            return []
        row_of = {}
        for n, i in enumerate(i for i, wanted in enumerate(samples) if wanted):
            row_of[i] = n
        expanded = logits[torch.tensor([row_of[i] for i in rows], dtype=torch.long)]   # [N, vocab]
        results = [SampleResult(r.seq_id) for r in reqs]
        beam = [j for j, r in enumerate(reqs) if r.beam_candidates]
        if beam:
            k = max(reqs[j].beam_candidates for j in beam)
            values, ids = top_logprobs(expanded[beam], k)
            for j, vals, toks in zip(beam, values.tolist(), ids.tolist()):
                n = reqs[j].beam_candidates
                results[j].candidates = list(zip(toks[:n], vals[:n]))
        if draw:
            sampling_rows = [SamplingRow(reqs[j].params, reqs[j].prompt_token_ids,
                                         reqs[j].output_token_ids, reqs[j].seq_index) for j in draw]
            out = sample(expanded[draw], sampling_rows, self.eos_token_ids, self.generator, allowed)
            if allowed is not None:
                self.guides.advance([reqs[j] for j in draw], out.token_ids)
            for n, j in enumerate(draw):
                results[j].token_id = out.token_ids[n]
                results[j].logprob = out.logprobs[n]
                results[j].top_logprobs = out.top_logprobs[n]
            for n in waiting:          # drawn only to keep the batch whole: not a token
                results[draw[n]].token_id = WAITS_FOR_GRAMMAR
            self.last_draws = {r.seq_id: r.token_id for r in results if r.token_id >= 0}
        return results

    def _start_masks(self, reqs: list[SampleRequest]):
        if self.guides is None:
            if any(r.params.structured_outputs is not None for r in reqs):
                raise ValueError("this worker serves no structured outputs")
            return None
        return self.guides.start_masks(reqs)


def _split(masks: tuple) -> tuple:
    """(rows, bitmask, rows that wait) -> ((rows, bitmask) for the sampler, rows that wait)."""
    rows, bitmask, waiting = masks
    return (rows, bitmask), waiting
