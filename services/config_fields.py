"""The settings several processes share, each written once: its flag, help, default and check.

Every process's Config (launcher, router, scheduler, worker, kvstore, the offline engine) builds
its fields from these, so that `--block-size 12` is refused with the same words everywhere and a
default changes in one place. No torch here (the scheduler and the load generator import it).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, fields

from pagedserve.kvstore.allocator import ALLOCATIONS
from pagedserve.services.flags import opt, to_argv

DTYPES = ("auto", "float32", "float16", "bfloat16")     # services.worker.model_loader maps them
PREEMPTION_MODES = ("swap", "recompute", "auto")
BATCHING = ("iteration", "request")
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def positive(v) -> bool | str:
    # inf passes `v > 0` and then breaks whatever uses the number (Retry-After, a Redis expiry).
    return (v > 0 and math.isfinite(v)) or "must be positive and finite"


def at_least(n):
    return lambda v: v >= n or f"must be at least {n}"


def power_of_two_block(v: int) -> bool | str:
    if v < 1 or v & (v - 1):
        return "must be a power of two"
    return v <= 256 or "must be at most 256"


def endpoint_check(v: str) -> bool | str:
    return v.startswith(("tcp://", "ipc://", "inproc://")) or "must be a tcp://, ipc:// or inproc:// address"


def log_level_check(v: str) -> bool | str:
    return v.upper() in LOG_LEVELS or f"must be one of {', '.join(LOG_LEVELS)}"


def device_check(v: str) -> bool | str:
    return v in ("cpu", "cuda") or bool(re.fullmatch(r"cuda:\d+", v)) or "must be cpu, cuda or cuda:N"


def redis_url_check(v: str) -> bool | str:
    return v.startswith(("redis://", "rediss://", "unix://")) or "must be a redis://, rediss:// or unix:// URL"


_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1G', '1GiB', '1.5Gi' -> bytes (vLLM's human-readable sizes: K, M, G
    are powers of ten, Ki, Mi, Gi powers of two; a trailing B is allowed)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ValueError("a size in bytes, e.g. 1073741824, 512M or 4GiB")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])


# ---- field factories: call one as a dataclass field's default ------------------------------------

def model(help: str = "a local Hugging Face folder (config.json, safetensors, tokenizer)"):
    """Required: a process serves one model."""
    return opt(help=help, check=lambda v: bool(v) or "needs a local Hugging Face folder")


def block_size(default: int = 16):
    return opt(default, "tokens per KV block (a power of two, at most 256)", check=power_of_two_block)


def dtype(default: str = "auto"):
    return opt(default, "auto: float32 on CPU, the checkpoint's dtype on CUDA", choices=DTYPES)


def device(default: str = "cpu", help: str = "cpu, cuda (one GPU per tensor-parallel rank) or cuda:N"):
    return opt(default, help, check=device_check)


def endpoint(default: str, help: str, flag: str | None = None):
    return opt(default, help, check=endpoint_check, flag=flag)


def log_level(default: str = "INFO"):
    return opt(default, "logging level", check=log_level_check)


def preemption_mode(default: str = "recompute"):
    return opt(default, "what preemption does to a request: swap its blocks to host memory, drop them "
                        "and recompute, or auto (recompute short single sequences, swap the rest)",
               choices=PREEMPTION_MODES)


def allocation(default: str = "paged"):
    return opt(default, "KV allocation policy (orca-*: the paper's contiguous-region baselines)", choices=ALLOCATIONS)


def batching(default: str = "iteration"):
    return opt(default, "iteration-level batching, or request-level as FasterTransformer "
                        "(a batch runs until all its requests finish; needs --allocation orca-max)",
               choices=BATCHING)


def enforce_eager():
    return opt(False, "run every step eagerly: no CUDA graphs for decode (vLLM's --enforce-eager; graphs are "
                      "only ever captured on CUDA)")


def async_scheduling():
    return opt(True, "plan each decode step while the one before it runs, its inputs the tokens still being "
                     "drawn (vLLM's --async-scheduling); --no-async-scheduling waits for every step's tokens")


def _writable_file(v: str) -> bool | str:
    folder = os.path.dirname(os.path.abspath(v))
    if not os.path.isdir(folder):
        return f"its folder {folder} does not exist"
    if os.path.isdir(v) or not os.access(v if os.path.exists(v) else folder, os.W_OK):
        return "must be a file this process can write"
    return True


def step_log():
    return opt(None, "append one JSON line per engine step to this file: its seconds, the worker's, and "
                     "what it computed (services/scheduler/step_log.py; loadgen fidelity reads it)", check=_writable_file, metavar="FILE")


def max_num_seqs(default: int = 256):
    return opt(default, "sequences in one step at the most", check=at_least(1))


def max_num_batched_tokens(default: int = 2048):
    return opt(default, "tokens in one step at the most (at least --max-num-seqs)", check=at_least(1))


def max_model_len(default: int | None = None, help: str = "the context length (default: the model's)"):
    return opt(default, help, check=at_least(2))


def redis_url(help: str = "Redis for what several routers share (redis://[:password@]host:port/db)"):
    return opt(None, help, check=redis_url_check)


def gpu_memory_utilization(default: float = 0.9):
    return opt(default, "CUDA: the fraction of each GPU this replica may use; the KV pool gets what the "
                        "weights and a profiled largest step leave",
               check=lambda v: 0 < v <= 1 or "must be in (0, 1]")


def _swap_check(v: float) -> bool | str:
    if not v >= 0:
        return "must be >= 0"
    # More than the machine has used to reach the kvstore, which died with a traceback creating
    # the pool (OverflowError) or later, on first touch (SIGBUS): refuse it here in one line, as vLLM.
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return v * (1 << 30) <= total or f"must be at most this machine's memory ({total / (1 << 30):.1f} GiB)"


def swap_space(default: float = 0.25):
    return opt(default, "GiB of host memory for swapped-out KV blocks", flag="--swap-space", check=_swap_check)


def kv_offloading_size():
    return opt(None, "GiB of host memory, over all tensor-parallel ranks, that keeps prefix blocks evicted "
                     "from the device (the host tier, vLLM's spelling; default: the whole --swap-space, "
                     "which swapped-out requests take first; 0: no host tier)",
               flag="--kv-offloading-size", metavar="GIB",
               check=lambda v: (v >= 0 and math.isfinite(v)) or "must be >= 0 and finite")


def host_cache_blocks(config, host_blocks: int, block_bytes: int, tp_size: int = 1) -> int:
    """Host blocks (per rank) of the host tier that --kv-offloading-size asks for, at most the host
    pool's host_blocks; block_bytes is one rank's block."""
    if config.kv_offloading_size is None:
        return host_blocks
    return min(host_blocks, int(config.kv_offloading_size * (1 << 30)) // (block_bytes * tp_size))


def num_device_blocks():
    return opt(None, "device KV blocks, overriding every sizing", flag="--num-gpu-blocks-override",
               aliases=["--num-device-blocks"], check=at_least(1))


def kv_cache_memory_bytes():
    return opt(None, f"bytes for the device KV pool, e.g. 512M or 4GiB (default on CPU: "
                     f"{DEFAULT_KV_GIB:g} GiB; on CUDA: what --gpu-memory-utilization leaves)",
               parse=parse_bytes, check=at_least(1))


def kv_cache_memory_gib():
    return opt(None, "GiB for the device KV pool (the older spelling of --kv-cache-memory-bytes)",
               flag="--kv-cache-memory", check=positive)


DEFAULT_KV_GIB = 0.25


def kv_pool_check(config) -> str | None:
    """Contradictions among the three ways to size the device pool."""
    given = [flag for flag, v in (("--num-gpu-blocks-override", config.num_device_blocks),
                                  ("--kv-cache-memory-bytes", config.kv_cache_memory_bytes),
                                  ("--kv-cache-memory", config.kv_cache_memory_gib)) if v is not None]
    if len(given) > 1:
        return f"{given[0]} and {given[1]} both size the device KV pool: give one"
    return None


def kv_pool_bytes(config) -> int:
    """Bytes of the device pool a config asks for (when it does not give a block count)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    return int((config.kv_cache_memory_gib or DEFAULT_KV_GIB) * (1 << 30))


def grammar_cache_size(default: int = 256):
    return opt(default, "compiled structured-output constraints kept per process (LRU)", check=at_least(1))


def grammar_cache_bytes():
    from pagedserve.services.guided.limits import DEFAULT_CACHE_BYTES
    return opt(DEFAULT_CACHE_BYTES, "bytes of compiled structured-output constraints kept per process, e.g. 512MiB "
                                  "(one that alone compiles to more is a 400)", parse=parse_bytes, check=at_least(1))


# The limits of a constraint, checked before it compiles (services/guided/limits.py says why).
def grammar_compile_timeout():
    return opt(_limits().compile_timeout_s, "seconds a structured-output constraint may take to compile (a 400 "
               "after)", flag="--grammar-compile-timeout", check=positive)


def max_grammar_bytes():
    return opt(_limits().max_bytes, "bytes of a structured-output constraint's text (schema, regex, grammar, "
               "choices)", parse=parse_bytes, check=at_least(1))


def max_grammar_enum_values():
    return opt(_limits().max_enum_values, "enum and choice values of a structured-output constraint, all told",
               check=at_least(1))


def max_grammar_properties():
    return opt(_limits().max_properties, "object properties of a JSON-schema constraint, all told", check=at_least(1))


def max_grammar_depth():
    return opt(_limits().max_depth, "nesting depth of a JSON-schema constraint", check=at_least(1))


def _limits():
    from pagedserve.services.guided.limits import Limits
    return Limits()


@dataclass(kw_only=True)
class GrammarOptions:
    """The compile cache's bounds and a constraint's limits: one set of fields for every process
    that compiles constraints (router and worker), so that both refuse the same ones."""
    grammar_cache_size: int = grammar_cache_size()
    grammar_cache_bytes: int = grammar_cache_bytes()
    grammar_compile_timeout_s: float = grammar_compile_timeout()
    max_grammar_bytes: int = max_grammar_bytes()
    max_grammar_enum_values: int = max_grammar_enum_values()
    max_grammar_properties: int = max_grammar_properties()
    max_grammar_depth: int = max_grammar_depth()


def grammar_argv(config) -> list[str]:
    """A config's GrammarOptions as the flags of another process (the launcher's workers)."""
    return to_argv(config, [f.name for f in fields(GrammarOptions)])


def hang_timeout(help: str):
    return opt(4.0, help, flag="--hang-timeout", check=positive)


def shutdown_timeout(default: float):
    return opt(default, "on SIGTERM, seconds running requests may take to finish (new ones get 503); "
                        "0: fail them now", flag="--shutdown-timeout", check=lambda v: v >= 0 or "must be >= 0")


def optional_endpoint(help: str):
    return opt(None, help, check=endpoint_check)


def curve_keys(why: str):
    from pagedserve.services.curve import KEYS_ENV     # (no import cycle: curve needs only zmq)
    return opt("", f"folder of CURVE keys (pagedserve keys DIR; else ${KEYS_ENV}): {why}")


def seed(default: int = 0):
    return opt(default, "seed of unseeded sampling")


def allocation_check(allocation: str, batching: str) -> str | None:
    if batching == "request" and allocation != "orca-max":
        # FasterTransformer reserves the model's whole length per request, as Orca Max does.
        return ("--batching request sizes its batches as Orca Max reserves memory: "
                "use it with --allocation orca-max")
    return None


def batch_limits_check(max_num_seqs: int, max_num_batched_tokens: int) -> str | None:
    if max_num_batched_tokens < max_num_seqs:
        return ("--max-num-batched-tokens must be at least --max-num-seqs "
                f"({max_num_batched_tokens} < {max_num_seqs})")
    return None

