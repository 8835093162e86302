"""One HTTP request's work on an engine replica: submit, follow the deltas, abort, record.

Owns the request's backend ids (one scheduler request per prompt), the queue the scheduler
client fills for them, the per-choice states, the request record in the shared state and the
request's metrics. Completions and chat both drive a Generation; only their JSON differs.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import AsyncIterator

from pagedserve.services import protocol
from pagedserve.services.router.admission import Ticket
from pagedserve.services.router.choices import ChoiceEvent, ChoiceState
from pagedserve.services.router.context import RouterContext
from pagedserve.services.router.detokenizer import IncrementalDetokenizer
from pagedserve.services.router.errors import APIError
from pagedserve.services.router.metrics import FinishedRequest
from pagedserve.services.router.pacing import BEHIND_UPDATES, StreamPacer
from pagedserve.services.router.scheduler_client import Buffered, Failure, SchedulerUnavailable
from pagedserve.services.router.stop_strings import StopStrings
from pagedserve.services.sampling_params import SamplingParams

log = logging.getLogger("pagedserve.router")


class ClientDisconnected(Exception):
    """The HTTP client went away; the request was aborted."""


class _Disconnected:
    pass


class Generation:
    def __init__(self, ctx: RouterContext, request_id: str, prompts: list[list[int]],
                 params: SamplingParams, include_stop_str: bool = False, kind: str = "completion",
                 stream: bool = True, score_only: bool = False, true_output_len: int | None = None,
                 ticket: Ticket | None = None, stream_interval: int = 1, record_id: str | None = None):
        self.ctx = ctx
        self.record_id = record_id or request_id     # its record's key, scoped to its API key
        self.ticket = ticket                 # the router's queue place, given back at the first token
        self.true_output_len = true_output_len
        # Nobody reads a non-streamed request's text before its end, and without stop strings
        # nothing in it can end the request early: its updates are merged by the scheduler client
        # and applied once, instead of waking this request's task every step.
        self.buffered = not stream and not params.stop
        # A stream's chunks: one per token, or every stream_interval tokens (services/router/pacing.py).
        self.pacer = StreamPacer(stream_interval) if stream else None
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.kind = kind
        # '#' is not allowed in a client's X-Request-Id, so a client cannot name another request's
        # backend request (and take over its updates). The tag makes every submission's ids its
        # own: a retry under the id of a request that the engine is still tearing down (its client
        # just left) must not receive that request's last token and abort.
        tag = secrets.token_hex(4)
        self.backend_ids = [f"{request_id}#{tag}"] if len(prompts) == 1 else \
            [f"{request_id}#{tag}.{i}" for i in range(len(prompts))]
        self.queue: asyncio.Queue = asyncio.Queue()
        stop_ids = set(params.stop_token_ids)
        eos_ids = set() if params.ignore_eos else set(ctx.info.eos_token_ids)
        self.choices: list[list[ChoiceState]] = [
            [ChoiceState(p * params.n + i,
                         IncrementalDetokenizer(ctx.decode, ids, params.skip_special_tokens),
                         StopStrings(params.stop, include_stop_str), eos_ids, stop_ids, params.min_tokens,
                         keep_output=not score_only)
             for i in range(params.n)]
            for p, ids in enumerate(prompts)]
        self.done: set[int] = set()          # prompt indices whose backend request is over
        self.client = None
        # From the request's arrival (its ticket), not from here: tokenizing and compiling its
        # constraint count against --request-timeout and the latencies too.
        self.arrival = ticket.since if ticket is not None else time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.error: APIError | None = None
        self.aborted = False
        self.timed_out = False   # ended by --request-timeout: an engine abort, though answered with a 504
        self.closed = False
        self.num_cached_tokens = 0
        self.finals: dict[int, protocol.RequestUpdate] = {}   # per prompt: the engine's final update
        self.ttft_seen: set[int] = set()     # prompts whose first token was timed
        self._seen = None                    # the metrics children of the engine serving it
        self.prompt_logprobs: list[list | None] = [None] * len(prompts)   # per prompt, when asked for
        self.timer: asyncio.TimerHandle | None = None

    @property
    def all_choices(self) -> list[ChoiceState]:
        return [c for per_prompt in self.choices for c in per_prompt]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    # ---- submit --------------------------------------------------------------------------------
    async def start(self) -> None:
        ctx = self.ctx
        if self.ticket is not None:
            # 503 when the queued sequences or tokens would pass their limits
            self.ticket.charge(self.num_prompt_tokens, len(self.prompts) * max(self.params.n, self.params.beam_width))
        client = ctx.backends.pick(self.prompts[0])
        if not ctx.state.put_request(self.record_id, ctx.router_id, client.endpoint, "running",
                                     backend_ids=self.backend_ids, kind=self.kind, model=ctx.model_name):
            raise APIError(409, f"request id {self.request_id!r} is already in use", "X-Request-Id")
        self.client = client
        ctx.backends.started(client.endpoint)
        wire = self.params.to_dict()
        try:
            for bid, ids in zip(self.backend_ids, self.prompts):
                # A buffered request's first token reaches no task of ours: the merge gives
                # its queue place back then (it is running, no longer queued).
                client.subscribe(bid, self.queue, buffered=self.buffered,
                                 on_start=self.ticket.release if self.ticket is not None else None)
                await client.add(protocol.AddRequest(bid, ids, wire, time.time(), self.true_output_len))
        except SchedulerUnavailable as e:
            self.close(APIError(503, str(e)))
            raise self.error from None
        except BaseException:
            # Whatever failed (an unencodable message, a cancelled task), the record, the
            # subscriptions and the prompts already sent must not outlive this request.
            self.abort()
            self.close(APIError(500, "internal error"))
            raise
        if self.ticket is not None:
            self.ticket.hand_over()
        if ctx.config.request_timeout_s is not None:
            left = ctx.config.request_timeout_s - (time.monotonic() - self.arrival)
            self.timer = asyncio.get_running_loop().call_later(max(0.0, left), self._timed_out)

    def _timed_out(self) -> None:
        if len(self.done) < len(self.prompts):
            log.info("%s ran past --request-timeout; aborting", self.request_id)
            self.timed_out = True
            # Handled as any failure, in the request's own task: it aborts what still runs (the
            # scheduler frees the blocks) and ends the response with this error.
            self.queue.put_nowait(Failure(504, f"the request took longer than --request-timeout "
                                               f"{self.ctx.config.request_timeout_s:g} s and was aborted"))

    # ---- follow --------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[list[ChoiceEvent]]:
        """Yields the choice events of each scheduler update until every choice is over.

        Raises APIError for a rejected or failed request, ClientDisconnected if the client left.
        A stream's events are paced: one per token, or as --stream-interval says."""
        held = None
        while len(self.done) < len(self.prompts):
            msg, held = held or await self.queue.get(), None
            events = self._handle(msg)
            # Updates that queued up while the client was being written to go out as one batch
            # (a stream writes a batch at once); a failure or disconnect waits for the next round
            # so the text before it is sent first.
            queued = 0
            while len(self.done) < len(self.prompts) and not self.queue.empty():
                msg = self.queue.get_nowait()
                if not isinstance(msg, (protocol.RequestUpdate, Buffered)) or getattr(msg, "error", None):
                    held = msg
                    break
                events = events + self._handle(msg)
                queued += 1
            if self.pacer is not None:
                events, merged = self.pacer.pace(events, behind=queued >= BEHIND_UPDATES)
                if merged:
                    self.ctx.metrics.stream_merged_tokens.inc(merged)
            yield events

    def _handle(self, msg) -> list[ChoiceEvent]:
        if isinstance(msg, _Disconnected):
            raise ClientDisconnected()
        if isinstance(msg, Failure):
            raise self._fail(APIError(msg.status, msg.message))
        if isinstance(msg, protocol.Error):
            raise self._fail(APIError(msg.code if 400 <= msg.code < 600 else 500, msg.message, msg.param))
        if isinstance(msg, Buffered):
            return self._apply(msg.update, msg.first_token_at, msg.last_token_at)
        return self._apply(msg)

    def _apply(self, update: protocol.RequestUpdate, first_at: float | None = None,
               last_at: float | None = None) -> list[ChoiceEvent]:
        try:
            p = self.backend_ids.index(update.request_id)
        except ValueError:
            return []
        if update.error:
            # 503: the engine could not serve it now (a retry may); 400: never as asked (fewer
            # choices or tokens may fit).
            raise self._fail(APIError(400 if update.unservable else 503, f"the engine failed the request: {update.error}"))
        now = time.monotonic()
        merged = first_at is not None
        if merged:   # its tokens arrived from first_at to last_at
            self._observe_span(p, first_at, last_at, max((len(d.token_ids) for d in update.outputs), default=0))
        self.num_cached_tokens = max(self.num_cached_tokens, update.num_cached_tokens)
        if update.prompt_logprobs is not None:
            self.prompt_logprobs[p] = update.prompt_logprobs
        choices = self.choices[p]
        events = []
        new_tokens = 0
        for delta in update.outputs:
            if not 0 <= delta.index < len(choices) or choices[delta.index].finished:
                continue
            event = choices[delta.index].apply(delta)
            new_tokens = max(new_tokens, event.num_new_tokens)
            events.append(event)
        if new_tokens and self.ticket is not None:
            self.ticket.release()            # started: no longer queued
        if new_tokens and not merged:
            if p not in self.ttft_seen:      # each prompt is an engine request of its own
                self.ttft_seen.add(p)
                self.seen.ttft.observe(now - self.arrival)
            elif self.last_token_at is not None:
                self.seen.itl.observe((now - self.last_token_at) / new_tokens)
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        if update.finished:
            self.finals[p] = update
            self.done.add(p)
            events.extend(c.finish("abort") for c in choices if not c.finished)
        elif all(c.finished for c in choices):
            # Every choice ended on a stop string: the scheduler need not run this prompt further.
            self.done.add(p)
            self.client.abort_soon(self.backend_ids[p], on_final=self._late_final(p))
        return events

    def _observe_span(self, p: int, first_at: float, last_at: float, num_tokens: int) -> None:
        """TTFT and inter-token latency of tokens that arrived merged, as if applied one by one."""
        if p not in self.ttft_seen:
            self.ttft_seen.add(p)
            self.seen.ttft.observe(first_at - self.arrival)
        if self.first_token_at is None:
            self.first_token_at = first_at
        if num_tokens > 1:
            itl = (last_at - first_at) / (num_tokens - 1)
            for _ in range(num_tokens - 1):
                self.seen.itl.observe(itl)
        self.last_token_at = last_at

    @property
    def seen(self):
        """This request's metrics children, labelled with the engine that serves it."""
        if self._seen is None:
            self._seen = self.ctx.metrics.seen(self.client.engine if self.client is not None else "")
        return self._seen

    def _record_finished(self) -> None:
        """vLLM's per-request series, once per engine request (prompt). The engine's phases come
        with its final update; a prompt this router aborted (a stop string) gets them when the
        scheduler's final update arrives after the abort (_late_final)."""
        now = time.monotonic()
        engine = self.client.engine if self.client is not None else ""
        for p, (ids, choices) in enumerate(zip(self.prompts, self.choices)):
            final = self.finals.get(p)
            self.ctx.metrics.finished(FinishedRequest(
                engine, [c.finish_reason or "abort" for c in choices], len(ids),
                final.num_cached_tokens if final is not None else self.num_cached_tokens,
                [len(c.token_ids) for c in choices], self.params.n, self.params.max_tokens,
                now - self.arrival, final))

    def _late_final(self, p: int):
        def arrived(update: protocol.RequestUpdate) -> None:
            if p in self.finals:
                return
            self.finals[p] = update          # before close: _record_finished takes it
            if self.closed and self.counts_as_finished:
                most = max((len(c.token_ids) for c in self.choices[p]), default=0)
                self.ctx.metrics.phases(self.client.engine, update, most)
        return arrived

    @property
    def counts_as_finished(self) -> bool:
        """Whether vLLM's per-request series count it: a request that ran to its end, or one the
        engine aborted (a client that left, --request-timeout: finished_reason "abort", as vLLM
        counts its aborted requests); not one refused or failed."""
        return self.error is None or self.timed_out

    def _fail(self, error: APIError) -> APIError:
        self.abort()
        self.close(error)
        return error

    # ---- end -----------------------------------------------------------------------------------
    def abort(self) -> None:
        """Stop every backend request still running (no await: callable from cancelled tasks)."""
        if self.client is None:
            return
        for p, bid in enumerate(self.backend_ids):
            if p not in self.done:
                # A whole-response request's tokens wait merged in the client: take them in, so
                # that its metrics and record count what the engine computed before the abort.
                partial = self.client.take_partial(bid) if self.buffered else None
                if partial is not None:
                    self._apply(partial.update, partial.first_token_at, partial.last_token_at)
                self.done.add(p)
                self.aborted = True
                self.client.abort_soon(bid, on_final=self._late_final(p))

    def disconnected(self) -> None:
        if len(self.done) < len(self.prompts):
            log.info("client of %s disconnected; aborting", self.request_id)
            self.abort()
            self.queue.put_nowait(_Disconnected())

    def close(self, error: APIError | None = None) -> None:
        """Record the outcome once: state, metrics, subscriptions."""
        if self.closed:
            return
        self.closed = True
        self.error = error
        ctx = self.ctx
        if self.ticket is not None:
            self.ticket.release()
        if self.timer is not None:
            self.timer.cancel()
        if self.client is not None:
            for bid in self.backend_ids:
                self.client.unsubscribe(bid)
            ctx.backends.ended(self.client.endpoint)
        reasons = [c.finish_reason or "abort" for c in self.all_choices]
        if error is not None:
            status = "failed"
        elif self.aborted or "abort" in reasons:
            status = "cancelled"
        else:
            status = "finished"
        generated = sum(len(c.token_ids) for c in self.all_choices)
        if self.counts_as_finished:
            self._record_finished()
        try:
            ctx.state.update_request_status(self.record_id, status, finish_reasons=reasons,
                                            num_prompt_tokens=self.num_prompt_tokens,
                                            num_generated_tokens=generated,
                                            error=error.message if error else None)
        except Exception as e:   # the record is informative; never fail a finished request over it
            log.warning("could not record the end of %s: %s", self.request_id, e)


async def watch_disconnect(request, gen: Generation) -> None:
    """Abort the generation when the HTTP client disconnects (run as a task; cancel when done)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gen.disconnected()
            return
