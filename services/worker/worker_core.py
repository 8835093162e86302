"""The worker's I/O-free core: run a scheduled step on the model and sample from its logits.

Owns nothing but what ModelRunner owns (weights, its views of the device pool), the sampler's
generator, and its last step's draw, still on the device: a step planned ahead (async scheduling)
gives a sequence PENDING_TOKEN as its input, the token that sequence drew in the step before.
`execute` is `launch` then `finish`: the worker process launches the next step, when it is already
waiting, before it finishes this one (on a GPU nothing in between waits for the device), and the
offline engine calls `execute`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.services.protocol import PENDING_TOKEN, WAITS_FOR_GRAMMAR
from pagedserve.services.steps import SampleRequest, SampleResult  # noqa: F401  (re-exported)
from pagedserve.services.worker.model_runner import ModelRunner, SeqStep
from pagedserve.services.worker.guides import Guides
from pagedserve.services.worker.sampler import Draw, SamplingRow, sample_on_device, to_device, top_logprobs


class PendingTokenError(ValueError):
    """A step's input is a sequence's last draw, but that sequence drew nothing in the last step."""


@dataclass
class Launched:
    """A step whose forward and draw are queued (on a GPU, perhaps still running)."""
    reqs: list[SampleRequest]
    results: list[SampleResult]
    draw_rows: list[int]              # indices into reqs of the rows sampled
    draw: Draw | None
    allowed: tuple | None             # the grammar rows and bitmask the draw obeyed
    waiting: tuple                    # indices into draw_rows: rows whose grammar still compiles


class WorkerCore:
    def __init__(self, runner: ModelRunner, eos_token_ids: tuple[int, ...], seed: int = 0,
                 guides: Guides | None = None):
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator().manual_seed(seed)
        self.guides = guides      # structured outputs; None: a request with a constraint is refused
        # The last launched step's draw: token ids [N] on the device, and seq id -> its index there.
        self.last_draw: tuple[torch.Tensor, dict[int, int]] | None = None

    def execute(self, steps: list[SeqStep], samples: list[list[SampleRequest]],
                prompt_logprobs: dict | None = None) -> list[SampleResult]:
        """samples[i] are the draws wanted from steps[i]'s last logits (empty: none wanted);
        prompt logprobs of the steps that ask go into the prompt_logprobs dict given."""
        return self.finish(self.launch(steps, samples, prompt_logprobs))

    def launch(self, steps: list[SeqStep], samples: list[list[SampleRequest]],
               prompt_logprobs: dict | None = None) -> Launched:
        """Queue the step's forward and draw; on a GPU, return without waiting for them (beam
        candidates and prompt logprobs excepted). A PENDING_TOKEN input takes its sequence's token
        from the last launched draw, on the device."""
        pending = [i for i, step in enumerate(steps) if step.token_ids and step.token_ids[0] == PENDING_TOKEN]
        try:
            device_ids = self._pending_ids(steps, pending)
        finally:
            self.last_draw = None    # a failed step leaves no draw to take
        for step, wanted in zip(steps, samples):
            step.wants_logits = bool(wanted)
        reqs = [r for wanted in samples for r in wanted]
        draw_rows = [j for j, r in enumerate(reqs) if not r.beam_candidates]
        # The grammar masks of this step's guided rows fill while the forward pass runs.
        masks = self._start_masks([reqs[j] for j in draw_rows])
        try:
            logits = self.runner.execute(steps, prompt_logprobs=prompt_logprobs,
                                         device_ids=device_ids)   # [R, vocab], one row per wanting step
        finally:
            allowed, waiting = (None, ()) if masks is None else _split(masks.result())
        results = [SampleResult(r.seq_id) for r in reqs]
        launched = Launched(reqs, results, draw_rows, None, allowed, waiting)
        if not reqs:
            return launched
        # One logits row per wanting step; a step with n samples (a fresh prompt) serves n rows.
        rows = [n for n, wanted in enumerate(w for w in samples if w) for _ in wanted]
        expanded = _rows(logits, rows)   # [N, vocab]
        beam = [j for j, r in enumerate(reqs) if r.beam_candidates]
        if beam:
            k = max(reqs[j].beam_candidates for j in beam)
            values, ids = top_logprobs(_rows(expanded, beam), k)
            for j, vals, toks in zip(beam, values.tolist(), ids.tolist()):
                n = reqs[j].beam_candidates
                results[j].candidates = list(zip(toks[:n], vals[:n]))
        if draw_rows:
            # A step planned ahead draws after the token its input is: one output more than the lists hold.
            drawn = [0] * len(reqs)
            if pending:
                first = [0]
                for wanted in samples:
                    first.append(first[-1] + len(wanted))
                for i in pending:
                    drawn[first[i]:first[i + 1]] = [1] * len(samples[i])
            sampling_rows = [SamplingRow(reqs[j].params, reqs[j].prompt_token_ids,
                                         reqs[j].output_token_ids, reqs[j].seq_index, drawn[j]) for j in draw_rows]
            launched.draw = sample_on_device(_rows(expanded, draw_rows), sampling_rows, self.eos_token_ids,
                                             self.generator, allowed)
            launched.draw.start_copy()
            skip = set(waiting)
            self.last_draw = (launched.draw.token_ids,
                              {reqs[j].seq_id: n for n, j in enumerate(draw_rows) if n not in skip})
        return launched

    def finish(self, launched: Launched) -> list[SampleResult]:
        """Wait for a launched step's draw -> its results (the grammars advance by its tokens)."""
        results, draw_rows = launched.results, launched.draw_rows
        if launched.draw is None:
            return results
        out = launched.draw.to_host()
        if launched.allowed is not None:
            self.guides.advance([launched.reqs[j] for j in draw_rows], out.token_ids)
        for n, j in enumerate(draw_rows):
            results[j].token_id = out.token_ids[n]
            results[j].logprob = out.logprobs[n]
            results[j].top_logprobs = out.top_logprobs[n]
        for n in launched.waiting:          # drawn only to keep the batch whole: not a token
            results[draw_rows[n]].token_id = WAITS_FOR_GRAMMAR
        return results

    def _pending_ids(self, steps: list[SeqStep], pending: list[int]) -> tuple | None:
        """(token indices [P], ids [P]) on the device for steps[i], i in pending, whose input is
        PENDING_TOKEN: taken from the last draw (their host input becomes 0, overwritten there)."""
        if not pending:
            return None
        starts = [0]
        for step in steps:
            starts.append(starts[-1] + len(step.token_ids))
        index, picks = [], []
        for i in pending:
            picks.append(self._drawn_at(steps[i]))
            steps[i].token_ids = [0]
            index.append(starts[i])
        drawn = self.last_draw[0]
        return to_device(index, torch.long, drawn.device), drawn.index_select(0, to_device(picks, torch.long, drawn.device))

    def fill_pending(self, items) -> None:
        """Host side, for the other tensor-parallel ranks' copy of a step: each PENDING_TOKEN input
        of `items` (SeqWork: .seq_id, .token_ids) becomes its sequence's last draw (waits for it)."""
        tokens = self.last_draw[0].tolist() if self.last_draw is not None else []
        for item in items:
            if item.token_ids and item.token_ids[0] == PENDING_TOKEN:
                item.token_ids = [tokens[self._drawn_at(item)]]

    def _drawn_at(self, item) -> int:
        """Where the last draw holds the token of item (a step whose input is PENDING_TOKEN)."""
        n = self.last_draw[1].get(item.seq_id) if self.last_draw is not None else None
        if n is None:
            raise PendingTokenError(f"seq {item.seq_id}: its input is the token it drew in the last step, "
                                    "but it drew none there")
        if len(item.token_ids) != 1:
            raise PendingTokenError(f"seq {item.seq_id}: a pending token must be the step's only one")
        return n

    def _start_masks(self, reqs: list[SampleRequest]):
        if self.guides is None:
            if any(r.params.structured_outputs is not None for r in reqs):
                raise ValueError("this worker serves no structured outputs")
            return None
        return self.guides.start_masks(reqs)


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows]: t itself when rows are all of its rows in order (a decode step), else a gather
    whose index reaches the device without a sync."""
    if len(rows) == t.shape[0] and rows == list(range(len(rows))):
        return t
    return t.index_select(0, to_device(rows, torch.long, t.device))


def _split(masks: tuple) -> tuple:
    """(rows, bitmask, rows that wait) -> ((rows, bitmask) for the sampler, rows that wait)."""
    rows, bitmask, waiting = masks
    return (rows, bitmask), waiting
