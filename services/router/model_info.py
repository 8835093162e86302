"""What the router needs of the model folder: its tokenizer, context length, EOS ids, vocabulary size.

Read once at start-up; the weights are never touched (inspect_model_dir checks the folder only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ModelInfo:
    path: str
    tokenizer: Any
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    max_token_chars: int = 64      # the longest token's text: a bound on characters per token

    @property
    def bos_token(self) -> str | None:
        return getattr(self.tokenizer, "bos_token", None)

    @property
    def max_prompt_chars(self) -> int:
        """Past this many characters a text cannot fit in the context, whatever it tokenizes to
        (4x slack for normalizers that shrink text); longer texts are refused before tokenizing."""
        return 4 * self.max_token_chars * self.max_model_len


def load_model_info(model_dir: str, max_model_len: int | None = None) -> ModelInfo:
    """Raises services.worker.model_loader.ModelLoadError for a folder that cannot be served."""
    from transformers import AutoTokenizer

    from pagedserve.services.worker.model_loader import ModelLoadError, context_length, inspect_model_dir

    _, spec = inspect_model_dir(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # missing or invalid tokenizer files raise several types
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {e}") from None
    limit = context_length(max_model_len, spec)
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return ModelInfo(str(model_dir), tokenizer, limit, tuple(spec.eos_token_ids), spec.vocab_size, longest)
