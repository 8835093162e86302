"""The server's own view while the load runs: /metrics read every interval (vLLM's metric names,
which pagedserve and SGLang's vLLM-compatible mode export too), kept as a time series.

Only the few families the report plots are read, by a line scan instead of a full Prometheus parse:
the scraper runs on the client's cores, beside the server. Values are summed over label sets
(several engines behind one endpoint), and a missing family is None, not 0.
"""
from __future__ import annotations

import asyncio
import math
import time

import aiohttp

# series name -> the metric names that carry it, newest first (vLLM renamed the KV gauge in v1).
SERIES = {
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "swapped": ("pagedserve:num_requests_swapped", "vllm:num_requests_swapped"),
    "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"),
    # The hits of a tier beside the device's (vLLM's CPU offloading and connectors, our host tier).
    "external_prefix_cache_hits": ("vllm:external_prefix_cache_hits_total",),
    "external_prefix_cache_queries": ("vllm:external_prefix_cache_queries_total",),
}
_WANTED = {name for names in SERIES.values() for name in names}


def parse_metrics(text: str) -> dict[str, float | None]:
    """One sample of every series from a Prometheus text exposition."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.split(" ", 1)[0]
        if name not in _WANTED:
            continue
        try:
            value = float(line.rsplit("}", 1)[-1].split()[0] if brace >= 0 else line.split()[1])
        except (IndexError, ValueError):
            continue
        if not math.isfinite(value):
            continue                      # NaN / Inf: not a reading (and not JSON)
        sums[name] = sums.get(name, 0.0) + value
    return {series: next((sums[n] for n in names if n in sums), None) for series, names in SERIES.items()}


class Scraper:
    """Polls `url`/metrics until stopped. A server without /metrics (404) is asked once."""

    def __init__(self, session: aiohttp.ClientSession, url: str, interval: float, t0: float,
                 headers: dict | None = None):
        self.session, self.url, self.interval, self.t0 = session, url + "/metrics", interval, t0
        self.headers = headers or {}
        self.samples: list[dict] = []
        self.failures = 0
        self.available: bool | None = None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and self.interval > 0:
            await self.scrape_once()
            if self.available is False:
                return
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except TimeoutError:
                pass

    async def scrape_once(self) -> None:
        try:
            async with self.session.get(self.url, headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=max(1.0, 2 * self.interval))) as r:
                if r.status == 404:
                    self.available = False
                    return
                r.raise_for_status()
                text = (await r.read()).decode("utf-8", "replace")
        except (aiohttp.ClientError, TimeoutError):
            self.failures += 1
            return
        self.available = True
        self.samples.append({"t": time.perf_counter() - self.t0, **parse_metrics(text)})
