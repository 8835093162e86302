"""The router's connection to one scheduler: a zmq.asyncio DEALER whose identity is the router id.

Owns the socket, a receive loop that hands each RequestUpdate / Error to the asyncio queue
subscribed under its request id (or, for a buffered subscriber, merges the updates and hands over
one Buffered at the end), and a heartbeat: a Ping every `ping_interval_s`. A scheduler not
heard from (any message counts) for `dead_after_s` is declared dead: every subscribed request gets
a Failure(503) in its queue and new requests are refused with 503, so nothing hangs. A dropped
connection (a socket monitor sees it) fails the subscribed requests at once: the scheduler that
held them is gone, and a restarted one, which answers Pings again, knows nothing of them.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pagedserve.services import protocol
from pagedserve.services.curve import SocketGuard

log = logging.getLogger("pagedserve.router")


@dataclass
class Failure:
    """Put in a request's queue by the router itself: the request cannot go on."""
    status: int
    message: str


@dataclass
class Buffered:
    """A whole request's updates merged into one, for a subscriber that only wants the end (a
    non-streamed request without stop strings): its task wakes once, not once per step."""
    update: protocol.RequestUpdate
    first_token_at: float | None      # when its first token arrived (the TTFT), monotonic
    last_token_at: float | None


class _Merge:
    """Collects one request's deltas, per choice, until its final update."""

    def __init__(self, on_start=None):
        self.on_start = on_start          # called at the first token (the request left the queue)
        self.outputs: dict[int, protocol.CompletionDelta] = {}
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs = None

    def delta(self, index: int) -> protocol.CompletionDelta:
        d = self.outputs.get(index)
        if d is None:
            d = self.outputs[index] = protocol.CompletionDelta(index, [], [])
        return d

    def stamp(self) -> None:
        self.last_token_at = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = self.last_token_at
            if self.on_start is not None:
                self.on_start()

    def add_token(self, t: protocol.TokenDelta) -> None:
        d = self.delta(0)
        d.token_ids.append(t.token_id)
        d.logprobs.append(t.logprob)
        d.cumulative_logprob = t.cumulative_logprob
        self.stamp()

    def add(self, update: protocol.RequestUpdate) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, update.num_cached_tokens)
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        for new in update.outputs:
            d = self.delta(new.index)
            if new.token_ids:
                self.stamp()
            if new.top_logprobs is not None:   # per token: pad the tokens that came without
                d.top_logprobs = (d.top_logprobs or [[] for _ in d.token_ids]) + new.top_logprobs
            elif d.top_logprobs is not None:
                d.top_logprobs += [[] for _ in new.token_ids]
            d.token_ids += new.token_ids
            d.logprobs += new.logprobs
            d.finish_reason = new.finish_reason or d.finish_reason
            d.cumulative_logprob = new.cumulative_logprob

    def result(self, final: protocol.RequestUpdate) -> Buffered:
        self.add(final)
        merged = dataclasses.replace(final, outputs=[self.outputs[i] for i in sorted(self.outputs)],
                                     num_cached_tokens=self.num_cached_tokens,
                                     prompt_logprobs=self.prompt_logprobs)
        return Buffered(merged, self.first_token_at, self.last_token_at)


class SchedulerUnavailable(RuntimeError):
    """A message could not be handed to the scheduler (no connection)."""


class SchedulerClient:
    def __init__(self, endpoint: str, identity: str, ctx: zmq.asyncio.Context,
                 ping_interval_s: float = 1.0, dead_after_s: float = 10.0, guard: SocketGuard | None = None):
        self.endpoint = endpoint
        self.guard = guard or SocketGuard(None)   # CURVE keys when the scheduler is on a network
        self.identity = identity
        self.ctx = ctx
        self.ping_interval_s = ping_interval_s
        self.dead_after_s = dead_after_s
        self.subscribers: dict[str, asyncio.Queue] = {}
        self.merging: dict[str, _Merge] = {}  # buffered subscribers: their updates so far
        # Requests aborted by their own router (a stop string, a client gone): the final update
        # the scheduler still sends goes to this callback (the request's phases, for metrics).
        self.on_final: dict[str, object] = {}
        self.last_heard = time.monotonic()    # a grace period from start: the scheduler may be starting
        self.last_pong: protocol.Pong | None = None
        self.dead = False
        self.heard = False                    # whether the scheduler ever answered
        self._ping_waiters: list[asyncio.Future] = []
        self._stats_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._tasks: list[asyncio.Task] = []
        self.sock: zmq.asyncio.Socket | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        # Queue only on a live connection: with no scheduler a send waits (and times out, -> 503)
        # instead of piling requests up for a scheduler that may come back much later.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RCVHWM, 0)    # every token and end the scheduler sends is kept (no drops)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.guard.connect(sock, self.endpoint)
        self.sock = sock
        self._tasks = [asyncio.create_task(self._receive_loop(), name=f"recv {self.endpoint}"),
                       asyncio.create_task(self._heartbeat_loop(), name=f"ping {self.endpoint}"),
                       asyncio.create_task(self._watch_connection(monitor), name=f"watch {self.endpoint}")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self.fail_all(503, "the router is shutting down")
        if self.sock is not None:
            self.sock.close(linger=0)

    @property
    def alive(self) -> bool:
        return not self.dead

    @property
    def engine(self) -> str:
        """The scheduler's replica name, as its Pongs give it (the `engine` label of metrics)."""
        return self.last_pong.sender if self.last_pong is not None else ""

    @property
    def ready(self) -> bool:
        return self.alive and self.last_pong is not None and self.last_pong.ready

    # ---- requests ------------------------------------------------------------------------------
    def subscribe(self, request_id: str, queue: asyncio.Queue, buffered: bool = False, on_start=None) -> None:
        """Updates for request_id go to queue: each as it comes, or (buffered) merged into one
        Buffered at the end, with on_start() called at its first token; errors and failures always
        at once."""
        if request_id in self.subscribers:
            raise ValueError(f"request {request_id!r} already has a subscriber")
        self.subscribers[request_id] = queue
        if buffered:
            self.merging[request_id] = _Merge(on_start)

    def take_partial(self, request_id: str) -> Buffered | None:
        """What a buffered request merged so far (None: nothing, or not buffered), for an owner that
        aborts it: its tokens were computed, and an abort that dropped them counted none."""
        merge = self.merging.pop(request_id, None)
        if merge is None or merge.first_token_at is None:
            return None
        return merge.result(protocol.RequestUpdate(request_id, []))

    def unsubscribe(self, request_id: str) -> None:
        self.subscribers.pop(request_id, None)
        self.merging.pop(request_id, None)

    async def add(self, msg: protocol.AddRequest) -> None:
        await self._send(msg)

    async def abort(self, request_id: str) -> None:
        """Abort on behalf of someone else (a cancel by id): the owner's subscription stays, so
        that its client hears the abort and gets its answer (unsubscribing here hung it)."""
        await self._send(protocol.AbortRequest(request_id))

    def abort_soon(self, request_id: str, on_final=None) -> None:
        """Send AbortRequest without awaiting: safe from a cancelled task or a finally block.
        on_final(update) gets the request's final update when it comes."""
        self.unsubscribe(request_id)
        if on_final is not None:
            self.on_final[request_id] = on_final
        try:
            # zmq.asyncio sends at once when the socket can take it (a DEALER queues up to its HWM).
            self.sock.send_multipart(protocol.encode(protocol.AbortRequest(request_id)))
        except zmq.ZMQError as e:
            log.warning("could not send AbortRequest(%s) to %s: %s", request_id, self.endpoint, e)

    async def _send(self, msg) -> None:
        try:
            await asyncio.wait_for(self.sock.send_multipart(protocol.encode(msg), copy=False),
                                   min(self.dead_after_s, 5.0))
        except asyncio.TimeoutError:
            raise SchedulerUnavailable(f"the engine at {self.endpoint} is not connected") from None

    # ---- questions -----------------------------------------------------------------------------
    async def ping(self, timeout_s: float = 1.0) -> protocol.Pong | None:
        fut = asyncio.get_running_loop().create_future()
        self._ping_waiters.append(fut)
        try:
            # One deadline for the send and the answer: a send to a scheduler that is not
            # connected waits (up to 5 s) and /ready must answer within its own timeout.
            async with asyncio.timeout(timeout_s):
                await self._send(protocol.Ping(self.identity, time.time()))
                return await fut
        except (asyncio.TimeoutError, SchedulerUnavailable):
            return None
        finally:
            if fut in self._ping_waiters:
                self._ping_waiters.remove(fut)

    async def stats(self, timeout_s: float = 1.0) -> dict | None:
        # StatsReply carries no correlation id; the scheduler answers in order, so FIFO matches.
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        try:
            async with asyncio.timeout(timeout_s):       # as ping: the send counts
                await self._send(protocol.GetStats(self.identity))
                return await fut
        except (asyncio.TimeoutError, SchedulerUnavailable):
            fut.cancel()
            return None

    # ---- loops ---------------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            self.last_heard = time.monotonic()
            if self.dead:
                log.info("the scheduler at %s answers%s", self.endpoint, " again" if self.heard else "")
                self.dead = False
            self.heard = True
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as e:
                log.warning("malformed message from the scheduler at %s: %s", self.endpoint, e)
                continue
            self._dispatch(msg)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, protocol.RequestUpdates):
            merging = self.merging
            for t in msg.tokens:
                merge = merging.get(t.request_id)
                if merge is not None:
                    merge.add_token(t)
                    continue
                queue = self.subscribers.get(t.request_id)
                if queue is not None:
                    queue.put_nowait(protocol.RequestUpdate(t.request_id, [protocol.CompletionDelta(
                        0, [t.token_id], [t.logprob], None, None, t.cumulative_logprob)]))
            for update in msg.updates:
                self._dispatch(update)
            return
        if isinstance(msg, (protocol.RequestUpdate, protocol.Error)) and msg.request_id is not None:
            queue = self.subscribers.get(msg.request_id)
            if queue is None:
                if isinstance(msg, protocol.RequestUpdate) and msg.finished and msg.request_id in self.on_final:
                    self.on_final.pop(msg.request_id)(msg)
                return
            merge = self.merging.get(msg.request_id)
            if merge is not None and isinstance(msg, protocol.RequestUpdate):
                if not msg.finished:
                    merge.add(msg)
                    return
                msg = merge.result(msg)
            queue.put_nowait(msg)
            if isinstance(msg, protocol.Error) or isinstance(msg, Buffered) or msg.finished:
                self.unsubscribe(msg.request_id if not isinstance(msg, Buffered) else msg.update.request_id)
        elif isinstance(msg, protocol.Pong):
            self.last_pong = msg
            waiters, self._ping_waiters = self._ping_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(msg)
        elif isinstance(msg, protocol.StatsReply):
            while self._stats_waiters:
                fut = self._stats_waiters.popleft()
                if not fut.done():
                    fut.set_result(msg.stats)
                    break
        elif isinstance(msg, protocol.Error):
            log.warning("the scheduler at %s reports: %s", self.endpoint, msg.message)

    async def _watch_connection(self, monitor) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and self.subscribers:
                    log.error("the connection to the scheduler at %s dropped: failing %d request(s)",
                              self.endpoint, len(self.subscribers))
                    self.fail_all(503, f"the engine at {self.endpoint} went away")
        finally:
            monitor.close(linger=0)

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.sock.send_multipart(
                    protocol.encode(protocol.Ping(self.identity, time.time()))), self.ping_interval_s)
            except (asyncio.TimeoutError, zmq.ZMQError):
                pass     # not connected: the silence below decides
            await asyncio.sleep(self.ping_interval_s)
            silent = time.monotonic() - self.last_heard
            if silent > self.dead_after_s and not self.dead and await self.sock.poll(0, zmq.POLLIN):
                continue   # this router was the one away (paused, busy): the scheduler's words wait unread
            if silent > self.dead_after_s and not self.dead:
                self.dead = True
                # Before its first word the scheduler is still starting (a first start builds the
                # model and compiles the CPU kernel: tens of seconds), which is no error.
                (log.error if self.heard else log.info)(
                    "the scheduler at %s has not answered for %.1f s%s", self.endpoint, silent,
                    "" if self.heard else " (it may still be starting)")
                self.fail_all(503, f"the engine at {self.endpoint} stopped answering")

    def fail_all(self, status: int, message: str) -> None:
        subscribers, self.subscribers, self.merging = self.subscribers, {}, {}
        self.on_final.clear()     # the scheduler that held them is gone: no final will come
        for queue in subscribers.values():
            queue.put_nowait(Failure(status, message))
