"""`loadgen profile`: what one engine step costs on this machine, measured with the offline Engine
(services/engine.py) on a real model, in the format of loadgen/step_profile.py.

Every time is one whole `Engine.step()` (schedule, model, sample, update) with async scheduling
off, so that one call is one step and its tokens are read before it returns; the copies are the
block pools' own copy functions (kvstore/pool.py), as the block store calls them for swaps and
copy-on-write. A grid point the model's context or the KV pool cannot hold is capped or dropped
(whole rows and columns: the grids stay rectangular), and the returned dict's "notes" say which.
"""
from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import random
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from pagedserve.loadgen.step_profile import VERSION
from pagedserve.services.flags import ConfigError

WARM = 1            # decode steps run untimed after the batch starts decoding (first-use costs)
COPY_BLOCKS = 64    # blocks per timed copy (fewer where they would pass COPY_BYTES)
COPY_BYTES = 1 << 30
FIRST_ID = 10       # prompt token ids are drawn from [10, vocab): clear of the special tokens
API_OUTPUT = 32     # decode steps that the streams measuring a served step take together (profile_api)


def profile(cfg) -> dict:
    """cfg: loadgen.config.ProfileConfig -> the raw profile (step_profile's format, plus "notes")."""
    import torch
    from pagedserve.services.engine import Engine
    from pagedserve.services.model_dir import ModelLoadError, serving_dtype_name
    from pagedserve.services.tiny_model import TinyModelError, resolve_model
    from pagedserve.services.worker.model_loader import inspect_model_dir

    from pagedserve.services.launcher import worker_threads_auto

    started = time.monotonic()
    try:
        model = resolve_model(cfg.model)
        hf_config, spec = inspect_model_dir(model)   # a bad folder is refused before anything loads
    except (ModelLoadError, TinyModelError) as e:
        raise ConfigError(str(e)) from None
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {cfg.device}: this torch ({torch.__version__}) sees no CUDA device")
    # As many threads as `pagedserve up` gives this model's worker here: a profile on two threads
    # prices a worker on one wrongly (on 2 cores the tiny model's step differs 2-3x).
    threads = cfg.torch_threads or worker_threads_auto(
        cfg.device, 1, sum(f.stat().st_size for f in Path(model).glob("*.safetensors")))
    torch.set_num_threads(threads)
    dtype = serving_dtype_name(cfg.dtype, cfg.device, spec)
    notes: list[str] = []
    batch, context = decode_axes(cfg, spec, dtype, notes)
    tokens, cached = prefill_axes(cfg, spec.max_model_len, notes)
    rng = random.Random(0)

    engine = Engine(engine_config(cfg, model, cfg.block_size, batch, context))
    try:
        log(f"{model}: {dtype} on {cfg.device}, block size {cfg.block_size}, "
            f"{engine.device_pool.num_blocks} KV blocks; torch {torch.get_num_threads()} threads")
        decode = [[decode_time(engine, b, c, cfg.repeats, rng) for c in context] for b in batch]
        prefill = [[prefill_time(engine, q, p, cfg.repeats, rng) for p in cached] for q in tokens]
    finally:
        engine.close()
    factors = block_size_factors(cfg, model, (batch[len(batch) // 2], context[len(context) // 2]), rng)
    copies = copy_costs(spec, dtype, cfg.device, cfg.swap_block_sizes, cfg.repeats)
    api = {}
    if cfg.api:
        from pagedserve.loadgen.profile_api import measure_api
        from pagedserve.loadgen.profiled_cost import interp2
        from pagedserve.loadgen.step_profile import Grid2
        log("the API's request overhead and served steps, through pagedserve up")
        flags = ["--device", cfg.device, "--block-size", str(cfg.block_size), "--worker-threads", str(threads)]
        grid = Grid2(tuple(map(float, batch)), tuple(map(float, context)), tuple(map(tuple, decode)))
        contexts = sorted({min(c, spec.max_model_len - API_OUTPUT - 2) for c in cfg.api_context})
        api = {"api": measure_api(model, flags, tokens, [row[0][0] for row in prefill], spec.max_model_len,
                                  [b for b in cfg.api_batch if b <= batch[-1]] or [batch[0]], contexts,
                                  lambda b, c: interp2(grid, b, c), decode_len=API_OUTPUT)}

    raw = {"version": VERSION,
           "machine": machine(cfg.device),
           "model": {"path": str(Path(model).resolve()), "name": Path(model).resolve().name,
                     "num_layers": spec.num_layers, "hidden": hf_config.hidden_size,
                     "num_heads": spec.num_attention_heads or spec.num_kv_heads, "num_kv_heads": spec.num_kv_heads,
                     "head_dim": spec.head_dim, "vocab": spec.vocab_size, "max_model_len": spec.max_model_len,
                     "dtype": dtype, "kv_bytes_per_token": spec.block_bytes(1, dtype)},
           "versions": versions(),
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "took_s": 0.0,
           "block_size": cfg.block_size,
           "decode": {"batch": batch, "context": context, "seconds": decode},
           "prefill": {"tokens": tokens, "context": cached, "seconds": [[t for t, _ in row] for row in prefill],
                       "cached": [[n for _, n in row] for row in prefill]},
           "block_size_factor": {"block_size": list(factors), "factor": list(factors.values())},
           **copies,
           **api,
           "notes": notes}
    raw["took_s"] = round(time.monotonic() - started, 1)
    return raw


# ---- the grids' axes -------------------------------------------------------------------------

def decode_tail(repeats: int) -> int:
    """Tokens a decode point's sequences grow past C while timed: the timed steps are centred on C."""
    return repeats - repeats // 2


def decode_prompt_len(c: int, repeats: int) -> int:
    """The prompt that puts the middle timed step at context c (WARM steps, then `repeats` timed)."""
    return c - WARM - 1 - repeats // 2


def seq_blocks(c: int, repeats: int, block_size: int) -> int:
    """KV blocks one decode sequence of context ~c holds by its last timed step."""
    return math.ceil((c + decode_tail(repeats) + 1) / block_size)


def decode_axes(cfg, spec, dtype: str, notes: list[str]) -> tuple[list[int], list[int]]:
    """Contexts capped to the model's length; then the largest batches (or contexts) dropped
    until the largest point fits the KV pool cfg.kv_cache_gib allows."""
    batch, context = list(cfg.decode_batch), list(cfg.decode_context)
    shortest = WARM + 2 + cfg.repeats // 2
    if context[0] < shortest:
        raise ConfigError(f"--decode-context {context[0]}: with --repeats {cfg.repeats} the shortest context "
                          f"is {shortest}")
    # The sequences must not reach max_model_len while timed (they would finish in a timed step).
    context = capped(context, spec.max_model_len - decode_tail(cfg.repeats) - 1, "decode context", notes)
    allowed = int(cfg.kv_cache_gib * (1 << 30)) // spec.block_bytes(cfg.block_size, dtype)
    while batch[-1] * (seq_blocks(context[-1], cfg.repeats, cfg.block_size) + 1) > allowed:
        if len(batch) > 2:
            notes.append(f"decode batch {batch.pop()} dropped: at context {context[-1]} it needs more than "
                         f"--kv-cache-gib {cfg.kv_cache_gib:g}")
        elif len(context) > 2:
            notes.append(f"decode context {context.pop()} dropped: at batch {batch[-1]} it needs more than "
                         f"--kv-cache-gib {cfg.kv_cache_gib:g}")
        else:
            raise ConfigError(f"--kv-cache-gib {cfg.kv_cache_gib:g}: too small for the decode grid's "
                              f"batch {batch[-1]} at context {context[-1]}")
    return batch, context


def prefill_axes(cfg, max_model_len: int, notes: list[str]) -> tuple[list[int], list[int]]:
    """Cached contexts rounded down to whole blocks (only those are cached) and kept where the
    shortest Q still fits; then every Q capped so that the longest P + Q fits the context (the
    prompt plus the one token sampled) and one step (max_num_batched_tokens)."""
    bs, longest = cfg.block_size, max_model_len - 2
    cached = sorted({p // bs * bs for p in cfg.prefill_context})
    if cached != list(cfg.prefill_context):
        notes.append(f"prefill context {cfg.prefill_context} rounded down to whole blocks of {bs}: {cached}")
    for p in [p for p in cached if p + cfg.prefill_tokens[0] > longest]:
        cached.remove(p)
        notes.append(f"prefill context {p} dropped: no prompt of {cfg.prefill_tokens[0]} more tokens fits "
                     f"max_model_len {max_model_len}")
    if len(cached) < 2:
        raise ConfigError(f"--prefill-context: fewer than two cached contexts fit max_model_len {max_model_len}")
    cap = min(cfg.max_num_batched_tokens, longest - cached[-1])
    return capped(list(cfg.prefill_tokens), cap, "prefill tokens", notes), cached


def capped(axis: list[int], cap: int, name: str, notes: list[str]) -> list[int]:
    """The axis with every value above cap replaced by cap (and so merged): still increasing."""
    if axis[-1] <= cap:
        return axis
    out = sorted({min(v, cap) for v in axis})
    if len(out) < 2:
        raise ConfigError(f"{name}: fewer than two points are at most {cap}")
    notes.append(f"{name} {axis} capped at {cap}: {out}")
    return out


# ---- measuring ---------------------------------------------------------------------------------

def engine_config(cfg, model: str, block_size: int, batch: list[int], context: list[int]):
    from pagedserve.services.engine_config import EngineConfig
    # The pool holds the largest point's sequences, plus one spare block each; no host pool (no
    # swapping happens here: copy_costs times the copies on pools of its own).
    blocks = batch[-1] * (seq_blocks(context[-1], cfg.repeats, block_size) + 1)
    prefill = math.ceil((max(cfg.prefill_tokens) + max(cfg.prefill_context) + 2) / block_size) + 1
    # One step must take a whole decode batch's prompt remainders at once (decode_time).
    tokens = max(cfg.max_num_batched_tokens, batch[-1] * block_size)
    return EngineConfig(model=model, device=cfg.device, dtype=cfg.dtype, block_size=block_size,
                        num_device_blocks=max(blocks, prefill), num_host_blocks=0,
                        max_num_seqs=batch[-1], max_num_batched_tokens=tokens, async_scheduling=False)


def decode_time(engine, b: int, c: int, repeats: int, rng: random.Random) -> float:
    """Median seconds of a step in which b sequences each compute one token at context ~c.

    All b must start decoding in the same step, else those whose prompts finished first would be
    steps ahead (longer contexts). So the prompts' whole blocks are computed first by requests of
    their own (any number of chunked steps) and left in the prefix cache; then the b requests
    each find those cached and compute the remainder (1 to block_size tokens) in one step."""
    from pagedserve.services.sampling_params import SamplingParams
    bs, vocab = engine.config.block_size, engine.spec.vocab_size
    prompts = [fresh(rng, decode_prompt_len(c, repeats), vocab) for _ in range(b)]
    whole = (len(prompts[0]) - 1) // bs * bs      # what allocate can find cached (not the last token)
    if whole:
        engine.generate([p[:whole] for p in prompts], SamplingParams(max_tokens=1, temperature=0.0))
    n_out = WARM + repeats + 2                    # never finishing while timed
    params = SamplingParams(max_tokens=n_out, min_tokens=n_out, ignore_eos=True, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()
    reqs = [engine.scheduler.requests[i] for i in ids]
    if any(r.num_cached_tokens != whole or len(r.seqs[0].output_token_ids) != 1 for r in reqs):
        raise RuntimeError(f"decode batch {b} context {c}: the prompts did not all start decoding in one step "
                           f"(each with {whole} tokens cached)")
    for _ in range(WARM):
        engine.step()
    times = [timed(engine.step) for _ in range(repeats)]
    if any(len(r.seqs) != 1 or len(r.seqs[0].output_token_ids) != 1 + WARM + repeats for r in reqs):
        raise RuntimeError(f"decode batch {b} context {c}: a sequence did not decode in every timed step")
    abort(engine, ids)
    t = statistics.median(times)
    log(f"decode batch {b} context {c} (block size {bs}): {1e3 * t:.2f} ms")
    return t


def prefill_time(engine, q: int, p: int, repeats: int, rng: random.Random) -> tuple[float, int]:
    """(median seconds of the step computing q prompt tokens after p cached, the tokens found
    cached). Fresh tokens every time, so that only the p meant to be cached are."""
    from pagedserve.services.sampling_params import SamplingParams
    vocab, times, hits = engine.spec.vocab_size, [], set()
    for _ in range(repeats):
        prefix = fresh(rng, p, vocab)
        if p:   # p is whole blocks: all of them are left in the prefix cache
            engine.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0))
        # Two tokens, so that the timed step is not also the one that finishes the request.
        rid = engine.add_request(prefix + fresh(rng, q, vocab),
                                 SamplingParams(max_tokens=2, min_tokens=2, ignore_eos=True, temperature=0.0))
        times.append(timed(engine.step))
        req = engine.scheduler.requests[rid]
        if len(req.seqs[0].output_token_ids) != 1:
            raise RuntimeError(f"prefill {q} tokens after {p}: the prompt took more than one step")
        hits.add(req.num_cached_tokens)
        abort(engine, [rid])
    if hits != {p}:   # a miss (or a stray hit) would time another point than (q, p)
        raise RuntimeError(f"prefill {q} tokens after {p}: found {sorted(hits)} tokens cached, not {p}")
    t = statistics.median(times)
    log(f"prefill {q} tokens after {p} cached: {1e3 * t:.2f} ms")
    return t, hits.pop()


def block_size_factors(cfg, model: str, point: tuple[int, int], rng: random.Random) -> dict[int, float]:
    """{block size: a decode step's time at the point (batch, context) / its time at cfg.block_size},
    cfg.block_size listed whether asked or not. Every block size gets an engine of its own, built
    alike (pool, batch limits), the reference's included, so that only the block size differs."""
    from pagedserve.services.engine import Engine
    b, c = point
    times = {}
    for bs in sorted({*cfg.factor_block_sizes, cfg.block_size}):
        with Engine(engine_config(cfg, model, bs, [b], [c])) as engine:
            times[bs] = decode_time(engine, b, c, cfg.repeats, rng)
    factors = {bs: t / times[cfg.block_size] for bs, t in times.items()}
    log("block-size factors: " + ", ".join(f"{bs} {f:.3f}" for bs, f in factors.items()))
    return factors


def copy_costs(spec, dtype: str, device: str, block_sizes: list[int], repeats: int) -> dict:
    """Seconds per block of swap-out (device -> host), swap-in (host -> device) and copy-on-write
    (device -> device), each timed over k blocks at a time with the pools' own copy functions."""
    from pagedserve.kvstore.pool import BlockPool, unique_pool_name
    out = {name: {"block_size": list(block_sizes), "seconds_per_block": []}
           for name in ("swap_out", "swap_in", "copy")}
    for bs in block_sizes:
        block_bytes = spec.block_bytes(bs, dtype)
        k = max(1, min(COPY_BLOCKS, COPY_BYTES // (2 * block_bytes)))
        dev = BlockPool.create(unique_pool_name("profile-device"), 2 * k, block_bytes, device)
        try:
            host = BlockPool.create(unique_pool_name("profile-host"), k, block_bytes, "cpu")
        except BaseException:
            release(dev)
            raise
        try:
            if dev.blocks.is_cuda:
                host.pin()   # as the kvstore pins its host pool: swaps are DMA, not staged copies
            # Every other device block: a sequence's blocks are scattered in a busy pool, and
            # consecutive ones would merge into one copy (pool._runs).
            evens, odds = [2 * i for i in range(k)], [2 * i + 1 for i in range(k)]
            ops = {"swap_out": lambda: dev.copy_to(host, list(zip(evens, range(k)))),
                   "swap_in": lambda: host.copy_to(dev, list(zip(range(k), odds))),
                   "copy": lambda: dev.copy_within(list(zip(evens, odds)))}
            for name, op in ops.items():
                timed(op, sync=dev.blocks)   # first touch of the pages (and a first CUDA launch): untimed
                t = statistics.median(timed(op, sync=dev.blocks) for _ in range(max(3, repeats)))
                out[name]["seconds_per_block"].append(t / k)
            log(f"copies at block size {bs} ({k} blocks of {block_bytes} bytes): " + ", ".join(
                f"{name} {1e6 * out[name]['seconds_per_block'][-1]:.2f} us" for name in ops))
        finally:
            release(host)
            release(dev)
    return out


# ---- helpers ---------------------------------------------------------------------------------

def fresh(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def timed(fn, sync=None) -> float:
    """Seconds fn takes; with sync (a CUDA tensor) until the device is done with it too."""
    start = time.perf_counter()
    fn()
    if sync is not None and sync.is_cuda:
        import torch
        torch.cuda.synchronize(sync.device)
    return time.perf_counter() - start


def abort(engine, request_ids: list[str]) -> None:
    for rid in request_ids:
        engine.scheduler.abort(rid)
        engine.scheduler.pop_finished(rid)


def release(pool) -> None:
    pool.close()
    pool.unlink()


def log(line: str) -> None:
    print(f"profile: {line}", file=sys.stderr, flush=True)


def machine(device: str) -> dict:
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    return {"hostname": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "device": name}


def versions() -> dict:
    import torch
    import transformers
    try:
        ours = importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:   # a checkout never installed
        ours = "unknown"
    return {"pagedserve": ours, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}
