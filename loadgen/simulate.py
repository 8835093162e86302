"""`loadgen simulate`: the project's own Scheduler and BlockStore, unchanged, driven in virtual time
by a worker that computes nothing and charges each step what loadgen.cost_model says a GPU takes,
or, with --profile, what a machine measured (loadgen.profiled_cost).

Nothing here schedules: requests go in through Scheduler.add_request at their arrival times, every
step is Scheduler.schedule(), the store is the kvstore's BlockStore behind the same op-log recorder
the served scheduler plans on (its swap results say which blocks crossed the host link, its append
results which blocks were copied on write), and the
sampled tokens go back through Scheduler.update. The clock the scheduler reads is the virtual one,
so its time stamps (first token, finish) and its time-averaged KV split are in simulated seconds.
Outputs run to their trace length (ignore_eos), so the simulated tokens' values do not matter.
"""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.kvstore.allocator import make_policy
from pagedserve.kvstore.replay import RecordingStore
from pagedserve.kvstore.store import BlockStore
from pagedserve.loadgen.client import RequestRecord
from pagedserve.loadgen.config import SimulateConfig
from pagedserve.loadgen.cost_model import GiB, PRESETS, BlockMoves, Preset, custom_preset
from pagedserve.loadgen.metrics import summarize
from pagedserve.loadgen.profiled_cost import ProfiledServer
from pagedserve.loadgen.report import write_run
from pagedserve.loadgen.traces import load_trace
from pagedserve.loadgen.workload import Plan, build_plan
from pagedserve.services.sampling_params import SamplingParams
from pagedserve.services.scheduler.scheduler import Scheduler, SchedulerConfig
from pagedserve.services.scheduler.step_log import composition, step_kind
from pagedserve.services.steps import SampleResult

FIRST_TOKEN_ID, VOCAB = 10, 50000


@dataclass
class SimResult:
    config: SimulateConfig
    preset: Preset | ProfiledServer
    plan: Plan
    records: list[RequestRecord]
    kv_breakdown: dict
    scheduler_stats: dict
    num_steps: int
    wall_s: float
    notes: list[str] = field(default_factory=list)
    busy_s: float = 0.0         # the steps' priced seconds summed (virtual time the engine ran)
    # kind (step_log.step_kind) -> [steps, their priced seconds summed]
    steps_by_kind: dict = field(default_factory=dict)


def preset_of(cfg: SimulateConfig) -> Preset | ProfiledServer:
    """The simulated server: a preset priced by the roofline, or with --profile the profiled
    model priced by its measured steps (step_profile.ProfileError for a profile it cannot use)."""
    if cfg.profile:
        pool = int(cfg.kv_cache_gib * GiB) if cfg.kv_cache_gib is not None else None
        return ProfiledServer.load(cfg.profile, pool, cfg.max_num_seqs)
    if cfg.preset == "custom":
        if not cfg.model_config:
            raise ValueError("--preset custom needs --model-config (a config.json)")
        preset = custom_preset(cfg.model_config, cfg.gpu_flops, cfg.gpu_mem_bw,
                               int((cfg.kv_cache_gib or 1.0) * GiB), cfg.num_gpus)
    else:
        preset = PRESETS[cfg.preset]
    if cfg.kv_cache_gib is not None:
        preset = dataclasses.replace(preset, kv_cache_bytes=int(cfg.kv_cache_gib * GiB))
    return preset


def make_workload(cfg: SimulateConfig, max_model_len: int) -> Plan:
    """The requests, as `loadgen replay` would send them (the same fitting, arrivals and prompts),
    each prompt after the shared prefix when one is asked for."""
    trace = load_trace(cfg.trace, num_requests=cfg.num_requests, seed=cfg.seed)
    room = max_model_len - cfg.shared_prefix_len
    if room < 2:
        raise ValueError(f"--shared-prefix-len {cfg.shared_prefix_len} leaves no room in the context")
    plan = build_plan(trace, max_model_len=room, fit_mode=cfg.fit, kv_block_size=cfg.block_size, seed=cfg.seed,
                      rate=cfg.rate, burstiness=cfg.burstiness, trace_times=False, speed=1.0, duration=None,
                      num_requests=cfg.num_requests, warmup=0, pool=list(range(FIRST_TOKEN_ID, VOCAB)))
    if cfg.shared_prefix_len:
        prefix = random.Random(f"{cfg.seed}:prefix").choices(range(FIRST_TOKEN_ID, VOCAB), k=cfg.shared_prefix_len)
        for r in plan.requests:
            r.prompt, r.input_len = prefix + list(r.prompt), r.input_len + cfg.shared_prefix_len
    return plan


def _draws(samples) -> list[SampleResult]:
    """What the worker would answer: one token per wanted sample, candidates for a beam (distinct
    per beam and step, so beams diverge and die as they would)."""
    out = []
    for wanted in samples:
        for w in wanted:
            if w.beam_candidates:
                base = w.seq_id * 7919 + len(w.output_token_ids) * 104729
                out.append(SampleResult(w.seq_id, candidates=[
                    [FIRST_TOKEN_ID + (base + k) % (VOCAB - FIRST_TOKEN_ID), -0.5 - k - (base % 97) / 97.0]
                    for k in range(w.beam_candidates)]))
            else:
                out.append(SampleResult(w.seq_id, FIRST_TOKEN_ID + (w.seq_id + len(w.output_token_ids)) % 1000, -1.0))
    return out


def simulate(cfg: SimulateConfig, scheduler_config: SchedulerConfig | None = None,
             plan: Plan | None = None) -> SimResult:
    """plan: the requests to simulate (default: cfg's workload); loadgen fidelity passes the very
    plan a replay sent the real stack."""
    started = time.perf_counter()
    preset = preset_of(cfg)
    max_len = preset.max_model_len
    plan = plan or make_workload(cfg, max_len)
    bs = cfg.block_size
    num_blocks = preset.num_kv_tokens() // bs
    host_blocks = int(cfg.swap_space_gib * GiB) // (preset.kv_bytes_per_token * bs)
    store = RecordingStore(num_blocks, host_blocks, bs, enable_prefix_caching=cfg.prefix_caching,
                                      policy=make_policy(cfg.allocation, max_len))
    now = [0.0]
    # kv_usage_interval_s=0: the KV split is sampled at every step (of the virtual clock).
    sched = Scheduler(scheduler_config or SchedulerConfig.of(cfg, max_model_len=max_len, kv_usage_interval_s=0.0),
                      store, clock=lambda: now[0])
    cost = preset.cost_model()
    requests = plan.requests
    records = {r.index: RequestRecord(r.index, r.arrival, r.input_len, r.output_len, r.prefix_blocks, send=r.arrival)
               for r in requests}
    rid_of = {}
    nxt, steps, busy = 0, 0, 0.0
    by_kind: dict[str, list] = {}
    admitted: set[str] = set()    # requests whose prompt's admission has been charged
    ahead = None            # async scheduling: (the step planned while the last one ran, its block moves)
    while nxt < len(requests) or sched.has_unfinished():
        while nxt < len(requests) and requests[nxt].arrival <= now[0]:
            r = requests[nxt]
            beam = cfg.beam_width > 1   # beam search is greedy and stops only at max_tokens here
            params = SamplingParams(n=cfg.n, beam_width=cfg.beam_width, max_tokens=r.output_len,
                                    min_tokens=0 if beam else r.output_len,
                                    temperature=1.0 if cfg.n > 1 and not beam else 0.0,
                                    ignore_eos=True, seed=None if beam else r.index)
            rid = f"sim-{r.index}"
            sched.add_request(rid, list(r.prompt), params, arrival_time=r.arrival, true_output_len=r.output_len)
            rid_of[rid] = r.index
            nxt += 1
        if not sched.has_unfinished():
            now[0] = requests[nxt].arrival
            continue
        if ahead is not None:     # planned while the step before ran: arrivals since wait for the next
            step, moves, ahead = ahead[0], ahead[1], None
        else:
            step = sched.schedule()
            moves = _block_moves(*store.drain())   # the op log a served scheduler sends its kvstore
        if cfg.async_scheduling and not step.is_empty:
            # As the served scheduler (and Engine.step): the next step is planned now, before this
            # one's tokens; its op log is its own and is charged when it runs.
            planned = sched.schedule_ahead(step)
            if planned is not None:
                ahead = (planned, _block_moves(*store.drain()))
        if step.is_empty:   # nothing fits now (the requests it aborted, if any, still finish)
            _record(sched, sched.update(step, []), records, rid_of)
            if sched.has_unfinished():
                if nxt >= len(requests):
                    raise RuntimeError("the scheduler holds work it never schedules")
                now[0] = max(now[0], requests[nxt].arrival)
            continue
        seqs = [(len(s.token_ids), s.start_pos + len(s.token_ids)) for s in step.steps]
        dt = cost.step_time(seqs, sum(1 for w in step.samples if w), moves, bs)
        # The requests this step starts had their prompts taken in (tokenized, their blocks hashed)
        # beside the worker, on the same cores, before it ran (preset.admission_s_per_token).
        for req in step.step_requests:
            if req.request_id not in admitted:
                admitted.add(req.request_id)
                dt += preset.admission_s_per_token * len(req.prompt_token_ids)
        acc = by_kind.setdefault(step_kind(composition(seqs)), [0, 0.0])
        acc[0] += 1
        acc[1] += dt
        now[0] += dt
        busy += dt
        steps += 1
        # The step's events leave one after another (router, then client): the k-th of B
        # streams reads its token k events late, (B + 1) / 2 on average (preset.event_s).
        sampled = [req for req, wanted in zip(step.step_requests, step.samples) if wanted]
        seen = now[0] + preset.event_s * (len(set(map(id, sampled))) + 1) / 2
        for req in sampled:
            records[rid_of[req.request_id]].token_times.append(seen)
        _record(sched, sched.update(step, _draws(step.samples)), records, rid_of)
    _delay(records.values(), preset.request_overhead_s)
    return SimResult(cfg, preset, plan, [records[r.index] for r in requests], sched.kv_breakdown(),
                     dict(sched.stats), steps, time.perf_counter() - started, list(plan.notes), busy, by_kind)


def _block_moves(ops: list[list], results: list) -> BlockMoves:
    """What a step's op log copied: a swap's result maps each block it moved, an append's lists
    its copy-on-write copies (replay.encode_result's wire forms)."""
    out = back = copied = 0
    for op, r in zip(ops, results):
        if op[0] == "swap_out":
            out += len(r[1])
        elif op[0] == "swap_in":
            back += len(r[1])
        elif op[0] in ("append_slots", "append_tokens"):
            copied += len(r[1])
    return BlockMoves(out, back, copied)


def _delay(records, lag_s: float) -> None:
    """What the client sees: every event of a request later by the API's path (a profile's "api"
    entry; a constant, so it shifts no request against another and changes no queue)."""
    if not lag_s:
        return
    for rec in records:
        rec.token_times = [t + lag_s for t in rec.token_times]
        rec.first_token = None if rec.first_token is None else rec.first_token + lag_s
        rec.end = None if rec.end is None else rec.end + lag_s


def _record(sched: Scheduler, finished: list, records: dict, rid_of: dict) -> None:
    for req in finished:
        rec = records[rid_of[req.request_id]]
        rec.end, rec.first_token = req.finish_time, req.first_token_time
        rec.prompt_tokens = len(req.prompt_token_ids)
        rec.output_tokens = max((len(s.output_token_ids) for s in req.finished), default=0)
        rec.token_times = sorted(set(rec.token_times))   # n > 1: one time per step, not per sample
        if rec.token_times:   # as the client reads them: its events' times (preset.event_s late)
            last = rec.token_times[-1]
            rec.first_token, rec.end = rec.token_times[0], last if rec.end is None else max(rec.end, last)
        if req.error:
            rec.error, rec.error_detail = "aborted", req.error
        sched.pop_finished(req.request_id)


def summary_of(result: SimResult) -> dict:
    """replay's summary.json fields, in virtual seconds, plus the batch and the Fig. 2 split."""
    cfg, kb = result.config, result.kv_breakdown
    sat = kb["saturated"]
    figures = summarize(result.records, cfg.percentiles)
    return {
        **figures,
        "label": cfg.label or f"{result.preset.name} {cfg.allocation}"
                              f"{' request-batching' if cfg.batching == 'request' else ''}, {cfg.trace}",
        "interrupted": False,
        "num_prompts": len(result.records),
        "request_rate": cfg.rate,
        "burstiness": cfg.burstiness,
        "trace": cfg.trace,
        "fit": dataclasses.asdict(result.plan.fit),
        "preset": result.preset.name, "preset_description": result.preset.description,
        "profile": result.preset.priced_by(cfg.block_size),     # None: the roofline priced the steps
        "allocation": cfg.allocation, "batching": cfg.batching,
        "num_kv_token_slots": result.preset.num_kv_tokens() // cfg.block_size * cfg.block_size,
        "avg_batched_requests": kb["avg_batched_requests"],
        "kv_token_share": kb["cache"]["token_states"],
        "kv_breakdown": {"cache": kb["cache"], "allocated": kb["allocated"]},
        "sharing_saving": kb["sharing_saving"],
        # The same while requests waited (the server saturated): what the paper's figures compare.
        "saturated": {"seconds": sat["seconds"], "avg_batched_requests": sat["avg_batched_requests"],
                      "kv_token_share": sat["cache"]["token_states"],
                      "kv_breakdown": {"cache": sat["cache"], "allocated": sat["allocated"]}},
        "num_steps": result.num_steps,
        "busy_seconds": result.busy_s,
        "steps_by_kind": {kind: {"steps": n, "priced_ms": 1e3 * t / n} for kind, (n, t) in result.steps_by_kind.items()},
        "simulated_seconds": kb["seconds"],
        "wall_seconds": result.wall_s,
        "num_preemptions": result.scheduler_stats.get("preemptions", 0),
        "notes": result.notes,
        "options": dataclasses.asdict(cfg),
        "virtual_time": True,
    }


def write_outputs(result: SimResult, out: str | Path) -> dict:
    summary = summary_of(result)
    write_run(Path(out), summary, result.records)
    return summary
