"""The attack soak's verdict: issue 28's targets checked against what was measured, and a short
table for people. Every missed target names what missed it (a class, a role, a figure), so that a
failing test says which finding is still open.
"""
from __future__ import annotations

import collections

from pagedserve.loadgen.attacks import HOLD, clear, judge
from pagedserve.loadgen.config import AttackSoakConfig
from pagedserve.loadgen.raw_http import Answer


def class_summary(cls: str, answers: list[Answer], problems: list[str], cfg: AttackSoakConfig,
                  t0: float) -> dict:
    unclear = [a for a in answers if not clear(cls, a, cfg.answer_s)]
    statuses = collections.Counter(str(a.status) for a in answers)
    latencies = [a.latency_s for a in answers]
    return {"judge": judge(cls), "requests": len(answers), "statuses": dict(statuses),
            "max_latency_s": round(max(latencies), 3) if latencies else None,
            "rounds_at_s": sorted({round(a.round_at - t0, 1) for a in answers if a.round_at is not None}),
            "unclear": [a.to_dict(t0) for a in unclear[:10]], "problems": problems,
            "ok": bool(answers) and not unclear and not problems}


def targets(cfg: AttackSoakConfig, report: dict) -> list[dict]:
    quiet, attack = report["quiet"], report["attack"]
    out = []

    def target(name: str, ok: bool, detail: str) -> None:
        out.append({"target": name, "ok": bool(ok), "detail": detail})

    target("normal success", attack["success"] >= cfg.min_success,
           f"{attack['success']:.4f} of {attack['requests']} (need >= {cfg.min_success}); "
           f"outcomes {attack['outcomes']}")
    restarted = {r: n for r, n in report["restarts"].items() if n}
    target("no restart", not restarted, f"restarts {restarted or 'none'} at {report['restart_events']}"
           + (f"; {'; '.join(report['restart_reasons'][:4])}" if report["restart_reasons"] else ""))
    base = max(quiet["ttft_p99_ms"] or 0.0, cfg.ttft_floor_ms)
    p99 = attack["ttft_p99_ms"]      # None: it falls on a stream that never got a first token
    target("p99 TTFT", p99 is not None and p99 <= cfg.ttft_ratio * base,
           f"{'a stream with no first token' if p99 is None else f'{p99} ms'} under attack vs quiet {quiet['ttft_p99_ms']} ms; {attack['streams_without_first_token']} of {attack['streamed']} streams had none (bound {cfg.ttft_ratio} x "
           f"max(quiet, {cfg.ttft_floor_ms:g}) = {cfg.ttft_ratio * base:.0f} ms)")
    grown = {r: v["growth_mb"] for r, v in report["rss"].items() if v["growth_mb"] > cfg.rss_growth_mb}
    target("RSS bounded", not grown, f"growth over {cfg.rss_growth_mb:g} MiB: {grown or 'none'}")
    for cls, c in report["classes"].items():
        if c["judge"] == HOLD:
            continue
        why = "; ".join(c["problems"] + [f"{len(c['unclear'])} answers not a {c['judge']} within "
                                         f"{cfg.answer_s:g} s: {c['unclear'][:3]}"] * bool(c["unclear"]))
        target(f"class {cls}", c["ok"], why or f"{c['statuses']} in <= {c['max_latency_s']} s")
    return out


def table(report: dict) -> str:
    q, a = report["quiet"], report["attack"]
    lines = [f"normal load   quiet: {q['requests']} requests, success {q['success']:.4f}, TTFT p50 "
             f"{q['ttft_p50_ms']} ms p99 {q['ttft_p99_ms']} ms",
             f"              attack: {a['requests']} requests, success {a['success']:.4f}, TTFT p50 "
             f"{a['ttft_p50_ms']} ms p99 {a['ttft_p99_ms']} ms  {a['outcomes']}",
             f"restarts      {report['restarts']}",
             "RSS MiB       " + ", ".join(f"{r} {v['baseline_mb']:.0f}->{v['max_mb']:.0f}" for r, v in report["rss"].items()),
             "", f"{'class':18} {'judge':24} {'n':>4} {'max s':>7}  statuses"]
    for cls, c in report["classes"].items():
        mark = "" if c["ok"] or c["judge"] == HOLD else "  <-- " + (c["problems"][0] if c["problems"] else "unclear")
        lines.append(f"{cls:18} {c['judge']:24} {c['requests']:>4} {c['max_latency_s'] or 0:>7.2f}  "
                     f"{c['statuses']}{mark}")
    lines.append("")
    lines += [f"{'ok  ' if t['ok'] else 'MISS'} {t['target']}: {t['detail']}" for t in report["targets"]]
    return "\n".join(lines)


def missed(report: dict) -> list[str]:
    return [f"{t['target']}: {t['detail']}" for t in report["targets"] if not t["ok"]]
