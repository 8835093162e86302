"""A single-process greedy decoder over the block store and a paged model.

The simplest correct loop: admit every prompt, prefill them in one step, then decode all of them
together until each hits EOS or its token limit. The continuous-batching engine supersedes it for
serving; it stays as the plainest statement of what one step does and as the exactness baseline.
"""
from __future__ import annotations

from kvstore.store import BlockStore
from services.worker.model_runner import ModelRunner, SeqStep


def greedy_generate(runner: ModelRunner, store: BlockStore, prompts: list[list[int]], max_tokens: int,
                    eos_token_ids: tuple[int, ...] = (), max_model_len: int | None = None) -> list[list[int]]:
    """Greedy continuation of every prompt (token ids) -> generated ids per prompt."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for seq_id, prompt in enumerate(prompts):
        result = store.allocate(seq_id, prompt)
        if not result.ok:
            raise MemoryError(f"prompt {seq_id}: {result.reason}")
    active = list(range(len(prompts)))
    steps = [SeqStep(i, prompts[i], 0, store.block_table(i)) for i in active]
    try:
        while active:
            next_ids = runner.execute(steps).argmax(dim=-1).tolist()
            still = []
            for seq_id, token in zip(active, next_ids):
                store.mark_computed(seq_id, store.num_tokens(seq_id))
                out = outputs[seq_id]
                out.append(token)
                total = len(prompts[seq_id]) + len(out)
                done = (token in eos_token_ids or len(out) >= max_tokens
                        or (max_model_len is not None and total >= max_model_len))
                if not done:
                    still.append(seq_id)
            steps = []
            for seq_id in still:
                pos = store.num_tokens(seq_id)
                appended = store.append_slots(seq_id, [outputs[seq_id][-1]])
                if not appended.ok:
                    raise MemoryError(f"prompt {seq_id}: {appended.reason}")
                steps.append(SeqStep(seq_id, [outputs[seq_id][-1]], pos, store.block_table(seq_id)))
            active = still
    finally:
        for seq_id in range(len(prompts)):
            store.free(seq_id)
    return outputs
