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
from dataclasses import dataclass, field

from loadgen.client import RequestRecord, Target, get_json, new_session, send
from loadgen.config import ReplayConfig
from loadgen.scrape import Scraper
from loadgen.traces import SYNTHETIC, load_trace
from loadgen.workload import Plan, PlannedRequest, build_plan

DEFAULT_DRAWN = 1000          # requests drawn from a distribution when --num-requests is not given
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
        from loadgen.text_prompts import TextCodec
        try:
            codec = TextCodec(cfg.tokenizer, chat=cfg.endpoint == "chat")
        except (OSError, ValueError) as e:
            raise ReplayError(f"--tokenizer {cfg.tokenizer}: {e}") from None
    if cfg.trace in SYNTHETIC:
        wanted = cfg.num_requests or (max(DEFAULT_DRAWN, math.ceil(cfg.rate * cfg.duration * 1.2))
                                      if cfg.duration and not math.isinf(cfg.rate) else DEFAULT_DRAWN)
        limit = wanted + cfg.warmup
    else:
        limit = sys.maxsize          # a file is read whole: the fit may drop some of its requests
    try:
        trace = load_trace(cfg.trace, num_requests=limit, seed=cfg.seed, input_len=cfg.input_len,
                           output_len=cfg.output_len, range_ratio=cfg.range_ratio)
        pool = codec.pool if codec else list(range(FIRST_TOKEN_ID, cfg.vocab_size))
        plan = build_plan(trace, max_model_len=server.max_model_len, fit_mode=cfg.fit,
                          kv_block_size=cfg.kv_block_size, seed=cfg.seed, rate=cfg.rate,
                          burstiness=cfg.burstiness, trace_times=cfg.trace_times, speed=cfg.speed,
                          duration=cfg.duration, num_requests=cfg.num_requests, warmup=cfg.warmup,
                          pool=pool, codec=codec)
    except ValueError as e:
        raise ReplayError(str(e)) from None
    if cfg.endpoint == "chat" and any(not isinstance(r.prompt, str) for r in plan.requests):
        raise ReplayError("--endpoint chat sends text: give --tokenizer DIR (or a trace with prompts)")
    if not plan.requests:
        raise ReplayError(f"no request of the {cfg.trace} trace is left to send ({plan.fit.describe()})")
    return plan


async def _run(session, cfg: ReplayConfig, server: Server, plan: Plan, target: Target) -> RunResult:
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal():
        (hurry if stop.is_set() else stop).set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    progress = Progress(len(plan.requests), cfg.progress)
    notes: list[str] = []

    async def one(req: PlannedRequest, t0: float) -> RequestRecord:
        try:
            if limit is None:
                rec = await send(session, target, req, t0, cfg.timeout)
            else:
                async with limit:
                    rec = await send(session, target, req, t0, cfg.timeout)
        except asyncio.CancelledError:
            rec = _interrupted(req, t0)
        progress.done(rec)
        return rec

    try:
        if plan.warmup:
            warm = await asyncio.gather(*(one(r, time.perf_counter()) for r in plan.warmup))
            if any(not r.ok for r in warm):
                notes.append(f"{sum(not r.ok for r in warm)} of {len(warm)} warm-up requests failed")
        t0, started_at = time.perf_counter(), time.time()
        scraper = Scraper(session, target.url, cfg.metrics_interval, t0, target.headers())
        scraping = asyncio.create_task(scraper.run(stop))
        tasks: list[asyncio.Task] = []
        sent: list[PlannedRequest] = []
        for req in plan.requests:
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
        await _finish(tasks, stop, hurry, cfg.grace)
        interrupted = stop.is_set()
        stop.set()
        await scraping
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        progress.close()
    # A task cancelled before it ever ran has no record of its own.
    records = [_interrupted(req, t0) if t.cancelled() else t.result() for t, req in zip(tasks, sent)]
    if interrupted:
        notes.append(f"interrupted: {len(records)} of {len(plan.requests)} requests were sent")
    if scraper.failures:
        notes.append(f"{scraper.failures} scrapes of /metrics failed")
    return RunResult(cfg, server, plan, records, scraper.samples, started_at, interrupted,
                     scraper.available, plan.notes + notes)


async def _finish(tasks: list[asyncio.Task], stop: asyncio.Event, hurry: asyncio.Event, grace: float) -> None:
    """Wait for every request; after a stop, only `grace` more seconds (none after a second signal)."""
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
    rec = RequestRecord(req.index, req.arrival, req.input_len, req.output_len, req.prefix_blocks,
                        error="interrupted", error_detail="the run was stopped")
    rec.end = time.perf_counter() - t0
    return rec


class Progress:
    """requests done / sent, output tok/s so far and errors, on stderr (tqdm), at most twice a second."""

    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm
        self.bar = tqdm(total=total, unit="req", file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                        mininterval=0.5)
        self.t0, self.n_sent, self.tokens, self.errors, self.last = time.perf_counter(), 0, 0, 0, 0.0

    def sent(self) -> None:
        self.n_sent += 1

    def done(self, rec: RequestRecord) -> None:
        self.tokens += rec.output_tokens or 0
        self.errors += not rec.ok
        now = time.perf_counter()
        if now - self.last >= 0.5:
            self.last = now
            self.bar.set_postfix_str(f"sent {self.n_sent}, {self.tokens / max(1e-9, now - self.t0):.0f} tok/s, "
                                     f"{self.errors} errors", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
