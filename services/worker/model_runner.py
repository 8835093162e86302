"""The worker's compute core: turns one scheduled step into tensors, runs the model, returns logits.

Owns the model weights and the worker's views of the device KV pool; never allocates blocks (the
kvstore does) and reads nothing but the step it is given. No I/O: the worker process wraps it.
"""
from __future__ import annotations

import heapq
from types import SimpleNamespace

import numpy as np
import torch

from pagedserve.services.steps import SeqStep  # noqa: F401  (re-exported: the worker's callers import it here)
from pagedserve.services.worker.attn_metadata import AttentionMetadata
from pagedserve.services.worker.cuda_graphs import DecodeGraphs, StepShape
from pagedserve.services.worker.model_loader import ModelSpec


PROMPT_LOGPROB_ROWS = 128   # prompt positions scored per lm_head call
PAD_ROW = 0                 # the block-table row of padded tokens: blocks -1, nothing read or written


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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, spec: ModelSpec, pool_blocks: torch.Tensor,
                 block_size: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 tp_size: int = 1, max_num_batched_tokens: int = 2048, max_model_len: int | None = None):
        """max_num_batched_tokens (the scheduler's) sizes the step buffers: tokens, and sequences
        too, each of which has a token in the step (the scheduler's max_num_seqs counts requests, and
        a request's n samples or beams are sequences each); max_model_len (default the model's) sets
        the block table's width."""
        self.model = model
        self.spec = spec
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_caches = kv_cache_views(pool_blocks, spec, block_size, dtype, tp_size)
        self.graphs = DecodeGraphs()   # none until capture_graphs: every step eager
        self._init_step_buffers(max_num_batched_tokens, max_num_batched_tokens,
                                cdiv(max_model_len or spec.max_model_len, block_size) + 1)

    # ---- the step's inputs: persistent buffers, one copy to the device per step ----------------

    def _init_step_buffers(self, max_seqs: int, max_tokens: int, width: int) -> None:
        """One host buffer (pinned on CUDA) holds every input of a step at fixed offsets; its device
        twin takes it in one copy (on CPU the host buffer is the device's). Fields, int64: ids,
        positions, table row of each token [T]; logits rows, table row of each sequence [S]; int32:
        seq lens [S], query starts [S+1], block table [S+1, width]. A sequence keeps its table row
        while it is in every step, and the row is rewritten only when its table changed. Row 0 is
        the padding row of decode graphs (cuda_graphs.py): its blocks are -1, so a padded token's
        slot is negative (written nowhere) and, with length 0, nothing is read through it."""
        S, T, W = max_seqs, max_tokens, width
        self.max_seqs, self.max_tokens, self.max_blocks = S, T, W
        self.n64 = 3 * T + 2 * S
        self.table_offset = 8 * self.n64 + 4 * (2 * S + 1)          # bytes before the block table
        nbytes = self.table_offset + 4 * (S + 1) * W
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.h = self._fields(self.host, numpy=True)
        self.h.table[PAD_ROW] = -1
        self.dev = self.host.to(self.device) if cuda else self.host
        self.d = self._fields(self.dev)
        self.copied = torch.cuda.Event() if cuda else None   # the last copy out of self.host
        self.row_of: dict[int, int] = {}                     # seq id -> its table row
        self.free_rows = list(range(1, S + 1))               # a heap: rows in use stay low
        self.written: list[list[int]] = [[] for _ in range(S + 1)]   # each row's table as last written

    def _fields(self, buf: torch.Tensor, numpy: bool = False) -> SimpleNamespace:
        S, T = self.max_seqs, self.max_tokens
        i64 = buf[:8 * self.n64].view(torch.int64)
        i32 = buf[8 * self.n64:].view(torch.int32)
        f = SimpleNamespace(ids=i64[:T], positions=i64[T:2 * T], token_rows=i64[2 * T:3 * T],
                            logits=i64[3 * T:3 * T + S], rows=i64[3 * T + S:],
                            seq_lens=i32[:S], qsl=i32[S:2 * S + 1],
                            table=i32[2 * S + 1:].view(S + 1, self.max_blocks))
        return SimpleNamespace(**{k: v.numpy() for k, v in vars(f).items()}) if numpy else f

    def _row(self, s: SeqStep) -> int:
        """The sequence's table row, its table written there if it changed since the last step."""
        row = self.row_of.get(s.seq_id)
        if row is None:
            row = self.row_of[s.seq_id] = heapq.heappop(self.free_rows)
        old, table = self.written[row], s.block_table
        if old != table:   # equal lists share their int objects: a pointer compare per entry
            if len(table) > self.max_blocks:
                raise ValueError(f"seq {s.seq_id}: block table has {len(table)} blocks, the runner "
                                 f"holds {self.max_blocks} (max_model_len)")
            self.h.table[row, :len(table)] = table
            self.h.table[row, len(table):len(old)] = 0
            self.written[row] = list(table)
        return row

    def fill(self, steps: list[SeqStep]) -> StepShape:
        """Flatten the ragged batch into the step buffers and start their copy to the device.

        A decode step (one token per sequence) that a captured graph serves is padded to the
        graph's batch: spare rows of length 0 whose token goes to no slot."""
        B, h = self.block_size, self.h
        S = len(steps)
        if S > self.max_seqs:
            raise ValueError(f"{S} sequences in a step, the runner holds {self.max_seqs} "
                             f"(max_num_batched_tokens)")
        present = {s.seq_id for s in steps}
        for seq_id in [i for i in self.row_of if i not in present]:   # gone or paused: row freed
            heapq.heappush(self.free_rows, self.row_of.pop(seq_id))
        if self.copied is not None:
            self.copied.synchronize()   # the last step's copy has left the host buffer
        ids: list[int] = []
        starts, q_lens, rows, wants = [], [], [], []
        for s in steps:
            n = len(s.token_ids)
            if len(s.block_table) * B < s.start_pos + n:
                raise ValueError(f"seq {s.seq_id}: block table covers {len(s.block_table) * B} slots, "
                                 f"step needs {s.start_pos + n}")
            rows.append(self._row(s))
            ids += s.token_ids
            starts.append(s.start_pos)
            q_lens.append(n)
            wants.append(s.wants_logits)
        T = len(ids)
        if T > self.max_tokens:
            raise ValueError(f"{T} tokens in a step, the runner holds {self.max_tokens} "
                             f"(max_num_batched_tokens)")
        max_query_len = max(q_lens)
        graph = self.graphs.find(S) if max_query_len == 1 else None
        return self._write(ids, starts, q_lens, rows, wants, graph or S, graph)

    def fill_padding(self, num_seqs: int) -> StepShape:
        """A decode step of padding rows only: what a graph is captured on (it writes nowhere)."""
        return self._write([], [], [], [], [], num_seqs, num_seqs)

    def _write(self, ids: list[int], starts: list[int], q_lens: list[int], rows: list[int],
               wants: list[bool], n: int, graph: int | None) -> StepShape:
        """The host buffers for a step of these sequences, padded to n rows of one token each."""
        h, S, T = self.h, len(rows), len(ids)
        pad = n - S
        q_lens_np, starts_np = np.array(q_lens + [1] * pad), np.array(starts + [0] * pad)
        qsl = h.qsl[:n + 1]
        np.cumsum(q_lens_np, out=qsl[1:])
        h.seq_lens[:n] = starts_np + q_lens_np
        h.seq_lens[S:n] = 0
        h.ids[:T] = ids
        h.ids[T:T + pad] = 0
        h.positions[:T + pad] = np.arange(T + pad) + np.repeat(starts_np - qsl[:-1], q_lens_np)
        h.token_rows[:T + pad] = np.repeat(rows + [PAD_ROW] * pad, q_lens_np)
        h.rows[:n] = rows + [PAD_ROW] * pad
        R = sum(wants)
        h.logits[:R] = qsl[1:S + 1][np.array(wants, dtype=bool)] - 1
        if self.copied is not None:   # up to the last table row in use
            end = self.table_offset + 4 * self.max_blocks * (max(rows, default=PAD_ROW) + 1)
            self.dev[:end].copy_(self.host[:end], non_blocking=True)
            self.copied.record()
        return StepShape(T + pad, n, max(q_lens, default=1), R, graph)

    def inputs(self, shape: StepShape):
        """The device's view of the filled buffers -> ids/positions [T] and the metadata: slot
        mapping [T] (computed on the device from positions and the table), block tables
        [S, max_blocks], seq lens [S], query starts [S+1]. Only device ops: a graph captures them."""
        T, S, B, d = shape.num_tokens, shape.num_seqs, self.block_size, self.d
        positions = d.positions[:T]
        slot_mapping = (d.table.view(-1)[d.token_rows[:T] * self.max_blocks + positions // B] * B
                        + positions % B)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=d.table.index_select(0, d.rows[:S]),
            seq_lens=d.seq_lens[:S],
            query_start_loc=d.qsl[:S + 1],
            max_query_len=shape.max_query_len,
        )
        return d.ids[:T], positions, meta

    def prepare(self, steps: list[SeqStep]):
        """fill + inputs, and the logits rows [R]: the step's tensors, views of the buffers valid
        until the next step."""
        shape = self.fill(steps)
        return (*self.inputs(shape), self.d.logits[:shape.num_logits])

    def forward(self, shape: StepShape) -> torch.Tensor:
        """The model on the filled buffers -> hidden [T, hidden]: the function a decode graph captures."""
        ids, positions, meta = self.inputs(shape)
        return self.model(ids, positions, self.kv_caches, meta)

    def capture_graphs(self, max_num_seqs: int, capture) -> dict:
        """Capture the decode graphs (CudaGraphs.capture says how) for up to max_num_seqs sequences
        (the scheduler's --max-num-seqs) -> what it cost, for the log and the pool sizing."""
        return self.graphs.capture(self, max_num_seqs, capture)

    @torch.inference_mode()
    def execute(self, steps: list[SeqStep], compute_logits: bool = True,
                prompt_logprobs: dict | None = None, device_ids: tuple | None = None) -> torch.Tensor | None:
        """Run one step; logits [R, vocab] float32 for the steps with wants_logits, in order.

        device_ids: (token indices [P], ids [P]), both on the device: those tokens' ids, which the
        host does not have yet (a step planned ahead takes the last step's draw, still on the device).

        Steps with prompt_logprobs >= 0 also put {seq_id: [start_pos, entries]} in the
        prompt_logprobs dict given (see prompt_logprob_entries).
        compute_logits=False (tensor-parallel ranks > 0, which do not sample) only writes the KV
        cache and takes part in the collectives; it returns None."""
        shape = self.fill(steps)
        if device_ids is not None:   # queued after fill's copy of the host buffer: it overwrites it
            self.d.ids.index_copy_(0, *device_ids)
        hidden = self.graphs.replay(shape) if shape.graph else self.forward(shape)   # [T, hidden]
        if not compute_logits:
            return None
        if prompt_logprobs is not None:
            start = 0
            for s in steps:
                if s.prompt_logprobs >= 0:
                    prompt_logprobs[s.seq_id] = [s.start_pos, self.prompt_logprob_entries(
                        hidden[start:start + len(s.token_ids)], s)]
                start += len(s.token_ids)
        return self.model.compute_logits(hidden[self.d.logits[:shape.num_logits]])

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
        """Drop the graphs and the views of the pool (before the pool's mapping is closed: touching
        them would segfault)."""
        self.graphs = DecodeGraphs()
        self.kv_caches = []
