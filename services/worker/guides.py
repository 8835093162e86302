"""The worker's structured-output state: one grammar matcher per guided sequence, and each step's
allowed-token bitmask. Owned by WorkerCore (rank 0, which samples); no I/O.

- Constraints compile on the cache's thread (services/guided/cache.py) from the moment their params
  arrive (`prepare`), so a new schema's compile overlaps the forward pass of the step that first
  samples it; a constraint compiled before (by its hash) costs nothing. A step never waits for a
  compile past its forward pass (and GRACE_S of the compile's own start): a row whose grammar is
  not ready is not drawn (protocol.WAITS_FOR_GRAMMAR) and its request waits for a later step, while
  the others go on. A step that waited on a 100,000-value enum's compile (44 s) sent no heartbeat
  tick and the supervisor restarted the worker, failing every running request. A compile still
  running after the cache's deadline holds its rows to EOS, as one that failed.
- `start_masks` fills the step's bitmask on a thread of its own while the forward pass runs (the
  matchers already hold every token sampled so far) and returns StepMasks of (rows, bitmask): one
  int32 [G, ceil(V/32)] tensor for the G guided rows only; unguided rows pay nothing.
- A matcher is made when its sequence first samples (each of a request's n samples gets its own,
  from the same compiled grammar), advances with each token sampled for it (`advance`), and lives
  until its request's params are dropped: a sequence swapped out and back in keeps it, and so does
  one recomputed (its seq id and params key stay). Should its count of consumed tokens ever differ
  from the sequence's output length (a worker that lost it), it is rebuilt from the tokens when the
  step carries them (the scheduler sends them with a recompute's prefill) and the row is held to EOS
  otherwise, so that the output never breaks the grammar.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from pagedserve.services.guided.backends import GrammarError, bitmask_width, make_backend
from pagedserve.services.guided.cache import CompileCache
from pagedserve.services.log_limit import LimitedLog
from pagedserve.services.steps import SampleRequest

log = logging.getLogger("pagedserve.worker")
warn = LimitedLog(log)        # these repeat per token or per sequence: at most one a kind per 10 s

# A compile that started less than this ago may hold the step past its forward pass: a small
# schema (4-16 ms) is then drawn in the step whose params brought it, not one step later.
GRACE_S = 0.1
POLL_S = 0.005


@dataclass
class _Guided:
    backend: object
    matcher: object | None     # None: its constraint did not compile (held to EOS)
    consumed: int              # output tokens the matcher has accepted
    key: str                   # the params key (the request) it belongs to


class Guides:
    def __init__(self, load_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], **cache_bounds):
        """load_tokenizer() -> the model's Hugging Face tokenizer, called once, when the first
        constraint arrives (a worker that never sees one never loads it); cache_bounds go to
        CompileCache (capacity, max_bytes, limits)."""
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.width = bitmask_width(vocab_size)
        tokenizer = []

        def factory(name):
            if not tokenizer:
                tokenizer.append(load_tokenizer())
            return make_backend(name, tokenizer[0], vocab_size, self.eos_token_ids)

        self.cache = CompileCache(factory, **cache_bounds)
        self.seqs: dict[int, _Guided] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self.mask_seconds = 0.0       # spent filling masks (on the mask thread, beside the forward)
        self.mask_rows = 0

    def prepare(self, constraint: dict) -> None:
        """New params carry this constraint: start compiling it now."""
        self.cache.submit(constraint)

    def start_masks(self, reqs: list[SampleRequest]) -> "StepMasks | None":
        """The bitmask of the guided rows among reqs (one row per req), computed on the mask thread;
        its result() (called once the forward is done) is (rows, bitmask, rows that wait)."""
        rows = [j for j, r in enumerate(reqs) if r.params.structured_outputs is not None]
        if not rows:
            return None
        return StepMasks(self._pool, self._masks, [reqs[j] for j in rows], rows)

    def advance(self, reqs: list[SampleRequest], token_ids: list[int]) -> None:
        """Each guided row's matcher takes the token sampled for it."""
        for r, t in zip(reqs, token_ids):
            g = self.seqs.get(r.seq_id) if r.params.structured_outputs is not None else None
            if g is None:
                continue
            g.consumed += 1
            if g.matcher is not None and not g.backend.accept(g.matcher, t):
                # Only a token the mask allowed can be sampled; this would be an engine bug.
                warn.warning("refused", "seq %d: the grammar refused sampled token %d", r.seq_id, t)

    def forget(self, keys) -> None:
        """Drop the matchers of these requests (by params key): they finished or were aborted."""
        keys = set(keys)
        if keys:
            for sid in [sid for sid, g in self.seqs.items() if g.key in keys]:
                del self.seqs[sid]

    def forget_seqs(self, seq_ids) -> None:
        for sid in seq_ids:
            self.seqs.pop(sid, None)

    def stats(self) -> dict:
        return {"guided_seqs": len(self.seqs), "grammar_mask_s": self.mask_seconds, "grammar_mask_rows": self.mask_rows,
                "grammar_compiled": len(self.cache), "grammar_cache_bytes": self.cache.bytes,
                "grammar_cache_hits": self.cache.hits,
                "grammar_cache_misses": self.cache.misses}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.cache.close()

    # ---- on the mask thread ------------------------------------------------------------------
    def _masks(self, reqs: list[SampleRequest], rows: list[int], forward_done: threading.Event
               ) -> tuple[list[int], torch.Tensor, list[int]]:
        start = time.perf_counter()
        bitmask = torch.zeros(len(reqs), self.width, dtype=torch.int32)   # [G, ceil(V/32)]
        by_backend: dict[int, tuple] = {}
        waiting = []
        for i, r in enumerate(reqs):
            g = self._matcher(r, forward_done)
            if g is None:                  # its grammar compiles: not drawn (EOS keeps the row samplable)
                waiting.append(rows[i])
                self._allow_eos(bitmask, i)
                continue
            if g.matcher is None or g.backend.is_finished(g.matcher):
                self._allow_eos(bitmask, i)
                continue
            entry = by_backend.setdefault(id(g.backend), (g.backend, [], []))
            entry[1].append(g.matcher)
            entry[2].append(i)
        for backend, matchers, idx in by_backend.values():
            backend.fill(matchers, bitmask, idx)
        self._end_dead_rows(reqs, bitmask, [i for _, _, idx in by_backend.values() for i in idx])
        self.mask_seconds += time.perf_counter() - start
        self.mask_rows += len(reqs)
        return rows, bitmask, waiting

    def _ready(self, c: dict, forward_done: threading.Event) -> Future | None:
        """The constraint's compile, once done; None when the step should not wait for it."""
        fut = self.cache.submit(c)
        since = time.monotonic() - self.cache.compiling_for(c)   # read once: an entry may be evicted meanwhile
        while not fut.done():
            if forward_done.is_set() and time.monotonic() - since >= GRACE_S:
                return None
            wait([fut], POLL_S)
        return fut

    def _matcher(self, r: SampleRequest, forward_done: threading.Event) -> _Guided | None:
        g = self.seqs.get(r.seq_id)
        num_output = len(r.output_token_ids)
        if g is not None and g.consumed == num_output:
            return g
        c = r.params.structured_outputs
        backend = self.cache.backend(c["backend"])
        try:
            fut = self._ready(c, forward_done)
            if fut is None:
                if self.cache.compiling_for(c) <= self.cache.limits.compile_timeout_s:
                    self.seqs.pop(r.seq_id, None)   # a stale state must not take this row's draw
                    return None
                raise GrammarError(f"the {c['kind']} constraint did not compile within "
                                   f"{self.cache.limits.compile_timeout_s:g} s")
            compiled = fut.result()
        except GrammarError as e:   # the router compiles first: only a direct client gets here
            warn.warning("no grammar", "seq %d: %s; its output is held to EOS", r.seq_id, e)
            g = self.seqs[r.seq_id] = _Guided(backend, None, num_output, r.params_key)
            return g
        matcher = backend.matcher(compiled)
        if num_output and not r.has_history:
            warn.warning("lost", "seq %d: its grammar state is lost and the step has no tokens to rebuild it "
                         "from; its output is held to EOS", r.seq_id)
            matcher = None
        elif num_output:   # rebuilt from the tokens (a recompute, or a worker that lost the state)
            for t in r.output_token_ids:
                if not backend.accept(matcher, t):
                    warn.warning("off grammar", "seq %d: its tokens do not follow its grammar; held to EOS", r.seq_id)
                    matcher = None
                    break
        g = self.seqs[r.seq_id] = _Guided(backend, matcher, num_output, r.params_key)
        return g

    def _end_dead_rows(self, reqs: list[SampleRequest], bitmask: torch.Tensor, filled: list[int]) -> None:
        """A row whose grammar allows no token at all (a dead end: `root ::= "a" x`, `x ::= x "b"`)
        is held to EOS. Sampled from a mask of nothing, it drew a token the grammar refused, every
        step until max_tokens, and each was counted as output (issue 28, finding 8)."""
        if not filled:
            return
        idx = torch.tensor(filled, dtype=torch.long)
        for i in idx[(bitmask[idx] == 0).all(dim=1)].tolist():
            warn.warning("dead end", "seq %d: its grammar allows no next token; its output is held to EOS",
                         reqs[i].seq_id)
            self.seqs[reqs[i].seq_id].matcher = None
            self._allow_eos(bitmask, i)

    def _allow_eos(self, bitmask: torch.Tensor, row: int) -> None:
        for t in self.eos_token_ids:
            if t < self.vocab_size:
                bitmask[row, t // 32] |= _bit(t % 32)


class StepMasks:
    """One step's masks, filling on the mask thread while the forward runs. result() says the
    forward is done: from then on the mask thread waits for no compile older than GRACE_S."""

    def __init__(self, pool: ThreadPoolExecutor, fill, reqs: list[SampleRequest], rows: list[int]):
        self._forward_done = threading.Event()
        self._future = pool.submit(fill, reqs, rows, self._forward_done)

    def result(self) -> tuple[list[int], torch.Tensor, list[int]]:
        self._forward_done.set()
        return self._future.result()


def _bit(i: int) -> int:
    # int32 bitmask: bit 31 is the sign bit.
    return (1 << i) if i < 31 else -(1 << 31)
