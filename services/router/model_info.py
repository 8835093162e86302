"""What the router needs of the model folder: its tokenizer, context length, EOS ids, vocabulary size.

Read once at start-up; the weights are never touched (services/model_dir.py checks the folder only).
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

    # The longest token's text in UTF-8 bytes, as the vocabulary writes it (a byte-level BPE's
    # stand-ins for bytes take 1-2, a byte fallback's "<0xE2>" 6: never fewer than the bytes it covers).
    max_token_bytes: int = 256
    normalizes: bool = True        # the tokenizer has a normalizer (it may shrink a text before splitting it)

    @property
    def bos_token(self) -> str | None:
        return getattr(self.tokenizer, "bos_token", None)

    @property
    def max_prompt_bytes(self) -> int:
        """Past this many UTF-8 bytes a text cannot fit in the context, whatever it tokenizes to
        (4x slack where a normalizer may shrink the text); larger texts are refused before
        tokenizing. Counted in bytes, not characters: 130,000 emoji are 520,000 bytes and at least
        one token per 4 of them, refused at once instead of after 0.5 s of tokenizing (issue 28)."""
        return (4 if self.normalizes else 1) * self.max_token_bytes * self.max_model_len


def load_model_info(model_dir: str, max_model_len: int | None = None) -> ModelInfo:
    """Raises services.model_dir.ModelLoadError for a folder that cannot be served."""
    from transformers import AutoTokenizer

    from pagedserve.services.model_dir import ModelLoadError, context_length, read_model_dir

    spec = read_model_dir(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # missing or invalid tokenizer files raise several types
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {e}") from None
    limit = context_length(max_model_len, spec)
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizes = backend is None or backend.normalizer is not None
    return ModelInfo(str(model_dir), tokenizer, limit, tuple(spec.eos_token_ids), spec.vocab_size, longest,
                     normalizes)
