"""What `loadgen multi-turn` leaves in --out: summary.json (replay's figures plus TTFT per turn
index, the prefix-cache hit rate per tier and the infinite-cache bound of the prompts sent, and the
refused count), requests.jsonl (one record per turn, with its user, turn index and answer),
metrics.jsonl (the scraped /metrics series) and report.md."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from pagedserve.loadgen.metrics import refused_count, summarize
from pagedserve.loadgen.multi_turn_run import MultiTurnResult, TurnRecord
from pagedserve.loadgen.report import jsonable, prefix_cache_of, write_run
from pagedserve.loadgen.workload import chained_hits, prefix_cache_bound


def per_turn(records: list[TurnRecord]) -> list[dict]:
    """By turn index: turns sent and completed, TTFT mean and p99 (ms), the prompt tokens sent (the
    chat template's ids) and the share of prompt tokens the server said it had cached
    (usage.prompt_tokens_details.cached_tokens over usage.prompt_tokens)."""
    rows = []
    for k in sorted({r.turn for r in records}):
        sent = [r for r in records if r.turn == k]
        ok = [r for r in sent if r.ok]
        ttfts = np.asarray([r.ttft for r in ok if r.ttft is not None] or [math.nan]) * 1000.0
        prompt = sum(r.prompt_tokens or 0 for r in ok)
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        rows.append({"turn": k, "sent": len(sent), "completed": len(ok),
                     "mean_ttft_ms": None if np.isnan(ttfts).all() else float(ttfts.mean()),
                     "p99_ttft_ms": None if np.isnan(ttfts).all() else float(np.percentile(ttfts, 99)),
                     "mean_prompt_tokens": sum(r.input_len for r in sent) / len(sent),
                     "cached_share": sum(cached) / prompt if cached and prompt else None})
    return rows


def bound_with_answers(prompts: list[list[int]], records: list[TurnRecord], encode, block_size: int) -> float:
    """The infinite-cache bound counting the server's answers too: a server caches the full blocks
    of what it generated, and the next turn sends them back, so the prompts-only bound undercounts
    what it can hit. In time order, each prompt is looked up and then kept (as prefix_cache_bound
    does), and once a turn's answer has ended, prompt + encode(answer) is kept as well. The
    answer's ids are its text tokenized again (the generated ids are not recorded), an
    approximation: a random-weight model's tokens need not tokenize back to themselves."""
    events = []
    for i, (ids, rec) in enumerate(zip(prompts, records)):
        events.append((rec.send if rec.send is not None else rec.arrival, 0, i, ids))
        if rec.ok and rec.answer and rec.end is not None:
            events.append((rec.end, 1, i, ids + list(encode(rec.answer))))
    seen: set = set()
    hits = total = 0
    for _, answer, _, ids in sorted(events, key=lambda e: e[:3]):
        total += 0 if answer else len(ids)
        hits += chained_hits(ids, block_size, seen, look_up=not answer)
    return hits / total if total else 0.0


def summary_of(result: MultiTurnResult, encode=None) -> dict:
    """`encode` (text -> token ids, no special tokens) adds the bound counting the answers."""
    cfg = result.config
    figures = summarize(result.records, cfg.percentiles)
    pc = prefix_cache_of(result.samples, prefix_cache_bound(result.prompts, cfg.kv_block_size))
    if encode is not None:
        pc["bound_with_answers"] = bound_with_answers(result.prompts, result.records, encode, cfg.kv_block_size)
    return {
        **figures,
        "label": cfg.label or f"{result.server.model} @ {result.server.url}, multi-turn",
        "interrupted": result.interrupted,
        "refused": refused_count(figures["errors"]),
        "users": cfg.users, "turns": cfg.turns, "user_rate": cfg.user_rate, "think_time": cfg.think_time,
        "turns_sent": len(result.records),
        "conversations_ended_at_context": result.ended_at_context,
        "per_turn": per_turn(result.records),
        "prefix_cache": pc,
        "server": dataclasses.asdict(result.server),
        "metrics_available": result.metrics_available,
        "started_at": result.started_at,
        "notes": result.notes,
        "options": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "api_key"},
    }


def write_outputs(result: MultiTurnResult, out: str | Path, encode=None) -> dict:
    out = Path(out)
    summary = summary_of(result, encode)
    write_run(out, summary, result.records)
    with (out / "metrics.jsonl").open("w") as f:
        for sample in result.samples:
            f.write(json.dumps(jsonable(sample), separators=(",", ":")) + "\n")
    (out / "report.md").write_text(markdown(summary, result))
    return summary


def ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def share(v) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def markdown(s: dict, result: MultiTurnResult) -> str:
    cfg = result.config
    arrivals = "all at once" if math.isinf(cfg.user_rate) else f"{cfg.user_rate:g} users/s (Poisson)"
    lengths = f"fixed {cfg.user_len} / {cfg.output_len}" if cfg.turn_lengths == "fixed" else \
        f"sharegpt / {cfg.length_scale:g}"
    pc = s["prefix_cache"]
    lines = [
        f"# loadgen multi-turn: {s['label']}", "",
        f"- server: {result.server.url}, model `{result.server.model}`, context {result.server.max_model_len}",
        f"- {cfg.users} users x {cfg.turns} turns, {arrivals}, think time {cfg.think_time:g} s (mean, exponential), "
        f"turn lengths (user message / answer tokens) {lengths}, system prompt {cfg.system_len} tokens, seed {cfg.seed}"
        + (", interrupted (Ctrl-C)" if result.interrupted else ""),
        "",
        "| figure | value |", "|---|---|",
        f"| turns sent / completed / failed | {s['turns_sent']} / {s['completed']} / {s['failed']} |",
        f"| refused (503, 429) | {s['refused']}" + (" — **the run did not hold this rate**" if s["refused"] else "")
        + " |",
        f"| duration | {s['duration']:.2f} s |",
        f"| input / output tokens | {s['total_input_tokens']} / {s['total_output_tokens']} |",
        f"| output token throughput | {s['output_throughput']:.1f} tok/s |",
        f"| TTFT mean / p99 | {s['mean_ttft_ms']:.1f} / {s.get('p99_ttft_ms', math.nan):.1f} ms |",
        f"| prefix-cache hits, share of prompt tokens | {share(pc['hit_rate'])} (device "
        f"{share(pc['device_hit_rate'])}, host {share(pc['host_hit_rate'])}) |",
        f"| infinite-cache bound of the prompts sent ({cfg.kv_block_size}-token blocks) | "
        f"{share(pc['infinite_cache_bound'])} |",
        *([f"| the same, the answers' blocks counted once each turn ends | {share(pc['bound_with_answers'])} |"]
          if "bound_with_answers" in pc else []),
        "", "| turn | sent | completed | TTFT mean ms | TTFT p99 ms | prompt tokens (mean) | cached (usage) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in s["per_turn"]:
        lines.append(f"| {r['turn']} | {r['sent']} | {r['completed']} | {ms(r['mean_ttft_ms'])} | {ms(r['p99_ttft_ms'])} "
                     f"| {ms(r['mean_prompt_tokens'])} | {share(r['cached_share'])} |")
    if s["errors"]:
        lines += ["", "Errors by kind: " + ", ".join(f"{k} {v}" for k, v in s["errors"].items())
                  + ". A failed turn ends its conversation."]
    if result.metrics_available is False:
        lines += ["", "The server has no /metrics: no hit rate per tier."]
    if result.notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in result.notes]
    lines += ["", "Hit rates per tier: the server's counters over the run (`vllm:prefix_cache_hits` for the "
              "device, `vllm:external_prefix_cache_hits` for the host tier) over the prompt tokens looked up. "
              "The bound: full blocks before each prompt's last token whose chained prefix an earlier prompt "
              "sent had (a cache that never evicts), over the token ids of the prompts sent."]
    return "\n".join(lines) + "\n"
