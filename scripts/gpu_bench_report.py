"""The reporting side of `make gpu-bench` (scripts/gpu_bench.py): the sections' figures as table
rows, each judged against the issue's targets where one applies, and the table itself.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The targets (issue 30, item 6).
TARGET_STEP_MS = 2.5          # engine decode step at batch 64
TARGET_FORWARD_MS = 1.6       # forward + logits at batch 64
TARGET_BUSY = 0.70            # GPU busy share of the step at batch 64
TARGET_OFFLINE_TOK_S = 12_000
TARGET_VS_ORCA = 1.6
TARGET_SERVED_RATIO = 4.0
JUDGED_BATCH = 64


def fmt(v, unit: str = "", digits: int = 2) -> str:
    return "n/a" if v is None or v != v else f"{v:,.{digits}f}{unit}"


def judge(value, target: float, higher: bool):
    if value is None or value != value:
        return None, "no figure"
    ok = value >= target if higher else value <= target
    return ok, f"{'>=' if higher else '<='} {target:g}: {'met' if ok else 'MISSED'}"


def row(section: str, config: str, figures: str, target: str = "-", ok=None, goal: bool = False) -> dict:
    """goal: ok judges one of the issue's speed targets (reported; a miss is not a failed run)."""
    return {"section": section, "config": config, "figures": figures, "target": target, "ok": ok, "goal": goal}


def profile_rows(data: dict, smoke: bool) -> list[dict]:
    rows = []
    runs = data.get("runs", [])
    judged_mode = next((m for m in ("graphs", "default (no enforce_eager here)") if any(r["mode"] == m for r in runs)),
                       None)
    unit = "CPU ops" if smoke else "launches"
    busy = "aten busy" if smoke else "GPU busy"
    for r in runs:
        fwd = (f"fwd+logits {fmt(r.get('forward_logits_ms'))} ms "
               f"({'graph ' + str(r['graph_bucket']) if r.get('graph_bucket') else 'eager'})"
               if "forward_logits_ms" in r else f"fwd+logits n/a ({r.get('forward_logits_error', '')[:60]})")
        prof = (f"{busy} {fmt(r['busy_ms'])} ms = "
                f"{fmt(100 * r['busy_share'] if r.get('busy_share') is not None else None, ' %', 0)}; "
                f"{fmt(r['launches'], '', 0)} {unit}/step"
                + (f" ({r['graph_launches']:g} graph replays)" if r.get("graph_launches") else "") if "busy_ms" in r
                else f"profiler n/a ({r.get('profiler_error', '')[:60]})")
        figures = (f"step {fmt(r['step_ms'])} ms (schedule {fmt(r['schedule_ms'])} / worker {fmt(r['worker_ms'])} / "
                   f"update {fmt(r['update_ms'])}); {fwd}; {prof}")
        config = f"{r['mode']}, batch {r['batch']}" + ("" if r.get("decode_batch") == r["batch"]
                                                       else f" (decoded {r.get('decode_batch')})")
        if r["batch"] == JUDGED_BATCH and r["mode"] == judged_mode:
            checks = [judge(r["step_ms"], TARGET_STEP_MS, False),
                      judge(r.get("forward_logits_ms"), TARGET_FORWARD_MS, False),
                      judge(r.get("busy_share"), TARGET_BUSY, True)]
            target = (f"step {checks[0][1]}; fwd+logits {checks[1][1]}; busy {checks[2][1].replace('0.7', '70 %')}")
            rows.append(row("profile", config, figures, target, all(c[0] for c in checks), goal=True))
        else:
            rows.append(row("profile", config, figures))
    return rows


def offline_rows(data: dict) -> list[dict]:
    rows, runs = [], data.get("runs", [])
    w = data.get("workload", {})
    what = (f"{w.get('requests')} requests at once, prompt/output mean {w.get('mean_prompt')}/{w.get('mean_output')}, "
            f"pool {w.get('kv_bytes', 0) / 2**20:g} MiB") if w else ""
    ok_runs = [r for r in runs if "error" not in r]
    orca = next((r for r in ok_runs if r["allocation"] == "orca-oracle"), None)
    for r in runs:
        config = f"{r['allocation']}, {r['mode']}"
        if "error" in r:
            rows.append(row("offline", config, r["error"][:160], "ran", False))
            continue
        complete = r["output_tokens"] == r["expected"]
        figures = (f"{fmt(r['tok_per_s'], '', 0)} out tok/s ({r['seconds']} s); tokens in cache "
                   f"{fmt(100 * r['token_states'], ' %', 1)} (saturated {fmt(100 * r['token_states_saturated'], ' %', 1)}); "
                   f"{r['preemptions']} preemptions" + ("" if complete else
                                                        f"; {r['output_tokens']} of {r['expected']} tokens"))
        if r["allocation"] == "paged" and orca is not None and r["mode"] == orca["mode"]:
            ratio = r["tok_per_s"] / orca["tok_per_s"]
            a, b = judge(r["tok_per_s"], TARGET_OFFLINE_TOK_S, True), judge(ratio, TARGET_VS_ORCA, True)
            figures += f"; {ratio:.2f}x Orca-Oracle"
            rows.append(row("offline", config, figures, f"tok/s {a[1]}; vs Orca {b[1]}", bool(a[0] and b[0]), goal=True))
            if not complete:
                rows.append(row("offline", config, f"{r['output_tokens']} of {r['expected']} tokens", "all tokens", False))
        else:
            rows.append(row("offline", config, figures, "-" if complete else "all tokens", None if complete else False))
    if what:
        rows.insert(0, row("offline", "workload", what))
    return rows


def served_rows(data: dict) -> list[dict]:
    rows, runs = [], data.get("runs", [])
    for r in runs:
        rows.append(row("served", r["mode"], f"{fmt(r['tok_per_s'], '', 0)} out tok/s, TPOT mean {fmt(r['mean_tpot_ms'])} "
                        f"/ p99 {fmt(r['p99_tpot_ms'])} ms, TTFT mean {fmt(r['mean_ttft_ms'], '', 0)} ms "
                        f"({r['requests']} requests at once, {r['seconds']} s; ready after {r['ready_s']} s)"))
    by = {r["mode"]: r for r in runs}
    if "eager" in by and "graphs" in by:
        ratio = by["graphs"]["tok_per_s"] / by["eager"]["tok_per_s"]
        ok, text = judge(ratio, TARGET_SERVED_RATIO, True)
        rows.append(row("served", "graphs / eager", f"{ratio:.2f}x out tok/s; TPOT {by['eager']['mean_tpot_ms']:.2f} -> "
                        f"{by['graphs']['mean_tpot_ms']:.2f} ms", f"ratio {text}", ok, goal=True))
    return rows


def section_rows(name: str, code, seconds: float, data: dict, log: Path, smoke: bool) -> list[dict]:
    rows = {"profile": lambda: profile_rows(data, smoke), "offline": lambda: offline_rows(data),
            "served": lambda: served_rows(data)}.get(name, lambda: [])()
    rows += [row(name, "note", n) for n in data.get("notes", [])]
    finished = code == 0 and data.get("done")
    tail = why_failed(log.read_text(errors="replace")) if log.exists() and not finished else ""
    rows.append(row(name, "section", ("finished" if finished else
                                      f"out of time; {tail}" if code is None else f"exit {code}; {tail}")
                    + f" ({seconds:.0f} s)", "finished", bool(finished)))
    return rows


def why_failed(text: str) -> str:
    """The log line that says what went wrong (gpu_e2e.cause: the last exception line, not the last
    line, which for a stack that died is a shutdown message)."""
    try:
        sys.path.insert(0, str(REPO))
        from pagedserve.loadgen.gpu_e2e import cause
        return cause(text)[:160]
    except Exception:
        return (text.strip().splitlines() or ["no output"])[-1][:160]
    finally:
        sys.path.remove(str(REPO))


def table(rows: list[dict]) -> str:
    mark = {True: "ok", False: "FAIL", None: "-"}
    goal = {True: "met", False: "MISSED", None: "-"}
    w = [max(len(r[k]) for r in rows + [{"section": "section", "config": "config"}]) for k in ("section", "config")]
    lines = [f"{'section':<{w[0]}}  {'config':<{w[1]}}  {'result':<6}  figures  [target]"]
    lines += [f"{r['section']:<{w[0]}}  {r['config']:<{w[1]}}  {(goal if r['goal'] else mark)[r['ok']]:<6}  {r['figures']}"
              + ("" if r["target"] == "-" else f"  [{r['target']}]") for r in rows]
    return "\n".join(lines)
