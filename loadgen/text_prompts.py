"""Text prompts of an exact token length, for servers and endpoints that take text (chat).

The pool is the tokenizer's whole-word tokens: pieces such as " paged" that encode to themselves,
alone and twice in a row. A string of such pieces splits at every piece under a byte-level BPE's
pre-tokenizer, so it tokenizes back to the very ids it was built from, and a block of pieces stays a
block: the prefix structure of a trace survives as text. `check` counts prompts that do not (an
unusual tokenizer), and the report says how many.
"""
from __future__ import annotations

import re

WORD = re.compile(r"^ [A-Za-z]{2,}$")


class TextCodec:
    """`chat`: the prompts go out as one user message, and the chat template's tokens count too."""

    def __init__(self, tokenizer_dir: str, chat: bool = False):
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tok = self.tokenizer
        special = set(tok.all_special_ids)
        ids = [i for i in range(len(tok)) if i not in special]
        pieces = tok.batch_decode([[i] for i in ids])
        candidates = [(i, p) for i, p in zip(ids, pieces) if WORD.match(p)]
        texts = [p for _, p in candidates] + [p + p for _, p in candidates]
        encoded = tok(texts, add_special_tokens=False)["input_ids"]
        k = len(candidates)
        self.piece = {i: p for n, (i, p) in enumerate(candidates)
                      if encoded[n] == [i] and encoded[k + n] == [i, i]}
        if len(self.piece) < 16:
            raise ValueError(f"the tokenizer in {tokenizer_dir} has only {len(self.piece)} whole-word tokens; "
                             "text prompts of exact lengths need more (send token ids: drop --tokenizer)")
        # Tokens the server adds to a text prompt (BOS; for chat, the template around the message):
        # the text is shorter by that many, so that the server sees the planned length.
        self.chat = chat and bool(getattr(tok, "chat_template", None))
        probe = self.text(self.pool[:4])
        bare = tok(probe, add_special_tokens=False)["input_ids"]
        full = self._encode(probe)
        self.added = len(full) - len(bare)
        # Tokens before the text (BOS, the template's head): the first trace block is that much
        # shorter so that the blocks of the trace start on the server's KV block boundaries.
        self.offset = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)

    def _encode(self, text: str) -> list[int]:
        if self.chat:
            out = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                     add_generation_prompt=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        return self.tokenizer(text)["input_ids"]

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The token ids a chat server makes of these messages (its template, the generation prompt)."""
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    @property
    def pool(self) -> list[int]:
        return sorted(self.piece)

    def text(self, ids: list[int]) -> str:
        return "".join(self.piece[i] for i in ids)

    def counts(self, texts: list[str]) -> list[int]:
        """Tokens the server will see for each text (with what it adds)."""
        if self.chat:
            return [len(self._encode(t)) for t in texts]
        return [len(ids) for ids in self.tokenizer(texts)["input_ids"]] if texts else []
