"""Incremental detokenization: token ids arrive a few at a time, text leaves as soon as it is final.

Uses the prefix/read-offset method (as vLLM does): decode a short window of recent ids twice, with
and without the new ones, and emit the difference, unless it ends in U+FFFD, which means a
multi-byte character is split across tokens and must wait for its next token. A few prompt ids
seed the window so that tokenizers which drop a leading space on the first token (SentencePiece)
render the first output token as it reads in context.
"""
from __future__ import annotations

from functools import lru_cache

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5   # prompt ids kept as left context (vLLM uses 5 too)


def fast_decoder(tokenizer):
    """(ids, skip_special_tokens) -> str, through the Rust tokenizer when there is one (~10x faster)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    def __init__(self, decode, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.decode = decode
        self.skip = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        if context and decode(context, skip_special_tokens).endswith(REPLACEMENT):
            context = []     # a prompt cut inside a character would garble the first output token
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly "")."""
        self.ids.append(token_id)
        prefix_text = self.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        new_text = self.decode(self.ids[self.prefix_offset:], self.skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            delta = new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """The sequence ended: release held ids, an incomplete character included (shown as U+FFFD,
        exactly as a batch decode of all the ids shows it)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        new_text = self.decode(self.ids[self.prefix_offset:], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]


class TokenTexts:
    """The text of single tokens, for logprobs ("tokens" and top-logprob keys); cached per id."""

    def __init__(self, decode):
        self._decode = decode
        self.text = lru_cache(maxsize=65536)(self._one)

    def _one(self, token_id: int) -> str:
        return self._decode([token_id], False)
