"""What a worker remembers between steps, and how it turns an ExecuteStep into WorkerCore inputs.

The scheduler sends only deltas (services.protocol.ExecuteStep): block-table changes, freed tables,
sampling params once per request. StepInputs owns the resulting per-sequence block tables and the
constructed SamplingParams objects, and builds the SeqStep / SampleRequest lists of one step.
Every tensor-parallel rank keeps its own copy and applies the same deltas, so every rank builds the
same step (and fails the same way, before any collective, on a bad one).

Every id that becomes an index is checked against what this worker has: a block id outside the
pool (a negative one would wrap around and write another sequence's blocks; on a GPU any of them is
an illegal memory access), a token id outside the vocabulary, a negative position, a sample whose
output count would allocate without bound. Such a step is a StepError, never a corrupted pool.
"""
from __future__ import annotations

from pagedserve.services.protocol import PENDING_TOKEN, ExecuteStep
from pagedserve.services.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedserve.services.worker.model_runner import SeqStep
from pagedserve.services.worker.worker_core import SampleRequest


_PENDING = [PENDING_TOKEN]


class StepError(ValueError):
    """The step refers to something this worker does not have (an unknown table, params key, ...)."""


MAX_OUTPUT_TOKENS = 1 << 24   # a sample's num_output_tokens beyond any context


class StepInputs:
    def __init__(self, num_blocks: int | None = None, vocab_size: int | None = None):
        self.tables: dict[int, list[int]] = {}          # seq_id -> physical block ids
        self.params: dict[str, SamplingParams] = {}     # params_key -> constructed params
        self.num_blocks, self.vocab_size = num_blocks, vocab_size   # None: not checked (unit tests)

    def apply_deltas(self, msg: ExecuteStep) -> dict[str, SamplingParams]:
        """Freed tables first, then table updates (a seq freed and re-admitted in one step gets its
        new table), then new params. Checked before anything changes: a bad delta changes nothing."""
        updates = []
        for seq_id, update in msg.table_updates.items():
            if type(seq_id) is not int or not isinstance(update, list) or not update \
                    or not all(type(b) is int for b in update):
                raise StepError(f"table_updates[{seq_id!r}] must be [start, *block ids]")
            start, blocks = update[0], update[1:]
            if blocks and self.num_blocks is not None and not 0 <= min(blocks) <= max(blocks) < self.num_blocks:
                raise StepError(f"table_updates[{seq_id}]: block ids must be in [0, {self.num_blocks})")
            have = 0 if seq_id in msg.freed else len(self.tables.get(seq_id, ()))
            if not 0 <= start <= have:
                raise StepError(f"table_updates[{seq_id}] starts at {start}, the table has {have} blocks")
            updates.append((seq_id, start, blocks))
        built = {}
        for key, data in msg.new_params.items():
            try:
                built[key] = SamplingParams.from_dict(data)   # validates
            except (TypeError, ValueError) as e:
                raise StepError(f"new_params[{key!r}]: {e}") from None
        for seq_id in msg.freed:
            self.tables.pop(seq_id, None)
        for seq_id, start, blocks in updates:
            table = self.tables.setdefault(seq_id, [])
            del table[start:]
            table.extend(blocks)
        self.params.update(built)
        return built

    def drop_params(self, msg: ExecuteStep) -> None:
        """After the step: a request may finish and be dropped in the same message that samples it."""
        for key in msg.dropped_params:
            self.params.pop(key, None)

    def build(self, msg: ExecuteStep) -> tuple[list[SeqStep], list[list[SampleRequest]]]:
        steps: list[SeqStep] = []
        samples: list[list[SampleRequest]] = []
        for work in msg.seqs:
            table = self.tables.get(work.seq_id)
            if table is None:
                raise StepError(f"seq {work.seq_id} has no block table on this worker")
            if not work.token_ids:
                raise StepError(f"seq {work.seq_id} has no tokens to compute")
            # [PENDING_TOKEN]: the sequence's draw of the step before (WorkerCore.fill_pending).
            pending = work.token_ids == _PENDING
            if not (pending or self._tokens_ok(work.token_ids)) or work.start_pos < 0:
                raise StepError(f"seq {work.seq_id}: token ids must be in [0, {self.vocab_size}) and "
                                f"start_pos >= 0")
            step = SeqStep(work.seq_id, work.token_ids, work.start_pos, table)
            wanted = msg.prompt_logprobs.get(work.seq_id) if msg.prompt_logprobs else None
            if wanted is not None:
                if not (isinstance(wanted, list) and len(wanted) == 2 and all(type(v) is int for v in wanted)
                        and 0 <= wanted[0] <= MAX_LOGPROBS and wanted[1] >= -1):
                    raise StepError(f"prompt_logprobs[{work.seq_id}] must be [k in 0..{MAX_LOGPROBS}, next token "
                                    f"or -1], got {wanted!r}")
                step.prompt_logprobs, step.next_token = wanted
            steps.append(step)
            samples.append([self._sample_request(s, work.seq_id, msg.histories) for s in work.samples])
        return steps, samples

    def _sample_request(self, sample: list, work_seq_id: int, histories: dict) -> SampleRequest:
        if not isinstance(sample, list) or len(sample) != 5:
            raise StepError(f"seq {work_seq_id}: a sample must be [seq_id, params_key, seq_index, "
                            f"beam_candidates, num_output_tokens], got {sample!r}")
        seq_id, key, seq_index, beam_candidates, num_output = sample
        if not all(type(v) is int and v >= 0 for v in (seq_index, beam_candidates, num_output)) \
                or num_output > MAX_OUTPUT_TOKENS or not isinstance(key, str):
            raise StepError(f"seq {work_seq_id}: a sample's key must be a string and its indices and "
                            f"counts ints in [0, {MAX_OUTPUT_TOKENS}], got {sample!r}")
        params = self.params.get(key)
        if params is None:
            raise StepError(f"seq {seq_id}: unknown params key {key!r} (its new_params never arrived)")
        history = histories.get(seq_id, histories.get(work_seq_id))
        if history is not None:
            if not (isinstance(history, list) and len(history) == 2
                    and all(isinstance(h, list) and self._tokens_ok(h) for h in history)):
                raise StepError(f"seq {seq_id}: a history must be [prompt ids, output ids] of token ids")
            prompt_ids, output_ids = history
        elif params.uses_penalties:
            raise StepError(f"seq {seq_id}: its params use penalties but the step carries no history")
        else:
            # Without penalties the sampler reads only len(output_token_ids) (min_tokens, and the
            # per-row seed of seeded sampling) and never the prompt: a list of the right length
            # stands in for the real tokens, which the scheduler does not send every step.
            prompt_ids, output_ids = [], [0] * num_output
        return SampleRequest(seq_id, params, prompt_ids, output_ids, seq_index, beam_candidates, key,
                             history is not None)

    def _tokens_ok(self, ids: list) -> bool:
        if not all(type(t) is int for t in ids):
            return False
        return not ids or self.vocab_size is None or 0 <= min(ids) <= max(ids) < self.vocab_size

