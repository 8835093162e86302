r"""Whether an xgrammar grammar's language is empty: no rule-free derivation of its root exists.

`root ::= "a" x`, `x ::= x "b"` lets "a" through the first mask, then refuses every token: its
language is empty all the same, which no mask at the start shows. The standard test: a rule is
productive when its body derives some text (a literal, a character class that holds a character,
the empty text, a sequence of productive parts, a choice with one productive part, a reference to
a productive rule, a repetition of one, or one that may repeat zero times); the language is empty
when the root is not. Linear: each part tells its parents once. A class that holds no character
(`[^\x00-\U0010FFFF]`; the regex `[^\s\S]`, which xgrammar writes as the class of neither) is
what makes `a[^\s\S]` empty: "a" passes the first mask, then nothing can follow.

It reads xgrammar's serialized grammar as parsed from the EBNF (Grammar.from_ebnf; not the compiled
one, whose serialized form grows with its token tables) (format "v18", xgrammar 0.2.x: each expression is
[type, length, data...]); another format answers None (not known), and an expression type not
named here counts as productive, so that a doubt never refuses a grammar.
"""
from __future__ import annotations

import json
from collections import defaultdict

FORMAT = "v18"
CHARACTER_CLASS, RULE_REF, SEQUENCE, CHOICES, REPEAT = 1, 4, 5, 6, 8
MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)    # no character: never valid UTF-8 (the worker's Utf8Guard refuses them)


def language_is_empty(serialized: str) -> bool | None:
    g = json.loads(serialized)
    if g.get("__VERSION__") != FORMAT:
        return None
    data, ptr = g["grammar_expr_data"], g["grammar_expr_indptr"]   # ptr: where each expression starts
    n_expr = len(ptr)
    ptr = ptr + [len(data)]
    rules = [r[1] for r in g["rules"]]               # each rule's body expression
    # Nodes: expressions 0..n_expr-1, then rules. need: productive parts still missing.
    need, parents = [0] * (n_expr + len(rules)), defaultdict(list)
    for e in range(n_expr):
        kind, args = data[ptr[e]], data[ptr[e] + 2:ptr[e + 1]]
        if kind == CHARACTER_CLASS and _holds_nothing(args[0], args[1:]):
            need[e] = 1                              # no part can ever make it productive
        elif kind == RULE_REF or (kind == REPEAT and args[1] > 0):
            need[e] = 1
            parents[n_expr + args[0]].append(e)
        elif kind in (SEQUENCE, CHOICES) and args:
            need[e] = len(args) if kind == SEQUENCE else 1
            for a in args:
                parents[a].append(e)
    for r, body in enumerate(rules):
        need[n_expr + r] = 1
        parents[body].append(n_expr + r)
    productive = [False] * len(need)
    todo = [v for v, k in enumerate(need) if k == 0]
    for v in todo:
        productive[v] = True
    while todo:
        v = todo.pop()
        for p in parents[v]:
            need[p] -= 1
            if need[p] <= 0 and not productive[p]:
                productive[p] = True
                todo.append(p)
    return not productive[n_expr + g["root_rule_id"]]


def _holds_nothing(negated: int, bounds: list[int]) -> bool:
    """Whether a character class ([negated, lo0, hi0, lo1, hi1, ...]) matches no code point."""
    ranges = sorted(zip(bounds[0::2], bounds[1::2]))
    if not negated:
        return all(lo > hi or SURROGATES[0] <= lo <= hi <= SURROGATES[1] for lo, hi in ranges)
    covered = -1          # every code point up to this one is in the class's ranges (or a surrogate)
    for lo, hi in sorted(ranges + [SURROGATES]):
        if lo > covered + 1:
            return False  # a gap: a character the negated class matches
        covered = max(covered, hi)
    return covered >= MAX_CODE_POINT
