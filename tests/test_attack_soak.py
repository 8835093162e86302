"""The short form of the attack soak (loadgen/attack_soak.py; `make soak-attack` runs the long
one): every hostile class of issue 28 once, at a third of the counts and the audit's sizes, beside
a steady normal load; the issue's targets must hold. A miss names its target and class, e.g.
"class schema_enum: 1 answers not a 4xx or served within 1 s: [...]".
"""
from __future__ import annotations

from pagedserve.loadgen import attack_report
from pagedserve.loadgen.attack_soak import attack_soak
from pagedserve.loadgen.config import AttackSoakConfig


def test_no_single_request_takes_the_service_down(tiny_llama, tmp_path):
    # This runs beside the rest of make test on 2 shared cores, so its p99 TTFT (the slowest of ~20
    # streams) is a figure of how busy the machine is, not a target: `make soak-attack` holds the
    # latency bound, alone on the machine. Here every stream must still get its first token, and
    # restarts, success, RSS and the 4xx answers are as strict as the long form (answers within 3 s
    # rather than 1: a hang, not a slow answer, is what this catches).
    cfg = AttackSoakConfig(model=tiny_llama, warmup=2, quiet=6, duration=20, rounds=1, scale=0.3,
                           answer_s=3.0, out=str(tmp_path / "attack-soak.json"))
    report = attack_soak(cfg)
    print(attack_report.table(report))
    assert report["attack"]["requests"] >= 30 and report["quiet"]["requests"] >= 10, attack_report.table(report)
    assert report["attack"]["streams_without_first_token"] == 0, attack_report.table(report)
    missed = [m for m in attack_report.missed(report) if not m.startswith("p99 TTFT")]
    assert not missed, "missed targets:\n" + "\n".join(missed)
