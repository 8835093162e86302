"""bench_host_cache --workload multi-turn (issue 27, part 2), without a stack: the bound that counts
the server's answers, worked by hand; the rows, the table and the targets from fabricated runs; the
order of the runs over rounds. The measurement itself is the README's command, run by hand."""
from __future__ import annotations

from types import SimpleNamespace

from pagedserve.loadgen.bench_host_multi_turn import order, row_of, table, targets, ttft_of
from pagedserve.loadgen.multi_turn_report import bound_with_answers


def rec(send, end, answer="", ok=True, turn=0, ttft=None, prompt_tokens=None, cached_tokens=None):
    return SimpleNamespace(send=send, arrival=send, end=end, answer=answer, ok=ok, turn=turn, ttft=ttft,
                           prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, error=None, error_detail=None)


def test_the_bound_counts_an_answer_once_its_turn_has_ended():
    # Blocks of 2. Turn 1 sends [1,2,3] and is answered "ab" (ids 5,6): [1,2,3,5,6] is kept at t=1.
    # Turn 2 resends it and more: (1,2) and (3,5) hit, the second only thanks to the answer.
    encode = (lambda text: [ord(c) - ord("a") + 5 for c in text])
    prompts = [[1, 2, 3], [1, 2, 3, 5, 6, 7, 8]]
    records = [rec(0.0, 1.0, "ab"), rec(2.0, 3.0, "c")]
    assert bound_with_answers(prompts, records, encode, 2) == 4 / 10
    # Sent before the answer ended, the second prompt hits the prompt's block only.
    early = [rec(0.0, 5.0, "ab"), rec(2.0, 6.0, "c")]
    assert bound_with_answers(prompts, early, encode, 2) == 2 / 10
    # A failed turn's answer is not kept.
    failed = [rec(0.0, 1.0, "ab", ok=False), rec(2.0, 3.0, "c")]
    assert bound_with_answers(prompts, failed, encode, 2) == 2 / 10


def summary(hit, bound, refused=0):
    errors = {"http_503": refused} if refused else {}
    return {"completed": 100 - refused, "failed": refused, "errors": errors, "interrupted": False,
            "request_throughput": 1.5, "output_throughput": 36.0,
            "prefix_cache": {"device_hit_rate": hit / 2, "host_hit_rate": hit / 2, "hit_rate": hit,
                             "infinite_cache_bound": bound - 0.02, "bound_with_answers": bound,
                             "device_hit_tokens": 500.0, "host_hit_tokens": 500.0}}


def records(first_ms, later_ms, before=0.8, after=0.8):
    """Turn 0 sent at t=0..9, later turns at t=10..109 (the kill at t=60), with these TTFTs and
    usage hit rates."""
    out = [rec(float(i), i + 0.5, turn=0, ttft=first_ms / 1000, prompt_tokens=100, cached_tokens=0) for i in range(10)]
    for i in range(10, 110):
        share = before if i < 60 else after
        out.append(rec(float(i), i + 0.5, turn=1, ttft=later_ms / 1000, prompt_tokens=100,
                       cached_tokens=round(100 * share)))
    return out


def test_turn_one_and_later_turns_are_timed_apart():
    rs = records(50.0, 200.0)
    assert ttft_of(rs, later=False) == (50.0, 50.0)
    assert ttft_of(rs, later=True)[0] == 200.0
    assert ttft_of([], later=True) == (None, None)


def test_the_targets_met():
    rows = [row_of("device", summary(0.4, 0.9), records(50, 200), None),
            row_of("host", summary(0.85, 0.9), records(50, 100), None),
            row_of("restart", summary(0.84, 0.9), records(50, 110, 0.8, 0.77), 60.0)]
    assert rows[2]["before_restart"] == 0.8 and rows[2]["after_restart"] == 0.77
    met = targets(rows)
    assert all(line.endswith(": met") for line in met), met
    text = table(rows)
    assert "| host | 100 / 0 | 42.5 % + 42.5 % = 85.0 % | 88.0 % / 90.0 % | 1000 | 50 / 50 | 100 / 100 |" in text
    assert "80.0 % / 77.0 %" in text and "did not hold" not in text


def test_the_targets_missed_and_a_refused_run_marked():
    refused = records(50, 150)
    for r in refused[:3]:
        r.ok, r.error, r.error_detail = False, "http_503", "queue full"
    rows = [row_of("device", summary(0.4, 0.9), records(50, 200), None),
            row_of("host", summary(0.7, 0.9, refused=3), refused, None),
            row_of("restart", summary(0.6, 0.9), records(50, 150, 0.8, 0.6), 60.0)]
    verdicts = [line.rsplit(": ", 1)[1] for line in targets(rows)]
    # hit 0.7/0.9 < 90 %; TTFT 25 % lower, not 30; p99 lower; restart 20 points apart; 3 refused
    assert verdicts == ["**missed**", "**missed**", "met", "**missed**", "**missed**"]
    assert "host (refused: did not hold)" in table(rows) and "3 turns refused" in table(rows)


def test_targets_without_the_runs_they_compare_say_so():
    verdicts = [line.rsplit(": ", 1)[1] for line in targets([row_of("none", summary(0.0, 0.9), records(50, 300), None)])]
    assert verdicts == ["n/a"] * 4 + ["met"]


def test_rounds_alternate_the_order():
    assert order(["none", "device", "host"], 1) == ["none", "device", "host"]
    assert order(["a", "b"], 2) == ["a (1)", "b (1)", "b (2)", "a (2)"]


def test_turns_lost_to_the_kill_are_not_refusals():
    rs = records(50, 110)
    rs[70].ok, rs[70].error, rs[70].error_detail = False, "http_503", "the engine at ipc:///x went away"
    rs[71].ok, rs[71].error, rs[71].error_detail = False, "http_503", "queue full"
    row = row_of("restart", summary(0.8, 0.9), rs, 60.0)
    assert row["lost"] == 1 and row["refused"] == 1
    assert "1 turns failed with the scheduler" in table([row])
