"""Paged-attention kernels: Triton (interpreted on CPU), the PyTorch reference, and ordinary
contiguous attention must agree on the same random data.

Caches are built exactly as the worker builds them (docs/INTERFACES.md, tensor layout): a byte pool
viewed as [N, L, 2, B, Hkv, D] and sliced to one layer's K or V, so stride(0) spans every layer and
both K and V. Block tables are shuffled, so neither contiguity nor monotonic order is assumed.
Triton cases stay tiny: the interpreter costs ~10 ms per (program x loop iteration).
"""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of kernels.triton_ops: @triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import importlib  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pagedserve.kernels import ops  # noqa: E402  (never imports triton_ops by itself)
from pagedserve.kernels import reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_LAYERS = 2
LAYER = 1  # the last layer: its K/V sit at a non-zero offset inside each block row
GARBAGE = 50.0  # scale of the junk left in unused cache slots: any read of it shows in the output


@pytest.fixture(scope="module")
def triton_ops():
    """pagedserve.kernels.triton_ops with every Triton function it reaches decorated for the interpreter.

    @triton.jit picks interpreted or compiled when it decorates. If some earlier import (another
    test module; importing a transformers Llama model imports triton) decorated triton's own
    library (tl.max, tl.sum, ...) or our kernels before TRITON_INTERPRET was set, they would need a
    GPU driver: re-wrap triton's library functions for this module's tests, then reload our kernels.
    """
    triton_module = importlib.import_module("pagedserve.kernels.triton_ops")
    if torch.cuda.is_available():
        yield triton_module
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    replaced = []
    for module in (tl, tl.standard, tl.math):
        for name, fn in list(vars(module).items()):
            if isinstance(fn, JITFunction):
                replaced.append((module, name, fn))
                setattr(module, name, InterpretedFunction(fn.fn))
    if not isinstance(triton_module.paged_decode_kernel, InterpretedFunction):
        triton_module = importlib.reload(triton_module)
    yield triton_module
    for module, name, fn in replaced:
        setattr(module, name, fn)


# ----------------------------------------------------------------------------------------------
# Building paged caches from contiguous per-sequence K/V
# ----------------------------------------------------------------------------------------------

def cpu_ops_available() -> bool:
    from pagedserve.kernels import cpu_ops
    return cpu_ops.available()


def make_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen):
    """A byte pool as the kvstore holds it, filled with junk; returns (pool, k_cache, v_cache)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    block_bytes = NUM_LAYERS * 2 * block_size * num_kv_heads * head_dim * itemsize
    pool = torch.empty(num_blocks, block_bytes, dtype=torch.uint8, device=DEVICE)
    kv = pool.view(dtype).view(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim)
    kv.copy_(GARBAGE * torch.randn(kv.shape, generator=gen).to(dtype))
    k_cache, v_cache = kv[:, LAYER, 0], kv[:, LAYER, 1]  # [N, B, Hkv, D]
    assert k_cache.stride(0) == NUM_LAYERS * 2 * block_size * num_kv_heads * head_dim
    assert not k_cache.is_contiguous()
    return pool, k_cache, v_cache


class PagedCase:
    """Random sequences stored in a shuffled paged cache, plus their contiguous originals.

    seq_lens[s] includes this step's q_lens[s] query tokens (the last q_lens[s] positions).
    """

    def __init__(self, seq_lens, q_lens, block_size, num_q_heads, num_kv_heads, head_dim,
                 dtype, seed=0, spare_blocks=3, shared_blocks=0):
        """shared_blocks: every sequence's first (up to) that many blocks are sequence 0's, as
        after a prefix-cache hit: the same physical blocks in several tables."""
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens, self.q_lens = list(seq_lens), list(q_lens)
        self.block_size, self.dtype, self.scale = block_size, dtype, head_dim ** -0.5
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        # A shared block must be full in sequence 0 and in the sharer (only full blocks are shared).
        shared = [0] + [min(shared_blocks, n // block_size, seq_lens[0] // block_size)
                        for n in seq_lens[1:]]
        num_blocks = sum(blocks_per_seq) - sum(shared) + spare_blocks
        self.pool, self.k_cache, self.v_cache = make_pool(
            num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)

        # A random permutation makes tables non-contiguous and non-monotonic. Entries past a
        # sequence's blocks are junk that must never be dereferenced: -1 and out-of-pool ids.
        physical = torch.randperm(num_blocks, generator=gen).tolist()
        table = torch.randint(-1, 2, (len(seq_lens), max(blocks_per_seq)), generator=gen)
        table = torch.where(table >= 0, table * 0 + 10 * num_blocks + 7, table).to(torch.int32)
        self.keys, self.values, queries = [], [], []
        for s, (n, q_len) in enumerate(zip(seq_lens, q_lens)):
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
            common = shared[s] * block_size
            if common:
                k[:common], v[:common] = self.keys[0][:common], self.values[0][:common]
                table[s, :shared[s]] = table[0, :shared[s]]
            for i in range(shared[s], blocks_per_seq[s]):
                block = physical.pop()
                table[s, i] = block
                lo, hi = i * block_size, min(n, (i + 1) * block_size)
                self.k_cache[block, : hi - lo] = k[lo:hi]
                self.v_cache[block, : hi - lo] = v[lo:hi]
            self.keys.append(k)
            self.values.append(v)
            queries.append(torch.randn(q_len, num_q_heads, head_dim, generator=gen).to(dtype))
        self.q = torch.cat(queries).to(DEVICE)  # [T, Hq, D]
        self.block_tables = table.to(DEVICE)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        qsl = [0]
        for q_len in q_lens:
            qsl.append(qsl[-1] + q_len)
        self.query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=DEVICE)
        self.max_query_len = max(q_lens)

    def paged(self, impl):
        return ops.paged_attention(
            self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens_t,
            self.query_start_loc, self.scale, self.max_query_len, impl=impl)

    def contiguous(self):
        """Ordinary SDPA on each sequence's own contiguous K/V, in float32: [T, Hq, D]."""
        outs, start = [], 0
        for k, v, n, q_len in zip(self.keys, self.values, self.seq_lens, self.q_lens):
            q = self.q[start:start + q_len].float().transpose(0, 1)  # [Hq, q_len, D]
            start += q_len
            q_pos = torch.arange(n - q_len, n, device=DEVICE)
            mask = torch.arange(n, device=DEVICE)[None, :] <= q_pos[:, None]  # [q_len, n]
            out = F.scaled_dot_product_attention(
                q, k.float().transpose(0, 1), v.float().transpose(0, 1), attn_mask=mask,
                scale=self.scale, enable_gqa=True)
            outs.append(out.transpose(0, 1))
        return torch.cat(outs)


def tolerance(dtype):
    if dtype == torch.bfloat16:  # torch.testing's own for bf16: 2 ulps of an 8-bit mantissa
        return {"atol": 1e-5, "rtol": 1.6e-2}
    return {"atol": 2e-3, "rtol": 2e-3} if dtype == torch.float16 else {"atol": 2e-5, "rtol": 2e-5}


def assert_close(actual, expected, dtype):
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance(dtype))


DTYPES = [torch.float32, torch.float16]


# ----------------------------------------------------------------------------------------------
# Reference vs contiguous attention (bigger shapes: the reference is the CPU serving path)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_ragged_matches_contiguous(block_size, dtype):
    # pure prefill, prefill over a cached prefix, chunked prefill mid-sequence, two decodes
    case = PagedCase(seq_lens=[150, 200, 97, 1, 333], q_lens=[150, 37, 50, 1, 1],
                     block_size=block_size, num_q_heads=8, num_kv_heads=2, head_dim=64,
                     dtype=dtype, seed=block_size)
    assert_close(case.paged("reference"), case.contiguous(), dtype)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_kv_heads", [1, 4, 8])
def test_reference_decode_matches_contiguous(block_size, num_kv_heads):
    seq_lens = [1, 7, 64, 65, 300, 129]
    case = PagedCase(seq_lens=seq_lens, q_lens=[1] * len(seq_lens), block_size=block_size,
                     num_q_heads=8, num_kv_heads=num_kv_heads, head_dim=32,
                     dtype=torch.float32, seed=num_kv_heads)
    out = ops.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                         case.seq_lens_t, case.scale, impl="reference")
    assert_close(out, case.contiguous(), torch.float32)
    # paged_attention with one query per sequence is the same computation
    assert_close(case.paged("reference"), out, torch.float32)


# ----------------------------------------------------------------------------------------------
# The C++ CPU kernel (kernels/cpu_ops.py) vs reference vs contiguous
# ----------------------------------------------------------------------------------------------

CPU_DTYPES = [torch.float32, torch.bfloat16]
# Context lengths 1..2048, on and off block boundaries (block size 16).
DECODE_LENS = [1, 2, 15, 16, 17, 100, 513, 1000, 2048]
# (seq_len, q_len): prefill over a long cached prefix, a prefix ending mid-block, pure prefill of
# more than one query tile, a one-token prefix, and a decode row inside the ragged batch.
PREFILL_ROWS = [(2048, 40), (700, 37), (53, 53), (18, 17), (1000, 1)]


def cpu_case(kind, dtype, group, head_dim, seed):
    lens, q_lens = ((DECODE_LENS, [1] * len(DECODE_LENS)) if kind == "decode"
                    else map(list, zip(*PREFILL_ROWS)))
    if kind == "prefill":  # sequence 0 (the longest) lends its first blocks to the others
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        lens, q_lens = [lens[i] for i in order], [q_lens[i] for i in order]
    else:
        lens, q_lens = lens[::-1], q_lens[::-1]
    return PagedCase(seq_lens=lens, q_lens=q_lens, block_size=16, num_q_heads=2 * group,
                     num_kv_heads=2, head_dim=head_dim, dtype=dtype, seed=seed, shared_blocks=3)


@pytest.mark.skipif(DEVICE != "cpu", reason="the C++ kernel serves CPU tensors")
@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_kernel_matches_reference(kind, dtype, group, head_dim):
    case = cpu_case(kind, dtype, group, head_dim, seed=group * head_dim)
    assert case.block_tables[1, 0] == case.block_tables[0, 0]   # a block shared by two tables
    if kind == "decode":
        args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale)
        out = ops.paged_decode_attention(*args, impl="cpu")
        assert_close(out, ops.paged_decode_attention(*args, impl="reference"), dtype)
        assert_close(case.paged("cpu"), out, dtype)   # the ragged entry point agrees on decode rows
    else:
        out = case.paged("cpu")
        assert_close(out, case.paged("reference"), dtype)
    if dtype == torch.float32:
        assert_close(out, case.contiguous(), dtype)


@pytest.mark.skipif(DEVICE != "cpu", reason="the C++ kernel serves CPU tensors")
@pytest.mark.parametrize("block_size,head_dim", [(8, 16), (32, 32), (128, 256), (256, 64)])
def test_cpu_kernel_other_block_and_head_sizes(block_size, head_dim):
    # Blocks smaller and larger than one 16-float vector of scores; every head size limits.py allows
    # besides 64 and 128; fp16 too (the dtype a CUDA pool has, should one be read on CPU).
    for dtype in (torch.float32, torch.float16):
        case = PagedCase(seq_lens=[block_size + 37, 5, 3 * block_size], q_lens=[20, 1, 1],
                         block_size=block_size, num_q_heads=6, num_kv_heads=2, head_dim=head_dim,
                         dtype=dtype, seed=block_size, spare_blocks=1)
        assert_close(case.paged("cpu"), case.paged("reference"), dtype)


@pytest.mark.skipif(DEVICE != "cpu", reason="the C++ kernel serves CPU tensors")
def test_cpu_kernel_takes_strided_queries_and_an_empty_batch():
    case = PagedCase(seq_lens=[40, 9], q_lens=[3, 1], block_size=16, num_q_heads=4,
                     num_kv_heads=2, head_dim=32, dtype=torch.float32, seed=2)
    # q as the model makes it: a slice of a fused QKV projection (stride(0) > Hq * D)
    qkv = torch.randn(case.q.shape[0], 3, 4, 32)
    qkv[:, 0] = case.q
    strided = PagedCase.__new__(PagedCase)
    vars(strided).update(vars(case), q=qkv[:, 0])
    assert not strided.q.is_contiguous()
    assert_close(strided.paged("cpu"), case.paged("reference"), torch.float32)
    empty = ops.paged_decode_attention(case.q[:0], case.k_cache, case.v_cache,
                                           case.block_tables[:0], case.seq_lens_t[:0], case.scale,
                                           impl="cpu")
    assert empty.shape == (0, 4, 32)


@pytest.mark.skipif(DEVICE != "cpu", reason="the C++ kernel serves CPU tensors")
def test_cpu_kernel_refuses_a_table_that_leaves_the_pool():
    case = PagedCase(seq_lens=[40, 9], q_lens=[1, 1], block_size=16, num_q_heads=4,
                     num_kv_heads=2, head_dim=32, dtype=torch.float32, seed=6)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale)
    case.block_tables[0, 2] = case.k_cache.shape[0]   # the last block sequence 0 reads
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.paged_decode_attention(*args, impl="cpu")
    case.block_tables[0, 2] = -1
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.paged_decode_attention(*args, impl="cpu")
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        ops.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables[:, :2],
                                       case.seq_lens_t, case.scale, impl="cpu")


def test_cpu_kernel_falls_back_to_the_reference_without_a_compiler(monkeypatch, caplog):
    """Holds on a machine with a compiler and a GPU too: the compiler lookup finds none whatever it
    asks for, and the case is built on the CPU (on the GPU machine DEVICE is cuda, where None means
    Triton and the outputs differ from the reference's in the last bits)."""
    import shutil

    from pagedserve.kernels import cpu_ops
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)   # whatever the check looks up
    monkeypatch.setattr(cpu_ops, "_state", {})   # as in a fresh process
    monkeypatch.setitem(globals(), "DEVICE", "cpu")   # PagedCase and make_pool read it at call time
    with caplog.at_level("WARNING", logger="pagedserve.kernels"):
        assert ops.resolve_impl(torch.zeros(1), None) == "reference"
    assert "no C++ compiler" in caplog.text and "using the PyTorch reference" in caplog.text
    assert "no C++ compiler" in cpu_ops.unavailable_reason()
    case = PagedCase(seq_lens=[40, 9], q_lens=[3, 1], block_size=16, num_q_heads=4,
                     num_kv_heads=2, head_dim=32, dtype=torch.float32, seed=4)
    assert torch.equal(case.paged(None), case.paged("reference"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        case.paged("cpu")


def test_cpu_kernel_build_is_cached_across_processes():
    """A second process loads the library the first built: it does not compile it again."""
    import subprocess
    import sys
    from pagedserve.kernels import cpu_ops
    assert cpu_ops.available()
    library = cpu_ops.build_directory() / "pagedserve_cpu.so"
    before = library.stat().st_mtime_ns
    code = "from pagedserve.kernels import cpu_ops; assert cpu_ops.available(), cpu_ops.unavailable_reason()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert library.stat().st_mtime_ns == before


# ----------------------------------------------------------------------------------------------
# Triton vs reference vs contiguous (tiny shapes: interpreted on CPU)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_ragged_attention(triton_ops, block_size, dtype):
    # pure prefill; prefill over a prefix long enough for two KV tiles; a decode row inside the
    # ragged batch; GQA with 4 query heads over 2 kv heads.
    case = PagedCase(seq_lens=[19, 70, 9], q_lens=[19, 6, 1], block_size=block_size,
                     num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=dtype, seed=block_size)
    out = case.paged("triton")
    assert_close(out, case.paged("reference"), dtype)
    assert_close(out, case.contiguous(), dtype)


def test_triton_ragged_attention_long_prefix_big_heads(triton_ops):
    # several KV tiles (32 tokens each for head_dim 128) and several query blocks per sequence
    case = PagedCase(seq_lens=[150, 40], q_lens=[45, 40], block_size=16, num_q_heads=8,
                     num_kv_heads=2, head_dim=128, dtype=torch.float16, seed=3)
    out = case.paged("triton")
    assert_close(out, case.paged("reference"), torch.float16)
    assert_close(out, case.contiguous(), torch.float16)


def test_triton_ragged_attention_uneven_group(triton_ops):
    # 3 query heads per kv head: query rows of a program do not fill a power-of-two tile.
    case = PagedCase(seq_lens=[12, 30], q_lens=[12, 7], block_size=8, num_q_heads=6,
                     num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=5)
    assert_close(case.paged("triton"), case.contiguous(), torch.float32)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_attention(triton_ops, block_size, dtype):
    seq_lens = [1, 17, 70]
    case = PagedCase(seq_lens=seq_lens, q_lens=[1] * 3, block_size=block_size, num_q_heads=4,
                     num_kv_heads=2, head_dim=32, dtype=dtype, seed=block_size + 1)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale)
    out = ops.paged_decode_attention(*args, impl="triton")
    assert_close(out, ops.paged_decode_attention(*args, impl="reference"), dtype)
    assert_close(out, case.contiguous(), dtype)


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(2, 2, 128), (4, 1, 64)])
def test_triton_decode_head_shapes(triton_ops, num_q_heads, num_kv_heads, head_dim):
    # no GQA with the largest head size (smaller KV tile); every query head on one kv head
    case = PagedCase(seq_lens=[40, 5], q_lens=[1, 1], block_size=16, num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.float32, seed=7)
    assert_close(case.paged("triton"), case.contiguous(), torch.float32)


@pytest.mark.parametrize("block_size,head_dim", [(128, 16), (256, 128)])
def test_triton_kv_tiles_smaller_than_a_block(triton_ops, block_size, head_dim):
    # The KV tile is chosen by head_dim alone: several tiles per cache block, a tile that ends
    # inside a block, and (256, 128) which used to mean a 256-key tile that no GPU's shared
    # memory holds.
    assert triton_ops.kv_tile(head_dim) < block_size
    case = PagedCase(seq_lens=[block_size + 37, 5], q_lens=[3, 1], block_size=block_size,
                     num_q_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=torch.float32, seed=11,
                     spare_blocks=1)
    assert_close(case.paged("triton"), case.contiguous(), torch.float32)
    decode = PagedCase(seq_lens=[block_size + 37, 70], q_lens=[1, 1], block_size=block_size,
                       num_q_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=torch.float32, seed=12,
                       spare_blocks=1)
    assert_close(decode.paged("triton"), decode.contiguous(), torch.float32)


# FlashAttention-2 query tiles, split-KV decode, empty rows (issue 30, item 5). Small heads keep
# the interpreter fast; the tile rules are checked to pick the path each test means to cover.
# Every group and both dtypes, without the whole cross product (the interpreter is slow).
GROUP_DTYPES = [(1, torch.float32), (4, torch.bfloat16), (8, torch.float32)]


def assert_triton_close(actual, expected, dtype):
    """assert_close, but bf16 at tests/test_gpu_kernels.py's tolerance (2e-2): the kernels round
    the probabilities to bf16 for the P.V product (as FlashAttention-2 and vLLM do, to stay on the
    tensor cores), ~1e-3 absolute beyond the one final rounding the CPU kernel's 1e-5 allows."""
    if dtype != torch.bfloat16:
        return assert_close(actual, expected, dtype)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


def gqa_case(seq_lens, q_lens, group, dtype, seed, head_dim=16, block_size=16, **kw):
    return PagedCase(seq_lens=seq_lens, q_lens=q_lens, block_size=block_size,
                     num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, dtype=dtype,
                     seed=seed, **kw)


@pytest.mark.parametrize("group,dtype", GROUP_DTYPES)
@pytest.mark.parametrize("prefix", [0, 45])
def test_triton_long_prefill_big_query_tiles(triton_ops, group, dtype, prefix):
    # One 270-token prompt (over a cached prefix of 45 tokens, ending mid-block, or none): several
    # big query tiles, the last one partial, whole K/V tiles before the diagonal and a diagonal
    # that straddles K/V tiles.
    case = gqa_case([270 + prefix], [270], group, dtype, seed=group + prefix)
    rows, keys, _ = triton_ops.prefill_tile(16, group, 270, 1)
    assert rows == 128 and 270 // (rows // group) >= 2   # the big tile, several of them
    out = case.paged("triton")
    assert_triton_close(out, case.paged("reference"), dtype)
    if dtype == torch.float32:
        assert_triton_close(out, case.contiguous(), dtype)


@pytest.mark.parametrize("group,dtype", GROUP_DTYPES)
def test_triton_ragged_mixed_batch_both_tiles(triton_ops, group, dtype):
    # A prompt-heavy batch (big tiles; decode rows and a chunk inside it) and a decode-heavy one
    # (small tiles), each with a prefix-cache hit shared between tables.
    big = gqa_case([350, 9, 60], [330, 1, 60], group, dtype, seed=group, shared_blocks=2)
    assert triton_ops.prefill_tile(16, group, 391, 3)[0] == 128
    small = gqa_case([70, 33, 9, 50, 66], [1, 1, 1, 20, 1], group, dtype, seed=group + 10)
    assert triton_ops.prefill_tile(16, group, 24, 5)[0] == max(16, group)
    for case in (big, small):
        out = case.paged("triton")
        assert_triton_close(out, case.paged("reference"), dtype)
        if dtype == torch.float32:
            assert_triton_close(out, case.contiguous(), dtype)


def test_triton_big_tile_wide_heads_and_uneven_group(triton_ops):
    # head_dim 256 takes the 64-row tile with 32 keys; 3 query heads per kv head leave rows of
    # every tile idle (128 // 3 = 42 tokens, 126 rows).
    wide = PagedCase(seq_lens=[90], q_lens=[70], block_size=16, num_q_heads=4, num_kv_heads=2,
                     head_dim=256, dtype=torch.float32, seed=21)
    assert triton_ops.prefill_tile(256, 2, 70, 1)[:2] == (64, 32)
    assert_triton_close(wide.paged("triton"), wide.contiguous(), torch.float32)
    uneven = PagedCase(seq_lens=[130, 20], q_lens=[100, 20], block_size=8, num_q_heads=6,
                       num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=22)
    assert triton_ops.prefill_tile(16, 3, 120, 2)[0] == 128
    assert_triton_close(uneven.paged("triton"), uneven.contiguous(), torch.float32)


@pytest.mark.parametrize("group,dtype", GROUP_DTYPES)
def test_triton_split_decode_matches_no_split(triton_ops, group, dtype):
    # Contexts of 1 key, a partial tile, several tiles; 3 shares (uneven), and 16 shares, more
    # than most of these contexts have tiles (empty shares must weigh nothing).
    seq_lens = [1, 17, 200]
    case = gqa_case(seq_lens, [1] * len(seq_lens), group, dtype, seed=30 + group)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale)
    expected = ops.paged_decode_attention(*args, impl="reference")
    whole = triton_ops.paged_decode_attention(*args, num_splits=1)
    assert_triton_close(whole, expected, dtype)
    for num_splits in (3, triton_ops.MAX_SPLITS):
        assert_triton_close(triton_ops.paged_decode_attention(*args, num_splits=num_splits), expected, dtype)
    if dtype == torch.float32:
        assert_triton_close(whole, case.contiguous(), dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_decode_rows_with_no_keys_write_zeros(triton_ops, num_splits):
    # A CUDA-graph bucket pads its batch with rows of seq_len 0: they must come out as zeros
    # (not 0/0 = NaN), and leave the other rows alone.
    case = gqa_case([40, 9, 75], [1, 1, 1], 4, torch.float32, seed=40)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables)
    full = triton_ops.paged_decode_attention(*args, case.seq_lens_t, case.scale,
                                             num_splits=num_splits)
    padded_lens = case.seq_lens_t.clone()
    padded_lens[1] = 0
    out = triton_ops.paged_decode_attention(*args, padded_lens, case.scale, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[[0, 2]], full[[0, 2]])


def test_triton_decode_takes_strided_queries_and_reuses_its_plan(triton_ops):
    # q as the model makes it, a slice of a fused QKV projection; the launch plan cached for one
    # shape and layout must not serve another (a contiguous q of the same shape, a smaller batch).
    case = gqa_case([40, 9, 75], [1, 1, 1], 4, torch.float32, seed=50)
    qkv = torch.randn(3, 3, *case.q.shape[1:], device=DEVICE)
    qkv[:, 0] = case.q
    tables, lens = case.block_tables, case.seq_lens_t
    expected = ops.paged_decode_attention(case.q, case.k_cache, case.v_cache, tables, lens,
                                          case.scale, impl="reference")
    for num_splits in (1, 2):
        for q in (qkv[:, 0], case.q, qkv[:, 0]):
            out = triton_ops.paged_decode_attention(q, case.k_cache, case.v_cache, tables, lens,
                                                    case.scale, num_splits=num_splits)
            assert out.is_contiguous()
            assert_close(out, expected, torch.float32)
        two = triton_ops.paged_decode_attention(qkv[:2, 0], case.k_cache, case.v_cache,
                                                tables[:2], lens[:2], case.scale,
                                                num_splits=num_splits)
        assert_close(two, expected[:2], torch.float32)


def test_decode_split_rule_reads_only_static_shapes(triton_ops):
    cpu = torch.device("cpu")   # the rule's default SM count (an H100/H200's) stands in for a GPU
    split = triton_ops.decode_splits
    # a program for every SM: no split, however long the contexts may be
    assert split(32, 8, 1024, 16, cpu) == 1
    # short capacity (table width x block size < 2 shares of MIN_SPLIT_KEYS): no split
    assert split(1, 8, 16, 16, cpu) == 1
    # one long sequence: as many shares as fill the SMs twice, at most MAX_SPLITS
    assert split(1, 8, 1024, 16, cpu) == triton_ops.MAX_SPLITS
    assert split(8, 8, 64, 16, cpu) == 4    # 1024 keys of capacity: four shares of 256
    assert split(8, 8, 256, 16, cpu) == 5   # 2 x 132 SMs / 64 programs
    for num_seqs in (1, 2, 8, 32, 256):
        for width in (1, 8, 64, 4096):
            n = split(num_seqs, 8, width, 16, cpu)
            assert 1 <= n <= triton_ops.MAX_SPLITS
            assert n == 1 or width * 16 >= n * triton_ops.MIN_SPLIT_KEYS
    # paged_decode_attention picks it from the table's width, whatever seq_lens hold
    assert triton_ops.describe_launch("decode", 1, 1, 32, 8, 64, 1024, 16, cpu) == "split16"
    assert triton_ops.describe_launch("prefill", 4096, 1, 32, 8, 64, 256, 16, cpu) == "tile128x64"


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(8, 2, 16), (2, 2, 256)])
def test_triton_warm_up_launches_every_attention_variant(triton_ops, monkeypatch, num_q_heads,
                                                         num_kv_heads, head_dim):
    launches = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(
                (self.name, kw.get("BLOCK_M"), grid[2] > 1 if len(grid) == 3 else None))

    for name in ("paged_attention_kernel", "paged_decode_kernel", "decode_reduce_kernel"):
        monkeypatch.setattr(triton_ops, name, Kernel(name))
    triton_ops.warm_up_attention(torch.float16, head_dim, num_q_heads, num_kv_heads, 16, DEVICE)
    group = num_q_heads // num_kv_heads
    small, big = triton_ops.prefill_tile(head_dim, group, 1, 1)[0], 128 if head_dim <= 128 else 64
    assert sorted(launches, key=str) == sorted([
        ("paged_attention_kernel", small, None), ("paged_attention_kernel", big, None),
        ("paged_decode_kernel", None, False), ("paged_decode_kernel", None, True),
        ("decode_reduce_kernel", None, None)], key=str)
    monkeypatch.undo()   # and the real kernels run it (interpreted), tiny as it is
    triton_ops.warm_up_attention(torch.float32, 16, 4, 2, 8, DEVICE)


def test_every_triton_launch_runs_under_its_tensors_device(triton_ops, monkeypatch):
    """Triton launches on the current device; the kvstore holds a pool per rank, so each launch
    must run inside on_device(the tensor it writes). A fake guard and fake kernels check it."""
    inside, launches = [], []

    @contextlib.contextmanager
    def guard(tensor):
        inside.append(tensor)
        try:
            yield
        finally:
            inside.pop()

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, inside[-1] if inside else None))

    monkeypatch.setattr(triton_ops, "on_device", guard)
    for name in ("write_kv_kernel", "paged_attention_kernel", "paged_decode_kernel",
                 "decode_reduce_kernel", "copy_blocks_kernel"):
        monkeypatch.setattr(triton_ops, name, Kernel(name))
    case = PagedCase(seq_lens=[5, 9], q_lens=[5, 1], block_size=8, num_q_heads=2, num_kv_heads=2,
                     head_dim=16, dtype=torch.float32)
    key = torch.zeros(2, 2, 16)
    triton_ops.write_kv_cache(key, key, case.k_cache, case.v_cache, torch.tensor([0, 1]))
    out = triton_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                     case.seq_lens_t, case.query_start_loc, case.scale, 5)
    triton_ops.paged_decode_attention(case.q[:2], case.k_cache, case.v_cache, case.block_tables,
                                      case.seq_lens_t, case.scale)
    triton_ops.paged_decode_attention(case.q[:2], case.k_cache, case.v_cache, case.block_tables,
                                      case.seq_lens_t, case.scale, num_splits=2)
    triton_ops.copy_blocks(case.pool, torch.tensor([0]), torch.tensor([1]))
    assert [name for name, _ in launches] == [
        "write_kv_kernel", "paged_attention_kernel", "paged_decode_kernel",
        "paged_decode_kernel", "decode_reduce_kernel", "copy_blocks_kernel"]
    # the decode outputs are made inside the calls
    written = [case.k_cache, out, None, None, None, case.pool]
    for (name, tensor), expected in zip(launches, written):
        assert tensor is not None, f"{name} launched outside any device guard"
        if expected is not None:
            assert tensor is expected, f"{name} launched under another tensor's device"


# ----------------------------------------------------------------------------------------------
# K/V cache write and block copy
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["reference", "triton", "cpu"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache(request, impl, block_size, dtype):
    if impl == "cpu" and (DEVICE != "cpu" or not cpu_ops_available()):
        pytest.skip("the C++ kernels take CPU tensors, and need a compiler")
    if impl == "triton":
        request.getfixturevalue("triton_ops")
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim = 6, 2, 16
    pool, k_cache, v_cache = make_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    before = pool.clone()
    # Slots scattered over blocks out of order, with padding (-1) between them; the key is a
    # strided slice, as when it comes out of a fused QKV projection.
    slots = [3 * block_size + 1, -1, 0, 5 * block_size + block_size - 1, -1, 2 * block_size + 4]
    qkv = torch.randn(len(slots), 3, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]  # [T, Hkv, D], stride(0) = 3 * Hkv * D
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    ops.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, impl=impl)

    expected = before.clone()
    kv = expected.view(dtype).view(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim)
    for t, slot in enumerate(slots):
        if slot >= 0:
            kv[slot // block_size, LAYER, 0, slot % block_size] = key[t]
            kv[slot // block_size, LAYER, 1, slot % block_size] = value[t]
    assert torch.equal(pool, expected)  # byte-exact, and nothing else in the pool was touched
    assert not torch.equal(pool, before)


@pytest.mark.parametrize("impl", ["reference", "triton", "cpu"])
def test_write_kv_cache_all_padding(request, impl):
    if impl == "cpu" and (DEVICE != "cpu" or not cpu_ops_available()):
        pytest.skip("the C++ kernels take CPU tensors, and need a compiler")
    if impl == "triton":
        request.getfixturevalue("triton_ops")
    gen = torch.Generator().manual_seed(0)
    pool, k_cache, v_cache = make_pool(2, 8, 1, 16, torch.float32, gen)
    before = pool.clone()
    key = torch.randn(3, 1, 16, device=DEVICE)
    ops.write_kv_cache(key, key, k_cache, v_cache,
                           torch.full((3,), -1, dtype=torch.int64, device=DEVICE), impl=impl)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("pool_dtype,row_shape", [(torch.uint8, (1000,)),  # the kvstore's pool
                                                  (torch.uint8, (1001,)),  # odd byte count
                                                  (torch.float16, (2, 8, 16))])
def test_copy_blocks(request, impl, pool_dtype, row_shape):
    if impl == "triton":
        request.getfixturevalue("triton_ops")
    gen = torch.Generator().manual_seed(1)
    pool = torch.randint(0, 255, (7, *row_shape), generator=gen).to(pool_dtype).to(DEVICE)
    before = pool.clone()
    src = torch.tensor([0, 4, 4], dtype=torch.int64, device=DEVICE)
    dst = torch.tensor([6, 1, 2], dtype=torch.int64, device=DEVICE)
    ops.copy_blocks(pool, src, dst, impl=impl)
    expected = before.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        expected[d] = before[s]
    assert torch.equal(pool, expected)


def test_reference_copy_blocks_reads_before_writing():
    pool = torch.arange(4, dtype=torch.float32)[:, None].repeat(1, 3)  # row i holds i
    reference.copy_blocks(pool, torch.tensor([0, 1]), torch.tensor([1, 2]))
    assert pool[:, 0].tolist() == [0, 0, 1, 3]


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------

def test_dispatch_picks_the_cpu_kernel_for_cpu_attention_and_rejects_unknown_impl():
    cpu = torch.zeros(1)
    assert ops.resolve_impl(cpu, None) == "cpu"   # the compiler is on every CI machine
    assert ops.resolve_impl(cpu, None, attention=False) == "reference"
    assert ops.resolve_impl(cpu, "triton") == "triton"
    with pytest.raises(ValueError):
        ops.resolve_impl(cpu, "cuda")
