"""The load generator's options: one dataclass per subcommand, flags derived from the fields
(services.flags). Names follow `vllm bench serve` where the meaning is the same."""
from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.loadgen.multi_turn import TURN_LENGTHS
from pagedserve.loadgen.traces import TRACE_NAMES
from pagedserve.loadgen.workload import FIT_MODES
from pagedserve.services import config_fields as cf
from pagedserve.services.flags import opt

ENDPOINTS = ("completions", "chat")
SLO_KEYS = ("ttft", "tpot", "e2el")


def _positive(v) -> bool | str:
    return v > 0 or "must be > 0"


def _at_least(n):
    return lambda v: v >= n or f"must be >= {n}"


def _percentiles(ps) -> bool | str:
    return all(0 < p < 100 for p in ps) or "each percentile must lie in (0, 100)"


def parse_goodput(items: list[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds), as vLLM's --goodput."""
    slos = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"{item!r}: expected KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        ms = float(value)
        if not ms > 0:
            raise ValueError(f"{item!r}: the limit must be > 0 ms")
        slos[key] = ms
    return slos


def _goodput(items) -> bool | str:
    try:
        parse_goodput(items)
        return True
    except ValueError as e:
        return str(e)


@dataclass
class ReplayConfig:
    # target
    url: str = opt("http://127.0.0.1:8000", "the server's base URL (any OpenAI-compatible server)")
    model: str | None = opt(None, "model name to send (default: the first id in /v1/models)")
    endpoint: str = opt("completions", "API to call", choices=ENDPOINTS)
    api_key: str | None = opt(None, "bearer token", env="OPENAI_API_KEY")
    tokenizer: str | None = opt(None, "local tokenizer folder: send text prompts of exact token length "
                                      "(default: token-id prompts, completions only)")
    # workload
    trace: str = opt("sharegpt", f"workload: one of {', '.join(TRACE_NAMES)}, or a JSONL file "
                                 "(prompt or input_length, output_length, optional timestamp in ms, hash_ids)")
    input_len: int = opt(1024, "random trace: prompt tokens", check=_at_least(1))
    output_len: int = opt(128, "random trace: output tokens", check=_at_least(1))
    range_ratio: float = opt(0.0, "random trace: lengths uniform in len*(1-r) .. len*(1+r)",
                             check=lambda v: 0 <= v < 1 or "must lie in [0, 1)")
    max_model_len: int | None = opt(None, "fit lengths to this context (default: max_model_len from /v1/models)",
                                    check=_at_least(2))
    fit: str = opt("scale", "scale: shrink every length so the p99 request fits, cap the rest (a trace "
                            "block stays at least one KV block); filter: drop requests that do not fit",
                   choices=FIT_MODES)
    num_requests: int | None = opt(None, "requests to send, at most (default: 200, or with --duration "
                                         "every request that arrives within it)", check=_at_least(1))
    duration: float | None = opt(None, "send only requests that arrive within this many seconds", check=_positive)
    kv_block_size: int = opt(16, "the server's KV block size: a trace block becomes a whole number of them",
                             check=_at_least(1))
    vocab_size: int = opt(1000, "token-id prompts draw ids from [10, this)", check=_at_least(11))
    # arrivals
    rate: float = opt(math.inf, "requests per second (Poisson), or inf: all at once", check=_positive)
    burstiness: float = opt(1.0, "gamma shape of the gaps (1: Poisson; lower: burstier)", check=_positive)
    trace_times: bool = opt(False, "use the trace's own timestamps instead of --rate")
    speed: float = opt(1.0, "with --trace-times: divide the trace's times by this", check=_positive)
    max_concurrency: int | None = opt(None, "at most this many requests in flight", check=_at_least(1))
    warmup: int = opt(0, "requests sent (and awaited) before the run, left out of the figures", check=_at_least(0))
    seed: int = opt(0, "fixes every draw: lengths, arrivals, prompts")
    # requests
    stream: bool = opt(True, "stream responses (SSE); TTFT, TPOT and ITL need it")
    temperature: float = opt(0.0, "sampling temperature sent", check=lambda v: v >= 0 or "must be >= 0")
    force_output_len: bool = opt(True, "send ignore_eos and min_tokens so that every output has its length")
    send_true_output_len: bool = opt(False, "send each request's output length as true_output_len (pagedserve "
                                            "--allocation orca-pow2/orca-oracle reserve it; other servers reject it)")
    timeout: float = opt(600.0, "seconds a request may take before it counts as a timeout", check=_positive)
    # report
    percentiles: list[float] = opt([50.0, 90.0, 99.0], "percentiles to report", check=_percentiles)
    goodput: list[str] = opt([], "SLOs as KEY:MS (ttft, tpot, e2el), e.g. ttft:500 tpot:50", check=_goodput)
    metrics_interval: float = opt(0.5, "seconds between scrapes of the server's /metrics (0: none)",
                                  check=lambda v: v >= 0 or "must be >= 0")
    out: str = opt("loadgen-out", "folder for summary.json, requests.jsonl, metrics.jsonl, report.md, plots")
    label: str | None = opt(None, "name of this run in reports (default: the server and the trace)")
    plots: bool = opt(True, "write PNG plots (matplotlib)")
    progress: bool = opt(True, "show a progress bar on stderr")
    grace: float = opt(5.0, "after Ctrl-C, seconds to wait for requests in flight", check=lambda v: v >= 0 or "must be >= 0")

    @property
    def slos(self) -> dict[str, float]:
        return parse_goodput(self.goodput)

    def cross_check(self) -> str | None:
        if not self.stream and set(self.slos) & {"ttft", "tpot"}:
            return "--goodput ttft/tpot need streamed responses (drop --no-stream, or give only e2el)"
        return None


def _rate_list(rates: list[str]) -> bool | str:
    try:
        return all(float(r) > 0 for r in rates) and bool(rates) or "rates must be numbers > 0 (or auto)"
    except ValueError:
        return "rates must be numbers > 0 (or auto)"


@dataclass
class SweepConfig(ReplayConfig):
    rates: list[str] = opt(["auto"], "request rates, e.g. 1,2,4,8; or auto: find the saturated "
                                     "throughput with --rate inf, then rates spread below it",
                             check=lambda rs: rs == ["auto"] or _rate_list(rs))
    auto_points: int = opt(5, "with --rates auto: this many rates, evenly up to the saturated one",
                           check=_at_least(1))
    max_normalized_latency: float | None = opt(None, "mark the highest rate whose normalized latency (s/token) "
                                                     "stays under this", check=_positive)
    # Per rate: a sweep is several replays; 1000 a rate at a tiny model's few req/s was ~45 min.
    num_requests: int | None = opt(None, "requests per rate, at most (default: 100, or with --duration "
                                         "every request that arrives within it)", check=_at_least(1))

    def rate_values(self) -> list[float] | None:
        """The rates asked for, or None for auto."""
        if self.rates == ["auto"]:
            return None
        return [float(r) for r in self.rates]


@dataclass
class MultiTurnConfig:
    # target (as replay's)
    url: str = opt("http://127.0.0.1:8000", "the server's base URL (any OpenAI-compatible chat server)")
    model: str | None = opt(None, "model name to send (default: the first id in /v1/models)")
    api_key: str | None = opt(None, "bearer token", env="OPENAI_API_KEY")
    tokenizer: str | None = opt(None, "the model's local tokenizer folder (required): messages are real "
                                      "text, and the token ids sent give the infinite-cache bound")
    max_model_len: int | None = opt(None, "the context (default: max_model_len from /v1/models); a "
                                          "conversation ends at the turn that would not fit", check=_at_least(2))
    # the workload
    users: int = opt(20, "conversations (users)", check=_at_least(1))
    turns: int = opt(5, "turns per conversation", check=_at_least(1))
    user_rate: float = opt(0.5, "new users per second (Poisson), or inf: all at once", check=_positive)
    think_time: float = opt(5.0, "mean seconds between an answer and the user's next turn (exponential; 0: "
                                 "none)", check=lambda v: v >= 0 or "must be >= 0")
    turn_lengths: str = opt("sharegpt", "sharegpt: user message and answer lengths per turn from the "
                                        "ShareGPT fit (loadgen.lengths), divided by --length-scale; fixed: "
                                        "--user-len and --output-len", choices=TURN_LENGTHS)
    length_scale: float = opt(1.0, "sharegpt: divide every drawn length by this (small contexts)", check=_positive)
    user_len: int = opt(64, "fixed: tokens per user message", check=_at_least(1))
    output_len: int = opt(64, "fixed: tokens per answer", check=_at_least(1))
    system_len: int = opt(64, "tokens of the system prompt every conversation starts with (0: none)",
                          check=_at_least(0))
    kv_block_size: int = opt(16, "the server's KV block size, for the infinite-cache bound", check=_at_least(1))
    seed: int = opt(0, "fixes every draw: arrivals, think times, lengths, messages")
    # requests
    stream: bool = opt(True, "stream responses (SSE); TTFT needs it")
    temperature: float = opt(0.0, "sampling temperature sent", check=lambda v: v >= 0 or "must be >= 0")
    force_output_len: bool = opt(True, "send ignore_eos and min_tokens so that every answer has its length")
    timeout: float = opt(600.0, "seconds a request may take before it counts as a timeout", check=_positive)
    # report
    percentiles: list[float] = opt([50.0, 90.0, 99.0], "percentiles to report", check=_percentiles)
    metrics_interval: float = opt(0.5, "seconds between scrapes of the server's /metrics (0: none)",
                                  check=lambda v: v >= 0 or "must be >= 0")
    out: str = opt("loadgen-multi-turn", "folder for summary.json, requests.jsonl, metrics.jsonl, report.md")
    label: str | None = opt(None, "name of this run in reports (default: the server and the workload)")
    progress: bool = opt(True, "show a progress bar on stderr")
    grace: float = opt(5.0, "after Ctrl-C, seconds to wait for requests in flight", check=lambda v: v >= 0 or "must be >= 0")


@dataclass
class CompareConfig:
    dirs: list[str] = opt([], "sweep or replay folders to put side by side", positional=True, metavar="DIR")
    labels: list[str] = opt([], "a name for each folder (default: the folder's label)")
    out: str = opt("loadgen-compare", "folder for compare.md and compare.png")


PRESET_NAMES = ("opt-13b-a100-40g", "opt-66b-4xa100", "opt-175b-8xa100-80g", "custom")
ALLOCATION_NAMES = ("paged", "orca-max", "orca-pow2", "orca-oracle")   # kvstore.allocator.ALLOCATIONS


@dataclass
class SimulateConfig:
    # the simulated server
    preset: str = opt("opt-13b-a100-40g", "model and GPUs (the paper's setups), or custom", choices=PRESET_NAMES)
    model_config: str | None = opt(None, "custom: a model's config.json")
    gpu_flops: float = opt(312e12, "custom: peak fp16 FLOP/s per GPU", check=_positive)
    gpu_mem_bw: float = opt(1.555e12, "custom: memory bytes/s per GPU", check=_positive)
    num_gpus: int = opt(1, "custom: GPUs (tensor parallel)", check=_at_least(1))
    profile: str | None = opt(None, "a step profile (loadgen profile's JSON): its model, each step's time as "
                                    "that machine measured it (instead of the preset and its roofline)")
    kv_cache_gib: float | None = opt(None, "KV pool in GiB (default: the preset's; with --profile room for "
                                           "--max-num-seqs sequences of the model's whole context)", check=_positive)
    allocation: str = opt("paged", "the block store's policy", choices=ALLOCATION_NAMES)
    batching: str = opt("iteration", "iteration, or request (FasterTransformer: with orca-max)",
                        choices=("iteration", "request"))
    block_size: int = opt(16, "tokens per KV block", check=_at_least(1))
    preemption_mode: str = opt("recompute", "swap | recompute | auto", choices=("swap", "recompute", "auto"))
    swap_space_gib: float = opt(0.0, "host pool for swapped blocks, GiB", check=lambda v: v >= 0 or "must be >= 0")
    prefix_caching: bool = opt(True, "prefix caching (always off under the Orca policies)")
    max_num_seqs: int = opt(256, "most sequences in a step", check=_at_least(1))
    max_num_batched_tokens: int = opt(4096, "most tokens in a step", check=_at_least(1))
    async_scheduling: bool = opt(False, "plan each step while the one before runs, as pagedserve serves by "
                                        "default (a request that arrives during a step joins the step after "
                                        "next); off: the paper's synchronous vLLM")
    # the workload
    trace: str = opt("sharegpt", f"workload: one of {', '.join(TRACE_NAMES)}, or a JSONL file")
    num_requests: int = opt(1000, "requests", check=_at_least(1))
    rate: float = opt(math.inf, "requests per second (Poisson), or inf", check=_positive)
    burstiness: float = opt(1.0, "gamma shape of the gaps (1: Poisson)", check=_positive)
    fit: str = opt("filter", "fit lengths to the context: filter (the paper's) or scale", choices=FIT_MODES)
    n: int = opt(1, "parallel samples per request", check=_at_least(1))
    beam_width: int = opt(1, "beam search width (1: none)", check=_at_least(1))
    shared_prefix_len: int = opt(0, "tokens of one prefix every prompt starts with (a few-shot prompt)",
                                 check=_at_least(0))
    seed: int = opt(0, "fixes every draw: lengths, arrivals, prompts")
    # report
    percentiles: list[float] = opt([50.0, 90.0, 99.0], "percentiles to report", check=_percentiles)
    out: str = opt("loadgen-sim", "folder for summary.json, requests.jsonl and report.md")
    label: str | None = opt(None, "name of this run in reports (default: preset, allocation, trace)")


@dataclass
class PaperConfig:
    out: str = opt("loadgen-paper", "folder for paper.md, paper.json, the plots and every run's summary")
    num_requests: int = opt(400, "requests per simulated run (the paper's runs are longer; the "
                                 "saturated figures need only enough to fill the cache)", check=_at_least(20))
    jobs: int = opt(2, "simulations run at once (processes)", check=_at_least(1))
    figures: list[str] = opt(["2", "12", "13", "15", "16", "18b", "19"], "which of the paper's figures to run")
    seed: int = opt(11, "the workload seed of every run")
    profile: str | None = opt(None, "price every run's steps by this step profile (loadgen profile's JSON) "
                                    "instead of the roofline for OPT-13B on an A100")
    kv_cache_gib: float | None = opt(None, "every run's KV pool in GiB (default: the preset's 12 GiB; with "
                                           "--profile, room for 256 whole contexts)", check=_positive)
    plots: bool = opt(True, "write PNG plots (matplotlib)")
    progress: bool = opt(True, "a line on stderr as each run ends: runs done / total, elapsed, time left")
    replot: bool = opt(False, "redraw paper.md, paper.json and the plots from --out's runs.json of an earlier "
                              "run (same --num-requests, --seed, --figures) instead of simulating")


SLO_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_slo(items: list[str]) -> list[tuple[str, float, float]]:
    """['ttft_p99=500', 'tpot_p99=50'] -> [('ttft', 99.0, 500.0), ('tpot', 99.0, 50.0)]: (metric,
    percentile, limit in ms) each, as loadgen.metrics names them."""
    slo = []
    for item in items:
        name, sep, value = item.partition("=")
        metric, _, pct = name.partition("_p")
        try:
            p, ms = float(pct), float(value)
        except ValueError:
            p = ms = math.nan
        if not sep or metric not in SLO_METRICS or not 0 < p < 100 or not 0 < ms < math.inf:
            raise ValueError(f"{item!r}: expected METRIC_pP=MS with METRIC one of {', '.join(SLO_METRICS)}, "
                             "0 < P < 100 and MS > 0 (e.g. ttft_p99=500)")
        if any(m == metric and q == p for m, q, _ in slo):
            raise ValueError(f"{item!r}: {metric}_p{p:g} is given twice")
        slo.append((metric, p, ms))
    return slo


def _slo(items) -> bool | str:
    try:
        return bool(parse_slo(items)) or "give at least one limit"
    except ValueError as e:
        return str(e)


@dataclass
class PlanConfig:
    profile: str = opt(help="the step profile to plan on (loadgen profile's JSON): its model and machine")
    slo: list[str] = opt(help="the SLO, METRIC_pP=MS each, e.g. ttft_p99=500,tpot_p99=50 (METRIC: ttft, tpot, "
                              "itl, e2el)", check=_slo)
    trace: str = opt("sharegpt", f"workload: one of {', '.join(TRACE_NAMES)}, or a JSONL file")
    target_rate: float | None = opt(None, "requests per second to serve in all: how many replicas of the best "
                                          "candidate that takes", check=_positive)
    kv_cache_gib: list[float] = opt([], "KV pool sizes to try, GiB (default: one, room for --max-num-seqs "
                                        "sequences of the model's whole context)",
                                    check=lambda v: all(x > 0 for x in v) or "each must be > 0")
    block_size: list[int] = opt([16], "KV block sizes to try (powers of two, at most 256, as pagedserve takes)",
                                check=lambda v: bool(v) and next((w for b in v if (w := cf.power_of_two_block(b))
                                                                  is not True), True) or "give at least one")
    # A candidate's bisection is ~7 simulated runs, and a plan should take minutes on 2 cores; but a
    # run must hold several full batches (--max-num-seqs) for an overload's queue to show: 200 did
    # not load a 256-sequence replica at all, 500 overstated its rate by ~50 % beside 2000, 1000 by ~10 %.
    num_requests: int = opt(1000, "requests per simulated run (fewer overstate the rate: an overload's "
                                  "queue has no time to grow)", check=_at_least(20))
    seed: int = opt(0, "fixes every run's lengths, arrivals and prompts (the same at every rate)")
    max_num_seqs: int = opt(256, "most sequences in a step", check=_at_least(1))
    max_num_batched_tokens: int = opt(4096, "most tokens in a step", check=_at_least(1))
    tolerance: float = opt(0.05, "bisect until the lowest rate that misses is within this share above the "
                                 "highest that meets", check=lambda v: 0 < v < 1 or "must lie in (0, 1)")
    out: str = opt("loadgen-plan", "folder for plan.json and plan.md")

    @property
    def slos(self) -> list[tuple[str, float, float]]:
        return parse_slo(self.slo)


# The hostile classes of the attack soak (loadgen/attacks.py holds one function per name). The
# first ten are issue 28's audit findings; the rest probe the HTTP layer itself.
ATTACK_CLASSES = ("tokenize_flood", "schema_enum", "schema_props", "schema_cache", "cross_key",
                  "content_type", "big_body", "surrogate_model", "empty_grammar", "queue_fanout",
                  "rate_burst", "wrong_key_flood",
                  "slowloris", "idle_connections", "nested_json", "invalid_utf8", "huge_headers",
                  "disconnects", "tiny_containers", "late_limits")


@dataclass
class AttackSoakConfig:
    # the stack (tiny model; one router, its state in process: no Redis needed)
    model: str = opt("tiny", "a local model folder, or 'tiny'")
    rate_limit: int = opt(60, "the stack's --rate-limit: requests per window per key", check=_at_least(1))
    rate_limit_window: float = opt(10.0, "the stack's --rate-limit-window, seconds", check=_positive)
    max_queued_requests: int = opt(16, "the stack's --max-queued-requests (small, yet above what the normal "
                                       "load and the legitimate hostile requests hold at once)", check=_at_least(1))
    hang_timeout: float = opt(4.0, "the stack's --hang-timeout (the launcher's default)", check=_positive)
    # the normal load (openai SDK, one key, no retries: every failed attempt counts)
    rate: float = opt(2.0, "normal requests per second (evenly spaced)", check=_positive)
    warmup: float = opt(3.0, "seconds of normal load before anything is measured (first compiles, caches)",
                        check=lambda v: v >= 0 or "must be >= 0")
    quiet: float = opt(30.0, "seconds of normal load alone first: the TTFT baseline", check=_positive)
    duration: float = opt(150.0, "seconds of normal load while the hostile clients run", check=_positive)
    # the hostile clients
    attacks: list[str] = opt(list(ATTACK_CLASSES), "hostile classes to run",
                             check=lambda v: set(v) <= set(ATTACK_CLASSES) or
                             f"unknown class; known: {', '.join(ATTACK_CLASSES)}")
    rounds: int = opt(3, "times each one-shot class is repeated, spread over --duration", check=_at_least(1))
    scale: float = opt(1.0, "multiplies every count (connections, schemas, flood sizes); the audit's sizes "
                            "(bodies, enum lengths) are kept whatever it is", check=_positive)
    seed: int = opt(0, "fixes the normal load's mix and the hostile schedule")
    # the targets (issue 28)
    min_success: float = opt(0.999, "share of normal requests that must succeed",
                             check=lambda v: 0 < v <= 1 or "must lie in (0, 1]")
    ttft_ratio: float = opt(2.0, "p99 TTFT under attack / quiet p99 TTFT may be at most this", check=_positive)
    ttft_floor_ms: float = opt(100.0, "the quiet p99 counts as at least this much: on a shared CPU a ~30 ms "
                                      "TTFT doubles with scheduling noise alone", check=lambda v: v >= 0 or "must be >= 0")
    answer_s: float = opt(1.0, "seconds within which every hostile request must be answered", check=_positive)
    rss_growth_mb: float = opt(256.0, "MiB any process's RSS may grow over its size after the quiet run",
                               check=_positive)
    # output
    out: str = opt("attack-soak.json", "the JSON report")

    def count(self, n: int) -> int:
        """A count of the long form, scaled (at least 1)."""
        return max(1, round(n * self.scale))


def _axis(least: int):
    """A grid axis: at least two points, strictly increasing, each >= least."""
    def check(v: list[int]) -> bool | str:
        if len(v) < 2 or any(b <= a for a, b in zip(v, v[1:])):
            return "needs at least two values, strictly increasing"
        return v[0] >= least or f"each value must be >= {least}"
    return check


def _block_sizes(v: list[int]) -> bool | str:
    verdict = _axis(1)(v)
    if verdict is not True:
        return verdict
    for b in v:
        if (why := cf.power_of_two_block(b)) is not True:
            return f"{b} {why}"
    return True


@dataclass
class ProfileConfig:
    # the engine profiled
    model: str = cf.model("a local Hugging Face folder, or 'tiny' (built in .cache/tiny-llama on first use)")
    device: str = cf.device("cpu", "cpu, cuda or cuda:N")
    dtype: str = cf.dtype()
    block_size: int = cf.block_size()
    max_num_batched_tokens: int = opt(2048, "the engine's token budget of one step: prefill points above it "
                                            "are capped to it", check=_at_least(1))
    torch_threads: int = opt(0, "torch threads (0: as many as pagedserve up gives this model's worker here, "
                                "--worker-threads auto)", check=_at_least(0))
    kv_cache_gib: float = opt(8.0, "the most the device KV pool may take: the largest decode batches (or "
                                   "contexts) that need more are dropped", check=_positive)
    # the grids
    decode_batch: list[int] = opt([1, 2, 4, 8, 16, 32, 64, 128, 256], "decode grid: sequences in a step",
                                  check=_axis(1))
    decode_context: list[int] = opt([16, 64, 256, 1024], "decode grid: each sequence's context (capped to "
                                                         "the model's)", check=_axis(1))
    prefill_tokens: list[int] = opt([16, 64, 256, 1024], "prefill grid: prompt tokens computed in the step",
                                    check=_axis(1))
    prefill_context: list[int] = opt([0, 256, 1024], "prefill grid: tokens already cached before them "
                                                     "(whole blocks)", check=_axis(0))
    factor_block_sizes: list[int] = opt([1, 4, 8, 16, 32, 64, 128, 256], "block sizes of the decode step's "
                                        "block-size factor (an engine built for each)", check=_block_sizes)
    swap_block_sizes: list[int] = opt([1, 4, 16, 64, 256], "block sizes of the swap and copy costs",
                                      check=_block_sizes)
    api: bool = opt(True, "also measure a request's path and the served step's overhead through a real "
                          "pagedserve up (HTTP, SSE, the hops between the processes): what the simulator adds")
    api_batch: list[int] = opt([1, 4, 16, 64, 256], "batches of streams at which the served step is measured "
                                                  "(those above the decode grid's largest batch are skipped)",
                               check=_axis(1))
    api_context: list[int] = opt([32, 512], "prompt lengths at which the served step is measured (capped to "
                                            "the model's context)", check=_axis(1))
    repeats: int = opt(5, "timed decode steps per point, and timed runs per prefill point and copy (the "
                          "median is kept)", check=_at_least(1))
    out: str = opt("step-profile.json", "the profile, a JSON file (loadgen/step_profile.py's format)")


@dataclass
class FidelityConfig:
    model: str = cf.model("the model folder the stack serves and the profile was taken on, or 'tiny'")
    profile: str = opt(help="the step profile of this model on this machine (loadgen profile's JSON)")
    traces: list[str] = opt(["sharegpt", "mooncake-conversation"], "workloads, each at every rate")
    rates: list[float] = opt([], "requests per second (default: --below and --above times the saturation "
                                 "throughput the simulator predicts, per trace)",
                             check=lambda v: all(r > 0 for r in v) or "each must be > 0")
    below: float = opt(0.5, "the rate under saturation, as a share of it", check=lambda v: 0 < v < 1 or "must lie in (0, 1)")
    above: float = opt(1.5, "the rate over saturation, as a multiple of it", check=lambda v: v > 1 or "must be > 1")
    num_requests: int = opt(80, "requests per run", check=_at_least(10))
    num_device_blocks: int = opt(1024, "the KV pool of the stack and of the simulator, in blocks", check=_at_least(1))
    block_size: int = cf.block_size()
    max_num_seqs: int = opt(256, "most sequences in a step (stack and simulator)", check=_at_least(1))
    max_num_batched_tokens: int = opt(2048, "most tokens in a step (stack and simulator)", check=_at_least(1))
    serve_flags: list[str] = opt([], "more flags for pagedserve up (as one string each, e.g. --serve-flags=--no-async-scheduling)")
    seed: int = opt(0, "fixes every draw: lengths, arrivals, prompts")
    out: str = opt("loadgen-fidelity", "folder for fidelity.md, fidelity.json and each run's measured report")
