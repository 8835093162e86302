"""The worker's compute core: turns one scheduled step into tensors, runs the model, returns logits.

Owns the model weights and the worker's views of the device KV pool; never allocates blocks (the
kvstore does) and reads nothing but the step it is given. No I/O: the worker process wraps it.
"""
from __future__ import annotations

import torch

from pagedserve.services.steps import SeqStep  # noqa: F401  (re-exported: the worker's callers import it here)
from pagedserve.services.worker.attn_metadata import AttentionMetadata
from pagedserve.services.worker.model_loader import ModelSpec


PROMPT_LOGPROB_ROWS = 128   # prompt positions scored per lm_head call


def kv_cache_views(pool_blocks: torch.Tensor, spec: ModelSpec, block_size: int, dtype: torch.dtype,
                   tp_size: int = 1):
    """uint8 [N, block_bytes] pool -> per layer (k_cache, v_cache), each [N, B, Hkv, D] (strided views).

    With tensor parallelism the pool is one rank's and Hkv is that rank's KV heads."""
    n = pool_blocks.shape[0]
    want = spec.block_bytes(block_size, dtype, tp_size)
    if pool_blocks.shape[1] != want:
        raise ValueError(f"pool blocks have {pool_blocks.shape[1]} bytes; this model needs {want} "
                         f"(block size {block_size}, {dtype}, tp_size {tp_size})")
    hkv = spec.kv_heads_per_rank(tp_size)
    kv = pool_blocks.view(dtype).view(n, spec.num_layers, 2, block_size, hkv, spec.head_dim)
    return [(kv[:, layer, 0], kv[:, layer, 1]) for layer in range(spec.num_layers)]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, spec: ModelSpec, pool_blocks: torch.Tensor,
                 block_size: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 tp_size: int = 1):
        self.model = model
        self.spec = spec
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_caches = kv_cache_views(pool_blocks, spec, block_size, dtype, tp_size)

    def prepare(self, steps: list[SeqStep]):
        """Flatten the ragged batch: ids/positions [T], slot mapping [T], block tables [S, max_blocks]."""
        B = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        logits_rows: list[int] = []
        max_blocks = max(len(s.block_table) for s in steps)
        tables = torch.zeros((len(steps), max_blocks), dtype=torch.int32)
        for i, s in enumerate(steps):
            n = len(s.token_ids)
            end = s.start_pos + n
            if len(s.block_table) * B < end:
                raise ValueError(f"seq {s.seq_id}: block table covers {len(s.block_table) * B} slots, "
                                 f"step needs {end}")
            ids.extend(s.token_ids)
            pos = range(s.start_pos, end)
            positions.extend(pos)
            slots.extend(s.block_table[p // B] * B + p % B for p in pos)
            seq_lens.append(end)
            qsl.append(qsl[-1] + n)
            tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
            if s.wants_logits:
                logits_rows.append(qsl[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=max(len(s.token_ids) for s in steps),
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta)

    @torch.inference_mode()
    def execute(self, steps: list[SeqStep], compute_logits: bool = True,
                prompt_logprobs: dict | None = None) -> torch.Tensor | None:
        """Run one step; logits [R, vocab] float32 for the steps with wants_logits, in order.

        Steps with prompt_logprobs >= 0 also put {seq_id: [start_pos, entries]} in the
        prompt_logprobs dict given (see prompt_logprob_entries).
        compute_logits=False (tensor-parallel ranks > 0, which do not sample) only writes the KV
        cache and takes part in the collectives; it returns None."""
        input_ids, positions, meta = self.prepare(steps)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)   # [T, hidden]
        if not compute_logits:
            return None
        if prompt_logprobs is not None:
            start = 0
            for s in steps:
                if s.prompt_logprobs >= 0:
                    prompt_logprobs[s.seq_id] = [s.start_pos, self.prompt_logprob_entries(
                        hidden[start:start + len(s.token_ids)], s)]
                start += len(s.token_ids)
        return self.model.compute_logits(hidden[meta.logits_indices])

    def prompt_logprob_entries(self, hidden: torch.Tensor, step: SeqStep) -> list[list]:
        """hidden [n, H] of the chunk's tokens -> per token that has a successor in the prompt,
        [raw logprob of that successor, its rank (1 = most likely), [[id, logprob] of the top-k]]."""
        targets = step.token_ids[1:] + ([step.next_token] if step.next_token >= 0 else [])
        out: list[list] = []
        # A few rows at a time: [rows, vocab] float32 temporaries, not [chunk, vocab] ones.
        for lo in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            rows = targets[lo:lo + PROMPT_LOGPROB_ROWS]
            logits = self.model.compute_logits(hidden[lo:lo + len(rows)]).float()             # [n, V]
            logprobs = torch.log_softmax(logits, dim=-1)
            picked = logprobs.gather(1, torch.tensor(rows, device=logprobs.device)[:, None])    # [n, 1]
            ranks = ((logprobs > picked).sum(dim=-1) + 1).tolist()
            picked = picked.squeeze(1).tolist()
            if step.prompt_logprobs == 0:
                out += [[lp, r, []] for lp, r in zip(picked, ranks)]
                continue
            values, ids = torch.topk(logprobs, step.prompt_logprobs, dim=-1)     # [n, k]
            out += [[lp, r, [list(p) for p in zip(i, v)]]
                    for lp, r, i, v in zip(picked, ranks, ids.tolist(), values.tolist())]
        return out

    def close(self) -> None:
        """Drop the views of the pool (before the pool's mapping is closed: touching them would segfault)."""
        self.kv_caches = []
