"""`loadgen multi-turn`: the multi-turn chat workload (loadgen.multi_turn) against a server.

Each user is one task: it waits for its arrival, then sends its turns one after the other on
/v1/chat/completions, each with the whole conversation so far, the server's streamed answer
appended to it (Target.keep_text), and its think time between an answer and the next turn. A turn
that fails (refused with 503 or 429, a timeout, ...) ends its conversation: the next turn would
need its answer. A turn whose prompt and answer would not fit the context ends it too, before it
is sent. The token ids of every prompt sent (the tokenizer's chat template, as the server applies
it) give the infinite-cache bound. Ctrl-C (or SIGTERM) stops new turns, waits --grace seconds for
those in flight and writes what it has, as `loadgen replay` does.
"""
from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.loadgen.client import RequestRecord, Target, new_session, send
from pagedserve.loadgen.config import MultiTurnConfig
from pagedserve.loadgen.multi_turn import (Conversation, ScriptOptions, build_script, system_prompt,
                                           turn_messages)
from pagedserve.loadgen.replay import (Progress, ReplayError, Server, discover, drain_or_cancel,
                                       long_run_line, stop_on_signals)
from pagedserve.loadgen.scrape import Scraper
from pagedserve.loadgen.workload import PlannedRequest


@dataclass
class TurnRecord(RequestRecord):
    user: int = 0
    turn: int = 0


@dataclass
class MultiTurnResult:
    config: MultiTurnConfig
    server: Server
    script: list[Conversation]
    records: list[TurnRecord]             # in the order sent
    prompts: list[list[int]]              # the token ids of each record's prompt
    samples: list[dict]                   # scraped /metrics series
    started_at: float
    interrupted: bool = False
    metrics_available: bool | None = None
    ended_at_context: int = 0             # conversations cut short: their next turn did not fit
    notes: list[str] = field(default_factory=list)


def script_options(cfg: MultiTurnConfig) -> ScriptOptions:
    return ScriptOptions(cfg.users, cfg.turns, cfg.user_rate, cfg.think_time, cfg.turn_lengths, cfg.user_len,
                         cfg.output_len, cfg.length_scale, cfg.seed)


def load_codec(cfg: MultiTurnConfig):
    if not cfg.tokenizer:
        raise ReplayError("multi-turn sends text and counts the token ids sent: give --tokenizer DIR "
                          "(the served model's folder will do)")
    if not Path(cfg.tokenizer).is_dir():
        raise ReplayError(f"--tokenizer {cfg.tokenizer}: no such folder (a local tokenizer folder; nothing "
                          "is downloaded)")
    from pagedserve.loadgen.text_prompts import TextCodec
    try:
        return TextCodec(cfg.tokenizer, chat=True)
    except (OSError, ValueError) as e:
        raise ReplayError(f"--tokenizer {cfg.tokenizer}: {e}") from None


def multi_turn(cfg: MultiTurnConfig) -> MultiTurnResult:
    return asyncio.run(run_multi_turn(cfg, load_codec(cfg)))


async def run_multi_turn(cfg: MultiTurnConfig, codec, on_sent=None) -> MultiTurnResult:
    """`codec`: pool (token ids), text(ids) -> str, chat_ids(messages) -> ids (text_prompts.TextCodec).
    `on_sent(records)`, if given, is called as each turn is about to be sent, its record last (the
    host-tier benchmark kills the scheduler half way through the turns, not half way in time)."""
    async with new_session(None) as session:
        server = await discover(session, cfg)
        script = build_script(script_options(cfg), codec.pool, codec.text)
        span = script[-1].arrival if script else 0.0
        print(long_run_line("loadgen", f"{cfg.users} users x {cfg.turns} turns", span), file=sys.stderr, flush=True)
        target = Target(cfg.url.rstrip("/"), server.model, "chat", cfg.api_key, cfg.stream, cfg.temperature,
                        cfg.force_output_len, keep_text=True)
        return await _run(session, cfg, server, script, target, codec, on_sent)


async def _run(session, cfg: MultiTurnConfig, server: Server, script: list[Conversation], target: Target,
               codec, on_sent=None) -> MultiTurnResult:
    loop = asyncio.get_running_loop()
    stop, hurry = stop_on_signals(loop)
    system = codec.text(system_prompt(codec.pool, cfg.system_len, cfg.seed)) if cfg.system_len else None
    records: list[TurnRecord] = []
    prompts: list[list[int]] = []
    ended = [0]
    progress = Progress(cfg.users * cfg.turns, cfg.progress)
    t0, started_at = time.perf_counter(), time.time()

    async def wait(seconds: float) -> bool:
        """Sleep, or less if the run is stopped; True when it was not."""
        if seconds > 0:
            try:
                await asyncio.wait_for(stop.wait(), seconds)
            except TimeoutError:
                pass
        return not stop.is_set()

    async def user(conv: Conversation) -> None:
        if not await wait(conv.arrival - (time.perf_counter() - t0)):
            return
        history: list[dict] = []
        for k, turn in enumerate(conv.turns):
            if k and not await wait(turn.think):
                return
            messages = turn_messages(system, history, turn)
            ids = codec.chat_ids(messages)
            if len(ids) + turn.output_len > server.max_model_len:
                ended[0] += 1
                return
            req = PlannedRequest(len(records), time.perf_counter() - t0, turn.text, len(ids), turn.output_len,
                                 messages=messages)
            rec = TurnRecord(req.index, req.arrival, req.input_len, req.output_len, user=conv.user, turn=k)
            records.append(rec)
            prompts.append(ids)
            progress.sent()
            if on_sent is not None:
                on_sent(records)
            try:
                await send(session, target, req, t0, cfg.timeout, rec)
            finally:
                progress.done(rec)
            if not rec.ok:
                return                      # the next turn would need this answer
            history += [messages[-1], {"role": "assistant", "content": rec.answer or ""}]

    scraper = Scraper(session, target.url, cfg.metrics_interval, t0, target.headers())
    try:
        scraping = asyncio.create_task(scraper.run(stop))
        users = [asyncio.create_task(user(conv)) for conv in script]
        await drain_or_cancel(users, stop, hurry, cfg.grace)
        interrupted = stop.is_set()
        stop.set()
        await scraping
        if scraper.available:
            await scraper.scrape_once()   # the counters after the last answer
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        progress.close()
    for rec in records:
        if rec.error is None and rec.end is None:     # cancelled before its answer began
            rec.error, rec.error_detail, rec.end = "interrupted", "the run was stopped", time.perf_counter() - t0
    notes = []
    if interrupted:
        notes.append(f"interrupted: {len(records)} of {cfg.users * cfg.turns} turns were sent")
    if ended[0]:
        notes.append(f"{ended[0]} conversations ended early: their next turn would not fit the context "
                     f"({server.max_model_len} tokens)")
    if scraper.failures:
        notes.append(f"{scraper.failures} scrapes of /metrics failed")
    return MultiTurnResult(cfg, server, script, records, prompts, scraper.samples, started_at, interrupted,
                           scraper.available, ended[0], notes)
