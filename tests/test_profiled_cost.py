"""`loadgen simulate --profile` and `loadgen plan`: each step priced by a measured step profile
(loadgen/profiled_cost.py). The profiles here are written by hand; no model is needed."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from pagedserve.loadgen import step_profile
from pagedserve.loadgen.config import PlanConfig, SimulateConfig
from pagedserve.loadgen.cost_model import BlockMoves
from pagedserve.loadgen.profiled_cost import ProfiledCost, interp1, interp2
from pagedserve.loadgen.simulate import simulate, summary_of
from pagedserve.loadgen.step_profile import Grid1

MS, US = 1e-3, 1e-6


def make_profile(**changes) -> dict:
    """A profile as `loadgen profile` writes one, its numbers chosen to work by hand: a small
    model (2 layers, 2 KV heads of 16, float32: 512 bytes of KV a token) measured at block size 16."""
    raw = {
        "version": 1,
        "machine": {"hostname": "test-host", "cpu": "test cpu", "cores": 2, "torch_threads": 2, "device": "cpu"},
        "model": {"path": "/models/toy", "name": "toy", "num_layers": 2, "hidden": 64, "num_heads": 4,
                  "num_kv_heads": 2, "head_dim": 16, "vocab": 2048, "max_model_len": 1024, "dtype": "float32",
                  "kv_bytes_per_token": 512},
        "versions": {"pagedserve": "0", "torch": "0", "transformers": "0", "python": "3"},
        "created": "2026-12-07T12:00:00+00:00", "took_s": 1.0,
        "block_size": 16,
        "decode": {"batch": [1, 3, 5], "context": [16, 128, 1024],
                   "seconds": [[2.0 * MS, 2.2 * MS, 3.0 * MS],
                               [2.5 * MS, 3.0 * MS, 6.0 * MS],
                               [4.0 * MS, 6.0 * MS, 20.0 * MS]]},
        "prefill": {"tokens": [16, 128, 1024], "context": [0, 128, 1024],
                    "seconds": [[3.0 * MS, 3.4 * MS, 5.0 * MS],
                                [6.0 * MS, 7.0 * MS, 12.0 * MS],
                                [30.0 * MS, 34.0 * MS, 60.0 * MS]]},
        "block_size_factor": {"block_size": [4, 16, 64], "factor": [1.5, 1.0, 1.2]},
        "swap_out": {"block_size": [4, 16, 64], "seconds_per_block": [14 * US, 20 * US, 44 * US]},
        "swap_in": {"block_size": [4, 16, 64], "seconds_per_block": [12 * US, 18 * US, 42 * US]},
        "copy": {"block_size": [4, 16, 64], "seconds_per_block": [2 * US, 4 * US, 12 * US]},
    }
    raw.update(changes)
    return raw


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    step_profile.save(make_profile(), path)
    return path


def test_every_grid_point_is_exact():
    profile = step_profile.parse(make_profile())
    cost = ProfiledCost(profile)
    for i, b in enumerate(profile.decode.x):
        for j, c in enumerate(profile.decode.y):
            assert interp2(profile.decode, b, c) == profile.decode.z[i][j]
            # B decode rows of context C, at the profile's own block size (factor 1).
            assert cost.step_time([(1, int(c))] * int(b), int(b), block_tokens=16) == profile.decode.z[i][j]
    for i, q in enumerate(profile.prefill.x):
        for j, p in enumerate(profile.prefill.y):
            assert interp2(profile.prefill, q, p) == profile.prefill.z[i][j]
            assert cost.step_time([(int(q), int(q + p))], 1) == profile.prefill.z[i][j]
    for grid in (profile.block_size_factor, profile.swap_out, profile.swap_in, profile.copy):
        for x, y in zip(grid.x, grid.y):
            assert interp1(grid, x) == y
    for b, f in zip(profile.block_size_factor.x, profile.block_size_factor.y):
        assert cost.block_factor(int(b)) == f      # the profile's own factor at 16 is 1


def test_a_mixed_step_worked_by_hand():
    cost = ProfiledCost(step_profile.parse(make_profile()))
    # Decode rows: contexts 50 and 94 -> D = 2, C = 72: halfway between batch 1 and 3 and between
    # context 16 and 128. Batch 1: (2.0 + 2.2) / 2 = 2.1 ms; batch 3: (2.5 + 3.0) / 2 = 2.75 ms;
    # decode part = (2.1 + 2.75) / 2 = 2.425 ms.
    # Prefill rows: 40 tokens with nothing cached, 32 tokens after 144 cached -> Q = 72, P =
    # (40 * 0 + 32 * 144) / 72 = 64: halfway between 16 and 128 tokens and between 0 and 128 cached.
    # Q 16: (3.0 + 3.4) / 2 = 3.2 ms; Q 128: (6.0 + 7.0) / 2 = 6.5 ms; prefill part = 4.85 ms.
    # Base: decode at (1, 16) = 2.0 ms. Block size 10, halfway between 4 (1.5) and 16 (1.0): factor 1.25.
    # Per block at block size 10: swap out (14 + 20) / 2 = 17 us, swap in (12 + 18) / 2 = 15 us,
    # copy (2 + 4) / 2 = 3 us; 3 blocks out, 2 in, 1 copied: 51 + 30 + 3 = 84 us.
    # Step: 1.25 * 2.425 + 4.85 - 2.0 = 5.88125 ms, + 0.084 ms = 5.96525 ms.
    seqs = [(1, 50), (1, 94), (40, 40), (32, 176)]
    t = cost.step_time(seqs, num_sampled=4, swap_blocks=BlockMoves(swap_out=3, swap_in=2, copied=1), block_tokens=10)
    assert t == pytest.approx(5.96525 * MS, rel=1e-12)
    # One kind alone: that part, no base taken off.
    assert cost.step_time(seqs[:2], 2, block_tokens=10) == pytest.approx(1.25 * 2.425 * MS, rel=1e-12)
    assert cost.step_time(seqs[2:], 2, block_tokens=10) == pytest.approx(4.85 * MS, rel=1e-12)


def test_beyond_the_grid_it_extrapolates_from_the_last_two_points():
    profile = step_profile.parse(make_profile())
    # Batch 7 at context 16: from batch 3 (2.5 ms) and 5 (4.0 ms): 4.0 + 1.5 = 5.5 ms.
    assert interp2(profile.decode, 7, 16) == pytest.approx(5.5 * MS)
    # Batch 7 at context 1920: on both axes t = 2 along the last segment (3 -> 5, 128 -> 1024).
    # Batch 3: 3.0 + 2 * (6.0 - 3.0) = 9 ms; batch 5: 6.0 + 2 * (20.0 - 6.0) = 34 ms; then
    # 9 + 2 * (34 - 9) = 59 ms.
    assert interp2(profile.decode, 7, 1920) == pytest.approx(59 * MS)
    # Per-block costs extrapolate too: swap out at block 112 = 44 + (112 - 64) / 48 * 24 = 68 us.
    assert interp1(profile.swap_out, 112) == pytest.approx(68 * US)
    # ... but never below 0.
    assert interp1(Grid1((1.0, 2.0), (3.0, 1.0)), 5.0) == 0.0
    # The block-size factor is clamped to the measured range instead.
    cost = ProfiledCost(profile)
    assert cost.block_factor(1) == 1.5 and cost.block_factor(256) == 1.2


def small(profile, **kw) -> SimulateConfig:
    base = dict(profile=str(profile), trace="sharegpt", rate=20.0, num_requests=60, seed=3, kv_cache_gib=0.01)
    return SimulateConfig(**{**base, **kw})


def test_simulate_with_a_profile_is_deterministic_and_says_what_priced_it(profile_path):
    a, b = summary_of(simulate(small(profile_path))), summary_of(simulate(small(profile_path)))
    for s in (a, b):
        s.pop("wall_seconds")
    assert a == b and a["completed"] == a["num_prompts"] > 50 and a["failed"] == 0
    assert a["profile"]["path"] == str(profile_path) and a["profile"]["machine"]["hostname"] == "test-host"
    assert a["profile"]["model"]["name"] == "toy"
    # The pool is the profile's model's: 0.01 GiB at 512 bytes a token.
    assert a["num_kv_token_slots"] == int(0.01 * (1 << 30)) // 512 // 16 * 16
    # Without --profile the preset's roofline prices the run, and the summary says so.
    roofline = summary_of(simulate(SimulateConfig(trace="sharegpt", rate=20.0, num_requests=20, kv_cache_gib=2.0)))
    assert roofline["profile"] is None and roofline["preset"] == "opt-13b-a100-40g"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve.loadgen.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_a_bad_profile_is_one_line_and_exit_2(tmp_path, profile_path):
    bad = make_profile()
    bad["decode"]["context"] = [128, 16, 1024]           # not increasing: step_profile.parse refuses it
    with pytest.raises(step_profile.ProfileError):
        step_profile.parse(bad)
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    (tmp_path / "nomodel.json").write_text(json.dumps(make_profile(model={"name": "toy"})))
    for path in (tmp_path / "bad.json", tmp_path / "nomodel.json", tmp_path / "missing.json"):
        r = run_cli("simulate", "--profile", str(path), "--num-requests", "5", "--out", str(tmp_path / "out"))
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("loadgen simulate: "), r.stderr
    ok = run_cli("simulate", "--profile", str(profile_path), "--num-requests", "20", "--kv-cache-gib", "0.01",
                 "--out", str(tmp_path / "out"))
    assert ok.returncode == 0, ok.stderr
    assert f"priced by the profile {profile_path} (toy on cpu)" in ok.stdout


def test_paper_with_a_profile_prices_the_block_size_as_measured(tmp_path, profile_path):
    from pagedserve.loadgen.config import PaperConfig
    from pagedserve.loadgen.paper import paper
    report = paper(PaperConfig(out=str(tmp_path), num_requests=20, jobs=1, figures=["18b", "19"], plots=False,
                               progress=False, profile=str(profile_path), kv_cache_gib=0.01))
    text = (tmp_path / "paper.md").read_text()
    assert "no block-size term" not in text and f"--profile {profile_path}" in text
    # The factors the profile gives, clamped outside its 4..64: 1.5 at 1, 1 at 16, 1.2 at 256.
    assert "1: 1.50" in text and "16: 1.00" in text and "256: 1.20" in text
    assert "4: 14.0 / 12.0" in text              # its swap out / in per block at block 4, in us
    assert "scaled to the profiled machine" in text and "scaled by this machine's saturated rate" in text
    assert set(report["figures"]) == {"18b", "19"}


def test_paper_with_a_profile_runs_figs_18b_and_19_at_the_papers_load_on_that_machine(profile_path):
    """The paper's rates are OPT-13B's on an A100: on a profiled machine Figs. 18b and 19 run at
    them times its saturated rate over the preset's, on a pool of as many whole contexts as the
    preset's holds (the same memory pressure; the toy's 1024-token contexts of 512 bytes a token)."""
    from pagedserve.loadgen.config import PaperConfig
    from pagedserve.loadgen.cost_model import GiB, PRESETS
    from pagedserve.loadgen.paper import FIG19_RATE, PAPER_RATE, machine_scale, plan_runs
    cfg = PaperConfig(num_requests=20, figures=["18b", "19"], profile=str(profile_path))
    scale = machine_scale(cfg)
    preset = PRESETS["opt-13b-a100-40g"]
    assert scale.pool_gib == pytest.approx(preset.num_kv_tokens() / preset.max_model_len * 1024 * 512 / GiB)
    # The toy's steps are milliseconds, OPT-13B's on the roofline tens of them: a faster machine.
    assert all(f > 1 for f in scale.rate_factor.values())
    runs = plan_runs(cfg)
    assert runs["fig19/swap/16"].rate == round(FIG19_RATE * scale.rate_factor["sharegpt"], 3)
    assert runs["fig18b/alpaca/4"].rate == round(PAPER_RATE["alpaca"] * scale.rate_factor["alpaca"], 3)
    assert all(r.kv_cache_gib == scale.pool_gib for k, r in runs.items())
    # Without a profile the paper's own rates, on the preset's pool.
    plain = plan_runs(PaperConfig(num_requests=20, figures=["19"]))
    assert plain["fig19/swap/16"].rate == FIG19_RATE and plain["fig19/swap/16"].kv_cache_gib is None


def test_plan_brackets_the_highest_rate_within_the_slo(tmp_path, profile_path):
    from pagedserve.loadgen.plan import meets, plan, run_config, slo_keys
    # The profile's unloaded decode step is ~2-3 ms: a 5 ms p99 TPOT binds well below capacity.
    cfg = PlanConfig(profile=str(profile_path), slo=["ttft_p99=1000", "tpot_p99=5"], num_requests=40,
                     kv_cache_gib=[0.01], target_rate=10.0, tolerance=0.1, out=str(tmp_path))
    report = plan(cfg)
    (row,) = report["candidates"]
    rate, missed = row["rate"], row["misses_at"]
    assert 0 < rate < missed <= rate * 1.1
    # The bounds hold when simulated again: the rate found meets the SLO, the one above it misses.
    limits = slo_keys(cfg)
    assert limits == {"p99_ttft_ms": 1000.0, "p99_tpot_ms": 5.0}
    assert meets(summary_of(simulate(run_config(cfg, 0.01, 16, rate))), limits)
    assert not meets(summary_of(simulate(run_config(cfg, 0.01, 16, missed))), limits)
    assert all(r["meets"] == (r["rate"] <= rate) for r in row["runs"])     # every run on its side
    assert report["replicas"] == math.ceil(10.0 / rate) > 10.0 / rate
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["replicas"] == report["replicas"]
    assert f"{report['replicas']} replicas (ceil(10 / {rate:.3g}))" in (tmp_path / "plan.md").read_text()
    # An SLO that even every request at once meets: no limit in so few requests, and no replica count.
    loose = plan(PlanConfig(profile=str(profile_path), slo=["ttft_p99=60000"], num_requests=40, kv_cache_gib=[0.01],
                            block_size=[16, 32], target_rate=10.0, out=str(tmp_path)))
    assert [math.isinf(r["rate"]) for r in loose["candidates"]] == [True, True] and loose["replicas"] is None
    assert "Raise --num-requests" in (tmp_path / "plan.md").read_text()


def test_plan_refuses_a_bad_slo_and_a_bad_profile(tmp_path, profile_path):
    r = run_cli("plan", "--profile", str(profile_path), "--slo", "ttft=500", "--out", str(tmp_path))
    assert r.returncode == 2 and "--slo" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = run_cli("plan", "--profile", str(tmp_path / "missing.json"), "--slo", "ttft_p99=500", "--out", str(tmp_path))
    assert r.returncode == 2 and "missing.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_plan_refuses_a_trace_it_can_send_nothing_of(tmp_path, profile_path):
    """Black-box finding: an empty trace, or one whose every request exceeds the context (1024
    tokens in the profile), planned 0 req/s and exited 0."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "long.jsonl").write_text("".join(
        json.dumps({"timestamp": i, "input_length": 5000, "output_length": 10}) + "\n" for i in range(5)))
    for trace, cause in (("empty.jsonl", "holds no requests"), ("long.jsonl", "none of the 5 requests")):
        r = run_cli("plan", "--profile", str(profile_path), "--slo", "ttft_p99=500", "--kv-cache-gib", "0.01",
                    "--trace", str(tmp_path / trace), "--out", str(tmp_path))
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and cause in lines[0], r.stderr


API = {"request_overhead_s": 4 * MS,
       "step_overhead": {"batch": [1, 5], "context": [48, 528],
                         "seconds": [[0.5 * MS, 0.9 * MS], [1.5 * MS, 2.7 * MS]]}}
NO_STEP_OVERHEAD = {"batch": [1], "context": [48], "seconds": [[0.0]]}


def test_the_served_step_overhead_worked_by_hand():
    cost = ProfiledCost(step_profile.parse(make_profile(api=API)))
    # 3 decode rows at context 128: the grid's 3.0 ms. The overhead at 3 rows is halfway between
    # batch 1 and 5; context 128 is 1/6 of the way from 48 to 528: at batch 1 0.5 + (0.9 - 0.5) / 6
    # = 0.5667 ms, at batch 5 1.5 + (2.7 - 1.5) / 6 = 1.7 ms; halfway: 1.1333 ms. 3.0 + 1.1333 ms.
    assert cost.step_time([(1, 128)] * 3, 3) == pytest.approx(4.1333333 * MS)
    # One point on an axis: the same overhead all along it; a negative one (the served step
    # faster) lowers the step, never below 0.
    fast = make_profile(api={**API, "step_overhead": {"batch": [1], "context": [48], "seconds": [[-9 * MS]]}})
    assert ProfiledCost(step_profile.parse(fast)).step_time([(1, 16)] * 4, 4) == 0.0


def test_the_request_overhead_delays_every_event_of_a_request(profile_path, tmp_path):
    delayed = tmp_path / "api.json"
    step_profile.save(make_profile(api={**API, "step_overhead": NO_STEP_OVERHEAD}), delayed)
    plain, late = summary_of(simulate(small(profile_path))), summary_of(simulate(small(delayed)))
    assert late["mean_ttft_ms"] == pytest.approx(plain["mean_ttft_ms"] + 4.0)
    assert late["mean_e2el_ms"] == pytest.approx(plain["mean_e2el_ms"] + 4.0)
    assert late["mean_tpot_ms"] == pytest.approx(plain["mean_tpot_ms"])


def test_each_step_s_tokens_reach_their_clients_one_event_after_another(profile_path, tmp_path):
    """api.event_s: the k-th of a step's B streams reads its token k events late; the simulator
    gives each of them the mean, (B + 1) / 2 events. The plan itself does not move (the clock does
    not wait for the client), so each token time shifts by (B + 1) / 2 events for its step's B."""
    eventful = tmp_path / "events.json"
    step_profile.save(make_profile(api={"request_overhead_s": 0.0, "step_overhead": NO_STEP_OVERHEAD,
                                        "event_s": 0.5 * MS}), eventful)
    plain, late = simulate(small(profile_path)), simulate(small(eventful))
    shifts = {round((b - a) / (0.5 * MS) * 2) for p, q in zip(plain.records, late.records)
              for a, b in zip(p.token_times, q.token_times)}
    assert all(len(p.token_times) == len(q.token_times) for p, q in zip(plain.records, late.records))
    assert min(shifts) >= 2 and len(shifts) > 2           # 2 = (1 + 1): a step of one stream
    # One request alone: every event one event late, TTFT and E2E by it, TPOT not at all.
    one, one_late = (summary_of(simulate(small(path, num_requests=1))) for path in (profile_path, eventful))
    assert one_late["mean_ttft_ms"] == pytest.approx(one["mean_ttft_ms"] + 0.5)
    assert one_late["mean_e2el_ms"] == pytest.approx(one["mean_e2el_ms"] + 0.5)
    assert one_late["mean_tpot_ms"] == pytest.approx(one["mean_tpot_ms"])


def test_a_prompt_s_admission_is_charged_once_on_the_step_that_takes_it_in(profile_path, tmp_path):
    """api.admission_s_per_token: the step that starts a request costs its prompt's tokens times it
    more, once (the later chunks and decode steps of that request do not pay it again)."""
    admitting = tmp_path / "admission.json"
    per_token = 1e-5
    step_profile.save(make_profile(api={"request_overhead_s": 0.0, "step_overhead": NO_STEP_OVERHEAD,
                                        "admission_s_per_token": per_token}), admitting)
    cfg = small(profile_path, num_requests=1, rate=float("inf"))
    plain, charged = simulate(cfg), simulate(dataclasses.replace(cfg, profile=str(admitting)))
    prompt = plain.records[0].prompt_tokens
    assert charged.num_steps == plain.num_steps
    assert charged.busy_s == pytest.approx(plain.busy_s + per_token * prompt)
    # One request alone: its first token later by its admission, the tokens after it not at all.
    (a, b) = plain.records[0], charged.records[0]
    assert b.first_token - a.first_token == pytest.approx(per_token * prompt)
    assert [y - x for x, y in zip(a.token_times, b.token_times)] == pytest.approx([per_token * prompt] * len(a.token_times))
    # By kind: the admitting step is a prefill one, and it holds the whole charge.
    kinds = summary_of(charged)["steps_by_kind"]
    assert sum(k["steps"] for k in kinds.values()) == charged.num_steps
    assert kinds["prefill"]["priced_ms"] * kinds["prefill"]["steps"] == pytest.approx(
        summary_of(plain)["steps_by_kind"]["prefill"]["priced_ms"] * kinds["prefill"]["steps"] + 1e3 * per_token * prompt)


def test_an_api_entry_that_cannot_be_used_is_refused():
    for api in ({"request_overhead_s": -1.0, "step_overhead": API["step_overhead"]},
                {"request_overhead_s": 1.0, "step_overhead": API["step_overhead"], "admission_s_per_token": -1e-6},
                {"request_overhead_s": 1.0, "step_overhead": API["step_overhead"], "admission_s_per_token": "1"},
                {"request_overhead_s": 1.0, "step_overhead": API["step_overhead"], "event_s": -1e-3},
                {"request_overhead_s": 1.0, "step_overhead": API["step_overhead"], "event_s": True},
                {"request_overhead_s": 1.0},
                {"request_overhead_s": 1.0, "step_overhead": {"batch": [2, 1], "context": [1], "seconds": [[0], [0]]}},
                {"request_overhead_s": 1.0, "step_overhead": {"batch": [1, 2], "context": [1], "seconds": [[0]]}}):
        with pytest.raises(step_profile.ProfileError):
            step_profile.parse(make_profile(api=api))


def test_async_scheduling_makes_an_arrival_wait_for_the_step_planned_ahead(profile_path):
    """As the served scheduler: the step after the running one is planned as it starts, so a
    request that arrives meanwhile joins the one after; the same plan otherwise."""
    import dataclasses
    sync = summary_of(simulate(small(profile_path)))
    ahead = summary_of(simulate(dataclasses.replace(small(profile_path), async_scheduling=True)))
    assert ahead["completed"] == sync["completed"] and ahead["total_output_tokens"] == sync["total_output_tokens"]
    assert ahead["mean_ttft_ms"] > sync["mean_ttft_ms"]


def test_a_logged_step_is_priced_as_the_simulator_prices_its_rows(tmp_path):
    # loadgen fidelity prices each step the stack logged (step_log.composition of its rows) with
    # ProfiledCost.priced: the same price step_time gives those rows, block moves aside.
    from pagedserve.loadgen.fidelity import steps_by_kind
    from pagedserve.loadgen.profiled_cost import ProfiledServer
    from pagedserve.services.scheduler.step_log import composition
    path = tmp_path / "p.json"
    step_profile.save(make_profile(api=API), path)
    server = ProfiledServer.load(str(path))
    cost = server.cost_model()
    decode, prefill, mixed = [(1, 50), (1, 94)], [(40, 40), (32, 176)], [(1, 50), (1, 94), (40, 40), (32, 176)]
    for rows in (decode, prefill, mixed):
        assert cost.priced(*composition(rows), 10) == pytest.approx(cost.step_time(rows, len(rows), block_tokens=10),
                                                                    rel=1e-12)
    # Records [seconds, worker_s, D, C, Q, P, R, S]: two decode steps, one mixed; means per kind.
    log = [[0.004, 0.003, *composition(decode)], [0.006, 0.005, *composition(decode)],
           [0.010, 0.008, *composition(mixed)]]
    kinds = steps_by_kind(log, server, 16)
    assert list(kinds) == ["decode", "mixed"]
    assert kinds["decode"]["steps"] == 2
    assert kinds["decode"]["served_ms"] == pytest.approx(5.0) and kinds["decode"]["worker_ms"] == pytest.approx(4.0)
    assert kinds["decode"]["priced_ms"] == pytest.approx(1e3 * cost.step_time(decode, 2))
    assert kinds["mixed"]["priced_ms"] == pytest.approx(1e3 * cost.step_time(mixed, 4))
