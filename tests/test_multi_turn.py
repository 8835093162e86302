"""The multi-turn chat workload (issue 27): its script, its runner against the in-process fake
server, the infinite-cache bound worked by hand; and bench_host_cache's refused runs marked as such
and its stop on SIGTERM. Fast: no model, no tokenizer (a character codec stands in), no stack."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import signal

import pytest

from pagedserve.loadgen import bench_host_cache
from pagedserve.loadgen.bench_host_cache import Stopped, arm_stop_signals, table
from pagedserve.loadgen.config import MultiTurnConfig
from pagedserve.loadgen.fake_server import FakeServer
from pagedserve.loadgen.multi_turn import build_script, system_prompt
from pagedserve.loadgen.multi_turn_report import write_outputs
from pagedserve.loadgen.multi_turn_run import run_multi_turn, script_options
from pagedserve.loadgen.workload import prefix_cache_bound


class CharCodec:
    """TextCodec's interface: pool ids become words, and a chat is tokenized one id per character of
    a template shaped like the tiny model's (a prompt of turn k is a prefix of turn k+1's)."""
    pool = list(range(10, 60))

    def text(self, ids: list[int]) -> str:
        return "".join(f" w{i}" for i in ids)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        s = "<s>" + "".join(f"<{m['role']}>{m['content']}<end>" for m in messages) + "<assistant>"
        return [ord(c) for c in s]


class RecordingServer(FakeServer):
    """The fake server, keeping every request body it answers."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.bodies: list[dict] = []

    async def complete(self, req: dict, chat: bool, w) -> None:
        self.bodies.append(req)
        await super().complete(req, chat, w)


def config(port: int, tmp_path, **kw) -> MultiTurnConfig:
    base = dict(url=f"http://127.0.0.1:{port}", users=3, turns=3, user_rate=math.inf, think_time=0.0,
                turn_lengths="fixed", user_len=6, output_len=5, system_len=4, progress=False,
                metrics_interval=0.0, out=str(tmp_path / "out"), seed=7)
    base.update(kw)
    return MultiTurnConfig(**base)


def run(tmp_path, server_kw: dict | None = None, **kw):
    async def go():
        server = RecordingServer(**(server_kw or {}))
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        async with srv:
            cfg = config(srv.sockets[0].getsockname()[1], tmp_path, **kw)
            return server, await run_multi_turn(cfg, CharCodec())
    return asyncio.run(go())


def test_each_turn_extends_the_previous_prompt_and_its_answer_exactly(tmp_path):
    server, result = run(tmp_path)
    assert len(result.records) == len(server.bodies) == 9 and all(r.ok for r in result.records)
    body_of = {b["messages"][-1]["content"]: b for b in server.bodies}     # by the new user message
    for conv in result.script:
        turns = sorted(((r, ids) for r, ids in zip(result.records, result.prompts) if r.user == conv.user),
                       key=lambda t: t[0].turn)
        assert [rec.turn for rec, _ in turns] == [0, 1, 2]
        messages = None
        for rec, ids in turns:
            body = body_of[conv.turns[rec.turn].text]
            assert body["stream"] and body["max_completion_tokens"] == 5
            assert ids == CharCodec().chat_ids(body["messages"])            # the ids the bound counts
            if messages is not None:
                # the previous turn's messages, the server's own answer, then the new user message
                assert body["messages"][:-1] == messages + [{"role": "assistant", "content": prev.answer}]
                assert body["messages"][-1]["role"] == "user"
                assert ids[:len(prev_ids)] == prev_ids                       # the token ids extend too
            assert rec.answer == " x" * 5                                     # the fake server's answer, whole
            messages, prev, prev_ids = body["messages"], rec, ids
        assert messages[0] == {"role": "system", "content": CharCodec().text(
            system_prompt(CharCodec.pool, 4, result.config.seed))}


def test_a_seed_fixes_the_script_and_what_is_sent(tmp_path):
    opts = script_options(config(0, tmp_path, users=5, turns=4, user_rate=2.0, think_time=3.0,
                                 turn_lengths="sharegpt", length_scale=4.0))
    one = build_script(opts, CharCodec.pool, CharCodec().text)
    assert one == build_script(opts, CharCodec.pool, CharCodec().text)
    assert one != build_script(dataclasses.replace(opts, seed=8), CharCodec.pool, CharCodec().text)
    # Arrivals grow (Poisson), the first turn has no think time, later ones do.
    assert [c.arrival for c in one] == sorted(c.arrival for c in one) and one[0].arrival == 0
    assert all(c.turns[0].think == 0 and all(t.think > 0 for t in c.turns[1:]) for c in one)
    # More users and turns keep the first ones as they were (each user draws from its own stream).
    more = build_script(dataclasses.replace(opts, users=7), CharCodec.pool, CharCodec().text)
    assert more[:5] == one
    # Two runs send the same conversations (the fake server answers the same each time).
    a, _ = run(tmp_path)
    b, _ = run(tmp_path)
    key = (lambda body: [m["content"] for m in body["messages"]])
    assert sorted(map(key, a.bodies)) == sorted(map(key, b.bodies))


def test_the_infinite_cache_bound_by_hand():
    # Blocks of 2; only full blocks before a prompt's last token count, and a block hits only if
    # every block before it did (chained keys).
    prompts = [[1, 2, 3, 4, 5],          # (1,2) (3,4): both new                    0 of 5
               [1, 2, 3, 4, 9, 9, 9],    # (1,2) (3,4) hit, (9,9) new               4 of 7
               [1, 2, 7, 7, 7],          # (1,2) hits, (7,7) new                    2 of 5
               [9, 9, 1, 2, 0]]          # (9,9) alone was never a first block: 0   0 of 5
    assert prefix_cache_bound(prompts, 2) == 6 / 22
    assert prefix_cache_bound(prompts[:2], 2) == 4 / 12


def test_the_report_has_turns_tiers_and_the_bound(tmp_path):
    _, result = run(tmp_path)
    s = write_outputs(result, tmp_path / "out")
    assert [r["turn"] for r in s["per_turn"]] == [0, 1, 2] and all(r["completed"] == 3 for r in s["per_turn"])
    assert s["per_turn"][2]["mean_prompt_tokens"] > s["per_turn"][0]["mean_prompt_tokens"]
    # Turn 2 resends turns 0 and 1 whole: the bound is well above 0 (the system prompt too).
    assert s["prefix_cache"]["infinite_cache_bound"] == prefix_cache_bound(result.prompts, 16) > 0.3
    assert s["refused"] == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| turn | sent |" in report and "infinite-cache bound" in report and "did not hold" not in report
    assert (tmp_path / "out" / "requests.jsonl").read_text().count('"turn"') == 9


def test_a_refused_turn_ends_its_conversation_and_the_report_says_so(tmp_path):
    server, result = run(tmp_path, {"fail_every": 4}, users=4)
    s = write_outputs(result, tmp_path / "out")
    refused = [r for r in result.records if r.error == "http_503"]
    assert refused and s["refused"] == len(refused)
    for r in refused:               # nothing more was sent in that conversation
        assert not [o for o in result.records if o.user == r.user and o.turn > r.turn]
    assert "did not hold" in (tmp_path / "out" / "report.md").read_text()


def test_a_turn_that_would_not_fit_the_context_ends_the_conversation(tmp_path):
    _, result = run(tmp_path, {"max_model_len": 130}, turns=4)
    assert result.ended_at_context == 3 and all(r.ok for r in result.records)
    assert {r.turn for r in result.records} < {0, 1, 2, 3}
    assert any("would not fit" in n for n in result.notes)


def test_a_bench_row_with_refused_requests_is_marked():
    row = {"run": "host", "completed": 95, "failed": 105, "refused": 100, "device_hit_rate": 0.2,
           "host_hit_rate": 0.1, "hit_rate": 0.3, "bound": 0.5, "prefill_saved": 1000.0, "mean_ttft_ms": 80.0,
           "p99_ttft_ms": 200.0, "output_throughput": 50.0}
    held = dict(row, run="device", failed=0, refused=0)
    text = table([held, row])
    held_line, refused_line = text.splitlines()[2:4]
    assert "refused" not in held_line and "100 refused" in refused_line and "did not hold" in refused_line
    assert "latencies of the 95 served only" in text


def test_sigterm_stops_the_bench_once_and_its_teardown_is_not_interrupted(monkeypatch):
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(bench_host_cache, "_stopping", False)
    try:
        arm_stop_signals()
        with pytest.raises(Stopped):            # raised where the main thread is: its finally stops the stack
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        arm_stop_signals()                      # after a replay: stays ignored while stopping
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
