"""What BlockStore's mutating operations return: ok=False with a reason means nothing changed.

Their own module so that the op log (replay.py) and the scheduler read them without the store's
internals; store.py re-exports every name for the callers that import them from there."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AllocResult:
    ok: bool
    num_cached_tokens: int = 0
    reason: str = ""
    num_host_cached_tokens: int = 0   # of num_cached_tokens, those the host tier gave back


@dataclass
class AppendResult:
    ok: bool
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src_block, dst_block)
    reason: str = ""


@dataclass
class BatchAppendResult:
    ok: bool
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (seq_id, src_block, dst_block)
    reason: str = ""


@dataclass
class SwapResult:
    ok: bool
    # swap_out: (device_block, host_block); swap_in: (host_block, device_block); one per distinct block
    mapping: list[tuple[int, int]] = field(default_factory=list)
    reason: str = ""
