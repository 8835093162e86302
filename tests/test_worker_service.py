"""The worker as a process: a real kvstore process, real worker processes, steps sent by hand.

This test plays the scheduler: it allocates on a mirror (RecordingStore over a pool-less
BlockStore), sends the op log to the kvstore (ApplyOps) and the step to the worker (ExecuteStep with
block-table deltas), and checks the worker's greedy tokens against the offline engine's.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pagedserve.services.kvstore.client import KVStoreClient
from pagedserve.kvstore.replay import RecordingStore
from pagedserve.kvstore.store import BlockStore
from pagedserve.services import protocol
from pagedserve.services.engine import Engine
from pagedserve.services.engine_config import EngineConfig
from pagedserve.services.rpc import PeerTimeout, RpcClient
from pagedserve.services.sampling_params import SamplingParams
from pagedserve.services.worker.model_loader import inspect_model_dir

REPO = Path(__file__).resolve().parents[1]
B, NUM_BLOCKS = 16, 64
PROMPTS = [[1, 400, 401, 402, 403], list(range(100, 121)), list(range(700, 740, 2))]
MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
START_S = 120   # two cores shared by several processes that each import torch


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def spawn(module: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def start_kvstore(endpoint: str, block_bytes: int, tp_size: int) -> subprocess.Popen:
    return spawn("pagedserve.services.kvstore.service", "--endpoint", endpoint, "--num-device-blocks", str(NUM_BLOCKS),
                 "--num-host-blocks", "0", "--block-size", str(B), "--block-bytes", str(block_bytes),
                 "--tp-size", str(tp_size), "--log-level", "WARNING")


def start_worker(model: str, endpoint: str, kvstore: str, rank: int = 0, tp_size: int = 1,
                 dist_init: str = "", *extra: str) -> subprocess.Popen:
    return spawn("pagedserve.services.worker.service", "--model", model, "--endpoint", endpoint,
                 "--kvstore-endpoint", kvstore, "--rank", str(rank), "--tp-size", str(tp_size),
                 "--dist-init", dist_init or "tcp://127.0.0.1:1", "--block-size", str(B),
                 "--torch-threads", "1", "--kvstore-timeout", "60", *extra)


def wait_ready(rpc: RpcClient, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_S
    while True:
        for p in procs:
            assert p.poll() is None, p.communicate()[1]
        try:
            assert isinstance(rpc.call(protocol.Ping("test"), timeout_s=0.5), protocol.Pong)
            return
        except PeerTimeout:
            assert time.monotonic() < deadline, "the worker did not come up"


def stop_all(procs: list[subprocess.Popen], sig=signal.SIGTERM) -> list[int]:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    codes = []
    for p in procs:
        try:
            p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
        codes.append(p.returncode)
    return codes


class Scheduler:
    """Plays the scheduler: mirror + op log to the kvstore, table deltas + steps to the worker."""

    def __init__(self, kvstore: str, worker: str):
        self.mirror = RecordingStore(NUM_BLOCKS, 0, B)
        self.kv = KVStoreClient(kvstore, timeout_s=30)
        self.worker = RpcClient(worker, timeout_s=60)
        self.sent: dict[int, list[int]] = {}     # the tables as the worker knows them
        self.step_no = 0

    def step(self, seqs: list[protocol.SeqWork], **fields) -> protocol.StepResult:
        ops, expected = self.mirror.drain()
        self.step_no += 1
        assert self.kv.apply(self.step_no, ops).results == expected
        reply = self.worker.call(protocol.ExecuteStep(self.step_no, seqs, table_updates=self.deltas(seqs),
                                                      **fields))
        assert isinstance(reply, protocol.StepResult) and reply.step == self.step_no, reply
        return reply

    def deltas(self, seqs: list[protocol.SeqWork]) -> dict:
        out = {}
        for w in seqs:
            table, known = self.mirror.block_table(w.seq_id), self.sent.get(w.seq_id, [])
            same = min(len(table), len(known))
            start = next((i for i, (a, b) in enumerate(zip(table, known)) if a != b), same)
            if table != known:
                out[w.seq_id] = [start, *table[start:]]
                self.sent[w.seq_id] = list(table)
        return out

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """Prefill every prompt in one step, then decode them together; frees them at the end."""
        seq_ids = [self.step_no * 100 + i for i in range(len(prompts))]
        for s, p in zip(seq_ids, prompts):
            assert self.mirror.allocate(s, p).ok
        outs: list[list[int]] = [[] for _ in prompts]
        seqs = [protocol.SeqWork(s, p, 0, [[s, "greedy", 0, 0, 0]]) for s, p in zip(seq_ids, prompts)]
        new_params = {"greedy": GREEDY.to_dict()}
        for _ in range(MAX_NEW):
            reply = self.step(seqs, new_params=new_params)
            assert reply.error is None, reply.error
            new_params = {}
            for out, r in zip(outs, reply.results):
                out.append(r.token_id)
            for s, p, out in zip(seq_ids, prompts, outs):
                assert self.mirror.append_slots(s, [out[-1]]).ok
            seqs = [protocol.SeqWork(s, [out[-1]], len(p) + len(out) - 1, [[s, "greedy", 0, 0, len(out)]])
                    for s, p, out in zip(seq_ids, prompts, outs)]
        for s in seq_ids:
            self.mirror.free(s)
            self.sent.pop(s)
        assert self.step([], freed=seq_ids, dropped_params=["greedy"]).results == []
        return outs

    def send_step(self, seqs: list[protocol.SeqWork], **fields) -> int:
        """A step's ops applied and its work sent; the answer is not read (-> its number)."""
        ops, expected = self.mirror.drain()
        self.step_no += 1
        assert self.kv.apply(self.step_no, ops).results == expected
        self.worker.send(protocol.ExecuteStep(self.step_no, seqs, table_updates=self.deltas(seqs), **fields))
        return self.step_no

    def generate_ahead(self, prompts: list[list[int]]) -> list[list[int]]:
        """As generate, with every decode step planned ahead (async scheduling): step k+1, its
        inputs PENDING_TOKEN in slots the mirror holds for them, is sent before the answer to step k
        is read; the answer then sets those slots' tokens."""
        seq_ids = [self.step_no * 100 + i for i in range(len(prompts))]
        for s, p in zip(seq_ids, prompts):
            assert self.mirror.allocate(s, p).ok
        outs: list[list[int]] = [[] for _ in prompts]
        sent = [self.send_step([protocol.SeqWork(s, p, 0, [[s, "greedy", 0, 0, 0]]) for s, p in zip(seq_ids, prompts)],
                               new_params={"greedy": GREEDY.to_dict()})]
        for k in range(MAX_NEW):
            if k + 1 < MAX_NEW:   # step k + 1, planned before step k's tokens are known
                for s in seq_ids:
                    assert self.mirror.append_slots(s, [protocol.PENDING_TOKEN]).ok
                sent.append(self.send_step([protocol.SeqWork(s, [protocol.PENDING_TOKEN], len(p) + k, [[s, "greedy", 0, 0, k]])
                                            for s, p in zip(seq_ids, prompts)]))
            reply = self.worker.receive()
            assert isinstance(reply, protocol.StepResult) and reply.step == sent[k] and reply.error is None, reply
            for out, r in zip(outs, reply.results):
                out.append(r.token_id)
            if k + 1 < MAX_NEW:
                self.mirror.set_tokens(seq_ids, [len(p) + k for p in prompts], [out[-1] for out in outs])
        for s in seq_ids:
            self.mirror.free(s)
            self.sent.pop(s)
        assert self.step([], freed=seq_ids, dropped_params=["greedy"]).results == []
        return outs

    def close(self) -> None:
        self.kv.close()
        self.worker.close()


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[list[int]]:
    with Engine(EngineConfig(model=tiny_llama, block_size=B, num_device_blocks=NUM_BLOCKS)) as engine:
        return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]


def block_bytes(model: str, tp_size: int) -> int:
    return inspect_model_dir(model)[1].block_bytes(B, torch.float32, tp_size)


class Served:
    def __init__(self, model: str, tp_size: int, *worker_flags: str):
        self.kv_ep, self.worker_ep, dist = free_endpoint(), free_endpoint(), free_endpoint()
        self.kvstore = start_kvstore(self.kv_ep, block_bytes(model, tp_size), tp_size)
        self.workers = [start_worker(model, self.worker_ep, self.kv_ep, r, tp_size, dist, *worker_flags)
                        for r in range(tp_size)]
        self.sched = Scheduler(self.kv_ep, self.worker_ep)
        wait_ready(self.sched.worker, [self.kvstore, *self.workers])

    def close(self) -> None:
        self.sched.close()
        stop_all(self.workers + [self.kvstore])   # SIGTERM: the kvstore unlinks its pools


@pytest.fixture(scope="module")
def served(tiny_llama):
    s = Served(tiny_llama, 1)
    yield s
    s.close()


def test_served_greedy_matches_offline_engine(served, expected):
    assert served.sched.generate(PROMPTS) == expected
    stats = served.sched.worker.call(protocol.GetStats())
    assert stats.stats["tables"] == 0 and stats.stats["params"] == 0   # freed and dropped


def test_bad_messages_get_errors_and_the_worker_carries_on(served, expected):
    rpc = served.sched.worker
    reply = rpc.call(protocol.AbortRequest("r1"))                       # not a worker message
    assert isinstance(reply, protocol.Error) and reply.code == 404
    rpc.sock.send_multipart([b"\x92garbage"])                           # undecodable
    assert rpc.sock.poll(30_000)
    reply = protocol.decode(rpc.sock.recv_multipart())
    assert isinstance(reply, protocol.Error) and reply.code == 400
    # A well-formed step about a sequence the worker has no table for: an error result, no crash.
    bad = rpc.call(protocol.ExecuteStep(10_000, [protocol.SeqWork(987, [5], 0, [[987, "nope", 0, 0, 0]])]))
    assert isinstance(bad, protocol.StepResult) and "no block table" in bad.error
    # A table too short for the step: the model runner's error comes back as the step's error.
    short = rpc.call(protocol.ExecuteStep(10_001, [protocol.SeqWork(988, list(range(3, 40)), 0)],
                                          table_updates={988: [0, 1]}, freed=[]))
    assert "model error" in short.error and "block table covers 16 slots" in short.error
    rpc.call(protocol.ExecuteStep(10_002, [], freed=[988]))
    assert isinstance(rpc.call(protocol.Ping("after")), protocol.Pong)
    assert served.sched.generate(PROMPTS[:1]) == expected[:1]         # and still computes right


@pytest.mark.parametrize("launch_ahead", ["on", "off"])
def test_steps_planned_ahead_take_the_last_draw_as_input(tiny_llama, expected, launch_ahead):
    """Async scheduling through the worker process: each decode step arrives before the step it
    follows is answered, its inputs PENDING_TOKEN. With --launch-ahead on the worker launches it
    before answering (on CPU too, where auto would not); off, it answers first. Same tokens."""
    s = Served(tiny_llama, 1, "--launch-ahead", launch_ahead)
    try:
        assert s.sched.generate_ahead(PROMPTS) == expected
    finally:
        s.close()


def test_two_ranks_take_steps_planned_ahead(tiny_llama, expected):
    """Under tensor parallelism rank 0 fills a step's pending inputs before forwarding it."""
    s = Served(tiny_llama, 2)
    try:
        assert s.sched.generate_ahead(PROMPTS) == expected
    finally:
        s.close()


def test_sigterm_stops_the_worker_with_exit_0(served):
    assert stop_all(served.workers) == [0]


def test_unreachable_kvstore_is_one_line_and_nonzero(tiny_llama):
    proc = start_worker(tiny_llama, free_endpoint(), free_endpoint(), 0, 1, "", "--kvstore-timeout", "1")
    _, err = proc.communicate(timeout=START_S)
    assert proc.returncode == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "no answer from the kvstore" in lines[0], err


def test_two_ranks_serve_like_one_and_stop_together(tiny_llama, expected):
    s = Served(tiny_llama, 2)
    try:
        assert s.sched.generate(PROMPTS) == expected
        rank0, rank1 = s.workers
        rank0.send_signal(signal.SIGTERM)              # rank 0 tells rank 1 to stop: no orphan
        err0, err1 = rank0.communicate(timeout=30)[1], rank1.communicate(timeout=30)[1]
        assert (rank0.returncode, rank1.returncode) == (0, 0), err0 + err1
    finally:
        s.close()


def test_rank0_killed_leaves_no_orphan(tiny_llama):
    s = Served(tiny_llama, 2)
    try:
        rank0, rank1 = s.workers
        rank0.kill()                                    # no goodbye: rank 1 notices the closed connection
        _, err = rank1.communicate(timeout=30)
        assert rank1.returncode == 1 and "rank 0 went away" in err, err
    finally:
        s.close()


# ---- the step state alone (no processes) ---------------------------------------------------------

def test_step_inputs_apply_table_deltas_and_params():
    from pagedserve.services.worker.step_inputs import StepError, StepInputs
    inputs = StepInputs()
    p = SamplingParams(temperature=0.0, min_tokens=3).to_dict()
    msg = protocol.ExecuteStep(1, [protocol.SeqWork(7, [5, 6], 0, [[7, "k", 0, 0, 2], [8, "k", 1, 0, 2]])],
                               table_updates={7: [0, 3, 4]}, new_params={"k": p})
    inputs.apply_deltas(msg)
    steps, samples = inputs.build(msg)
    assert steps[0].block_table == [3, 4] and steps[0].start_pos == 0
    assert [s.seq_id for s in samples[0]] == [7, 8] and samples[0][1].seq_index == 1
    assert samples[0][0].output_token_ids == [0, 0]      # only its length matters without penalties
    assert samples[0][0].params is samples[0][1].params   # constructed once, cached
    inputs.apply_deltas(protocol.ExecuteStep(2, [], table_updates={7: [1, 9, 10]}))
    assert inputs.tables[7] == [3, 9, 10]                 # table[start:] = blocks
    # Freed first, then updates: a sequence freed and re-admitted in one step gets its new table.
    inputs.apply_deltas(protocol.ExecuteStep(3, [], table_updates={7: [0, 11]}, freed=[7]))
    assert inputs.tables[7] == [11]
    with pytest.raises(StepError, match="starts at 5"):
        inputs.apply_deltas(protocol.ExecuteStep(4, [], table_updates={7: [5, 1], 8: [0, 2]}))
    assert 8 not in inputs.tables                          # a bad delta changes nothing
    inputs.drop_params(protocol.ExecuteStep(5, [], dropped_params=["k"]))
    with pytest.raises(StepError, match="unknown params key"):
        inputs.build(msg)


def test_step_inputs_need_histories_for_penalties():
    from pagedserve.services.worker.step_inputs import StepError, StepInputs
    inputs = StepInputs()
    pen = SamplingParams(repetition_penalty=1.3).to_dict()
    work = protocol.SeqWork(1, [5], 3, [[1, "pen", 0, 0, 1]])
    msg = protocol.ExecuteStep(1, [work], table_updates={1: [0, 2]}, new_params={"pen": pen})
    inputs.apply_deltas(msg)
    with pytest.raises(StepError, match="penalties"):
        inputs.build(msg)
    msg.histories = {1: [[9, 9, 9], [5]]}
    (_,), ((req,),) = inputs.build(msg)
    assert req.prompt_token_ids == [9, 9, 9] and req.output_token_ids == [5]
    with pytest.raises(StepError, match="new_params"):
        inputs.apply_deltas(protocol.ExecuteStep(2, [], new_params={"bad": {"temperature": -1}}))


def test_step_inputs_refuse_ids_outside_the_pool_and_the_vocabulary():
    """A negative block id would wrap around into another sequence's blocks; each of these is a
    StepError (the step fails, the worker and its pool stay as they were)."""
    from pagedserve.services.worker.step_inputs import StepError, StepInputs
    inputs = StepInputs(num_blocks=8, vocab_size=100)
    p = SamplingParams(temperature=0.0).to_dict()
    inputs.apply_deltas(protocol.ExecuteStep(1, [], table_updates={1: [0, 2, 3]}, new_params={"k": p}))
    for bad in ({1: [2, -1]}, {1: [2, 8]}, {2: [0, 1, 99]}):
        with pytest.raises(StepError, match="block ids"):
            inputs.apply_deltas(protocol.ExecuteStep(2, [], table_updates=bad))
    assert inputs.tables == {1: [2, 3]}
    for work, match in ((protocol.SeqWork(1, [5, 100], 0), "token ids"),
                        (protocol.SeqWork(1, [-4], 0), "token ids"),
                        # PENDING_TOKEN only ever stands alone (the sequence's one input in the step)
                        (protocol.SeqWork(1, [5, protocol.PENDING_TOKEN], 0), "token ids"),
                        (protocol.SeqWork(1, [5], -1), "start_pos"),
                        (protocol.SeqWork(1, [5], 0, [[1, "k", 0, 0, 10**15]]), "counts"),
                        (protocol.SeqWork(1, [5], 0, [[1, 7, 0, 0, 1]]), "key")):
        with pytest.raises(StepError, match=match):
            inputs.build(protocol.ExecuteStep(3, [work]))
    with pytest.raises(StepError, match="history"):
        inputs.build(protocol.ExecuteStep(3, [protocol.SeqWork(1, [5], 0, [[1, "k", 0, 0, 1]])],
                                          histories={1: [[5], [100]]}))
