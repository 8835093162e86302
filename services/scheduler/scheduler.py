"""Scheduler core: iteration-level scheduling over the paged KV cache (no I/O, no wall clock).

Owns request and sequence state: the waiting, running and swapped queues, lengths, sampling
params, beam groups and stop checks on token ids. It never touches a block itself: every block
operation goes through the block store (in-process here, the kvstore service when served), which
answers with results, never exceptions, when memory is short.

Each step (`schedule`):
1. running requests in FCFS order get their next token (decode) or prefill chunk; when the store
   cannot grow them, the newest running request is preempted (all its sequences at once) by swap
   or recompute, and the scheduler asks again;
2. if nobody was preempted, swapped requests come back, oldest first;
3. if nobody was preempted and nothing is left swapped, waiting requests are admitted FCFS,
   reusing cached prefixes, within the token budget and the sequence cap; long prompts are
   prefilled in chunks. With request-level batching (FasterTransformer, the paper's baseline)
   admission opens only when nothing runs, and then takes every request that fits at once.
After the worker ran the step, `update` appends the sampled tokens, forks parallel samples and
beams, checks stops and frees what finished.

Async scheduling (`schedule_ahead`): the served scheduler plans step N+1 while the worker runs N,
when N+1 can be planned without N's tokens: every running sequence is drawing its next token in N,
and that token, unknown here, is its one input in N+1 (PENDING_TOKEN: the worker takes it from its
own last draw; its slot in the store holds the placeholder until `update` of N sets it). A
sequence whose N token ends it by length sits N+1 out; one that N's token stops (EOS, a stop token)
computed N+1 for nothing, and its result is dropped. A sequence in a step planned ahead keeps its
blocks until that step is updated: a block freed earlier could be handed, with a copy into it, to
a step that runs while the worker still writes it.
"""
from __future__ import annotations

import itertools
import operator
from collections import Counter, deque
from dataclasses import dataclass, field, fields
from typing import Callable, KeysView

from pagedserve.services import config_fields as cf
from pagedserve.services.sampling_params import SamplingParams, SamplingParamsError
from pagedserve.services.scheduler.beam_search import BeamSearch
from pagedserve.services.scheduler.kv_usage import KVUsageMeter
from pagedserve.services.scheduler.request import FINISHED, Request, RequestStatus, Sequence
from pagedserve.services.protocol import PENDING_TOKEN, WAITS_FOR_GRAMMAR
from pagedserve.services.steps import SampleRequest, SampleResult, SeqStep


@dataclass
class SchedulerConfig:
    # The defaults, choices and checks of the settings a user gives are their flags' (config_fields).
    max_num_seqs: int = cf.max_num_seqs()
    max_num_batched_tokens: int = cf.max_num_batched_tokens()
    max_model_len: int = 2048                   # the served context (the model's, or --max-model-len)
    preemption_mode: str = cf.preemption_mode()
    auto_swap_min_tokens: int = 256             # auto: recompute shorter single sequences, swap longer
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0                         # > 0: prompt token ids must be below it
    batching: str = cf.batching()
    kv_usage_interval_s: float = 0.05           # how often the KV usage split is sampled (clock s)

    @classmethod
    def of(cls, settings, **fixed) -> "SchedulerConfig":
        """The scheduler's part of a process's config (the scheduler service's, the offline
        engine's or the simulator's: each field of theirs with a name of ours), and the fields the
        caller decides itself (fixed=: what the model decides, max_model_len, eos_token_ids,
        vocab_size; the simulator's kv_usage_interval_s)."""
        mine = {f.name for f in fields(cls)}
        return cls(**{name: getattr(settings, name) for name in mine - fixed.keys() if hasattr(settings, name)},
                   **fixed)


@dataclass
class ScheduledStep:
    steps: list[SeqStep] = field(default_factory=list)
    samples: list[list[SampleRequest]] = field(default_factory=list)
    computed: list[tuple[Sequence, int]] = field(default_factory=list)   # (seq, tokens computed)
    requests: list[Request] = field(default_factory=list)               # requests with work this step
    preempted: list[Request] = field(default_factory=list)
    pending_forks: dict[int, list[Sequence]] = field(default_factory=dict)   # parent seq id -> n-1 samples
    step_requests: list[Request] = field(default_factory=list)   # the request of each entry of steps
    aborted: list[Request] = field(default_factory=list)   # ended while scheduling (they can never fit)
    ahead: bool = False    # planned by schedule_ahead while the step before it ran

    @property
    def is_empty(self) -> bool:
        return not self.steps

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.computed)


_ARRIVAL = operator.attrgetter("arrival_time")


class SchedulerError(ValueError):
    """A request that can never be served (e.g. longer than the whole KV pool)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, store, clock: Callable[[], float]):
        self.config = config
        self.store = store
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.stats = Counter()
        self._capacity_tokens = store.stats()["device_blocks_total"] * store.block_size
        self._eos, self._max_model_len = config.eos_token_ids, config.max_model_len   # read per token
        self.kv_meter = KVUsageMeter(config.kv_usage_interval_s)
        self._ahead: list[ScheduledStep] = []     # steps planned ahead, not updated yet
        self._held: list[int] = []                # freed sequences whose blocks those steps still use
        self._pending_slots: dict[int, int] = {}  # seq id -> position whose token it draws in flight

    # ---- requests in and out ------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      true_output_len: int | None = None) -> None:
        """Raise SamplingParamsError / SchedulerError for a request this engine can never serve."""
        params.validate()
        if not prompt_token_ids:
            raise SchedulerError("the prompt is empty")
        vocab = self.config.vocab_size
        if vocab and not (0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab):
            # The router checks this too; a peer that did not would fail the worker's whole step.
            raise SchedulerError(f"prompt token ids must be in [0, {vocab})")
        if vocab and params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            # As vLLM: a whitelist id past the vocabulary is refused, never silently dropped.
            raise SamplingParamsError("allowed_token_ids", f"allowed_token_ids must be token ids below {vocab}, "
                                                           f"got {max(params.allowed_token_ids)}")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise SchedulerError(f"the prompt has {len(prompt_token_ids)} tokens; the maximum context is "
                                 f"{self.config.max_model_len} including at least one generated token")
        width = max(params.n, params.beam_width)
        if width > self.config.max_num_seqs:
            # It would wait forever at the head of the queue (and every request behind it).
            raise SchedulerError(f"the request runs {width} sequences at once; this engine runs at most "
                                 f"{self.config.max_num_seqs} (max_num_seqs)")
        if len(prompt_token_ids) + 1 > self._capacity_tokens:
            raise SchedulerError(f"the prompt needs {len(prompt_token_ids) + 1} KV slots; "
                                 f"the whole device pool has {self._capacity_tokens}")
        if true_output_len is None and self.store.policy.needs_final_length:
            raise SchedulerError(f"the {self.store.policy.name} allocation reserves each request's true "
                                 "length: the request must give true_output_len")
        if true_output_len is not None and true_output_len < 1:
            raise SchedulerError(f"true_output_len must be at least 1, got {true_output_len}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, true_output_len: int | None = None) -> Request:
        """true_output_len: how many tokens the request will really generate, known only to a
        benchmark; the baselines that reserve a request's true length read it (through the
        store's allocate), nothing else does."""
        self.check_request(prompt_token_ids, params, true_output_len)
        if request_id in self.requests:
            raise SchedulerError(f"request id {request_id!r} is already in use")
        salt = (params.cache_salt,) if params.cache_salt else ()
        if params.prompt_logprobs is not None:
            # Its prompt's logits are all needed: a key of its own keeps it from hitting (and so
            # skipping) cached blocks, which other requests may be reading.
            salt += (f"prompt-logprobs:{request_id}:{next(self._seq_ids)}",)
        req = Request(request_id, list(prompt_token_ids), params,
                      self.clock() if arrival_time is None else arrival_time, cache_salt=salt)
        req.seqs = [Sequence(next(self._seq_ids), req.prompt_token_ids)]
        out_len = true_output_len if true_output_len is not None else params.max_tokens
        req.final_len = min(len(prompt_token_ids) + out_len, self.config.max_model_len)
        req.params_key = f"{request_id}/{req.seqs[0].seq_id}"     # seq ids are never reused
        if params.use_beam_search:
            req.beam = BeamSearch(beam_width=params.beam_width, length_penalty=params.length_penalty,
                                  early_stopping=params.early_stopping,
                                  max_new_tokens=min(params.max_tokens,
                                                     self.config.max_model_len - len(prompt_token_ids)),
                                  prompt_len=len(prompt_token_ids),
                                  eos_token_ids=() if params.ignore_eos else self.config.eos_token_ids,
                                  num_return=params.n, new_beam_id=lambda: next(self._seq_ids))
            req.beam.start(req.seqs[0].seq_id)
        # Whether a step can be planned for it before its last tokens are known (schedule_ahead).
        req.plans_blind = (req.beam is None and params.structured_outputs is None and not params.uses_penalties
                           and params.prompt_logprobs is None)
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        for seq in req.seqs:
            seq.finish_reason = "abort"
        self._finish(req, "abort")
        return True

    @property
    def live_request_ids(self) -> KeysView[str]:
        """The ids of the requests this core still holds (unfinished, or finished and not popped
        yet): a live, read-only view, cheap to take every step."""
        return self.requests.keys()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def pop_finished(self, request_id: str) -> Request:
        return self.requests.pop(request_id)

    def plan_on(self, store) -> None:
        """From now on plan on this block store (a scheduler process's new mirror after it
        resynchronized with the kvstore)."""
        self.store = store

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        out = ScheduledStep()
        budget = [self.config.max_num_batched_tokens]
        self._schedule_running(out, budget)
        num_running = len(self.running)
        if not out.preempted:
            self._schedule_swapped(out, budget)
        if not out.preempted and not self.swapped:
            self._schedule_waiting(out, budget)
        if len(self.running) != num_running:
            # Oldest first, so that "newest first" preemption picks by arrival, not by re-admission.
            self.running.sort(key=_ARRIVAL)
        self._sample_kv_usage()
        return out

    def schedule_ahead(self, in_flight: ScheduledStep) -> ScheduledStep | None:
        """The step after `in_flight`, planned while it runs (async scheduling), or None when that
        needs its results: a request the blind plan cannot serve runs (beams, a fork pending, a
        grammar, penalties that read the history, prompt logprobs), a running sequence is not
        drawing in it, something is swapped out, or the running sequences' next slots do not all
        fit (preempting needs the tokens). Waiting requests are admitted as in `schedule`."""
        if not in_flight.steps or in_flight.pending_forks or self.swapped:
            return None
        drawing = {w.seq_id for wanted in in_flight.samples for w in wanted}
        grow: list[Sequence] = []
        grow_requests: list[Request] = []
        max_len = self._max_model_len
        for req in self.running:
            if not req.plans_blind:
                return None
            max_tokens = req.params.max_tokens
            for seq in req.seqs:
                if seq.seq_id not in drawing:
                    return None
                n_out = len(seq.output_token_ids) + 1   # with the token it draws in flight
                if n_out < max_tokens and len(seq.prompt_token_ids) + n_out < max_len:
                    grow.append(seq)
                    grow_requests.append(req)
        budget = [self.config.max_num_batched_tokens - len(grow)]
        if budget[0] < 0:
            return None
        if grow:
            ids = [s.seq_id for s in grow]
            if not self.store.append_tokens(ids, [PENDING_TOKEN] * len(ids)).ok:
                return None   # nothing appended: the synchronous step after it preempts
        out = ScheduledStep(ahead=True)
        table = self.store.block_table_view
        pending = self._pending_slots
        last_req = None
        for seq, req in zip(grow, grow_requests):
            pos = seq.num_tokens          # the in-flight token's position
            pending[seq.seq_id] = pos
            out.steps.append(SeqStep(seq.seq_id, [PENDING_TOKEN], pos, table(seq.seq_id)))
            out.samples.append(seq.sample_requests or self._sample_requests(req, seq, out))
            out.computed.append((seq, 1))
            out.step_requests.append(req)
            if req is not last_req:
                out.requests.append(req)
                last_req = req
        num_running = len(self.running)
        self._schedule_waiting(out, budget)
        if len(self.running) != num_running:
            self.running.sort(key=_ARRIVAL)
        self._sample_kv_usage()
        if out.steps:
            self._ahead.append(out)
            self.stats["steps_planned_ahead"] += 1
        return out if out.steps or out.aborted else None

    def abandon(self, scheduled: ScheduledStep) -> None:
        """A step that will never be updated (its worker failed): its sequences' blocks go."""
        if self._retire(scheduled):
            for step in scheduled.steps:
                self._pending_slots.pop(step.seq_id, None)
        self._release_held()

    def _retire(self, scheduled: ScheduledStep) -> bool:
        """A step planned ahead is answered (or abandoned): no longer in flight. Its rows for
        sequences freed before it (stopped in the step before) were for nothing."""
        if not (scheduled.ahead and any(s is scheduled for s in self._ahead)):
            return False
        self._ahead = [s for s in self._ahead if s is not scheduled]
        if self._held:
            mine = {step.seq_id for step in scheduled.steps}
            self.stats["ahead_rows_dropped"] += sum(1 for seq_id in self._held if seq_id in mine)
        return True

    def _release_held(self) -> None:
        """Free the held sequences that no step in flight uses any more."""
        if not self._held:
            return
        busy = {step.seq_id for s in self._ahead for step in s.steps}
        held, self._held = self._held, []
        for seq_id in held:
            if seq_id in busy:
                self._held.append(seq_id)
            else:
                self.store.free(seq_id)

    def _free(self, seq_id: int) -> None:
        """Free a sequence's blocks, or hold them while a step planned ahead still uses them."""
        if self._ahead and any(step.seq_id == seq_id for s in self._ahead for step in s.steps):
            if seq_id not in self._held:
                self._held.append(seq_id)
            return
        self.store.free(seq_id)

    def _set_pending_tokens(self, results: list[SampleResult]) -> None:
        """The store's placeholders of the tokens just drawn get the tokens."""
        pending, store = self._pending_slots, self.store
        ids, positions, tokens = [], [], []
        for r in results:
            pos = pending.get(r.seq_id)
            if pos is not None and r.token_id is not None and r.token_id >= 0 and r.seq_id in store:
                del pending[r.seq_id]
                ids.append(r.seq_id)
                positions.append(pos)
                tokens.append(r.token_id)
        if ids:
            store.set_tokens(ids, positions, tokens)

    def _sample_kv_usage(self, force: bool = False) -> None:
        now = self.clock()
        if not force and not self.kv_meter.due(now):
            return
        head = self.waiting[0] if self.waiting else None
        usage = self.store.kv_usage(head.seqs[0].num_tokens, head.final_len) if head is not None \
            else self.store.kv_usage()
        self.kv_meter.sample(now, usage, len(self.running), head is not None)

    def kv_breakdown(self) -> dict:
        """The time-averaged Fig. 2 split and average batch (kv_usage.KVUsageMeter.breakdown)."""
        return self.kv_meter.breakdown()

    def _append_all_at_once(self) -> bool:
        """Give every running sequence the slot for its last sampled token in one store call;
        False (and nothing appended) when they do not all fit, or one needs more than one token."""
        seqs = [s for r in self.running for s in r.seqs]
        if not seqs:
            return True
        ids, tokens = [], []
        # One pass, no per-sequence call (this runs for every running sequence every step): a
        # sequence whose tokens the store all holds needs nothing; one token short, its last.
        for seq, known in zip(seqs, self.store.num_tokens_of([s.seq_id for s in seqs])):
            out = seq.output_token_ids
            missing = len(seq.prompt_token_ids) + len(out) - known
            if missing:
                if missing != 1:
                    return False
                ids.append(seq.seq_id)
                tokens.append(out[-1] if out else seq.prompt_token_ids[-1])
        if not ids:
            return True
        result = self.store.append_tokens(ids, tokens)
        self.stats["cow_copies"] += len(result.copies)
        return result.ok

    def _schedule_running(self, out: ScheduledStep, budget: list[int]) -> None:
        """Running requests, FCFS: first every sequence's slot for its last token, then each
        request's tokens for this step. The slots come from one batched append when they all fit
        (nearly every step: no request needs its own check, which only matters when someone must
        be preempted); else one request at a time, preempting the newest while one cannot grow.
        Growing all before computing any is the same plan as growing each before computing it:
        growth takes no token budget and computing takes no block."""
        if not self._append_all_at_once():
            self._grow_one_by_one(out)
        self._add_compute(self.running, out, budget)

    def _grow_one_by_one(self, out: ScheduledStep) -> None:
        running = deque(self.running)
        kept: list[Request] = []
        while running:
            req = running.popleft()
            while not self._can_grow(req):
                victim = running.pop() if running else req
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._grow(req)
                kept.append(req)
        self.running = kept

    def _num_live_seqs(self) -> int:
        return sum(len(r.seqs) for r in self.running)

    def _to_append(self, seqs: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        """(sequence, the tokens the scheduler knows that the store has no slot for yet: the last
        sampled one) for each of seqs that lacks any, asked of the store in one call."""
        if not seqs:
            return []
        return [(seq, seq.token_slice(known))
                for seq, known in zip(seqs, self.store.num_tokens_of([s.seq_id for s in seqs]))
                if known < len(seq.prompt_token_ids) + len(seq.output_token_ids)]

    def _can_grow(self, req: Request) -> bool:
        grow = [seq.seq_id for seq, _ in self._to_append(req.seqs)]
        return not grow or self.store.can_append(grow)

    def _grow(self, req: Request) -> None:
        for seq, new in self._to_append(req.seqs):
            result = self.store.append_slots(seq.seq_id, new)
            if not result.ok:   # can_grow said yes: a mismatch is a bug, not a shortage
                raise RuntimeError(f"append_slots failed after can_append: {result.reason}")
            self.stats["cow_copies"] += len(result.copies)

    def _add_compute(self, requests, out: ScheduledStep, budget: list[int]) -> None:
        """Give each request's sequences this step's tokens and say which want a sample.

        Sequences of one request sample together (a beam step needs every beam's candidates), so
        a multi-sequence request being re-prefilled holds back each sequence's last token until
        all of them can finish in the same step. (One call for all the running requests: this
        loop runs for every running sequence every step, so what it looks up is looked up once.)"""
        table = self.store.block_table_view
        add_step, add_samples, add_computed = out.steps.append, out.samples.append, out.computed.append
        add_step_request, add_request = out.step_requests.append, out.requests.append
        left = budget[0]
        for req in requests:
            seqs = req.seqs
            # Each sequence keeps its last token back (hold) unless all of them finish in this step.
            hold = 0 if len(seqs) == 1 or sum(s.num_pending for s in seqs) <= left else 1
            # Asked once per request, and the property only where prompt logprobs were asked for.
            prompt_logprobs = req.params.prompt_logprobs is not None and req.needs_prompt_logprobs
            pending = False
            for seq in seqs:
                start = seq.num_computed
                n = len(seq.prompt_token_ids) + len(seq.output_token_ids) - start
                if n == 0:
                    continue
                pending = True
                take = n - hold
                if take > left:
                    take = left
                if take <= 0:
                    continue
                left -= take
                end = start + take
                step = SeqStep(seq.seq_id, seq.token_slice(start, end), start, table(seq.seq_id))
                if prompt_logprobs and seq is seqs[0]:
                    step.prompt_logprobs = req.params.prompt_logprobs
                    step.next_token = req.prompt_token_ids[end] if end < len(req.prompt_token_ids) else -1
                add_step(step)
                if take != n:
                    add_samples([])
                else:   # the cached draw when there is one (set only where it stays valid: see below)
                    add_samples(seq.sample_requests or self._sample_requests(req, seq, out))
                add_computed((seq, take))
                add_step_request(req)
            if pending:
                add_request(req)
        budget[0] = left

    def _sample_requests(self, req: Request, seq: Sequence, out: ScheduledStep) -> list[SampleRequest]:
        p = req.params
        if req.beam is not None:
            return [SampleRequest(seq.seq_id, p, seq.prompt_token_ids, seq.output_token_ids, 0,
                                  beam_candidates=req.beam.candidates_per_beam)]
        if p.n > 1 and not req.forked:
            # The n samples share the prompt's blocks: forked after this step computes the prompt.
            children = [Sequence(next(self._seq_ids), req.prompt_token_ids, seq_index=i) for i in range(1, p.n)]
            out.pending_forks[seq.seq_id] = children
            return [SampleRequest(s.seq_id, p, s.prompt_token_ids, s.output_token_ids, s.seq_index)
                    for s in [seq] + children]
        # The same draw every step (its lists grow in place): built once per sequence, never for
        # a beam (new Sequences every step) or a prompt whose samples are not forked yet.
        if seq.sample_requests is None:
            seq.sample_requests = [SampleRequest(seq.seq_id, p, seq.prompt_token_ids, seq.output_token_ids,
                                                 seq.seq_index)]
        return seq.sample_requests

    def _schedule_swapped(self, out: ScheduledStep, budget: list[int]) -> None:
        while self.swapped and budget[0] > 0:
            req = self.swapped[0]
            ids = [s.seq_id for s in req.seqs]
            if self._num_live_seqs() + len(ids) > self.config.max_num_seqs:
                break
            # Room for the blocks coming back and for the next tokens (_room_after_swap_in).
            if not self.store.can_swap_in(ids) or not self._room_after_swap_in(req):
                if not self.running:
                    # Nothing else holds device memory: it can never come back.
                    self.swapped.popleft()
                    self._abort_unservable(req, "the request outgrew the KV cache even with nothing else running",
                                           out)
                    continue
                break
            result = self.store.swap_in(ids)
            if not result.ok:
                break
            self.swapped.popleft()
            self.stats["swap_ins"] += 1
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._grow(req)
            self._add_compute((req,), out, budget)

    def _room_after_swap_in(self, req: Request) -> bool:
        """Room for the blocks coming back and for the next token of every sequence whose last
        sampled token has no slot yet."""
        growing = [s.seq_id for s, have in zip(req.seqs, self.store.num_tokens_of([s.seq_id for s in req.seqs]))
                   if s.num_tokens != have]
        need = self.store.swap_in_blocks_needed([s.seq_id for s in req.seqs], growing)
        return self.store.num_free_device_blocks >= need

    def _abort_unservable(self, req: Request, why: str, out: ScheduledStep) -> None:
        """End a request that can never fit; it goes out with this step, so its router hears of it."""
        req.error, req.unservable = why, True
        self._finish(req, "abort")
        out.aborted.append(req)
        out.requests.append(req)

    def _schedule_waiting(self, out: ScheduledStep, budget: list[int]) -> None:
        if self.config.batching == "request":
            if self.running:
                return   # the batch runs until every request in it has finished
            # The whole batch is admitted and prefilled together, as FasterTransformer runs it.
            budget = [sum(r.seqs[0].num_tokens for r in self.waiting)]
        while self.waiting and budget[0] > 0:
            req = self.waiting[0]
            if self._num_live_seqs() + max(len(req.seqs), req.params.n, req.params.beam_width) \
                    > self.config.max_num_seqs:
                break
            if not self._admit(req):
                if not self.running and not self.swapped:
                    # Nothing else holds memory: this request can never fit.
                    self.waiting.popleft()
                    self._abort_unservable(
                        req, "the request does not fit in the KV cache even with nothing else running", out)
                    continue
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = self.clock()
            self.running.append(req)
            self._add_compute((req,), out, budget)

    def _admit(self, req: Request) -> bool:
        """Allocate every live sequence of the request (prompt, plus output after a recompute)."""
        if len(req.seqs) > 1 and len(req.prompt_token_ids) >= self.store.block_size:
            return self._admit_sharing_prompt(req)
        done: list[Sequence] = []
        for seq in req.seqs:
            result = self.store.allocate(seq.seq_id, seq.all_token_ids(), req.cache_salt, req.final_len)
            if not result.ok:
                for d in done:
                    self.store.free(d.seq_id)
                    d.num_computed = 0
                return False
            seq.num_computed = result.num_cached_tokens
            if req.num_preemptions == 0 and result.num_cached_tokens > req.num_cached_tokens:
                req.num_cached_tokens = result.num_cached_tokens
                req.num_host_cached_tokens = result.num_host_cached_tokens
            done.append(seq)
        return True

    def _admit_sharing_prompt(self, req: Request) -> bool:
        """Several sequences back after a recompute (samples, beams): they share the prompt's full
        blocks again, as they did before, instead of each allocating the whole prompt (which may
        need n times the memory the request ran in). Each then grows by its own tokens."""
        store, seqs = self.store, req.seqs
        bs = store.block_size
        shared = len(req.prompt_token_ids) // bs * bs
        first = seqs[0]
        tokens = [s.all_token_ids() for s in seqs]
        most = shared // bs + sum(-(-(len(t) - shared) // bs) for t in tokens)   # with no prefix hit
        if most > store.num_free_device_blocks and (self.running or self.swapped):
            return False   # wait, without trying (each try is ops sent to the kvstore)
        ok = store.allocate(first.seq_id, tokens[0][:shared], req.cache_salt, req.final_len)
        if not ok.ok:
            return False
        for s in seqs[1:]:
            store.fork(first.seq_id, s.seq_id)
        for s, toks in zip(seqs, tokens):
            if not store.append_slots(s.seq_id, toks[shared:]).ok:
                for d in seqs:
                    if d.seq_id in store:
                        store.free(d.seq_id)
                return False
        for s in seqs:   # every sequence writes its own K/V past the cached blocks (equal values
            s.num_computed = ok.num_cached_tokens   # where blocks are shared)
        return True

    # ---- preemption ---------------------------------------------------------------------

    def _preemption_mode(self, req: Request) -> tuple[str, str]:
        ids = [s.seq_id for s in req.seqs]
        fits_host = self.store.can_swap_out(ids)
        mode = self.config.preemption_mode
        if mode == "swap":
            return ("swap", "swap mode") if fits_host else ("recompute", "swap mode, host pool full")
        if mode == "recompute":
            return "recompute", "recompute mode"
        if not fits_host:
            return "recompute", "auto: host pool full"
        if len(req.seqs) > 1:
            return "swap", "auto: multi-sequence request keeps its shared blocks"
        if req.seqs[0].num_tokens >= self.config.auto_swap_min_tokens:
            return "swap", "auto: long sequence is cheaper to copy than to recompute"
        return "recompute", "auto: short sequence is cheaper to recompute"

    def _preempt(self, req: Request, out: ScheduledStep) -> None:
        mode, why = self._preemption_mode(req)
        self.stats["preemptions"] += 1
        self.stats[f"preempted_by_{mode}"] += 1
        self.stats[f"preemption_reason[{why}]"] += 1
        req.num_preemptions += 1
        out.preempted.append(req)
        ids = [s.seq_id for s in req.seqs]
        if mode == "swap":
            result = self.store.swap_out(ids)
            if result.ok:
                self.stats["swap_outs"] += 1
                req.status = RequestStatus.SWAPPED
                self.swapped.append(req)
                return
        for seq in req.seqs:
            self.stats["recomputed_tokens"] += seq.num_computed
            self.store.free(seq.seq_id)
            seq.num_computed = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)  # FCFS: the preempted request is older than any waiting one

    # ---- after the step -------------------------------------------------------------------

    def update(self, scheduled: ScheduledStep, results: list[SampleResult],
               prompt_logprobs: dict | None = None) -> list[Request]:
        """Apply the worker's results; return the requests that finished in this step."""
        now = self.clock()
        if self._pending_slots:
            self._set_pending_tokens(results)
        if scheduled.ahead:
            self._retire(scheduled)
        if prompt_logprobs:
            self._add_prompt_logprobs(scheduled, prompt_logprobs)
        bs, store = self.store.block_size, self.store
        live = store.live_seq_ids()
        for seq, n in scheduled.computed:
            if seq.seq_id in live:   # not aborted meanwhile
                before = seq.num_computed
                seq.num_computed = after = before + n
                # Only a step that fills a block gives the store something to key for prefix
                # caching: skip the call otherwise (15 of 16 decode steps).
                if before // bs != after // bs:
                    store.mark_computed(seq.seq_id, after)
        by_seq = {r.seq_id: r for r in results}
        finished: list[Request] = list(scheduled.aborted)
        append_token = self._append_token
        for req in scheduled.requests:
            if req.status is FINISHED:
                continue
            seqs = req.seqs
            if len(seqs) == 1:   # most requests: no comprehension (a call of its own) per request
                wanted = seqs[:] if seqs[0].seq_id in by_seq else []
            else:
                wanted = [s for s in seqs if s.seq_id in by_seq]
            if wanted and by_seq[wanted[0].seq_id].token_id == WAITS_FOR_GRAMMAR:
                # No draw: its grammar compiles on the worker (one constraint per request, so all
                # its samples wait). Its last token is computed again next step, which draws then.
                for seq in wanted:
                    seq.num_computed -= 1
                continue
            if scheduled.pending_forks:
                self._fork_samples(req, wanted, scheduled.pending_forks)
            if not wanted:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            if req.beam is not None:
                self._update_beams(req, by_seq)
            else:
                for seq in wanted:
                    append_token(req, seq, by_seq[seq.seq_id])
            if not req.seqs:
                self._finish(req, None)
            if req.status is FINISHED:
                finished.append(req)
        self._release_held()
        if finished and not self.has_unfinished():
            # Going idle: the empty pool, not the last busy step, stands for the time until the
            # next request (no step samples while nothing runs).
            self._sample_kv_usage(force=True)
        return finished

    def _add_prompt_logprobs(self, scheduled: ScheduledStep, prompt_logprobs: dict) -> None:
        """{seq_id: [start position, entries]} from the worker -> each request's prompt_logprobs
        (positions past the prompt, in a recompute's chunk, are not the prompt's)."""
        for step, req in zip(scheduled.steps, scheduled.step_requests):
            got = prompt_logprobs.get(step.seq_id)
            if got is None or req.status is FINISHED:
                continue
            start, entries = got
            limit = len(req.prompt_token_ids) - 1
            if start <= len(req.prompt_logprobs):
                req.prompt_logprobs[start:] = entries[:max(0, limit - start)]

    def _fork_samples(self, req: Request, wanted: list[Sequence], pending_forks: dict) -> None:
        """The prompt is computed: its n - 1 other samples share its blocks from now on."""
        for parent_id, children in pending_forks.items():
            if any(s.seq_id == parent_id for s in wanted):
                for child in children:
                    self.store.fork(parent_id, child.seq_id)
                    child.num_computed = req.seqs[0].num_computed
                    req.seqs.append(child)
                    wanted.append(child)
                req.forked = True

    def _append_token(self, req: Request, seq: Sequence, r: SampleResult) -> None:
        p = req.params
        seq.output_token_ids.append(r.token_id)
        seq.cum_logprob += r.logprob
        seq.logprobs.append(r.logprob)
        if p.logprobs is not None:
            seq.top_logprobs.append(r.top_logprobs)
        reason = None
        num_out = len(seq.output_token_ids)
        if num_out >= p.min_tokens:
            if not p.ignore_eos and r.token_id in self._eos:
                reason, seq.stop_token = "stop", r.token_id
            elif r.token_id in p.stop_token_ids:
                reason, seq.stop_token = "stop", r.token_id
        if reason is None and (num_out >= p.max_tokens
                               or len(seq.prompt_token_ids) + num_out >= self._max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self._free(seq.seq_id)
            req.seqs.remove(seq)
            req.finished.append(seq)

    def _update_beams(self, req: Request, by_seq: dict[int, SampleResult]) -> None:
        beam: BeamSearch = req.beam
        step = beam.step({s.seq_id: by_seq[s.seq_id].candidates for s in req.seqs})
        old = {s.seq_id: s for s in req.seqs}
        new_seqs = []
        for new_id, parent_id, token, cum in step.running:
            parent = old[parent_id]
            if new_id != parent_id:
                self.store.fork(parent_id, new_id)
                seq = parent.fork(new_id, 0)
                seq.output_token_ids = list(parent.output_token_ids)
            else:
                seq = Sequence(parent.seq_id, parent.prompt_token_ids, list(parent.output_token_ids),
                               0, parent.num_computed)
            seq.output_token_ids.append(token)
            seq.cum_logprob = cum
            new_seqs.append(seq)
        for seq_id in step.freed:
            self.store.free(seq_id)
        req.seqs = new_seqs
        if step.done:
            for seq in req.seqs:
                self.store.free(seq.seq_id)
            req.seqs = []
            for tokens, score in beam.results():
                s = Sequence(-1, req.prompt_token_ids, list(tokens))
                s.cum_logprob = score
                stopped = bool(tokens) and tokens[-1] in self.config.eos_token_ids and not req.params.ignore_eos
                s.finish_reason = "stop" if stopped else "length"
                req.finished.append(s)

    def _finish(self, req: Request, reason: str | None) -> None:
        for seq in list(req.seqs):
            if seq.seq_id in self.store:
                self._free(seq.seq_id)
            seq.finish_reason = seq.finish_reason or reason
            req.finished.append(seq)
        req.seqs = []
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_time = self.clock()
