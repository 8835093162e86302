"""What the attention kernels can serve, checked once when a model is loaded (on every device, so a
model that runs on CPU cannot fail on its first CUDA step) and again by the Triton wrappers."""
from __future__ import annotations

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def check_attention_shape(head_dim: int, num_q_heads: int, num_kv_heads: int) -> None:
    """ValueError naming the limit when the kernels cannot serve these heads.

    head_dim is a tl.arange length (a power of two) and the K/V tiles hold head_dim columns: below 16
    tl.dot has no tile, above 256 a tile no longer fits the registers and shared memory of one
    program. GQA maps each query head to kv head h // (Hq / Hkv), so the group must be whole."""
    if head_dim & (head_dim - 1) or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a power of two in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], "
                         f"got {head_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
