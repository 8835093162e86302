"""Prometheus metrics of one router, under vLLM's names where vLLM has one.

Request-level series (latencies, token counts, outcomes) are measured here. Engine gauges and
counters (queue lengths, KV usage, preemptions, prefix-cache queries/hits) are the scheduler's: the
/metrics handler fetches StatsReply at scrape time and this module renders it, summed over the
replicas this router uses (KV usage is averaged).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# (StatsReply key, metric name, help, kind); counters get "_total" in the exposition.
ENGINE_SERIES = (
    ("num_requests_running", "vllm:num_requests_running", "Requests running on the engine.", "gauge"),
    ("num_requests_waiting", "vllm:num_requests_waiting", "Requests waiting to be scheduled.", "gauge"),
    ("num_requests_swapped", "vllm:num_requests_swapped", "Requests swapped out to host memory.", "gauge"),
    ("kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "Fraction of device KV blocks in use (0-1).", "gauge"),
    ("num_preemptions", "vllm:num_preemptions", "Preemptions since the engine started.", "counter"),
    ("prefix_cache_queries", "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "counter"),
    ("prefix_cache_hits", "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "counter"),
    ("external_prefix_cache_queries", "vllm:external_prefix_cache_queries",
     "Prompt tokens looked up in the host tier of the prefix cache (those the device missed).", "counter"),
    ("external_prefix_cache_hits", "vllm:external_prefix_cache_hits",
     "Prompt tokens found in the host tier of the prefix cache (promoted to the device).", "counter"),
    ("host_cache_demotions", "pagedserve:host_cache_demotions",
     "Prefix blocks evicted from the device and copied to the host tier.", "counter"),
    ("host_cache_promotions", "pagedserve:host_cache_promotions",
     "Host-tier blocks copied back to the device on a prefix hit.", "counter"),
    ("host_cache_bytes_copied", "pagedserve:host_cache_bytes_copied",
     "Bytes copied between the device and the host tier, both ways, all ranks.", "counter"),
)


def aggregate(stats: list[dict]) -> dict:
    """Several replicas' StatsReply -> one: counts summed, KV usage averaged."""
    out: dict = {}
    for key, _, _, _ in ENGINE_SERIES:
        values = [float(s.get(key, 0) or 0) for s in stats]
        out[key] = (sum(values) / len(values) if values else 0.0) if key == "kv_cache_usage_perc" else sum(values)
    # The Fig. 2 split of the KV cache (time-averaged shares, 0-1), averaged over the replicas.
    splits = [s["kv"]["kv_breakdown"] for s in stats if "kv_breakdown" in s.get("kv", {})]
    out["kv_breakdown"] = {of: {part: sum(b[of][part] for b in splits) / len(splits) for part in splits[0][of]}
                           for of in ("cache", "allocated")} if splits else {}
    return out


class _EngineCollector:
    """Renders the last fetched engine stats; set `stats` right before generating the exposition."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict | None = None
        self.replicas_up = 0

    def collect(self):
        up = GaugeMetricFamily("pagedserve:engine_replicas_up", "Engine replicas that answered GetStats.",
                               labels=["model_name"])
        up.add_metric([self.model_name], self.replicas_up)
        yield up
        if self.stats is None:
            return
        for key, name, doc, kind in ENGINE_SERIES:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(self.stats.get(key, 0) or 0))
            yield family
        split = self.stats.get("kv_breakdown")
        if split:
            family = GaugeMetricFamily("pagedserve:kv_breakdown", "Time-averaged share of the KV cache "
                                       "(of=cache) or of its allocated slots (of=allocated) per part, "
                                       "as the PagedAttention paper's Fig. 2 (0-1).",
                                       labels=["model_name", "of", "part"])
            for of, parts in split.items():
                for part, share in parts.items():
                    family.add_metric([self.model_name, of, part], float(share))
            yield family


class RouterMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model_name"]
        reg = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              registry=reg, buckets=TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", labels,
                             registry=reg, buckets=ITL_BUCKETS).labels(model_name)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token of a request.",
                              labels, registry=reg, buckets=ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             registry=reg, buckets=E2E_BUCKETS).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels,
                                         registry=reg).labels(model_name)
        self._success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                                labels + ["finished_reason"], registry=reg)
        self._errors = Counter("pagedserve:request_errors", "Requests answered with an error, by HTTP status.",
                               labels + ["status"], registry=reg)
        self.engine = _EngineCollector(model_name)
        reg.register(self.engine)

    def success(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    def expose(self, engine_stats: list[dict]) -> bytes:
        self.engine.replicas_up = len(engine_stats)
        self.engine.stats = aggregate(engine_stats) if engine_stats else None
        return generate_latest(self.registry)
