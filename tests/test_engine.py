"""The offline engine: continuous batching, preemption, sharing, prefix caching, sampling.

Every engine made here goes through `make_engine`, whose teardown checks that the pools are back
to empty and the block store's invariants hold.
"""
from __future__ import annotations

import pytest
import torch

from pagedserve.services.engine import Engine
from pagedserve.services.engine_config import ConfigError, EngineConfig
from pagedserve.services.sampling_params import SamplingParams, SamplingParamsError
from pagedserve.services.scheduler.scheduler import SchedulerError
from tests.test_exactness import hf_greedy

PROMPTS = [
    "def fibonacci(n):", "import os", "x", "class Scheduler:\n    def step(self):",
    "# Licensed under the Apache License, Version 2.0", "for i in range(10):", "while True:\n    pass",
    "return sorted(items, key=len)", "async def main():", "try:\n    import numpy\nexcept ImportError:",
    "with open(path) as f:\n    data = f.read()", "print('hello world')", "lambda x: x + 1",
    "if __name__ == '__main__':\n    main()", "assert a == b, 'mismatch'", "@dataclass\nclass Point:",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture
def make_engine(tiny_llama):
    engines: list[Engine] = []

    def make(**kw) -> Engine:
        kw.setdefault("model", tiny_llama)
        engine = Engine(EngineConfig(**kw))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        stats = engine.store.stats()
        engine.store.check_invariants()
        assert not engine.scheduler.has_unfinished()
        assert stats["device_blocks_used"] == 0, stats
        assert stats["host_blocks_used"] == 0, stats
        assert stats["num_sequences"] == 0, stats
        engine.close()


@pytest.fixture(scope="module")
def reference_outputs(tiny_llama):
    """Greedy outputs with plenty of memory: the baseline every pressured run must equal."""
    with Engine(EngineConfig(model=tiny_llama, num_device_blocks=512)) as engine:
        outs = engine.generate(PROMPTS, GREEDY)
        ids = [o.prompt_token_ids for o in outs]
    return ids, [o.outputs[0].token_ids for o in outs]


def test_no_pressure_matches_transformers(tiny_llama, reference_outputs):
    prompt_ids, outs = reference_outputs
    assert outs == hf_greedy(tiny_llama, prompt_ids, GREEDY.max_tokens)


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preemption_keeps_greedy_output(make_engine, reference_outputs, mode):
    engine = make_engine(num_device_blocks=10, preemption_mode=mode)
    outs = engine.generate(PROMPTS, GREEDY)
    stats = engine.stats()
    assert [o.outputs[0].token_ids for o in outs] == reference_outputs[1]
    assert stats["preemptions"] >= 4, stats
    if mode == "swap":
        assert stats["swap_outs"] >= 4 and stats["swap_ins"] == stats["swap_outs"]
        assert stats["swap_out_blocks"] == stats["swap_in_blocks"] > 0
    if mode == "recompute":
        assert stats["recomputed_tokens"] > 0 and stats["swap_outs"] == 0
    assert stats["device_blocks_peak_used"] <= 10


def test_auto_mode_says_why(make_engine):
    engine = make_engine(num_device_blocks=10, preemption_mode="auto")
    engine.scheduler.config.auto_swap_min_tokens = 16   # so both branches are taken
    engine.generate(PROMPTS, GREEDY)
    reasons = [k for k in engine.stats() if k.startswith("preemption_reason[auto")]
    assert reasons, engine.stats()


def test_swap_mode_without_host_space_falls_back_to_recompute(make_engine, reference_outputs):
    engine = make_engine(num_device_blocks=10, preemption_mode="swap", swap_space_gib=0.0)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference_outputs[1]
    assert engine.stats()["preemption_reason[swap mode, host pool full]"] > 0


def test_chunked_prefill_matches(make_engine, reference_outputs):
    engine = make_engine(num_device_blocks=256, max_num_batched_tokens=8, max_num_seqs=4)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference_outputs[1]


def test_preempting_step_admits_nobody(make_engine):
    engine = make_engine(num_device_blocks=10, preemption_mode="recompute")
    for p in PROMPTS:
        engine.add_request(p, GREEDY)
    saw_preemption = False
    while engine.scheduler.has_unfinished():
        waiting_before = {r.request_id for r in engine.scheduler.waiting}
        scheduled = engine.scheduler.schedule()
        if scheduled.preempted:
            saw_preemption = True
            admitted = {r.request_id for r in scheduled.requests} & waiting_before
            assert not admitted, "a step that preempted admitted a waiting request"
        results = engine.worker.execute(scheduled.steps, scheduled.samples) if scheduled.steps else []
        for req in engine.scheduler.update(scheduled, results):
            engine.scheduler.pop_finished(req.request_id)
    assert saw_preemption


def test_finished_request_returns_its_blocks(make_engine):
    engine = make_engine(num_device_blocks=64, enable_prefix_caching=False)
    engine.add_request("a fairly long prompt " * 5, SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("short", SamplingParams(max_tokens=30, temperature=0))
    used = []
    while engine.scheduler.has_unfinished():
        for req in engine.step():
            engine.scheduler.pop_finished(req.request_id)
            used.append(engine.store.stats()["device_blocks_used"])
    assert used[0] <= 2 and used[-1] == 0


# ---- prefix caching -----------------------------------------------------------------------

def test_prefix_cache_hits_three_blocks(make_engine):
    engine = make_engine(num_device_blocks=64, block_size=16)
    prefix = list(range(100, 148))              # exactly 3 blocks of 16
    first = engine.generate([prefix + [7, 8, 9]], GREEDY)[0]
    before = engine.stats()["prefix_hit_tokens"]
    second = engine.generate([prefix + [7, 8, 9]], GREEDY)[0]
    assert engine.stats()["prefix_hit_tokens"] - before == 48
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    # A prompt that is exactly the cached 3 blocks: the hit must stop before its last token.
    before = engine.stats()["prefix_hit_tokens"]
    engine.generate([prefix], GREEDY)
    assert engine.stats()["prefix_hit_tokens"] - before == 32


def test_blocks_filled_while_decoding_are_found_again(make_engine):
    """A follow-up turn (prompt + the answer so far) hits the blocks the answer filled in decode:
    the scheduler keys a block when a step fills it, not only after a prefill."""
    engine = make_engine(num_device_blocks=64, block_size=16)
    prompt = list(range(100, 140))                                   # 40 tokens
    first = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    follow_up = prompt + first.outputs[0].token_ids                  # 80 tokens, 79 of them computed
    before = engine.stats()["prefix_hit_tokens"]
    engine.generate([follow_up], SamplingParams(max_tokens=2, temperature=0))
    assert engine.stats()["prefix_hit_tokens"] - before == 64       # 4 full blocks, 2 filled in decode


def test_prefix_caching_on_off_same_output(make_engine):
    shared = "You are a helpful assistant that writes Python code carefully and explains it. " * 2
    prompts = [shared + p for p in PROMPTS[:8]]
    on = make_engine(num_device_blocks=128)
    off = make_engine(num_device_blocks=128, enable_prefix_caching=False)
    a = [o.outputs[0].token_ids for o in on.generate(prompts[:1], GREEDY) + on.generate(prompts[1:], GREEDY)]
    b = [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY)]
    assert a == b
    assert on.stats()["prefix_hit_tokens"] > 0 and off.stats()["prefix_hit_tokens"] == 0


def test_cache_salt_separates_prefixes(make_engine):
    engine = make_engine(num_device_blocks=64)
    prompt = list(range(200, 240))
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, cache_salt="tenant-a"))
    before = engine.stats()["prefix_hit_tokens"]
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, cache_salt="tenant-b"))
    assert engine.stats()["prefix_hit_tokens"] == before


# ---- sharing: n samples, copy-on-write ------------------------------------------------------

def test_parallel_samples_fork_and_copy_once(make_engine):
    engine = make_engine(num_device_blocks=64, enable_prefix_caching=False)
    prompt = list(range(300, 340))               # 2.5 blocks: the last block is shared partly filled
    params = SamplingParams(n=4, max_tokens=1, temperature=1.0, seed=3)
    engine.add_request(prompt, params, request_id="r")
    scheduled = engine.scheduler.schedule()
    results = engine.worker.execute(scheduled.steps, scheduled.samples)
    used_before_fork = engine.store.stats()["device_blocks_used"]
    req = engine.scheduler.requests["r"]
    # The prompt is computed once and 4 samples are drawn from its logits.
    assert len(scheduled.steps) == 1 and len(results) == 4
    engine.scheduler.update(scheduled, results)
    engine.scheduler.pop_finished("r")
    assert used_before_fork == 3
    assert req.is_finished and len(req.finished) == 4


def test_parallel_samples_share_prompt_blocks(make_engine):
    engine = make_engine(num_device_blocks=64, enable_prefix_caching=False)
    prompt = list(range(300, 340))               # 3 blocks, the last partly filled (8 of 16)
    engine.add_request(prompt, SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=3), request_id="r")
    engine.step()                                # prefill + fork + first tokens
    stats = engine.store.stats()
    assert stats["device_blocks_used"] == 3      # the fork allocated nothing
    engine.step()                                # each sample writes its first token's K/V
    stats = engine.store.stats()
    # Two full prompt blocks shared by all 4; the partly filled one copied for 3 writers, kept by 1.
    assert stats["cow_copies"] == 3 and stats["device_blocks_used"] == 2 + 4
    tables = [engine.store.block_table(s.seq_id) for s in engine.scheduler.requests["r"].seqs]
    assert len({tuple(t[:2]) for t in tables}) == 1 and len({t[2] for t in tables}) == 4
    while engine.scheduler.has_unfinished():
        engine.step()
    out = engine.output_of(engine.scheduler.pop_finished("r"))
    assert len(out.outputs) == 4


def test_seeded_sampling_reproducible_alone_and_in_batch(make_engine):
    engine = make_engine(num_device_blocks=128)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = engine.generate(["def main():"], p)[0].outputs[0].token_ids
    mixed = engine.generate(PROMPTS[:5] + ["def main():"] + PROMPTS[5:9],
                            [SamplingParams(max_tokens=12, temperature=1.0)] * 5 + [p]
                            + [SamplingParams(max_tokens=12, temperature=1.0)] * 4)
    assert mixed[5].outputs[0].token_ids == alone


def test_n_samples_distinct_and_reproducible(make_engine):
    engine = make_engine(num_device_blocks=128)
    p = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=99)
    first = [c.token_ids for c in engine.generate(["import os"], p)[0].outputs]
    again = [c.token_ids for c in engine.generate(["import os"], p)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) == 3


def test_unseeded_sampling_varies(make_engine):
    engine = make_engine(num_device_blocks=128)
    p = SamplingParams(max_tokens=16, temperature=1.0)
    outs = {tuple(engine.generate(["import os"], p)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(outs) > 1


def test_stop_conditions(make_engine, reference_outputs):
    engine = make_engine(num_device_blocks=128)
    ref = reference_outputs[1][0]
    stop_tok = ref[5]
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0,
                                                       stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop_tok) + 1] and out.finish_reason == "stop"
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=7, temperature=0))[0].outputs[0]
    assert out.token_ids == ref[:7] and out.finish_reason == "length"


def test_logprobs_returned(make_engine):
    engine = make_engine(num_device_blocks=64)
    out = engine.generate(["import os"], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4 and len(out.top_logprobs) == 4
    for lp, top, tok in zip(out.logprobs, out.top_logprobs, out.token_ids):
        assert len(top) == 3 and top[0][0] == tok and abs(top[0][1] - lp) < 1e-5


# ---- beam search ---------------------------------------------------------------------------

@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_transformers(tiny_llama, make_engine, width):
    import torch
    from transformers import AutoModelForCausalLM
    engine = make_engine(num_device_blocks=128)
    prompts = ["def fibonacci(n):", "import os\nimport sys", "class A:"]
    params = SamplingParams(beam_width=width, n=width, max_tokens=10, length_penalty=1.0)
    outs = engine.generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for out in outs:
        x = torch.tensor([out.prompt_token_ids])
        y = hf.generate(x, attention_mask=torch.ones_like(x), num_beams=width, do_sample=False,
                        max_new_tokens=10, num_return_sequences=width, length_penalty=1.0,
                        early_stopping=False)
        expected = [row[x.shape[1]:].tolist() for row in y]
        assert [c.token_ids for c in out.outputs] == expected


def test_beam_search_under_preemption(make_engine):
    prompts = ["def fibonacci(n):", "import os\nimport sys", "class A:", "x = [1, 2, 3]"]
    params = SamplingParams(beam_width=3, n=3, max_tokens=16)
    roomy = make_engine(num_device_blocks=256)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params)]
    for mode in ("swap", "recompute"):
        tight = make_engine(num_device_blocks=12, preemption_mode=mode)
        got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)]
        assert got == expected, mode
        assert tight.stats()["preemptions"] > 0


# ---- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(n=0),
                                 dict(beam_width=0)])
def test_bad_sampling_params_rejected(make_engine, bad):
    engine = make_engine(num_device_blocks=32)
    with pytest.raises(SamplingParamsError):
        engine.generate(["x"], SamplingParams(**bad))


def test_request_longer_than_pool_rejected_others_continue(make_engine):
    engine = make_engine(num_device_blocks=4)               # 64 slots
    with pytest.raises(SchedulerError, match="device pool"):
        engine.add_request(list(range(10, 90)), GREEDY)
    out = engine.generate(["x"], GREEDY)
    assert len(out[0].outputs[0].token_ids) > 0


def test_logit_bias_steers_every_token(make_engine):
    engine = make_engine(num_device_blocks=32)
    out = engine.generate(["x y"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                  logit_bias={77: 100.0}))
    assert out[0].outputs[0].token_ids == [77] * 4


def test_allowed_token_ids_bound_every_token_greedy_and_sampled(make_engine):
    engine = make_engine(num_device_blocks=32)
    params = [SamplingParams(max_tokens=5, temperature=t, seed=1, ignore_eos=True, allowed_token_ids=[10, 11])
              for t in (0.0, 1.5)]
    for out in engine.generate(["x y", "x y"], params):
        assert out.outputs[0].token_ids and set(out.outputs[0].token_ids) <= {10, 11}


def test_allowed_token_ids_past_the_vocabulary_rejected(make_engine):
    engine = make_engine(num_device_blocks=32)
    with pytest.raises(SamplingParamsError) as e:
        engine.add_request("x", SamplingParams(allowed_token_ids=[10, 10 ** 9]))
    assert e.value.param == "allowed_token_ids"


def test_request_wider_than_max_num_seqs_rejected_not_left_waiting(make_engine):
    engine = make_engine(num_device_blocks=64, max_num_seqs=4)
    for params in (SamplingParams(n=5, max_tokens=2), SamplingParams(n=2, beam_width=5, max_tokens=2)):
        with pytest.raises(SchedulerError, match="max_num_seqs"):
            engine.add_request([5, 6, 7], params)
    out = engine.generate(["x"], SamplingParams(n=4, max_tokens=2))
    assert len(out[0].outputs) == 4


def test_request_that_outgrows_pool_is_aborted_not_retried(make_engine):
    engine = make_engine(num_device_blocks=2, max_num_seqs=2, max_num_batched_tokens=64)   # 32 slots
    out = engine.generate([list(range(10, 30)), "x"],
                          [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), GREEDY])
    assert out[0].error and out[0].outputs[0].finish_reason == "abort"
    # step() reports it too (the served stack tells its client from that), though no model ran for it.
    rid = engine.add_request(list(range(10, 30)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    ended = []
    while engine.scheduler.has_unfinished():
        ended += [r.request_id for r in engine.step()]
    assert ended == [rid] and engine.scheduler.requests[rid].error


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_samples_back_from_preemption_share_their_prompt_again(make_engine, mode):
    """An n=3 request fits only because its samples share the prompt's blocks. Preempted (by
    recompute, or by swap and then swapped in), it comes back sharing them and finishes; it used
    to be aborted as "does not fit" after it had produced tokens."""
    import random
    rng = random.Random(0)
    a = [1] + [rng.randrange(7, 500) for _ in range(40)]
    b = [1] + [rng.randrange(7, 500) for _ in range(95)]      # 96 tokens: 6 full blocks
    alone = make_engine(num_device_blocks=64).generate(
        [b], SamplingParams(max_tokens=20, temperature=0, n=3, ignore_eos=True))[0]
    engine = make_engine(num_device_blocks=15, preemption_mode=mode, enable_prefix_caching=False)
    out = engine.generate([a, b], [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
                                   SamplingParams(max_tokens=20, temperature=0, n=3, ignore_eos=True)])
    assert out[1].num_preemptions > 0 and out[1].error is None
    assert [c.token_ids for c in out[1].outputs] == [c.token_ids for c in alone.outputs]
    stats = engine.stats()
    assert stats["device_blocks_used"] == 0 and stats["host_blocks_used"] == 0


def test_swapped_samples_come_back_when_their_blocks_and_next_tokens_fit(make_engine):
    """B (n=3) needs 7 of 9 blocks; swapped out for A, it must come back once A is done (the room
    check used to ask a new block per sample even where their last blocks had free slots)."""
    import random
    rng = random.Random(0)
    a = [1] + [rng.randrange(7, 500) for _ in range(30)]      # 31 tokens
    b = [1] + [rng.randrange(7, 500) for _ in range(63)]      # 64 tokens: 4 full blocks
    engine = make_engine(num_device_blocks=9, preemption_mode="swap", enable_prefix_caching=False)
    out = engine.generate([a, b], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                                   SamplingParams(max_tokens=10, temperature=0, n=3, ignore_eos=True)])
    assert out[1].error is None and out[1].num_preemptions == 1
    assert [len(c.token_ids) for c in out[1].outputs] == [10, 10, 10]


def test_swapped_samples_sharing_a_partial_last_block_come_back(make_engine):
    """Q's two samples share their partly filled last block when swapped out; back in, the one
    that writes last owns it, so Q needs 3 blocks, not 4 (it used to be aborted)."""
    engine = make_engine(num_device_blocks=3, num_host_blocks=8, preemption_mode="swap",
                         enable_prefix_caching=False)
    out = engine.generate([list(range(10, 20)), list(range(30, 50))],
                          [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                           SamplingParams(max_tokens=3, n=2, temperature=0, ignore_eos=True)])
    assert out[1].error is None and out[1].num_preemptions > 0
    assert [len(c.token_ids) for c in out[1].outputs] == [3, 3]


def test_generate_queues_nothing_when_one_prompt_can_never_fit(make_engine):
    engine = make_engine(num_device_blocks=4)               # 64 slots
    with pytest.raises(SchedulerError):
        engine.generate([[1, 50, 60], list(range(10, 90))], GREEDY)
    assert not engine.scheduler.requests and not engine.scheduler.has_unfinished()


def test_config_rejects_bad_values(tiny_llama):
    for bad in (dict(block_size=12), dict(num_device_blocks=0), dict(preemption_mode="later")):
        with pytest.raises(ConfigError):
            Engine(EngineConfig(model=tiny_llama, **bad))


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                   "original_max_position_embeddings": 64}])
def test_rope_scaling_that_cached_kv_cannot_follow_is_refused(tiny_llama, tmp_path, rope):
    import json
    import shutil
    from pagedserve.services.worker.model_loader import ModelLoadError, inspect_model_dir
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_scaling"] = rope
    cfg.pop("rope_parameters", None)
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="RoPE scaling"):
        inspect_model_dir(model)


def test_prompt_logprobs_match_transformers_through_chunks_and_cached_prefixes(tiny_llama, make_engine):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompts = [list(range(5, 60)), [7, 8, 9, 10], [3]]
    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=4, num_device_blocks=16)
    engine.generate([prompts[0][:40]], SamplingParams(max_tokens=2, temperature=0))   # cache its prefix
    outs = engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3, n=2))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1)     # [P, V]
        assert len(out.prompt_logprobs) == len(p) - 1
        for i, (lp, rank, top) in enumerate(out.prompt_logprobs):
            assert lp == pytest.approx(ref[i, p[i + 1]].item(), abs=1e-5)
            assert rank == int((ref[i] > ref[i, p[i + 1]]).sum()) + 1
            assert [t for t, _ in top] == ref[i].topk(3).indices.tolist()


@pytest.mark.parametrize("allocation", ["orca-max", "orca-pow2", "orca-oracle"])
def test_orca_allocations_give_the_same_greedy_output_in_a_tight_pool(make_engine, reference_outputs, allocation):
    # 12 blocks of 16: one orca-max region (the model's whole context) would not fit, so orca-max
    # runs with a shorter context; every request waits its turn instead of failing or swapping.
    kw = {"max_model_len": 64} if allocation == "orca-max" else {}
    engine = make_engine(num_device_blocks=12, allocation=allocation, preemption_mode="swap", **kw)
    outs = engine.generate(PROMPTS, GREEDY, true_output_lens=[GREEDY.max_tokens] * len(PROMPTS))
    assert [o.outputs[0].token_ids for o in outs] == reference_outputs[1]
    stats = engine.stats()
    assert stats.get("preemptions", 0) == 0 and stats["swap_outs"] == 0
    assert sum(stats["kv_breakdown"]["cache"].values()) == pytest.approx(1.0)


def test_allocation_flags_are_checked(tiny_llama):
    with pytest.raises(ConfigError, match="--allocation"):
        EngineConfig(model=tiny_llama, allocation="buddy").validate()
    with pytest.raises(ConfigError, match="orca-max"):
        EngineConfig(model=tiny_llama, batching="request").validate()
