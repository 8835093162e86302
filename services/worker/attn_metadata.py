"""What one forward step needs to find each token's K/V slots: built by the model runner."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [T] int64: where each new token's K/V is written (-1: padding)
    block_tables: torch.Tensor     # [S, max_blocks] int32: logical -> physical block per sequence
    seq_lens: torch.Tensor         # [S] int32: KV length of each sequence after this step
    query_start_loc: torch.Tensor  # [S+1] int32: cumulative new-token counts (ragged batch)
    max_query_len: int             # 1: a decode step (the decode kernel; a graph may serve it)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1
