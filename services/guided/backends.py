"""The grammar engines behind one interface: compile a constraint, make matchers, fill bitmasks.

A Backend is built once per process from the model's tokenizer and vocabulary width (the logits'
width, which may exceed the tokenizer's). `compile` turns a wire-form constraint
(services.guided.spec) into the engine's compiled form or raises GrammarError naming the problem;
`matcher` makes one sequence's state from it; `fill` writes the allowed-token bitmasks of many
matchers into rows of one int32 [B, ceil(V/32)] tensor in one call (bit t of a row: token t is
allowed). EOS is one of the engine's stop tokens: a mask allows it only where the grammar accepts.

Whitespace is compact (no indentation, "," and ":" with no spaces): a free-whitespace grammar lets
a weak model spend max_tokens on blanks between JSON tokens, and OpenAI's strict mode emits none.
"""
from __future__ import annotations

import json
import re
from typing import Any

import torch

from pagedserve.services.guided.limits import GrammarError  # noqa: F401  (re-exported: raised here)
from pagedserve.services.guided.productive import language_is_empty
from pagedserve.services.guided.schema import no_instance, xgrammar_unenforced

COMPACT = (",", ":")
ANY_OBJECT = '{"type": "object"}'


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | None = None):
        import xgrammar as xgr
        self._xgr = xgr
        stops = list(eos_token_ids) if eos_token_ids else None
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        # One thread: the caller decides where compiling runs (a worker thread of its own), and
        # xgrammar's internal cache is off because ours (cache.py) is the one that is bounded.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)
        self.vocab_size = vocab_size
        self.json_tokens = _without_control_bytes(self.info.decoded_vocab, vocab_size, set(stops or ()))
        self.utf8 = Utf8Guard(self.info.decoded_vocab, vocab_size, set(stops or ()))

    def compile(self, c: dict) -> Any:
        """-> (xgrammar's CompiledGrammar, whether it is JSON)."""
        kind, spec = c["kind"], c["spec"]
        if kind == "json" and isinstance(spec, str):
            _check_schema(json.loads(spec))
        try:
            grammar = self._parse(kind, spec)
            empty = self._empty(grammar)
            # Parsed, then compiled: the same compiled form as compile_json_schema / compile_regex
            # (measured: byte for byte), with the emptiness test on the parsed one before it.
            compiled = None if empty else (self.compiler.compile_grammar(grammar), kind in ("json", "json_object"))
        except Exception as e:   # xgrammar raises RuntimeError / ValueError / its own types
            raise GrammarError(f"the {kind} constraint does not compile: {_message(e)}") from None
        if empty or self._first_mask_empty(compiled[0]):
            raise GrammarError(f"the {kind} constraint matches no text at all (its language is empty)")
        return compiled

    def _parse(self, kind: str, spec: str):
        """The constraint as xgrammar's grammar, parsed and not yet compiled."""
        Grammar = self._xgr.Grammar
        if kind in ("json", "json_object"):
            return Grammar.from_json_schema(spec or ANY_OBJECT, any_whitespace=False, separators=COMPACT,
                                            strict_mode=True)
        if kind == "regex":
            return Grammar.from_regex(spec)
        return Grammar.from_ebnf(_choice_ebnf(spec) if kind == "choice" else spec)

    @staticmethod
    def _empty(grammar) -> bool:
        r"""`root ::= x`, `x ::= x "a"` compiled, and every token was refused until max_tokens
        (issue 28, finding 8); `a[^\s\S]` let "a" through, then nothing. The productive-rules test
        (productive.py) on the parsed form finds a grammar that dead-ends anywhere, for every kind
        (the compiled form is no use: 25 MB serialized for 300 optional properties). A format it
        cannot read answers False here, and the first mask decides (_first_mask_empty)."""
        return bool(language_is_empty(grammar.serialize_json()))

    def _first_mask_empty(self, grammar) -> bool:
        """A first mask with no token allowed and nothing to end on (a dead end further in is then
        the worker's to end, guides.py)."""
        m = self._xgr.GrammarMatcher(grammar)
        bitmask = torch.zeros(1, bitmask_width(self.vocab_size), dtype=torch.int32)
        m.fill_next_token_bitmask(bitmask)
        return not bool(bitmask.any())

    def size_of(self, compiled: Any) -> int:
        """Bytes the compiled form holds (xgrammar's own count: its token masks dominate)."""
        return compiled[0].memory_size_bytes

    def matcher(self, compiled: Any):
        grammar, is_json = compiled
        return _XMatcher(self._xgr.GrammarMatcher(grammar), is_json)

    def accept(self, m, token_id: int) -> bool:
        if not m.matcher.accept_token(token_id):
            return False
        m.utf8 = self.utf8.advance_token(m.utf8, token_id)
        return True

    def fill(self, matchers: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        self.batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask, rows)
        self.utf8.restrict(bitmask, rows, [m.utf8 for m in matchers])
        # xgrammar 0.2.9 lets a length-bounded JSON string hold raw control characters (its class
        # is [^"\\\r\n]), which no JSON parser takes; compact JSON has no raw byte below 0x20 at all.
        json_rows = [r for m, r in zip(matchers, rows) if m.is_json]
        if json_rows:
            idx = torch.tensor(json_rows, dtype=torch.long)
            bitmask[idx] &= self.json_tokens

    def is_finished(self, m) -> bool:
        return m.matcher.is_terminated()


def _check_schema(schema) -> None:
    """A schema xgrammar would compile into a grammar weaker than itself (schema.py) is refused,
    or a "stop" answer would not validate against it."""
    if (why := no_instance(schema)):
        raise GrammarError(f"the json constraint holds a schema that no value matches: {why}")
    if (why := xgrammar_unenforced(schema)):
        raise GrammarError(f"the json constraint uses what the xgrammar backend does not enforce: {why}")


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | None = None):
        import llguidance
        import llguidance.hf
        self._llg = llguidance
        eos = list(eos_token_ids) if eos_token_ids else None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=1)
        self.vocab_size = vocab_size

    def compile(self, c: dict) -> Any:
        LLMatcher = self._llg.LLMatcher
        kind, spec = c["kind"], c["spec"]
        try:
            if kind in ("json", "json_object"):
                grammar = LLMatcher.grammar_from_json_schema(spec or ANY_OBJECT,
                                                             defaults={"whitespace_flexible": False})
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(spec)
            elif kind == "choice":
                grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in json.loads(spec)))
            else:
                from llguidance._grammar_from import grammar_from
                grammar = grammar_from("grammar", spec)
        except Exception as e:
            raise GrammarError(f"the {kind} constraint does not compile: {_message(e)}") from None
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(f"the {kind} constraint does not compile: {_message(error)}")
        if self._empty(grammar):
            raise GrammarError(f"the {kind} constraint matches no text at all (its language is empty)")
        return grammar   # llguidance builds its parser lazily: the checked grammar is the compiled form

    def _empty(self, grammar) -> bool:
        """llguidance stops a matcher whose first mask is empty: stopped, and not accepting (an
        empty language; `root ::= ""` is accepting), as xgrammar's check (XGrammarBackend._empty)."""
        m = self.matcher(grammar)
        self.fill([m], torch.zeros(1, bitmask_width(self.vocab_size), dtype=torch.int32), [0])
        return m.is_stopped() and not m.is_accepting()

    def size_of(self, compiled: Any) -> int:
        """The checked grammar is what is kept (its parser is built per matcher, lazily)."""
        return len(compiled.encode())

    def matcher(self, compiled: Any):
        return self._llg.LLMatcher(self.tokenizer, compiled, log_level=0)

    def accept(self, m, token_id: int) -> bool:
        return m.consume_token(token_id) and not m.is_error()

    def fill(self, matchers: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        self.executor.unsafe_compute_mask_ptr(list(zip(matchers, rows)), bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    def is_finished(self, m) -> bool:
        return m.is_stopped()


class _XMatcher:
    __slots__ = ("matcher", "is_json", "utf8")

    def __init__(self, matcher, is_json: bool):
        self.matcher, self.is_json = matcher, is_json
        self.utf8 = 0            # Utf8Guard state of the bytes accepted so far


# UTF-8 decoder states between tokens: (continuation bytes still needed, the next one's range).
# After E0, ED, F0 and F4 the first continuation byte has a narrower range (no overlong forms, no
# surrogates, nothing past U+10FFFF); every later one is 80-BF.
_UTF8_STATES = ((0, 0x80, 0xBF), (1, 0x80, 0xBF), (2, 0x80, 0xBF), (3, 0x80, 0xBF),
                (2, 0xA0, 0xBF), (2, 0x80, 0x9F), (3, 0x90, 0xBF), (3, 0x80, 0x8F))
_UTF8_INDEX = {s: i for i, s in enumerate(_UTF8_STATES)}


def _utf8_advance(state: tuple, data: bytes) -> tuple | None:
    """The decoder state after `data`, or None where it breaks UTF-8 (RFC 3629's table)."""
    need, lo, hi = state
    for b in data:
        if need:
            if not lo <= b <= hi:
                return None
            need, lo, hi = need - 1, 0x80, 0xBF
        elif b < 0x80:
            continue
        elif 0xC2 <= b <= 0xDF:
            need = 1
        elif b == 0xE0:
            need, lo = 2, 0xA0
        elif b == 0xED:
            need, hi = 2, 0x9F
        elif 0xE1 <= b <= 0xEF:
            need = 2
        elif b == 0xF0:
            need, lo = 3, 0x90
        elif 0xF1 <= b <= 0xF3:
            need = 3
        elif b == 0xF4:
            need, hi = 3, 0x8F
        else:
            return None
    return need, lo, hi


class Utf8Guard:
    """Keeps a guided output valid UTF-8. xgrammar 0.2.9 matches bytes by the shape of UTF-8 but
    takes what a decoder refuses (ED A0..BF: a UTF-16 surrogate; overlong forms), so a string of 16
    "characters" by its count decoded to 18, three of them U+FFFD, and failed its maxLength (found
    by loadgen.bench_structured). Per decoder state, a bitmask row of the tokens that continue
    validly; the matcher carries its state, and each step's rows are ANDed with their state's row."""

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int, keep: set[int]):
        self.vocab = decoded_vocab
        width = bitmask_width(vocab_size) * 32
        allowed = torch.zeros(len(_UTF8_STATES), width, dtype=torch.bool)
        allowed[:, vocab_size:] = True          # past the tokenizer: the grammar's own mask decides
        for t, raw in enumerate(decoded_vocab[:vocab_size]):
            if t in keep or not raw:
                allowed[:, t] = True
            elif raw.isascii():
                allowed[0, t] = True            # nothing but state 0 takes an ASCII byte first
            else:
                for i, state in enumerate(_UTF8_STATES):
                    allowed[i, t] = _utf8_advance(state, raw) is not None
        self.rows = torch.stack([_pack(a) for a in allowed])    # [S, W] int32

    def advance_token(self, state: int, token_id: int) -> int:
        raw = self.vocab[token_id] if token_id < len(self.vocab) else b""
        if state == 0 and raw.isascii():
            return 0
        after = _utf8_advance(_UTF8_STATES[state], raw)
        return 0 if after is None else _UTF8_INDEX[after]   # None: a token the mask did not offer

    def restrict(self, bitmask: torch.Tensor, rows: list[int], states: list[int]) -> None:
        bitmask[rows] &= self.rows[states]


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [32 * W] -> int32 bitmask row [W] (bit t: token t allowed)."""
    bits = allowed.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    packed = bits.sum(dim=1)                                   # [W] in [0, 2**32)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def _without_control_bytes(decoded_vocab: list[bytes], vocab_size: int, keep: set[int]) -> torch.Tensor:
    """int32 bitmask row [ceil(V/32)]: every token but those whose bytes hold one below 0x20 (the
    stop tokens stay; ids past the tokenizer's are left to the grammar's own mask)."""
    allowed = torch.ones(bitmask_width(vocab_size) * 32, dtype=torch.bool)
    for t, raw in enumerate(decoded_vocab[:vocab_size]):
        if t not in keep and any(b < 0x20 for b in raw):
            allowed[t] = False
    return _pack(allowed)


BACKEND_TYPES = {b.name: b for b in (XGrammarBackend, GuidanceBackend)}


def make_backend(name: str, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | None = None):
    try:
        cls = BACKEND_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown structured-outputs backend {name!r}; one of {', '.join(BACKEND_TYPES)}") from None
    return cls(tokenizer, vocab_size, eos_token_ids)


def _choice_ebnf(spec: str) -> str:
    # JSON string literals are valid EBNF literals in xgrammar's dialect (same escapes).
    return "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(spec))


# xgrammar prefixes its messages with a time and its C++ source line: not the client's business.
_SOURCE_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: ")


def _message(e) -> str:
    """An engine's error as one line a client can read (some span lines: a regex error and its caret)."""
    text = " ".join(line.strip() for line in _SOURCE_PREFIX.sub("", str(e)).splitlines() if line.strip())
    text = text or type(e).__name__
    return text if len(text) <= 500 else text[:497] + "..."
