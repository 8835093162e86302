"""The Triton kernels compiled for a real GPU, at real sizes: head_dim 64 and 128, GQA (32 query
heads over 8 KV heads), blocks of 16 and 32, fp16 and bf16, contexts to 8k. Only where CUDA is
present (`make gpu-check` runs them); the interpreter covers the same code at tiny sizes on CPU."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")

from test_kernels import PagedCase  # noqa: E402  (the same builder of shuffled paged caches)

from pagedserve.kernels import ops  # noqa: E402

TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def close(actual, expected, dtype):
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_ragged_prefill_and_decode_at_real_sizes(dtype, block_size, head_dim):
    # prefill over an 8k prefix, a whole 3k prompt, a short one, and a decode row, in one batch
    case = PagedCase(seq_lens=[8192, 3000, 17, 1000], q_lens=[512, 3000, 17, 1], block_size=block_size,
                     num_q_heads=32, num_kv_heads=8, head_dim=head_dim, dtype=dtype, seed=head_dim + block_size)
    close(case.paged("triton"), case.contiguous(), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_at_real_sizes(dtype, block_size, head_dim):
    seq_lens = [8192, 1, 777, 4096, 33, 2048, 5000, 16]
    case = PagedCase(seq_lens=seq_lens, q_lens=[1] * len(seq_lens), block_size=block_size, num_q_heads=32,
                     num_kv_heads=8, head_dim=head_dim, dtype=dtype, seed=head_dim * block_size)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t, case.scale)
    close(ops.paged_decode_attention(*args), case.contiguous(), dtype)


def test_block_copy_on_a_second_device_stream_and_a_pool_of_real_size():
    # The kvstore's copy-on-write: a 2 GiB byte pool (rows of 512 KiB), on a non-default stream.
    pool = torch.randint(0, 255, (4096, 512 * 1024), dtype=torch.uint8, device="cuda")
    src = torch.tensor([5, 4000, 17], device="cuda")
    dst = torch.tensor([6, 1, 4095], device="cuda")
    expected = pool[src].clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.copy_blocks(pool, src, dst)
    stream.synchronize()
    assert torch.equal(pool[dst], expected)
