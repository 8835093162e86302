"""Incremental detokenization: token ids arrive a few at a time, text leaves as soon as it is final.

Uses the prefix/read-offset method (as vLLM does): decode a short window of recent ids twice, with
and without the new ones, and emit the difference, unless it ends in U+FFFD, which means a
multi-byte character is split across tokens and must wait for its next token. A few prompt ids
seed the window so that tokenizers which drop a leading space on the first token (SentencePiece)
render the first output token as it reads in context.
"""
from __future__ import annotations

import re

from pagedserve.services.router.lru_bytes import BytesLRU

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
        """The sequence ended: release held ids. A character whose bytes were cut off by the end
        is dropped rather than shown as U+FFFD, as vLLM does (push held it for that reason only)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        new_text = self.decode(self.ids[self.prefix_offset:], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return without_cut_character(new_text[len(prefix_text):])


def without_cut_character(text: str) -> str:
    """A text whose last character lost its final bytes to the end of the sequence (decoded as
    U+FFFD) ends before that character instead, as vLLM's does; the offline engine's texts too."""
    return text.rstrip(REPLACEMENT)


class TokenTexts:
    """The text of single tokens, for logprobs ("tokens", top-logprob keys, decoded_token), and
    their bytes (chat logprobs' "bytes"); cached per id. A token that holds only part of a
    character has no text of its own: "" as vLLM shows it, not U+FFFD; its bytes are its own."""

    def __init__(self, decode, tokenizer=None, max_bytes: int = 16 << 20):
        self._decode = decode
        self._tokenizer = tokenizer
        # Bounded in bytes (--token-text-cache-mb, split between the two), exported as metrics.
        self.text = BytesLRU(max_bytes // 2, self._one)
        self.bytes = BytesLRU(max_bytes // 2, self._bytes)

    def _one(self, token_id: int) -> str:
        text = self._decode([token_id], False)
        if REPLACEMENT in text and "\ufffd".encode() not in bytes(self._own_bytes(token_id, text)):
            return text.replace(REPLACEMENT, "")
        return text

    def _bytes(self, token_id: int) -> list[int]:
        return self._own_bytes(token_id, self._decode([token_id], False))

    def _own_bytes(self, token_id: int, text: str) -> list[int]:
        """For a token holding part of a character its text is U+FFFD, whose bytes say nothing;
        the vocabulary entry has them (byte-level BPE spells each byte as one character;
        SentencePiece's byte fallback as <0xNN>)."""
        if REPLACEMENT in text and self._tokenizer is not None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                m = _BYTE_FALLBACK.fullmatch(piece)
                if m:
                    return [int(m.group(1), 16)]
                if all(c in _BYTE_LEVEL for c in piece):
                    return [_BYTE_LEVEL[c] for c in piece]
        return list(text.encode("utf-8"))


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table (byte-level BPE), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
