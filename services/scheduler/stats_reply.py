"""What the scheduler answers a router's GetStats with: the engine's state in one dict.

The routers render it as vLLM's Prometheus series (queue lengths, KV usage, prefix-cache hits,
preemptions, cache_config_info). Assembly only: the caller gathers the parts.
"""
from __future__ import annotations

from pagedserve.services import protocol
from pagedserve.services.scheduler.scheduler import Scheduler


def engine_stats(core: Scheduler, kv: dict, pool_info: protocol.PoolInfo, *, ready: bool, broken: str | None,
                 model: str, max_model_len: int, replica_id: str, preemption_mode: str,
                 grammar_cache_bytes: int, steps: dict) -> dict:
    """kv: the kvstore's own stats ({} when it could not say); steps: StepStats.snapshot()."""
    total = max(1, kv.get("device_blocks_total", 1))
    s = core.stats
    return {"ready": ready, "model": model, "max_model_len": max_model_len,
            "broken": broken, "num_requests_running": len(core.running), "num_requests_waiting": len(core.waiting),
            "num_requests_swapped": len(core.swapped),
            "kv_cache_usage_perc": kv.get("device_blocks_used", 0) / total,
            "num_preemptions": s["preemptions"], "prefix_cache_queries": kv.get("prefix_queries_tokens", 0),
            "prefix_cache_hits": kv.get("prefix_hit_tokens", 0),
            "external_prefix_cache_queries": kv.get("host_queries_tokens", 0),
            "external_prefix_cache_hits": kv.get("host_hit_tokens", 0),
            "host_cache_demotions": kv.get("host_cache_demotions", 0),
            "host_cache_promotions": kv.get("host_cache_promotions", 0),
            "host_cache_bytes_copied": kv.get("host_cache_bytes_copied", 0), "scheduler": dict(s),
            "grammar_cache_bytes": grammar_cache_bytes,
            "kv": {**kv, "kv_breakdown": core.kv_breakdown()},
            "engine": replica_id, "steps": steps,
            "cache_config": cache_config(pool_info, preemption_mode)}


def cache_config(info: protocol.PoolInfo, preemption_mode: str) -> dict:
    """vLLM's cache_config_info labels that carry over (its CacheConfig field names)."""
    return {"block_size": info.block_size, "num_gpu_blocks": info.num_device_blocks,
            "num_cpu_blocks": info.num_host_blocks, "enable_prefix_caching": info.enable_prefix_caching,
            "allocation": info.allocation, "device": info.device,
            "preemption_mode": preemption_mode}
