"""Size limits of a structured-output constraint, checked before anything compiles.

A grammar's compile time grows with its input, and for some shapes faster than linearly: measured
with the tiny model's tokenizer (xgrammar 0.2.9, a shared 2-core VM), an object of 500 optional
properties compiled in 0.19 s, of 1000 in 0.75-5 s and of 5000 in 490 s (1000 required ones: 0.13
s); a 100,000-value enum (1.5 MB) in 44 s into 351 MB. So the input is
bounded (bytes, enum/choice values, properties, nesting) and the compile has a deadline as well,
for a shape these limits do not foresee. At the defaults the slowest case measured compiles in
under a second. The walk is iterative: a deeply nested schema must not exhaust Python's stack.

Nesting is the schema's own (each properties/items/anyOf... one level; schema.walk), not its JSON's,
where an object's property costs two (the `properties` map, then the schema) and an anyOf branch
two: 16 nested objects were "deeper than 32". The JSON is bounded apart, at JSON_DEPTH_PER_LEVEL
times as deep, whatever it holds (enum and const values too): the engines' JSON parsers recurse.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from pagedserve.services.guided.schema import walk


# Levels of JSON a level of schema may take, with room for its data: a property is two (the
# properties map, then its schema), an enum value may nest in turn.
JSON_DEPTH_PER_LEVEL = 4

# The compile cache's default bound in bytes (services/guided/cache.py), here beside the limits so
# that config_fields reads both without importing the backends (xgrammar, which imports torch).
DEFAULT_CACHE_BYTES = 512 << 20


class GrammarError(ValueError):
    """The constraint does not compile; the message says why (it becomes the 400's message)."""


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 64 << 10          # of the constraint's text (regex, grammar, schema, choices)
    max_enum_values: int = 1000        # enum and choice values, all of them (OpenAI's limit)
    max_properties: int = 500          # object properties, all of them (superlinear to compile when optional)
    max_depth: int = 32                # nesting of the schema's structure (properties, items, anyOf...)
    compile_timeout_s: float = 5.0     # a compile that takes longer is refused (and its result not used)

    @classmethod
    def of(cls, config) -> "Limits":
        """From a process's config fields of the same names (services/config_fields.py)."""
        return cls(config.max_grammar_bytes, config.max_grammar_enum_values, config.max_grammar_properties,
                   config.max_grammar_depth, config.grammar_compile_timeout_s)

    @property
    def max_json_depth(self) -> int:
        """The bound on the schema's JSON nesting (its own nesting is max_depth)."""
        return JSON_DEPTH_PER_LEVEL * self.max_depth

    def check(self, c: dict) -> None:
        """GrammarError naming the first limit the wire-form constraint passes."""
        kind, spec = c["kind"], c["spec"]
        size = len(spec.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise GrammarError(f"the {kind} constraint is {size} bytes, over the limit of {self.max_bytes} "
                               f"(--max-grammar-bytes)")
        if kind == "choice":
            self._count("choice values", len(json.loads(spec)), self.max_enum_values, "--max-grammar-enum-values")
        elif kind == "json" and spec:
            try:
                schema = json.loads(spec)
                too_deep = _json_deeper_than(schema, self.max_json_depth)
            except RecursionError:      # the decoder recursed past Python's limit (depth ~1000)
                too_deep = True
            if too_deep:
                raise GrammarError(f"the json schema's JSON is nested deeper than {self.max_json_depth} "
                                   f"({JSON_DEPTH_PER_LEVEL} x --max-grammar-depth)")
            self._walk(schema)

    def _walk(self, schema) -> None:
        enums = properties = 0
        for node, path, depth in walk(schema):
            if depth > self.max_depth:
                raise GrammarError(f"the json schema is nested deeper than {self.max_depth} at {path} "
                                   f"(--max-grammar-depth)")
            if isinstance(node.get("enum"), list):
                enums += len(node["enum"])
            if isinstance(node.get("properties"), dict):
                properties += len(node["properties"])
        self._count("enum values", enums, self.max_enum_values, "--max-grammar-enum-values")
        self._count("properties", properties, self.max_properties, "--max-grammar-properties")

    @staticmethod
    def _count(what: str, n: int, limit: int, flag: str) -> None:
        if n > limit:
            raise GrammarError(f"the constraint has {n} {what}, over the limit of {limit} ({flag})")


def _json_deeper_than(value, limit: int) -> bool:
    """Whether a parsed JSON value nests more than limit arrays and objects deep (iterative)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return False
