"""Decode graphs on CPU: the bucketing, padding and fallback of services/worker/cuda_graphs.py, with
CUDA capture replaced by the Recorder (it replays the captured aten ops on the same tensors, with
the Python values of the capture, as a graph replays its kernels). So the replay path is right
before it first meets a GPU: a buffer the fill forgot, a host read, a kernel whose work was fixed by
the values seen at capture would each give a wrong answer here."""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve.kernels import cpu_ops
from pagedserve.services.engine import Engine
from pagedserve.services.engine_config import EngineConfig
from pagedserve.services.sampling_params import SamplingParams
from pagedserve.services.worker.cuda_graphs import HostRead, Recorder, batch_buckets, capture_decode_graphs
from pagedserve.services.worker.model_loader import load_model
from pagedserve.services.worker.model_runner import ModelRunner, SeqStep

# The CPU decode kernel reads its bounds from seq_lens inside one op; the reference reads the longest
# length on the host (a graph would freeze it), so the replay needs the C++ kernel.
needs_cpu_kernel = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler: the CPU kernel is not built")

B, NUM_BLOCKS, MAX_SEQS = 4, 400, 12


def test_buckets_are_vllms_ladder_in_steps_of_16():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256) == [1, 2, 4, 8] + list(range(16, 257, 16))


def test_the_recorder_replays_the_ops_on_the_same_tensors_with_the_values_of_the_capture():
    x, scale = torch.ones(3), [2.0]
    replay = Recorder()(lambda: x * scale[0] + x.sum())
    out = replay()
    assert out.tolist() == [5.0] * 3
    x.fill_(2.0)
    scale[0] = 10.0                               # a Python value: frozen, as in a graph
    assert replay().tolist() == [10.0] * 3 and replay() is out   # one output tensor, refilled
    with pytest.raises(HostRead):
        Recorder()(lambda: x * int(x.sum()))      # a sync on CUDA; frozen in a graph


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_model(tiny_llama, torch.float32, "cpu")


def make_runner(model, device: str = "cpu", dtype: torch.dtype = torch.float32) -> ModelRunner:
    net, spec = model
    pool = torch.zeros((NUM_BLOCKS, spec.block_bytes(B, dtype)), dtype=torch.uint8)
    # The same K/V history in every runner's pool, so that two runners can be compared.
    pool.view(dtype).copy_(torch.randn(pool.view(dtype).shape, generator=torch.Generator().manual_seed(0)))
    pool = pool.to(device)
    runner = ModelRunner(net, spec, pool, B, dtype, device, max_num_batched_tokens=32, max_model_len=128)
    runner.test_pool = pool.view(NUM_BLOCKS, spec.num_layers, 2, B, -1)   # [N, L, 2, B, Hkv * D]
    return runner


class Seqs:
    """Random sequences in decode on a shared pool, each with its own blocks: the same steps can be
    run by two runners on two pools."""

    def __init__(self, rng: random.Random):
        self.rng, self.free, self.seqs, self.next_id = rng, list(range(NUM_BLOCKS)), {}, 0

    def step(self, num: int) -> list[SeqStep]:
        while len(self.seqs) < num:
            length = self.rng.randint(1, 40)
            table = [self.free.pop() for _ in range(-(-(length + 1) // B))]
            self.seqs[self.next_id] = [length, table]
            self.next_id += 1
        chosen = self.rng.sample(sorted(self.seqs), num)
        steps = []
        for seq_id in chosen:
            length, table = self.seqs[seq_id]
            if len(table) * B < length + 1:
                table.append(self.free.pop())
            steps.append(SeqStep(seq_id, [self.rng.randrange(100)], length, table))
            self.seqs[seq_id][0] = length + 1
        return steps

    def finish_one(self):
        seq_id = self.rng.choice(sorted(self.seqs))
        self.free += self.seqs.pop(seq_id)[1]


@needs_cpu_kernel
def test_decode_in_a_graph_equals_eager_and_pads_without_writing(model):
    """Random decode batches (sizes between buckets, sequences joining and finishing, tables
    growing): the recorded graphs give eager's logits, and the padded rows write nowhere."""
    eager, graphed = make_runner(model), make_runner(model)
    stats = graphed.capture_graphs(MAX_SEQS, Recorder())
    assert graphed.graphs.buckets == [1, 2, 4, 8, MAX_SEQS] and stats["graphs"] == 5
    decode_like_eager(eager, graphed, tolerance=1e-4)


def decode_like_eager(eager: ModelRunner, graphed: ModelRunner, tolerance: float, steps: int = 30) -> None:
    """Run the same random decode steps on both runners: equal logits, and graphed's padding
    rows wrote nowhere in its pool."""
    seqs = Seqs(random.Random(0))
    for step in range(steps):
        num = [1, 3, 5, 9, 12, 2, 7][step % 7]
        steps = seqs.step(num)
        for s in steps:
            s.wants_logits = True
        before = graphed.test_pool.clone()
        want = eager.execute(steps)
        shape = graphed.fill(steps)
        assert shape.graph == graphed.graphs.find(num) and shape.num_seqs == shape.graph >= num
        got = graphed.execute(steps)
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        written = {s.block_table[s.start_pos // B] * B + s.start_pos % B for s in steps}
        slots = (graphed.test_pool != before).any(dim=4).any(dim=2).any(dim=1)   # [N, B]
        changed = {int(b) * B + int(o) for b, o in slots.nonzero().tolist()}
        assert changed <= written          # padding wrote nowhere
        if step % 4 == 3:
            seqs.finish_one()


@needs_cpu_kernel
def test_prefill_mixed_and_oversized_steps_run_eagerly(model):
    runner = make_runner(model)
    runner.capture_graphs(4, Recorder())
    assert runner.graphs.buckets == [1, 2, 4]
    prefill = [SeqStep(0, [1, 2, 3], 0, [0]), SeqStep(1, [4], 0, [1])]
    assert runner.fill(prefill).graph is None                       # mixed: eager
    decode = [SeqStep(i, [1], 2, [i]) for i in range(5)]
    assert runner.fill(decode).graph is None                        # past the largest bucket
    assert runner.fill(decode[:3]).graph == 4
    assert make_runner(model).fill(decode[:3]).graph is None         # nothing captured: eager


def test_graphs_are_captured_only_on_cuda_and_not_with_enforce_eager(model):
    runner = make_runner(model)
    assert capture_decode_graphs(runner, 8, enforce_eager=False) is None   # CPU: never
    runner.device = torch.device("cuda")     # as if on CUDA: --enforce-eager and tp > 1 still capture nothing
    assert capture_decode_graphs(runner, 8, enforce_eager=True) is None
    assert capture_decode_graphs(runner, 8, enforce_eager=False, tp_size=2) is None
    assert runner.graphs.buckets == []


@needs_cpu_kernel
def test_the_engine_with_recorded_graphs_decodes_as_eager(tiny_llama):
    """End to end through the scheduler: greedy and seeded sampling, n > 1 (forked sequences share
    blocks), a stop that ends some requests early: the same tokens with graphs as without."""
    prompts = ["the quick brown fox", "hello", "a b c d e f g h i j k l m n o p", "once upon a time"] * 2
    params = [SamplingParams(max_tokens=12, temperature=0.0),
              SamplingParams(max_tokens=9, temperature=0.8, seed=3, n=2),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.0)] * 2
    config = EngineConfig(model=tiny_llama, block_size=B, num_device_blocks=128, max_num_seqs=8)
    with Engine(config) as engine:
        want = engine.generate(prompts, params)
    with Engine(config) as engine:
        engine.runner.capture_graphs(8, Recorder())
        got = engine.generate(prompts, params)
        assert engine.runner.graphs.buckets == [1, 2, 4, 8]
    for w, g in zip(want, got):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]


@needs_cpu_kernel
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_recorded_graphs_keep_greedy_and_beams_under_preemption(tiny_llama, mode):
    """A pool so small that requests are preempted and come back (table rows freed and taken
    again, batches shrinking and growing between buckets), beams forking and dying: with graphs
    the tokens are the roomy eager engine's."""
    prompts = ["the quick brown fox jumps", "hello there", "a b c d e f g h", "once upon a time there was"]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    beams = SamplingParams(beam_width=3, n=2, max_tokens=10)
    roomy = EngineConfig(model=tiny_llama, block_size=B, num_device_blocks=256, max_num_seqs=8)
    tight = EngineConfig(model=tiny_llama, block_size=B, num_device_blocks=24, max_num_seqs=8, preemption_mode=mode)
    with Engine(roomy) as engine:
        want = [[c.token_ids for c in o.outputs] for o in engine.generate(prompts * 2, [greedy] * 4 + [beams] * 4)]
    with Engine(tight) as engine:
        engine.runner.capture_graphs(8, Recorder())
        got = [[c.token_ids for c in o.outputs] for o in engine.generate(prompts * 2, [greedy] * 4 + [beams] * 4)]
        assert engine.stats()["preemptions"] > 0
    assert got == want
