"""The attack soak (issue 28, "no single request takes the service down"): a steady normal load
through the openai SDK, first alone (the quiet baseline) and then while hostile clients run
(loadgen/attacks.py), against a real `pagedserve up` stack with API keys, a rate limit and a small
queue. Reported: the normal load's success and TTFT, each hostile class's answers, the launcher's
restarts and every process's RSS over time (loadgen/proc_watch.py); exit 1 when a target of the
issue is missed (loadgen/attack_report.py).

    python -m pagedserve.loadgen.attack_soak                      (make soak-attack, a few minutes)
    python -m pagedserve.loadgen.attack_soak --quiet 10 --duration 25 --rounds 1 --scale 0.3
tests/test_attack_soak.py runs the short form in `make test`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import sys
import time
import traceback

from pagedserve.loadgen import attack_report, raw_http
from pagedserve.loadgen.attacks import ATTACKS, HOLD, KEYED, Attacker, judge
from pagedserve.loadgen.config import AttackSoakConfig
from pagedserve.loadgen.normal_load import LoadProcess
from pagedserve.loadgen.proc_watch import ProcWatch
from pagedserve.loadgen.raw_http import Answer
from pagedserve.loadgen.stack import Stack
from pagedserve.services.flags import ConfigError, add_flags, from_args

CLASS_TIMEOUT_S = 60.0     # one round of one class; past it the round counts as a "timeout" answer


def stack_flags(cfg: AttackSoakConfig, keys: list[str]) -> list[str]:
    flags = ["--rate-limit", str(cfg.rate_limit), "--rate-limit-window", str(cfg.rate_limit_window),
             "--max-queued-requests", str(cfg.max_queued_requests), "--hang-timeout", str(cfg.hang_timeout),
             "--shutdown-timeout", "2"]
    for k in keys:
        flags += ["--api-key", k]
    return flags


async def hostile(cls: str, a: Attacker, cfg: AttackSoakConfig, rng: random.Random,
                  answers: dict[str, list[Answer]]) -> None:
    """The rounds of one class, spread over the first 80 % of the attack phase (each at a random
    point of its slot, so the classes overlap differently from seed to seed), sent from the class's
    own loopback address (127.0.0.10 + its index; the normal load keeps 127.0.0.1)."""
    raw_http.SOURCE.set(f"127.0.0.{10 + list(ATTACKS).index(cls)}")
    start, slot = time.monotonic(), 0.8 * cfg.duration / cfg.rounds
    for r in range(1 if judge(cls) == HOLD else cfg.rounds):
        await asyncio.sleep(max(0.0, start + slot * (r + rng.uniform(0, 0.6)) - time.monotonic()))
        t0, got = time.monotonic(), []
        try:
            got = await asyncio.wait_for(ATTACKS[cls](a), CLASS_TIMEOUT_S)
        except asyncio.TimeoutError:
            got = [Answer("timeout", time.monotonic() - t0)]
        except OSError as e:   # the router refused the connection itself (it is down)
            got = [Answer(f"{type(e).__name__}", time.monotonic() - t0)]
        except Exception:      # a bug of the attacker's, not a finding: it must show, not pass
            a.problem(cls, "the attack itself failed: " + traceback.format_exc(limit=2).replace("\n", " | "))
        for ans in got:
            ans.round_at = t0
        answers[cls] += got


async def run(cfg: AttackSoakConfig, stack: Stack, model: str, keys: dict[str, str]) -> dict:
    rng = random.Random(cfg.seed)
    watch = ProcWatch(stack)
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch.run(stop))
    load = LoadProcess(stack.url, keys["normal"], model, cfg.rate, cfg.seed,
                       {"warmup": cfg.warmup, "quiet": cfg.quiet, "attack": cfg.duration})
    answers: dict[str, list[Answer]] = {cls: [] for cls in cfg.attacks}
    attacker = Attacker(stack.port, model, cfg, keys, random.Random(cfg.seed + 1))
    try:
        await load.begun("warmup")
        await load.ended("warmup")
        await load.begun("quiet")
        watch.mark("quiet")
        quiet = await load.ended("quiet")
        await load.begun("attack")
        watch.mark("attack")
        await asyncio.gather(*(hostile(cls, attacker, cfg, rng, answers) for cls in cfg.attacks))
        attack = await load.ended("attack")
    finally:
        stop.set()
        await watcher
        load.close()
    classes = {cls: attack_report.class_summary(cls, answers[cls], attacker.problems.get(cls, []), cfg, watch.t0)
               for cls in cfg.attacks}
    return {"quiet": quiet, "attack": attack, "classes": classes,
            "restarts": watch.restarts(), "restart_events": watch.events, "restart_reasons": watch.restart_reasons(),
            "rss": watch.rss(since="attack"), "rss_samples": watch.samples, "marks": watch.marks}


def attack_soak(cfg: AttackSoakConfig) -> dict:
    """Start the stack, run both phases, stop it; the report with its targets checked."""
    from pagedserve.services.tiny_model import resolve_model
    model = resolve_model(cfg.model)
    keys = {name: f"{name.replace(':', '-')}-{secrets.token_hex(6)}" for name in ("normal", *KEYED)}
    stack = Stack(model, *stack_flags(cfg, list(keys.values())))
    try:
        report = asyncio.run(run(cfg, stack, model, keys))
    finally:
        code = stack.stop()
    report["launcher_exit"] = code
    report["config"] = {k: v for k, v in vars(cfg).items()}
    report["targets"] = attack_report.targets(cfg, report)
    with open(cfg.out, "w") as f:
        json.dump(report, f, indent=1)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedserve.loadgen.attack_soak", description=__doc__.splitlines()[0])
    add_flags(p, AttackSoakConfig)
    try:
        cfg = from_args(AttackSoakConfig, p.parse_args(argv))
    except ConfigError as e:
        print(f"attack_soak: {e}", file=sys.stderr)
        return 2
    report = attack_soak(cfg)
    print(attack_report.table(report))
    print(f"report in {cfg.out}")
    return 1 if attack_report.missed(report) else 0


if __name__ == "__main__":
    sys.exit(main())
