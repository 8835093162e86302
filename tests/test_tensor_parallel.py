"""Tensor parallelism: 2 CPU ranks (gloo) decode exactly what 1 rank decodes; shards are the right slices.

The multi-rank test drives ModelRunner directly in spawned processes (each rank with its own KV pool
holding its KV heads, block tables from a pool-less BlockStore), so it needs no kvstore or sockets
beyond gloo's; tests/test_worker_service.py covers the served path.
"""
from __future__ import annotations

import multiprocessing as mp
import shutil
from pathlib import Path

import pytest
import torch

from pagedserve.kvstore.store import BlockStore
from pagedserve.services.worker.model_loader import ModelLoadError, inspect_model_dir, load_model
from pagedserve.services.worker.model_runner import ModelRunner, SeqStep
from pagedserve.services.worker.tp import SINGLE, TensorParallel, TPConfigError, head_shard, kv_heads_per_rank

BLOCK_SIZE = 16
NUM_BLOCKS = 64
PROMPT_LENS = (5, 17, 33, 40)
MAX_NEW = 12
TP_ARCHS = ("llama", "qwen2", "opt")   # GQA; q/k/v bias (column-parallel biases); OPT's fc1/fc2


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def greedy_decode(model_dir: str, tp: TensorParallel) -> list[list[int]]:
    """Batched greedy decode of `prompts` over this rank's own pool; every rank returns the tokens."""
    dtype = torch.float32
    model, spec = load_model(model_dir, dtype, "cpu", tp)
    pool = torch.zeros((NUM_BLOCKS, spec.block_bytes(BLOCK_SIZE, dtype, tp.size)), dtype=torch.uint8)
    runner = ModelRunner(model, spec, pool, BLOCK_SIZE, dtype, "cpu", tp.size)
    store = BlockStore(NUM_BLOCKS, 0, BLOCK_SIZE, enable_prefix_caching=False)
    ids = prompts(spec.vocab_size)
    outs: list[list[int]] = [[] for _ in ids]
    for seq_id, p in enumerate(ids):
        assert store.allocate(seq_id, p).ok
    steps = [SeqStep(i, p, 0, store.block_table(i)) for i, p in enumerate(ids)]
    for _ in range(MAX_NEW):
        logits = runner.execute(steps)                       # [S, vocab], identical on every rank
        for seq_id, tok in enumerate(logits.argmax(-1).tolist()):
            outs[seq_id].append(tok)
        steps = []
        for seq_id, out in enumerate(outs):
            assert store.append_slots(seq_id, [out[-1]]).ok
            start = len(ids[seq_id]) + len(out) - 1
            steps.append(SeqStep(seq_id, [out[-1]], start, store.block_table(seq_id)))
    return outs


@pytest.fixture(scope="module")
def biased_model_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    """The tiny models with random biases: random init leaves them zero, and a bias added on every
    rank (or sliced where it must stay whole) would then go unnoticed."""
    from safetensors.torch import load_file, save_file
    out = {}
    g = torch.Generator().manual_seed(1)
    for arch in TP_ARCHS:
        src, dst = Path(tiny_model_dirs[arch]), tmp_path_factory.mktemp(f"biased-{arch}")
        for f in src.iterdir():
            shutil.copy(f, dst / f.name)
        weights = load_file(str(src / "model.safetensors"))
        for name, w in weights.items():
            if name.endswith(".bias"):
                weights[name] = 0.2 * torch.randn(w.shape, generator=g)
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
        out[arch] = str(dst)
    return out


def _rank_main(rank: int, size: int, init_method: str, model_dirs: dict, results) -> None:
    from pagedserve.services.worker.tp import close_tensor_parallel, init_tensor_parallel
    torch.set_num_threads(1)   # two ranks on a 2-core box
    tp = init_tensor_parallel(rank, size, init_method, timeout_s=60)
    try:
        results.put((rank, {arch: greedy_decode(d, tp) for arch, d in model_dirs.items()}))
    except BaseException as e:
        results.put((rank, repr(e)))
        raise
    finally:
        close_tensor_parallel(tp)


def test_two_ranks_decode_like_one(biased_model_dirs, tmp_path):
    dirs = biased_model_dirs
    ctx = mp.get_context("spawn")   # not fork: the parent's OpenMP and gloo state must not leak in
    results = ctx.Queue()
    init = f"file://{tmp_path}/rendezvous"   # not a TCP port: no race with other tests for a free one
    procs = [ctx.Process(target=_rank_main, args=(r, 2, init, dirs, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0], got
    expected = {arch: greedy_decode(d, SINGLE) for arch, d in dirs.items()}
    for arch in expected:
        assert got[0][arch] == got[1][arch] == expected[arch], arch


# ---- shards without a process group: slicing and its arithmetic ---------------------------------

def test_head_shards_split_and_replicate():
    # 8 query heads, 4 KV heads over 2 ranks: 4 + 2 each.
    s = head_shard(8, 4, TensorParallel(1, 2))
    assert (s.q_start, s.num_heads, s.kv_start, s.num_kv_heads) == (4, 4, 2, 2)
    # 8 query heads, 2 KV heads over 4 ranks: KV heads replicated, each rank's 2 query heads map onto its one.
    for rank in range(4):
        s = head_shard(8, 2, TensorParallel(rank, 4))
        assert (s.q_start, s.num_heads, s.num_kv_heads) == (2 * rank, 2, 1)
        group = 8 // 2
        assert s.kv_start == s.q_start // group == (s.q_start + s.num_heads - 1) // group
    assert kv_heads_per_rank(2, 4) == 1 and kv_heads_per_rank(4, 2) == 2 and kv_heads_per_rank(4, 1) == 4
    with pytest.raises(TPConfigError, match="num_attention_heads"):
        head_shard(6, 2, TensorParallel(0, 4))
    with pytest.raises(TPConfigError, match="num_key_value_heads"):
        head_shard(12, 3, TensorParallel(0, 2))


def _checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(Path(model_dir) / "model.safetensors"))


def _merged_layout(arch: str, spec, ckpt: dict, tp: TensorParallel) -> dict[str, tuple[str, list[tuple[str, slice]]]]:
    """Merged parameter suffix -> the checkpoint tensors (suffixes) and rows of each that rank tp holds,
    in order: its q, k, v slices (gate, up), each cut from its own tensor."""
    heads = spec.num_attention_heads
    s = head_shard(heads, heads if arch == "opt" else spec.num_kv_heads, tp)
    D = spec.head_dim
    q = slice(s.q_start * D, (s.q_start + s.num_heads) * D)
    kv = slice(s.kv_start * D, (s.kv_start + s.num_kv_heads) * D)
    layout = {"self_attn.qkv_proj": [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)]}
    if arch != "opt":
        i = ckpt["model.layers.0.mlp.gate_proj.weight"].shape[0] // tp.size
        rows = slice(tp.rank * i, (tp.rank + 1) * i)
        layout["mlp.gate_up_proj"] = [("mlp.gate_proj", rows), ("mlp.up_proj", rows)]
    return layout


@pytest.mark.parametrize("arch", TP_ARCHS)
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_merged_weights_are_the_checkpoints_slices_concatenated(biased_model_dirs, arch, tp_size):
    """qkv_proj (and gate_up_proj) of rank r == cat(rank r's q slice, its k slice, its v slice) of the
    unchanged Hugging Face tensors, weights and biases: not a slice of the concatenation. tp=4 over
    the tiny llama/qwen2 (4 query heads, 2 KV heads) replicates each KV head on two ranks."""
    ckpt = _checkpoint(biased_model_dirs[arch])
    prefix = "model.decoder.layers" if arch == "opt" else "model.layers"
    for rank in range(tp_size):
        tp = TensorParallel(rank, tp_size)
        model, spec = load_model(biased_model_dirs[arch], tp=tp)
        params = dict(model.named_parameters())
        layout = _merged_layout(arch, spec, ckpt, tp)
        for layer in range(spec.num_layers):
            for merged, parts in layout.items():
                for leaf in ("weight", "bias"):
                    name = f"{prefix}.{layer}.{merged}.{leaf}"
                    sources = [f"{prefix}.{layer}.{part}.{leaf}" for part, _ in parts]
                    if not all(src in ckpt for src in sources):
                        assert name not in params, name       # no bias in the checkpoint: none here
                        continue
                    want = torch.cat([ckpt[src][rows] for src, (_, rows) in zip(sources, parts)])
                    assert torch.equal(params[name], want), (arch, tp_size, rank, name)
        if tp_size == 1:   # no tensor-parallel slicing at all: merged == the whole tensors concatenated
            assert not any(hasattr(p, "tp_slice") for p in model.parameters())
    if arch == "qwen2":   # the biases the test relies on are there and not zero
        assert ckpt["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0


def test_rank_shards_are_slices_of_the_checkpoint(tiny_llama):
    """tp=4 over the tiny llama (4 query heads, 2 KV heads): KV heads replicated on rank pairs."""
    full, spec = load_model(tiny_llama)
    D = spec.head_dim
    attn, mlp = full.model.layers[1].self_attn, full.model.layers[1].mlp
    q, k, v = attn.qkv_proj.weight.split(attn.qkv_proj.sizes)       # tp=1: the whole q, k, v
    gate, up = mlp.gate_up_proj.weight.split(mlp.gate_up_proj.sizes)
    for rank in range(4):
        shard, _ = load_model(tiny_llama, tp=TensorParallel(rank, 4))
        a, m = shard.model.layers[1].self_attn, shard.model.layers[1].mlp
        kv = rank // 2
        sq, sk, sv = a.qkv_proj.weight.split(a.qkv_proj.sizes)
        assert torch.equal(sq, q[rank * D:(rank + 1) * D])
        assert torch.equal(sk, k[kv * D:(kv + 1) * D])
        assert torch.equal(sv, v[kv * D:(kv + 1) * D])
        assert torch.equal(a.o_proj.weight, attn.o_proj.weight[:, rank * D:(rank + 1) * D])
        i = gate.shape[0] // 4
        assert torch.equal(m.gate_up_proj.weight, torch.cat([gate[rank * i:(rank + 1) * i], up[rank * i:(rank + 1) * i]]))
        assert torch.equal(m.down_proj.weight, mlp.down_proj.weight[:, rank * i:(rank + 1) * i])
        assert torch.equal(shard.lm_head.weight, full.lm_head.weight)       # replicated
    assert spec.block_bytes(BLOCK_SIZE, torch.float32, 4) == spec.block_bytes(BLOCK_SIZE, torch.float32) // 2
    assert spec.block_bytes(BLOCK_SIZE, torch.float32, 2) == spec.block_bytes(BLOCK_SIZE, torch.float32) // 2


def test_a_missing_part_of_a_merged_weight_is_named(tiny_llama, tmp_path):
    """A checkpoint without k_proj of one layer is refused by that tensor's own name."""
    from safetensors.torch import save_file
    for f in Path(tiny_llama).iterdir():
        shutil.copy(f, tmp_path / f.name)
    weights = _checkpoint(tiny_llama)
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing .*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(str(tmp_path))


def test_row_parallel_bias_is_added_once(tiny_model_dirs):
    """OPT's out_proj/fc2 biases stay whole on every rank (added after the reduce, not sliced)."""
    full, _ = load_model(tiny_model_dirs["opt"])
    shard, _ = load_model(tiny_model_dirs["opt"], tp=TensorParallel(1, 2))
    for f, s in zip(full.model.decoder.layers, shard.model.decoder.layers):
        assert torch.equal(s.fc2.bias, f.fc2.bias)
        assert torch.equal(s.self_attn.out_proj.bias, f.self_attn.out_proj.bias)
        assert torch.equal(s.fc1.bias, f.fc1.bias[128:])                      # column-parallel: sliced


def test_unsplittable_model_is_rejected_with_the_dimension(tiny_llama):
    with pytest.raises(ModelLoadError, match="num_attention_heads .4. is not divisible by tp_size 3"):
        load_model(tiny_llama, tp=TensorParallel(0, 3))
    _, spec = inspect_model_dir(tiny_llama)
    with pytest.raises(TPConfigError):
        spec.block_bytes(BLOCK_SIZE, torch.float32, 3)


def test_single_rank_takes_no_distributed_path(tiny_llama):
    import torch.distributed as dist
    model, _ = load_model(tiny_llama)
    assert not any(hasattr(p, "tp_slice") for p in model.parameters())
    assert not dist.is_initialized()
