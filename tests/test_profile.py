"""`loadgen profile`: a real profile of the tiny model on a tiny grid (seconds), read back through
step_profile; and the command's refusals (one line, exit 2).

Timings on a shared CPU are noisy (a busy neighbour makes one step 10-50x slower for seconds), so
the profile's checks are of shape (every point measured, positive, the cache hit where it must be);
the one check of speed compares points far apart (1 and 256 sequences), each at its fastest of
three interleaved measurements, since noise only ever adds time."""
from __future__ import annotations

import json
import random

import pytest

from pagedserve.loadgen import step_profile
from pagedserve.loadgen.cli import main
from pagedserve.loadgen.config import ProfileConfig
from pagedserve.loadgen.profile import decode_time, engine_config, profile


@pytest.fixture(scope="module")
def tiny_profile(tiny_llama, tmp_path_factory):
    cfg = ProfileConfig(model=tiny_llama, decode_batch=[1, 2], decode_context=[16, 32],
                        prefill_tokens=[16, 32], prefill_context=[0, 16], factor_block_sizes=[8, 16],
                        swap_block_sizes=[4, 16], repeats=3)
    raw = profile(cfg)
    path = tmp_path_factory.mktemp("profile") / "step-profile.json"
    step_profile.save(raw, path)
    return raw, path


def test_the_file_reads_back_as_it_was_returned(tiny_profile):
    raw, path = tiny_profile
    loaded = step_profile.load(path)
    assert loaded.raw == json.loads(json.dumps(raw))
    assert loaded.block_size == 16
    assert loaded.decode.x == (1, 2) and loaded.decode.y == (16, 32)
    assert loaded.prefill.x == (16, 32) and loaded.prefill.y == (0, 16)
    assert raw["notes"] == []     # nothing in this grid needed capping


def test_every_point_is_measured_and_positive(tiny_profile):
    raw, _ = tiny_profile
    for part in ("decode", "prefill"):
        rows = raw[part]["seconds"]
        assert all(t > 0 for row in rows for t in row), (part, rows)
    factor = dict(zip(raw["block_size_factor"]["block_size"], raw["block_size_factor"]["factor"]))
    assert factor[16] == 1.0 and factor[8] > 0
    for part in ("swap_out", "swap_in", "copy"):
        assert raw[part]["block_size"] == [4, 16]
        assert all(s > 0 for s in raw[part]["seconds_per_block"]), raw[part]
    assert raw["model"]["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4   # layers, K and V, KV heads, head dim, fp32
    assert raw["took_s"] > 0 and raw["machine"]["cores"] >= 1


def test_a_decode_step_of_256_sequences_takes_longer_than_one_of_one(tiny_llama):
    from pagedserve.services.engine import Engine
    cfg = ProfileConfig(model=tiny_llama, repeats=3)
    rng = random.Random(0)
    times: dict[int, list[float]] = {1: [], 256: []}
    with Engine(engine_config(cfg, tiny_llama, 16, [1, 256], [16, 32])) as engine:
        for _ in range(3):
            for b in times:
                times[b].append(decode_time(engine, b, 32, cfg.repeats, rng))
        assert engine.store.stats()["num_sequences"] == 0     # every point's requests are gone
    assert min(times[256]) > min(times[1]), times


def test_the_cached_prefill_points_hit_the_prefix_cache(tiny_profile):
    raw, _ = tiny_profile
    assert raw["prefill"]["cached"] == [raw["prefill"]["context"]] * len(raw["prefill"]["tokens"])


def test_a_default_grid_too_long_for_the_model_is_capped_and_noted():
    from pagedserve.loadgen.profile import decode_axes, prefill_axes
    from pagedserve.services.model_dir import ModelSpec
    spec = ModelSpec(path="m", architecture="LlamaForCausalLM", num_layers=2, num_kv_heads=2, head_dim=32,
                     vocab_size=2048, max_model_len=1024, eos_token_ids=(2,))
    cfg, notes = ProfileConfig(model="m"), []
    batch, context = decode_axes(cfg, spec, "float32", notes)
    assert batch == cfg.decode_batch and context == [16, 64, 256, 1020]
    assert prefill_axes(cfg, 1024, notes) == ([16, 64, 256, 766], [0, 256])
    assert len(notes) == 3, notes          # the decode cap, the dropped P=1024, the Q cap
    # 128 MiB: 8192 blocks of 16 KiB; 128 sequences of 1020 tokens need 128 x 65 of them
    small = ProfileConfig(model="m", kv_cache_gib=0.125)
    batch, _ = decode_axes(small, spec, "float32", notes := [])
    assert batch == [1, 2, 4, 8, 16, 32, 64] and len(notes) == 3   # the cap, 256 and 128 dropped


def test_a_missing_model_folder_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["profile", "--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("flags, words", [(["--decode-batch", "4,2"], "strictly increasing"),
                                          (["--swap-block-sizes", "3,4"], "power of two"),
                                          (["--decode-context", "2,16"], "shortest context")])
def test_a_bad_grid_is_one_line_and_exit_2(tiny_llama, tmp_path, capsys, flags, words):
    assert main(["profile", "--model", tiny_llama, "--out", str(tmp_path / "p.json"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_the_api_entry_measures_a_real_stack(tiny_profile):
    """The path of one request and the served step beyond the engine's, through pagedserve up
    (loadgen/profile_api.py): measured, and read back into the profile the simulator uses."""
    raw, path = tiny_profile
    api = raw["api"]
    # TTFT at each of the prefill grid's prompt lengths, beside the engine's step for that prompt.
    prompt = api["prompt"]
    assert prompt["tokens"] == [16, 32] and all(t > 0 for t in prompt["ttft_s"])
    assert prompt["engine_step_s"] == [row[0] for row in raw["prefill"]["seconds"]]
    assert api["request_overhead_s"] >= 0 and api["admission_s_per_token"] >= 0
    assert api["step_overhead"]["batch"] == [1]              # api_batch above the decode grid's 2: skipped
    assert api["step_overhead"]["context"] == [32 + 16, 512 + 16]   # the decode's mean context
    assert all(s > 0 for row in api["step_overhead"]["served_step_s"] for s in row)
    # Subtracted at the window's own mean context: past the prompt by half the decode and the prefills.
    assert [c for row in api["step_overhead"]["window_context"] for c in row] == [32 + 16.5, 512 + 16.5]
    # (One batch here: CPU over events, which the requests' own costs inflate; a real grid's slope.)
    assert api["event_s"] > 0 and loaded_event_s(path) == api["event_s"]
    loaded = step_profile.load(path)
    assert loaded.request_overhead_s == api["request_overhead_s"] and loaded.step_overhead is not None
    assert loaded.admission_s_per_token == api["admission_s_per_token"]


def test_a_request_s_path_splits_into_fixed_and_per_prompt_token():
    from pagedserve.loadgen.profile_api import admission_fit
    # 3 ms fixed, 2 us a token, on a line: found exactly.
    fixed, per_token = admission_fit([16, 256, 1024], [3e-3 + n * 2e-6 for n in (16, 256, 1024)])
    assert fixed == pytest.approx(3e-3) and per_token == pytest.approx(2e-6)
    # Noise that makes the path shrink with the prompt: no negative per-token cost, the mean fixed.
    assert admission_fit([16, 1024], [4e-3, 3e-3]) == (pytest.approx(3.5e-3), 0.0)
    assert admission_fit([16], [-1e-3]) == (0.0, 0.0)          # one length, the step above the TTFT


def test_fidelity_runs_the_same_plan_on_the_stack_and_the_simulator(tiny_llama, tiny_profile, tmp_path):
    from pagedserve.loadgen.config import FidelityConfig
    from pagedserve.loadgen.fidelity import FIGURES, fidelity
    _, path = tiny_profile
    cfg = FidelityConfig(model=tiny_llama, profile=str(path), traces=["sharegpt"], rates=[4.0], num_requests=10,
                         num_device_blocks=256, out=str(tmp_path / "fid"))
    report = fidelity(cfg)
    (row,) = report["rows"]
    assert row["measured_failed"] == 0
    for key, _, bound in FIGURES:
        f = row["figures"][key]
        assert f["measured"] > 0 and f["simulated"] > 0, (key, f)
        assert f["error"] == pytest.approx(f["simulated"] / f["measured"] - 1)
        assert f["ok"] is (None if bound is None else abs(f["error"]) <= bound)
    md = (tmp_path / "fid" / "fidelity.md").read_text()
    assert "| sharegpt | 4 |" in md
    # The stack's logged steps, by kind, beside the profile's price of each: every step is in one.
    kinds = row["steps_by_kind"]
    assert kinds and set(kinds) <= {"decode", "prefill", "mixed"}
    assert sum(k["steps"] for k in kinds.values()) == row["figures"]["num_steps"]["measured"]
    assert all(k["served_ms"] > 0 and k["worker_ms"] > 0 and k["priced_ms"] > 0 for k in kinds.values())
    assert f"| sharegpt | 4 | {next(iter(kinds))} |" in md
    # Beside them the simulator's steps by kind: the same number of steps in all as it reports.
    sim = row["simulated_steps_by_kind"]
    assert sum(k["steps"] for k in sim.values()) == row["figures"]["num_steps"]["simulated"]
    assert all(k["priced_ms"] > 0 for k in sim.values())
    assert json.loads((tmp_path / "fid" / "fidelity.json").read_text())["rows"][0]["rate"] == 4.0


def test_fidelity_refuses_a_profile_of_another_model(tiny_profile, tmp_path, capsys):
    raw, _ = tiny_profile
    other = tmp_path / "other.json"
    step_profile.save({**raw, "model": {**raw["model"], "path": "/elsewhere/model"}}, other)
    code = main(["fidelity", "--model", raw["model"]["path"], "--profile", str(other), "--out", str(tmp_path / "f")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "/elsewhere/model" in err[0]


def loaded_event_s(path) -> float:
    return step_profile.load(path).event_s


def test_the_served_step_is_timed_while_every_stream_decodes():
    """profile_api.window_step by hand: two streams, a step every 10 ms; the second starts 3 steps
    late (the first decoded beside its prefill), one of its tokens sent no event (its text was not
    out yet), the first ends first. Inside the window each step gives both a token: 10 ms."""
    from pagedserve.loadgen.client import RequestRecord
    from pagedserve.loadgen.profile_api import window_step
    a = RequestRecord(0, 0.0, 8, 10, token_times=[0.010 * k for k in range(1, 11)], output_tokens=10)
    b_times = [0.010 * k for k in range(4, 16) if k != 7]     # the token of step 7 had no text
    b = RequestRecord(1, 0.0, 8, 12, token_times=b_times, output_tokens=12)
    # Window (0.04, 0.10]: a's 6 events and b's 5; tokens with an event: 21 of 22.
    step, steps = window_step([a, b])
    assert step == pytest.approx(0.06 * (21 / 22) * 2 / 11) and step == pytest.approx(0.010, rel=0.05)
    assert steps == pytest.approx(11 / (21 / 22) / 2)                    # ~6 steps in (0.04, 0.10]
    assert window_step([a, b], least_steps=7) is None                    # too short to use
    late = RequestRecord(2, 0.0, 8, 2, token_times=[0.2, 0.21], output_tokens=2)   # after a ended
    assert window_step([a, late]) is None


def test_an_event_costs_the_slope_of_cpu_over_events():
    from pagedserve.loadgen.profile_api import Served, per_event_s
    # 0.1 s of fixed cost per run, 100 us an event: the slope finds the event, the ratio cannot.
    points = [Served(0.01, 48, 0.1 + n * 1e-4, n) for n in (100, 400, 1600)]
    assert per_event_s(points) == pytest.approx(1e-4)
    assert per_event_s(points[:1]) == pytest.approx(0.11 / 100)

