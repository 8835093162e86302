"""How the Triton kernels are launched: tile sizes, decode splits, the checks on their arguments and
the cached decode plan. Host-side only (no @triton.jit here), so it imports and answers without a
GPU or the interpreter (describe_launch serves the benchmark's table).

The rules read only shapes (host ints the caller already has), never a tensor's values: one fixed
launch configuration per shape, no autotune (it needs a driver), and a launch a CUDA graph may
capture. kernels/triton_ops.py launches with what this module picks.
"""

from __future__ import annotations

import functools

import torch
import triton

from pagedserve.kernels.limits import check_attention_shape


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    # tl.dot on fp32 defaults to tf32 on GPUs (10-bit mantissa); fp32 callers expect fp32 results.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("caches must be [num_blocks, B, Hkv, D] with a unit stride on D")
    if k_cache.stride()[1:] != v_cache.stride()[1:] or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must share shape and inner strides")


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    check_cache(k_cache, v_cache)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    check_attention_shape(k_cache.shape[3], num_q_heads, num_kv_heads)
    if q.shape[2] != k_cache.shape[3] or q.stride(2) != 1:
        raise ValueError("q must be [T, Hq, D] with the caches' D and a unit stride on D")
    return num_q_heads // num_kv_heads


# --------------------------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------------------------

def kv_tile(head_dim: int) -> int:
    """Keys per loop iteration of the decode kernel and of the small prefill tile. Independent of
    the cache's block size (each key finds its own block through the table), so a big block never
    means a big tile: a tile of 256 keys at head_dim 128 needs more shared memory than a GPU has.
    >= 16 for tl.dot; smaller for big heads, whose [D, N] + [N, D] tiles would otherwise spill
    registers."""
    return 64 if head_dim <= 64 else 32


# Rows (query tokens x GQA group) of the small prefill tile: 16 is the smallest tl.dot tile.
SMALL_TILE_ROWS = 16


def prefill_tile(head_dim: int, group: int, num_tokens: int, num_seqs: int) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps) of the ragged prefill kernel.

    The big tile is FlashAttention-2's: 128 query rows against 64-key tiles, so each K/V tile read
    through the table serves 128 rows (32 tokens of a GQA group of 4) and a 4096-token prompt makes
    128 programs per kv head instead of 1024 that each re-read the whole prefix. Its fp32
    accumulator is 128 x D: at D 128 that takes 8 warps (64 registers a thread for acc, 32 for the
    scores); at D 256 the rows halve and the keys too, or it would spill. The small tile (16 rows,
    the decode kernel's key tile) is for batches whose sequences average less than one big tile of
    rows: decode-heavy mixed batches and short chunks over a cached prefix, where a 128-row tile
    would compute mostly padding. Two variants only (each a compile); the rule reads host ints the
    caller already has (q.shape[0], seq_lens.shape[0]), never a tensor's values."""
    big_rows = 128 if head_dim <= 128 else 64
    small_rows = max(SMALL_TILE_ROWS, next_pow2(group))
    if num_tokens * group >= num_seqs * big_rows and big_rows > small_rows:
        return big_rows, (64 if head_dim <= 128 else 32), (4 if head_dim <= 64 else 8)
    return small_rows, kv_tile(head_dim), 4


# --------------------------------------------------------------------------------------------
# Decode splits
# --------------------------------------------------------------------------------------------

# Flash-decoding (split-KV) rule. One decode program per (sequence, kv head) leaves most of a big
# GPU idle when there are few of them (8 sequences x 8 kv heads = 64 programs on 132 SMs), and each
# walks its whole context alone. Splitting the context into num_splits shares, reduced by a second
# small kernel, multiplies the programs. The rule sees only shapes that are static for a batch
# size (num_seqs, kv heads, the table's width = blocks per sequence at most, the device), so a
# CUDA graph captured for that batch size replays with the same launch whatever the lengths.
MAX_SPLITS = 16          # the reduce kernel's tile over splits (one compile); 16 x 8 heads x 1 seq = 128 programs
MIN_SPLIT_KEYS = 256     # a share reads at least 256 keys (128 KiB of K/V at head_dim 128, fp16), so its
                         # partial (GROUP x D floats + m, l) is < 2 % of its traffic; contexts of at
                         # most 256 keys never split, and so never pay the reduce's extra launch
WAVES = 2                # below one program per SM, aim for two: one 4-warp program cannot keep an
                         # SM's memory pipe busy on its own, and decode is bandwidth-bound
_DEFAULT_SMS = 132       # H100 SXM / H200; used where no CUDA device answers (the interpreter)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(num_seqs: int, num_kv_heads: int, table_width: int, block_size: int,
                  device: torch.device) -> int:
    """How many shares the decode kernel splits each context into (1: no split).

    table_width * block_size bounds every context of the batch; under a CUDA graph it is the
    bucket's capacity rather than today's longest sequence, so a short batch may split where its
    real lengths would not: the shares are cut on the device from seq_lens, and a share past a
    sequence's end exits at once (it writes an empty partial)."""
    programs = num_seqs * num_kv_heads
    sms = _sm_count(device)
    if programs >= sms:  # every SM already has a program: shares would only add partials + reduce
        return 1
    want = triton.cdiv(WAVES * sms, max(1, programs))
    fit = (table_width * block_size) // MIN_SPLIT_KEYS
    return max(1, min(MAX_SPLITS, want, fit))


# Decode launches, by the shapes and strides of their arguments: a decode step at small batch is
# bound by the host (the GPU work is a few us), so the checks and the launch configuration are
# worked out once per shape rather than at every call, in every layer.
_DECODE_PLANS: dict[tuple, tuple] = {}


def decode_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table_width: int,
                num_splits: int | None) -> tuple:
    key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(),
           v_cache.shape, v_cache.stride(), table_width, num_splits)
    plan = _DECODE_PLANS.get(key)
    if plan is not None:
        return plan
    group = check_attention_args(q, k_cache, v_cache)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_splits is None:
        num_splits = decode_splits(num_seqs, num_kv_heads, table_width, block_size, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    out_stride = (num_q_heads * head_dim, head_dim)  # out is made contiguous
    strides = (q.stride(0), q.stride(1), out_stride[0], out_stride[1],
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), table_width)
    meta = dict(GROUP=group, BLOCK_G=max(16, next_pow2(group)), BLOCK_N=kv_tile(head_dim),
                BLOCK_SIZE=block_size, HEAD_DIM=head_dim, DOT_PRECISION=dot_precision(q.dtype),
                num_warps=4, num_stages=2)
    reduce_meta = dict(MAX_SPLITS=MAX_SPLITS, HEAD_DIM=head_dim,
                       num_warps=4 if head_dim >= 128 else 2)
    plan = ((num_seqs, num_kv_heads, num_splits), (num_seqs, num_q_heads), num_splits, strides,
            out_stride, meta, reduce_meta)
    if len(_DECODE_PLANS) >= 1024:  # batch sizes x layouts seen: bounded all the same
        _DECODE_PLANS.clear()
    _DECODE_PLANS[key] = plan
    return plan


def describe_launch(kind: str, num_tokens: int, num_seqs: int, num_q_heads: int,
                    num_kv_heads: int, head_dim: int, table_width: int, block_size: int,
                    device: torch.device) -> str:
    """The path a call of these shapes takes, for the benchmark's table: "decode" (one program
    per sequence and kv head), "split<n>" (flash-decoding in n shares + reduce), "tile<M>x<N>"
    (ragged prefill, M query rows x N keys per tile)."""
    group = num_q_heads // num_kv_heads
    if kind == "decode":
        n = decode_splits(num_seqs, num_kv_heads, table_width, block_size, device)
        return "decode" if n == 1 else f"split{n}"
    rows, keys, _ = prefill_tile(head_dim, group, num_tokens, num_seqs)
    return f"tile{rows}x{keys}"
