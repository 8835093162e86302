"""Whether an xgrammar grammar's language is empty: no rule-free derivation of its root exists.

`root ::= "a" x`, `x ::= x "b"` lets "a" through the first mask, then refuses every token: its
language is empty all the same, which no mask at the start shows. The standard test: a rule is
productive when its body derives some text (a literal, a character class, the empty text, a
sequence of productive parts, a choice with one productive part, a reference to a productive
rule); the language is empty when the root is not. Linear: each part tells its parents once.

It reads xgrammar's serialized grammar as parsed from the EBNF (Grammar.from_ebnf; not the compiled
one, whose serialized form grows with its token tables) (format "v18", xgrammar 0.2.x: each expression is
[type, length, data...]); another format answers None (not known), and an expression type not
named here counts as productive, so that a doubt never refuses a grammar.
"""
from __future__ import annotations

import json
from collections import defaultdict

FORMAT = "v18"
RULE_REF, SEQUENCE, CHOICES = 4, 5, 6


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
        if kind == RULE_REF:
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
