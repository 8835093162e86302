"""`loadgen replay`: one run of a workload against a server, from the plan to the written report.

The main loop sends each planned request at its arrival time (bounded by --max-concurrency), while
a scraper reads the server's /metrics and a progress bar counts. Ctrl-C (or SIGTERM) stops sending,
waits --grace seconds for what is in flight, cancels the rest (recorded as `interrupted`) and
writes what it has; a second Ctrl-C cancels at once.
"""
from __future__ import annotations

import asyncio
import math
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.loadgen.client import RequestRecord, Target, get_json, new_session, send
from pagedserve.loadgen.config import ReplayConfig
from pagedserve.loadgen.scrape import Scraper
from pagedserve.loadgen.traces import SYNTHETIC, load_trace
from pagedserve.loadgen.workload import FIT_SAMPLE, Plan, PlannedRequest, build_plan

DEFAULT_REQUESTS = 200        # sent when neither --num-requests nor --duration bounds a run (a whole
                              # trace file was 19,365 requests: hours at a few req/s)
LONG_RUN_S = 600.0            # arrivals spread over longer than this are announced as a warning
FIRST_TOKEN_ID = 10           # token-id prompts avoid the lowest ids (specials in most vocabularies)


class ReplayError(RuntimeError):
    """A run that cannot start (server unreachable, bad trace): one line for the user."""


@dataclass
class Server:
    url: str
    model: str
    max_model_len: int
    models: list[str] = field(default_factory=list)


@dataclass
class RunResult:
    config: ReplayConfig
    server: Server
    plan: Plan
    records: list[RequestRecord]
    samples: list[dict]                 # scraped /metrics series
    started_at: float                   # wall clock (time.time) of t0
    interrupted: bool = False
    metrics_available: bool | None = None
    notes: list[str] = field(default_factory=list)


def replay(cfg: ReplayConfig) -> RunResult:
    return asyncio.run(run_replay(cfg))


async def run_replay(cfg: ReplayConfig, plan: Plan | None = None) -> RunResult:
    async with new_session(None) as session:
        server = await discover(session, cfg)
        if plan is None:
            plan = make_plan(cfg, server)
            print(plan_line(cfg, plan), file=sys.stderr, flush=True)
        target = Target(cfg.url.rstrip("/"), server.model, cfg.endpoint, cfg.api_key, cfg.stream,
                        cfg.temperature, cfg.force_output_len, cfg.send_true_output_len)
        return await _run(session, cfg, server, plan, target)


async def discover(session, cfg: ReplayConfig) -> Server:
    """The model to name and its context, from /v1/models unless both are given."""
    url = cfg.url.rstrip("/")
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        listing = await get_json(session, url + "/v1/models", headers)
        models = listing.get("data") or []
    except Exception as e:    # any failure: the flags may still be enough
        if cfg.model and cfg.max_model_len:
            return Server(url, cfg.model, cfg.max_model_len)
        raise ReplayError(f"cannot read {url}/v1/models ({type(e).__name__}: {e}); "
                          "is the server up? (or give --model and --max-model-len)") from None
    ids = [m.get("id") for m in models if isinstance(m, dict)]
    model = cfg.model or (ids[0] if ids else None)
    if model is None:
        raise ReplayError(f"{url}/v1/models lists no model; give --model")
    entry = next((m for m in models if isinstance(m, dict) and m.get("id") == model), {})
    max_len = cfg.max_model_len or entry.get("max_model_len")
    if not isinstance(max_len, int) or max_len < 2:
        raise ReplayError(f"{url}/v1/models gives no max_model_len for {model!r}; give --max-model-len")
    return Server(url, model, max_len, ids)


def make_plan(cfg: ReplayConfig, server: Server) -> Plan:
    codec = None
    if cfg.tokenizer:
        from pagedserve.loadgen.text_prompts import TextCodec
        if not Path(cfg.tokenizer).is_dir():
            raise ReplayError(f"--tokenizer {cfg.tokenizer}: no such folder (a local tokenizer folder; "
                              "nothing is downloaded)")
        try:
            codec = TextCodec(cfg.tokenizer, chat=cfg.endpoint == "chat")
        except (OSError, ValueError) as e:
            raise ReplayError(f"--tokenizer {cfg.tokenizer}: {e}") from None
    count = request_count(cfg)
    if cfg.trace in SYNTHETIC:
        wanted = count or max(DEFAULT_REQUESTS, math.ceil(cfg.rate * cfg.duration * 1.2))
        # At least FIT_SAMPLE: the scale factor comes from the first FIT_SAMPLE draws, so that
        # the same seed gives the same requests whatever the count, the rate or the duration.
        limit = max(wanted + cfg.warmup, FIT_SAMPLE)
    else:
        limit = sys.maxsize          # a file is read whole: the fit may drop some of its requests
    try:
        trace = load_trace(cfg.trace, num_requests=limit, seed=cfg.seed, input_len=cfg.input_len,
                           output_len=cfg.output_len, range_ratio=cfg.range_ratio)
        if codec is not None:           # the user's own texts: their exact length, not a guess
            own = [r for r in trace.requests if r.prompt is not None]
            for r, n in zip(own, codec.counts([r.prompt for r in own])):
                r.input_len = n
        pool = codec.pool if codec else list(range(FIRST_TOKEN_ID, cfg.vocab_size))
        plan = build_plan(trace, max_model_len=server.max_model_len, fit_mode=cfg.fit,
                          kv_block_size=cfg.kv_block_size, seed=cfg.seed, rate=cfg.rate,
                          burstiness=cfg.burstiness, trace_times=cfg.trace_times, speed=cfg.speed,
                          duration=cfg.duration, num_requests=count, warmup=cfg.warmup,
                          pool=pool, codec=codec)
    except ValueError as e:
        raise ReplayError(str(e)) from None
    if cfg.endpoint == "chat" and any(not isinstance(r.prompt, str) for r in plan.requests):
        raise ReplayError("--endpoint chat sends text: give --tokenizer DIR (or a trace with prompts)")
    if not plan.requests:
        raise ReplayError(f"no request of the {cfg.trace} trace is left to send ({plan.fit.describe()})")
    return plan


def request_count(cfg: ReplayConfig, default: int = DEFAULT_REQUESTS) -> int | None:
    """--num-requests; or None where --duration bounds the run (arrivals spread in time); else
    `default`: a run nobody bounded stays short."""
    if cfg.num_requests:
        return cfg.num_requests
    if cfg.duration and (cfg.trace_times or not math.isinf(cfg.rate)):
        return None
    return default


def span_text(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 \
        else f"{seconds / 3600:.1f} h"


def long_run_line(prog: str, what: str, seconds: float) -> str:
    """`what` takes `seconds` of arrivals: one line, a warning when that is long."""
    line = f"{what}: arrivals alone take about {span_text(seconds)}"
    if seconds > LONG_RUN_S:
        return (f"{prog}: warning: {line}; --num-requests N or --duration S shortens it "
                "(Ctrl-C stops and writes what it has)")
    return f"{prog}: {line}"


def plan_line(cfg: ReplayConfig, plan: Plan) -> str:
    """What the run will send, said before it starts."""
    what = f"{len(plan.requests):,} requests of {cfg.trace}"
    if not plan.requests or plan.requests[-1].arrival == 0:
        return f"loadgen: {what}, all at once"
    return long_run_line("loadgen", what, plan.requests[-1].arrival)


def stop_on_signals(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Event, asyncio.Event]:
    """(stop, hurry): the first SIGINT or SIGTERM sets stop (send nothing more, give what is in
    flight --grace seconds), the second sets hurry (cancel it now). The caller removes the handlers."""
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal():
        (hurry if stop.is_set() else stop).set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    return stop, hurry


async def _run(session, cfg: ReplayConfig, server: Server, plan: Plan, target: Target) -> RunResult:
    loop = asyncio.get_running_loop()
    stop, hurry = stop_on_signals(loop)
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    progress: Progress | None = None
    notes: list[str] = []

    async def one(req: PlannedRequest, t0: float) -> RequestRecord:
        rec = RequestRecord.planned(req)
        try:
            if limit is None:
                await send(session, target, req, t0, cfg.timeout, rec)
            else:
                async with limit:
                    await send(session, target, req, t0, cfg.timeout, rec)
        except asyncio.CancelledError:
            if rec.error is None:                   # cancelled while waiting for its turn
                _mark_interrupted(rec, t0)
        if progress is not None:
            progress.done(rec)
        return rec

    t0, started_at = time.perf_counter(), time.time()
    tasks: list[asyncio.Task] = []
    sent: list[PlannedRequest] = []
    scraper = Scraper(session, target.url, cfg.metrics_interval, t0, target.headers())
    try:
        if plan.warmup:
            warm = [asyncio.create_task(one(r, time.perf_counter())) for r in plan.warmup]
            await drain_or_cancel(warm, stop, hurry, cfg.grace)
            failed = sum(t.cancelled() or not t.result().ok for t in warm)
            if failed:
                notes.append(f"{failed} of {len(warm)} warm-up requests failed")
        progress = Progress(len(plan.requests), cfg.progress)
        t0, started_at = time.perf_counter(), time.time()
        scraper.t0 = t0
        scraping = asyncio.create_task(scraper.run(stop))
        for req in plan.requests:
            if stop.is_set():
                break
            delay = req.arrival - (time.perf_counter() - t0)
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
                if stop.is_set():
                    break
            tasks.append(asyncio.create_task(one(req, t0)))
            sent.append(req)
            progress.sent()
        await drain_or_cancel(tasks, stop, hurry, cfg.grace)
        interrupted = stop.is_set()
        stop.set()
        await scraping
        if scraper.available:
            await scraper.scrape_once()   # the counters after the last answer (prefix hits of the run)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if progress is not None:
            progress.close()
    # A task cancelled before it ever ran has no record of its own.
    records = [_interrupted(req, t0) if t.cancelled() else t.result() for t, req in zip(tasks, sent)]
    if interrupted:
        notes.append(f"interrupted: {len(records)} of {len(plan.requests)} requests were sent")
    if scraper.failures:
        notes.append(f"{scraper.failures} scrapes of /metrics failed")
    missing = sum(r.usage_missing for r in records)
    if missing:
        notes.append(f"{missing} responses had no usage: their output tokens are counted as one per text "
                     "event, a lower bound")
    return RunResult(cfg, server, plan, records, scraper.samples, started_at, interrupted,
                     scraper.available, plan.notes + notes)


async def drain_or_cancel(tasks: list[asyncio.Task], stop: asyncio.Event, hurry: asyncio.Event,
                          grace: float) -> None:
    """Wait for every task; after a stop, only `grace` more seconds (none after a second signal),
    then cancel the ones still running and wait for them to end."""
    pending = {t for t in tasks if not t.done()}
    deadline = None
    while pending and not hurry.is_set():
        if stop.is_set() and deadline is None:
            deadline = time.monotonic() + grace
        waker = asyncio.create_task((hurry if stop.is_set() else stop).wait())
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, _ = await asyncio.wait(pending | {waker}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waker.cancel()
        pending -= done
        if deadline is not None and time.monotonic() >= deadline:
            break
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _interrupted(req: PlannedRequest, t0: float) -> RequestRecord:
    return _mark_interrupted(RequestRecord.planned(req), t0)


def _mark_interrupted(rec: RequestRecord, t0: float) -> RequestRecord:
    rec.error, rec.error_detail, rec.end = "interrupted", "the run was stopped", time.perf_counter() - t0
    return rec


class Progress:
    """requests done / sent, output tok/s over the last few seconds and errors, on stderr (tqdm),
    redrawn at most twice a second."""

    WINDOW_S = 5.0

    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm
        self.bar = tqdm(total=total, unit="req", file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                        mininterval=0.5)
        self.t0, self.n_sent, self.errors, self.last = time.perf_counter(), 0, 0, 0.0
        self.recent: deque[tuple[float, int]] = deque()      # (when, output tokens) of recent ends

    def sent(self) -> None:
        self.n_sent += 1

    def done(self, rec: RequestRecord) -> None:
        now = time.perf_counter()
        self.errors += not rec.ok
        self.recent.append((now, rec.output_tokens or 0))
        while self.recent and self.recent[0][0] < now - self.WINDOW_S:
            self.recent.popleft()
        if now - self.last >= 0.5:
            self.last = now
            rate = sum(n for _, n in self.recent) / max(1e-3, min(self.WINDOW_S, now - self.t0))
            self.bar.set_postfix_str(f"sent {self.n_sent}, {rate:.0f} tok/s, {self.errors} errors", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
