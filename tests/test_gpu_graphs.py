"""CUDA graphs on a real GPU (`make gpu-check` runs this file; skipped without CUDA): the decode
graphs captured with CudaCapture give eager's logits on random decode batches in float32 and
bf16, padded rows write nowhere in the pool, and the engine's greedy tokens are the same with
graphs as with --enforce-eager; a launched step (async scheduling) does not wait for the device.
The CPU twin, with the Recorder, is tests/test_cuda_graphs.py."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")

from test_cuda_graphs import MAX_SEQS, decode_like_eager, make_runner  # noqa: E402

from pagedserve.services.engine import Engine  # noqa: E402
from pagedserve.services.engine_config import EngineConfig  # noqa: E402
from pagedserve.services.sampling_params import SamplingParams  # noqa: E402
from pagedserve.services.worker.cuda_graphs import CudaCapture  # noqa: E402
from pagedserve.services.worker.model_loader import load_model  # noqa: E402


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-3), (torch.bfloat16, 6e-2)])
def test_cuda_graphs_decode_as_eager(tiny_llama, dtype, tolerance):
    model = load_model(tiny_llama, dtype, "cuda")
    eager, graphed = make_runner(model, "cuda", dtype), make_runner(model, "cuda", dtype)
    stats = graphed.capture_graphs(MAX_SEQS, CudaCapture())
    assert stats["graphs"] == 5 and stats["bytes"] >= 0
    decode_like_eager(eager, graphed, tolerance)


def test_engine_greedy_is_the_same_with_graphs_and_eager(tiny_llama):
    prompts = ["the quick brown fox", "hello", "a b c d e f g h i j k l m n o p", "once upon a time"] * 3
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for eager in (True, False):
        config = EngineConfig(model=tiny_llama, device="cuda", dtype="float32", num_device_blocks=256,
                              max_num_seqs=16, enforce_eager=eager)
        with Engine(config) as engine:
            assert bool(engine.runner.graphs.buckets) != eager
            outputs[eager] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert outputs[False] == outputs[True]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, temperature=0.0),
                                    SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=3, logprobs=2)])
def test_a_launched_step_does_not_wait_for_the_device(tiny_llama, params):
    """Async scheduling on a GPU: WorkerCore.launch queues the forward and the draw and returns
    while the device is still busy (no host sync in between), and a step planned ahead launches
    on the draw still on the device. The device is kept busy by a sleep kernel queued first."""
    config = EngineConfig(model=tiny_llama, device="cuda", dtype="float32", num_device_blocks=256,
                          max_num_seqs=16, async_scheduling=False)
    with Engine(config) as engine:
        sched, worker = engine.scheduler, engine.worker
        for i in range(8):
            engine.add_request(f"prompt number {i} says", params)
        engine.step()   # the prefill: the requests decode from here on
        cur = sched.schedule()
        busy = torch.cuda.current_stream().query
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)   # ~0.1 s of device time, queued before the step
        launched = worker.launch(cur.steps, cur.samples)
        assert not busy(), "launch waited for the device"
        nxt = sched.schedule_ahead(cur)
        # (the next fill waits for this step's input copy, queued behind the first sleep: one host
        # buffer; a second sleep, behind this step's draw, keeps the device busy past it)
        torch.cuda._sleep(200_000_000)
        launched_next = worker.launch(nxt.steps, nxt.samples)
        assert not busy(), "a step planned ahead waited for the draw it takes its inputs from"
        sched.update(cur, worker.finish(launched))
        sched.update(nxt, worker.finish(launched_next))
        while engine.has_work():
            engine.step()
