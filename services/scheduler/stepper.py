"""Turns the scheduler core's plan into what the worker needs, and its results into router updates.

Pure bookkeeping (no sockets): the block-table deltas the worker has not seen, the sampling params it
has not cached, and the tokens each router has not been sent yet. Owned by the scheduler process.
"""
from __future__ import annotations

from collections.abc import KeysView

from pagedserve.services import protocol
from pagedserve.services.scheduler.request import FINISHED, Request
from pagedserve.services.scheduler.scheduler import ScheduledStep



class WorkerView:
    """What the worker already knows: block tables and params sent so far."""

    def __init__(self):
        self.tables: dict[int, list[int]] = {}
        self.params: dict[str, str] = {}        # request id -> key of the params the worker holds for it
        self.with_history: set[str] = set()     # params keys whose sampling reads the token history
        self.stale: tuple[list, list] = ([], [])   # (tables, params) to drop with the next step

    def forget_all(self) -> None:
        """The block stores were reset: tell the worker, with the next step, to drop everything."""
        self.stale = (self.stale[0] + list(self.tables), self.stale[1] + list(self.params.values()))
        self.tables, self.params = {}, {}
        self.with_history.clear()

    def execute_step(self, step: int, scheduled: ScheduledStep, store, live_requests: KeysView[str]
                     ) -> protocol.ExecuteStep:
        """The ExecuteStep of a scheduled step; live_requests: the ids of the requests the scheduler
        still holds (the params of any other are dropped on the worker)."""
        updates, new_params, histories, prompt_logprobs = {}, {}, {}, {}
        ids, tokens, starts, samples_of = [], [], [], []   # the SeqWork columns, built as columns
        tables, params, with_history = self.tables, self.params, self.with_history
        replaced = []
        # (Bound once: this loop runs for every sequence of every step.)
        add_id, add_tokens, add_start, add_samples = ids.append, tokens.append, starts.append, samples_of.append
        for s, wanted, req in zip(scheduled.steps, scheduled.samples, scheduled.step_requests):
            table = s.block_table
            known = tables.get(s.seq_id)
            if known != table:   # a C-level compare; equal on 15 of 16 decode steps
                start = _first_difference(known or [], table)
                updates[s.seq_id] = [start, *table[start:]]
                tables[s.seq_id] = list(table)
            key = req.params_key
            if params.get(req.request_id) != key:   # new, or an id that came back: its own params
                old = params.get(req.request_id)
                if old is not None:
                    replaced.append(old)
                params[req.request_id] = key
                new_params[key] = req.params.to_dict()
                if req.params.uses_penalties:
                    with_history.add(key)
            if len(wanted) == 1:   # most steps of most sequences: no comprehension (a call of its own)
                w = wanted[0]
                samples = [[w.seq_id, key, w.seq_index, w.beam_candidates, len(w.output_token_ids)]]
            else:
                samples = [[w.seq_id, key, w.seq_index, w.beam_candidates, len(w.output_token_ids)] for w in wanted]
            if key in with_history:
                for w in wanted:
                    histories[w.seq_id] = [w.prompt_token_ids, w.output_token_ids]
            elif len(s.token_ids) > 1 and req.params.structured_outputs is not None:
                # A recompute's prefill: the worker may rebuild the grammar state from the tokens.
                for w in wanted:
                    if w.output_token_ids:
                        histories[w.seq_id] = [w.prompt_token_ids, w.output_token_ids]
            if s.prompt_logprobs >= 0:
                prompt_logprobs[s.seq_id] = [s.prompt_logprobs, s.next_token]
            add_id(s.seq_id)
            add_tokens(s.token_ids)
            add_start(s.start_pos)
            add_samples(samples)
        freed = list(tables.keys() - store.live_seq_ids())
        for sid in freed:
            del tables[sid]
        # The scheduler process forgets a request once it finished and was flushed.
        dropped = [params.pop(rid) for rid in params.keys() - live_requests] + replaced
        for k in dropped:
            self.with_history.discard(k)
        if self.stale[0] or self.stale[1]:
            freed, dropped = freed + self.stale[0], dropped + self.stale[1]
            self.stale = ([], [])
        seqs = protocol.Columns(protocol.SeqWork, {"seq_id": ids, "token_ids": tokens, "start_pos": starts,
                                                   "samples": samples_of})
        return protocol.ExecuteStep(step, seqs, updates, freed, new_params, dropped, histories, prompt_logprobs)


def _first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:      # the common case: the table only grew
        return n
    return next(i for i in range(n) if a[i] != b[i])


class RouterView:
    """Per request, how many tokens of each choice the router has been sent, and which choices ended."""

    def __init__(self):
        self.sent: dict[str, dict[int, int]] = {}
        self.closed: dict[str, set[int]] = {}

    def updates_for(self, requests: list[Request], owner: dict[str, bytes]) -> dict[bytes, protocol.RequestUpdates]:
        """This step's news for each router (by identity, from `owner`), one message each. The common
        case, exactly one new token for a request's only choice, which is still running and wants
        no top logprobs, goes in the TokenDelta columns; anything else is a RequestUpdate."""
        batches: dict[bytes, tuple] = {}
        sent_all = self.sent
        last_identity = batch = None   # (most steps: one router owns every request)
        for req in requests:
            rid = req.request_id
            identity = owner.get(rid)
            if identity is None:
                continue
            if identity != last_identity:
                batch = batches.get(identity)
                if batch is None:
                    batch = batches[identity] = ([], [], [], [], [])
                last_identity = identity
            seqs = req.seqs
            params = req.params
            if len(seqs) == 1 and req.beam is None and not req.finished and req.status is not FINISHED \
                    and params.logprobs is None and seqs[0].seq_index == 0 \
                    and (params.prompt_logprobs is None or req.prompt_logprobs_sent):
                seq = seqs[0]
                sent = sent_all.get(rid)
                if sent is None:
                    sent = sent_all[rid] = {}
                out = seq.output_token_ids
                num_out = len(out)
                if num_out == sent.get(0, 0) + 1:
                    sent[0] = num_out
                    batch[1].append(rid)
                    batch[2].append(out[-1])
                    batch[3].append(seq.logprobs[-1])
                    batch[4].append(seq.cum_logprob)
                    continue
            update = self.update_for(req)
            if update is not None:
                batch[0].append(update)
        return {identity: protocol.RequestUpdates(updates, protocol.Columns(protocol.TokenDelta, {
                    "request_id": rids, "token_id": toks, "logprob": lps, "cumulative_logprob": cums}))
                for identity, (updates, rids, toks, lps, cums) in batches.items() if updates or rids}

    def update_for(self, req: Request) -> protocol.RequestUpdate | None:
        """The new tokens since the last update (None if nothing new); beams report only at the end."""
        finished = req.is_finished
        if req.beam is not None and not finished:
            return None
        rid = req.request_id
        sent = self.sent.get(rid)
        if sent is None:
            sent = self.sent[rid] = {}
        closed = self.closed.get(rid, ())
        if req.beam is not None:
            choices = list(enumerate(req.finished[:req.params.n]))
        else:
            choices = [(s.seq_index, s) for s in req.seqs]
            choices += [(s.seq_index, s) for s in req.finished]
        want_top = req.params.logprobs is not None
        deltas = []
        for index, seq in choices:
            if index in closed:
                continue
            n = sent.get(index, 0)
            out = seq.output_token_ids
            if len(out) == n and seq.finish_reason is None:
                continue
            sent[index] = len(out)
            top = [[list(p) for p in t] if t else [] for t in seq.top_logprobs[n:]] if want_top else None
            deltas.append(protocol.CompletionDelta(index, out[n:], seq.logprobs[n:] if req.beam is None else [],
                                                   top, seq.finish_reason, seq.cum_logprob))
            if seq.finish_reason is not None:
                if not closed:
                    closed = self.closed[rid] = set()
                closed.add(index)
        if not deltas and not finished:
            return None
        if finished:
            self.sent.pop(rid, None)
            self.closed.pop(rid, None)
        prompt_logprobs = None
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent \
                and (not req.needs_prompt_logprobs or finished):
            prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        update = protocol.RequestUpdate(rid, deltas, finished, req.error, len(req.prompt_token_ids),
                                        req.num_cached_tokens, prompt_logprobs, unservable=req.unservable)
        if finished:
            self._phases(update, req)
        return update

    def _phases(self, update: protocol.RequestUpdate, req: Request) -> None:
        """vLLM's per-request phase times; a phase the request never reached counts 0."""
        update.num_preemptions, update.num_host_cached_tokens = req.num_preemptions, req.num_host_cached_tokens
        scheduled, first, last = req.scheduled_time, req.first_token_time, req.last_token_time
        if scheduled is None:
            return
        update.queued_s = scheduled - req.arrival_time
        if first is not None and last is not None:
            update.prefill_s, update.decode_s, update.inference_s = first - scheduled, last - first, last - scheduled
