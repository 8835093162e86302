"""Prometheus metrics of one router, under vLLM's names, types, labels and buckets (vLLM 0.32).

Two kinds of series, so that Prometheus may sum over several routers without counting twice:
- What this router saw: its requests' latencies, tokens, phases and outcomes, labelled
  `model_name` and `engine` (the replica that served the request). Every router exports its own.
- The engine's own state and counters (queue lengths, KV usage, preemptions, prefix-cache
  queries and hits, tokens per step, cache config): fetched from each scheduler at scrape time
  (StatsReply) and rendered only by the router that scheduler names its exporter
  (services/scheduler/exporter.py), so each engine's series appear once across all routers.
Ours, where vLLM has none, are under `pagedserve:`.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")   # vLLM's FinishReason, as str()
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 series up to the context length."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


@dataclass
class FinishedRequest:
    """One engine request (one prompt of an HTTP request, all its choices) at its end."""
    engine: str
    finish_reasons: list[str]         # per choice
    num_prompt_tokens: int
    num_cached_tokens: int
    generation_tokens: list[int]      # per choice
    n: int
    max_tokens: int | None
    e2e_s: float
    final: object | None = None       # the engine's final RequestUpdate (its phases); None: not yet


class _Seen:
    """The request-level families, with the children of one engine label bound once (a labels()
    lookup per token would cost more than the observation)."""

    def __init__(self, families: dict, model_name: str, engine: str):
        self.child = {name: family.labels(model_name, engine) for name, family in families.items()
                      if name not in ("success", "prompt_by_source", "cached_by_source")}
        self.success = {r: families["success"].labels(model_name, engine, r) for r in FINISH_REASONS}
        self.prompt_by_source = {s: families["prompt_by_source"].labels(model_name, engine, s)
                                 for s in PROMPT_SOURCES}
        self.cached_by_source = {s: families["cached_by_source"].labels(model_name, engine, s)
                                 for s in CACHE_SOURCES}
        self.ttft, self.itl = self.child["ttft"], self.child["itl"]


class RouterMetrics:
    def __init__(self, model_name: str, max_model_len: int = 2048):
        self.model_name = model_name
        self.registry = reg = CollectorRegistry(auto_describe=False)
        labels = ["model_name", "engine"]
        tokens = request_tokens_buckets(max_model_len)

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, registry=reg, buckets=buckets)

        def count(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=reg)

        self._families = {
            "ttft": hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS),
            "itl": hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS),
            "tpot": hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
            "e2e": hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS),
            "queue": hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS),
            "inference": hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS),
            "prefill": hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS),
            "decode": hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS),
            "preemptions": hist("vllm:request_num_preemptions",
                                "Histogram of the number of times a request was preempted.", PREEMPTIONS_BUCKETS),
            "kv_computed": hist("vllm:request_prefill_kv_computed_tokens",
                                "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                                tokens),
            "prompt_hist": hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens),
            "generation_hist": hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                    tokens),
            "max_generation": hist("vllm:request_max_num_generation_tokens",
                                   "Histogram of maximum number of requested generation tokens.", tokens),
            "params_n": hist("vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS),
            "params_max_tokens": hist("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", tokens),
            "prompt": count("vllm:prompt_tokens", "Number of prefill tokens processed."),
            "generation": count("vllm:generation_tokens", "Number of generation tokens processed."),
            "cached": count("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."),
            "prompt_by_source": count("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                      ["source"]),
            "cached_by_source": count("vllm:prompt_tokens_cached_by_source",
                                      "Prefix-cache hit tokens by the cache tier that supplied them.", ["source"]),
            "success": count("vllm:request_success", "Count of successfully processed requests.",
                             ["finished_reason"]),
        }
        self._seen: dict[str, _Seen] = {}
        rejections = Counter("vllm:admission_rejections",
                             "Number of admission attempts rejected by a queue limit, by reason.",
                             ["model_name", "reason"], registry=reg)
        self._rejections = {r: rejections.labels(model_name, r) for r in ADMISSION_REASONS}
        self._errors = Counter("pagedserve:request_errors", "Requests answered with an error, by HTTP status.",
                               ["model_name", "status"], registry=reg)
        # Streams send a chunk per token (vLLM's); a stream the router has fallen behind merges
        # what queued up. This counts the tokens that went out merged, not in a chunk of their own.
        self.stream_merged_tokens = Counter("pagedserve:stream_merged_tokens",
                                            "Streamed tokens sent merged into an earlier token's chunk "
                                            "because the router had fallen behind the stream.",
                                            ["model_name"], registry=reg).labels(model_name)
        # This router's own compile cache (set_function: read at scrape time, nothing to update).
        self.grammar_cache_bytes = Gauge("pagedserve:grammar_cache_bytes",
                                         "Bytes of compiled structured-output constraints this router keeps "
                                         "(--grammar-cache-bytes).", ["model_name"], registry=reg).labels(model_name)
        self.engines = EngineCollector(model_name)
        reg.register(self.engines)
        self.router = RouterCollector(model_name)
        reg.register(self.router)

    def seen(self, engine: str) -> _Seen:
        s = self._seen.get(engine)
        if s is None:
            s = self._seen[engine] = _Seen(self._families, self.model_name, engine)
        return s

    def finished(self, r: FinishedRequest) -> None:
        s = self.seen(r.engine)
        c = s.child
        c["e2e"].observe(r.e2e_s)
        computed = max(0, r.num_prompt_tokens - r.num_cached_tokens)
        c["kv_computed"].observe(computed)
        c["prompt_hist"].observe(r.num_prompt_tokens)
        generated = sum(r.generation_tokens)
        most = max(r.generation_tokens, default=0)
        c["generation_hist"].observe(generated)
        c["max_generation"].observe(most)
        c["params_n"].observe(r.n)
        if r.max_tokens is not None:
            c["params_max_tokens"].observe(r.max_tokens)
        if r.final is not None:
            self.phases(r.engine, r.final, most)
        c["prompt"].inc(r.num_prompt_tokens)
        c["generation"].inc(generated)
        c["cached"].inc(r.num_cached_tokens)
        host = r.final.num_host_cached_tokens if r.final is not None else 0   # of the cached ones
        s.prompt_by_source["local_compute"].inc(computed)
        s.prompt_by_source["local_cache_hit"].inc(r.num_cached_tokens - host)
        s.prompt_by_source["external_kv_transfer"].inc(host)   # vLLM's CPU offloading counts here
        s.cached_by_source["device"].inc(r.num_cached_tokens - host)
        s.cached_by_source["host"].inc(host)
        for reason in r.finish_reasons:
            s.success[reason if reason in s.success else "abort"].inc()

    def phases(self, engine: str, final, most_tokens: int) -> None:
        """The engine's phases of one request (its final RequestUpdate), and vLLM's mean time per
        output token: the decode phase over the tokens after the first (of its longest choice)."""
        c = self.seen(engine).child
        for name, value in (("queue", final.queued_s), ("inference", final.inference_s),
                            ("prefill", final.prefill_s), ("decode", final.decode_s)):
            c[name].observe(value)
        c["preemptions"].observe(final.num_preemptions)
        c["tpot"].observe(final.decode_s / (most_tokens - 1) if most_tokens > 1 else 0.0)

    def admission_rejected(self, reason: str) -> None:
        self._rejections[reason].inc()

    def error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    def expose(self, engine_stats: list[dict]) -> bytes:
        self.engines.stats = engine_stats
        return generate_latest(self.registry)


# (StatsReply key, metric name, help, kind) of each engine's own scalar series; counters get
# "_total" in the exposition.
ENGINE_SERIES = (
    ("num_requests_running", "vllm:num_requests_running", "Number of requests in model execution batches.",
     "gauge"),
    ("num_requests_waiting", "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
     "gauge"),
    ("kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "gauge"),
    ("num_preemptions", "vllm:num_preemptions", "Cumulative number of preemption from the engine.", "counter"),
    ("prefix_cache_queries", "vllm:prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens.", "counter"),
    ("prefix_cache_hits", "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     "counter"),
    ("external_prefix_cache_queries", "vllm:external_prefix_cache_queries",
     "Prompt tokens looked up in the host tier of the prefix cache (those the device missed).", "counter"),
    ("external_prefix_cache_hits", "vllm:external_prefix_cache_hits",
     "Prompt tokens found in the host tier of the prefix cache (promoted to the device).", "counter"),
    ("num_requests_swapped", "pagedserve:num_requests_swapped", "Requests swapped out to host memory.", "gauge"),
    ("host_cache_demotions", "pagedserve:host_cache_demotions",
     "Prefix blocks evicted from the device and copied to the host tier.", "counter"),
    ("host_cache_promotions", "pagedserve:host_cache_promotions",
     "Host-tier blocks copied back to the device on a prefix hit.", "counter"),
    ("host_cache_bytes_copied", "pagedserve:host_cache_bytes_copied",
     "Bytes copied between the device and the host tier, both ways, all ranks.", "counter"),
    ("grammar_cache_bytes", "pagedserve:worker_grammar_cache_bytes",
     "Bytes of compiled structured-output constraints the engine's worker keeps (--grammar-cache-bytes).", "gauge"),
)
# The scheduler core's counters (StatsReply["scheduler"]) rendered as ours.
SCHEDULER_COUNTERS = (
    ("cow_copies", "pagedserve:cow_copies", "Blocks copied on write (a shared block a sequence wrote to)."),
    ("swap_outs", "pagedserve:swap_outs", "Requests swapped out to host memory."),
    ("swap_ins", "pagedserve:swap_ins", "Requests swapped back in."),
    ("recomputed_tokens", "pagedserve:recomputed_tokens", "Tokens dropped by a preemption, to compute again."),
    ("steps_planned_ahead", "pagedserve:steps_planned_ahead",
     "Steps planned while the step before them ran (async scheduling)."),
    ("ahead_rows_dropped", "pagedserve:ahead_rows_dropped",
     "Rows of steps planned ahead computed for a sequence that had stopped in the step before."),
)


class RouterCollector:
    """The router's own memory and work in flight, read at scrape time: the size of each cache
    (bytes and entries; each is bounded in bytes) and the large bodies in the offload pool."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.caches: dict = {}          # name -> a cache with .bytes and len()
        self.offload = None             # services/router/offload.py's Offload: .pending

    def watch(self, caches: dict, offload=None) -> None:
        self.caches.update(caches)
        self.offload = offload if offload is not None else self.offload

    def collect(self):
        size = GaugeMetricFamily("pagedserve:router_cache_bytes", "Estimated bytes held by each of the "
                                 "router's caches.", labels=["model_name", "cache"])
        entries = GaugeMetricFamily("pagedserve:router_cache_entries", "Entries held by each of the router's "
                                    "caches.", labels=["model_name", "cache"])
        for name, cache in sorted(self.caches.items()):
            size.add_metric([self.model_name, name], cache.bytes)
            entries.add_metric([self.model_name, name], len(cache))
        yield size
        yield entries
        if self.offload is not None:
            pending = GaugeMetricFamily("pagedserve:router_offload_pending", "Large request bodies being "
                                        "parsed, rendered or tokenized off the event loop, or waiting for a "
                                        "thread.", labels=["model_name"])
            pending.add_metric([self.model_name], self.offload.pending)
            yield pending


class EngineCollector:
    """Renders the engine stats fetched for this scrape: only those naming this router exporter."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: list[dict] = []

    def collect(self):
        up = GaugeMetricFamily("pagedserve:engine_replicas_up", "Engine replicas that answered GetStats.",
                               labels=["model_name"])
        up.add_metric([self.model_name], len(self.stats))
        yield up
        mine = [s for s in self.stats if s.get("exporter")]
        labels = ["model_name", "engine"]
        for key, name, doc, kind in ENGINE_SERIES:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=labels)
            for s in mine:
                family.add_metric([self.model_name, s["engine"]], float(s.get(key, 0) or 0))
            yield family
        yield from self._by_label(mine, "vllm:num_requests_waiting_by_reason", "reason",
                                  "Number of waiting requests by reason (capacity: waiting for room; "
                                  "deferred: none here).",
                                  lambda s: {"capacity": s.get("num_requests_waiting", 0), "deferred": 0})
        yield from self._by_label(mine, "vllm:engine_sleep_state", "sleep_state",
                                  "Engine sleep state (this engine has no sleep mode: always awake).",
                                  lambda s: {"awake": 1, "weights_offloaded": 0, "discard_all": 0})
        for key, name, doc in SCHEDULER_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=labels)
            for s in mine:
                family.add_metric([self.model_name, s["engine"]], float(s.get("scheduler", {}).get(key, 0)))
            yield family
        yield from self._steps(mine)
        yield from self._cache(mine)

    def _by_label(self, mine, name, label, doc, values):
        family = GaugeMetricFamily(name, doc, labels=["model_name", "engine", label])
        for s in mine:
            for value_label, value in values(s).items():
                family.add_metric([self.model_name, s["engine"], value_label], float(value))
        yield family

    def _steps(self, mine):
        tokens = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                       labels=["model_name", "engine"])
        steps = CounterMetricFamily("pagedserve:engine_steps", "Engine steps run.", labels=["model_name", "engine"])
        seconds = CounterMetricFamily("pagedserve:engine_step_seconds",
                                      "Seconds of engine steps by phase (schedule, kvstore: the block-store "
                                      "exchange, worker round trip, worker compute; step: the whole).",
                                      labels=["model_name", "engine", "phase"])
        for s in mine:
            st = s.get("steps")
            if not st:
                continue
            lab = [self.model_name, s["engine"]]
            hist = st["iteration_tokens"]
            buckets = [(repr(float(b)), c) for b, c in zip(hist["bounds"], hist["cumulative"])]
            buckets.append(("+Inf", hist["cumulative"][-1]))
            tokens.add_metric(lab, buckets, float(hist["sum"]))
            steps.add_metric(lab, float(st["steps"]))
            for phase, secs in st["seconds"].items():
                seconds.add_metric(lab + [phase.replace(" ", "_")], float(secs))
        yield from (tokens, steps, seconds)

    def _cache(self, mine):
        info = [s for s in mine if s.get("cache_config")]
        if info:
            keys = sorted(info[0]["cache_config"])
            family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                       labels=["engine", *keys])
            for s in info:
                family.add_metric([s["engine"], *(str(s["cache_config"].get(k)) for k in keys)], 1.0)
            yield family
        split = GaugeMetricFamily("pagedserve:kv_breakdown", "Time-averaged share of the KV cache (of=cache) or "
                                  "of its allocated slots (of=allocated) per part, as the PagedAttention paper's "
                                  "Fig. 2 (0-1).", labels=["model_name", "engine", "of", "part"])
        for s in mine:
            split_of = s.get("kv", {}).get("kv_breakdown", {})
            for of in ("cache", "allocated"):
                for part, share in split_of.get(of, {}).items():
                    split.add_metric([self.model_name, s["engine"], of, part], float(share))
        yield split
