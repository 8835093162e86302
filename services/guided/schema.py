"""JSON schemas read before they compile (no engine imported): the walk over a schema's subschemas,
and what xgrammar 0.2.9 would compile into a grammar weaker than the schema.

xgrammar compiles some schemas into a grammar that lets through what the schema forbids (measured:
the strings it accepts), so an answer that ends with "stop" would not validate: a keyword it
ignores, an enum or const value of a type the schema's `type` forbids (`{"type": "integer",
"enum": ["a"]}` wrote "a"), a `required` name that `properties` does not define (it writes none of
those: `{"type": "object", "required": ["b"]}` wrote {}). Where such a schema has no valid value at
all, it is said so (the same 400 as a grammar whose language is empty). llguidance checks these
itself (an unsatisfiable schema is its compile error): these checks are xgrammar's.
"""
from __future__ import annotations

import json
from typing import Any, Iterator

# Keywords whose value is data, not schemas: names inside them are no keywords.
DATA = ("enum", "const", "default", "examples", "required", "dependentRequired")
# Keywords whose value maps names to schemas (the map itself is no level of the schema).
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

# Keywords xgrammar 0.2.9 compiles without enforcing (measured: a string they forbid is accepted;
# the last four by the black-box check of 2026-12-07: [0,0] under uniqueItems, 1.885105 under
# multipleOf 0.5, {"a":5} under dependentRequired/dependentSchemas a -> b).
XGRAMMAR_IGNORES = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "multipleOf",
                    "dependentRequired", "dependentSchemas")
JSON_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")


def subschemas(schema: dict, path: str) -> Iterator[tuple[Any, str]]:
    """The schemas right under a schema node, each with its JSON-pointer path. Any keyword but the
    data ones may hold schemas (one, a list, or a map for SCHEMA_MAPS): an unknown one is read as
    if it did, so that nothing a compiler might read goes unseen."""
    for key, value in schema.items():
        at = f"{path}/{_escaped(key)}"
        if key in DATA:
            continue
        if key in SCHEMA_MAPS and isinstance(value, dict):
            yield from ((sub, f"{at}/{_escaped(name)}") for name, sub in value.items())
        elif isinstance(value, list):
            yield from ((sub, f"{at}/{i}") for i, sub in enumerate(value))
        elif isinstance(value, dict):
            yield value, at


def walk(schema: Any, path: str = "#") -> Iterator[tuple[dict, str, int]]:
    """Every schema object in a schema, in document order, with its path and its depth in the
    schema's structure (the root is 1; each properties/items/anyOf... one more). Iterative: a
    deeply nested schema must not exhaust Python's stack."""
    stack = [(schema, path, 1)]
    while stack:
        node, at, depth = stack.pop()
        if isinstance(node, dict):
            yield node, at, depth
            stack.extend((sub, p, depth + 1) for sub, p in reversed(list(subschemas(node, at))))


def json_type(value: Any) -> str:
    """A JSON value's type as a schema's `type` names it (an integral number is an integer)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "object")


def allows_type(schema: dict, value: Any) -> bool:
    """Whether the node's `type` lets the value's type through (no `type`, or one this does not
    know, lets everything through: the compiler names an unknown one)."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not all(t in JSON_TYPES for t in types):
        return True
    t = json_type(value)
    return t in types or (t == "integer" and "number" in types)


def no_instance(schema: Any) -> str | None:
    """The first place that leaves no value valid against the schema (where it would still
    compile on xgrammar into a grammar that writes something), as 'path: why'."""
    return next((why for node, path, _ in walk(schema) if (why := _no_instance_at(node, path))), None)


def xgrammar_unenforced(schema: Any) -> str | None:
    """The first place in a JSON schema that xgrammar would not enforce, as 'path: why'."""
    return next((why for node, path, _ in walk(schema) if (why := _unenforced_at(node, path, schema))), None)


def _no_instance_at(node: dict, path: str) -> str | None:
    if node.get("type") == []:
        return f"{path}/type: an empty list of types allows no value"
    for key in ("anyOf", "oneOf", "enum"):
        if node.get(key) == []:
            return f"{path}/{key}: an empty '{key}' matches nothing"
    if "const" in node and not allows_type(node, node["const"]):
        return f"{path}/const: {_shown(node['const'])} is not of type {_shown(node['type'])}"
    enum = node.get("enum")
    if isinstance(enum, list) and not any(allows_type(node, v) for v in enum):
        return f"{path}/enum: none of its values is of type {_shown(node['type'])}"
    if node.get("additionalProperties") is False and "patternProperties" not in node:
        if (name := _undefined_required(node)) is not None:
            return (f"{path}/required: {_shown(name)} is required, but 'properties' does not define it "
                    f"and additionalProperties is false")
    return None


def _unenforced_at(node: dict, path: str, root: Any) -> str | None:
    for key, value in node.items():
        at = f"{path}/{_escaped(key)}"
        if key in XGRAMMAR_IGNORES:
            return f"{at}: '{key}' is not supported"
        if key == "uniqueItems" and value is True:
            return f"{at}: 'uniqueItems' is not supported"
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            return f"{at}: 'allOf' with more than one schema is not supported"
    enum = node.get("enum")
    if isinstance(enum, list):
        if (i := next((i for i, v in enumerate(enum) if not allows_type(node, v)), None)) is not None:
            return f"{path}/enum/{i}: {_shown(enum[i])} is not of type {_shown(node['type'])}"
    if (name := _undefined_required(node)) is not None:
        return f"{path}/required: {_shown(name)} is required, but 'properties' does not define it"
    if isinstance(node.get("oneOf"), list) and (why := _one_of_overlap(node["oneOf"], root)):
        return f"{path}/oneOf: {why}"
    return None


# xgrammar compiles oneOf as anyOf: a value that matches two branches would pass, where oneOf
# refuses it. So a oneOf is served only where no value can match two of its branches, as far as
# these rules can prove it (llguidance refuses the same way): two branches are disjoint when
# their types are (integer lies inside number), when both list their values (const, enum) and
# share none, or, for objects, when a property both require has disjoint schemas (a
# discriminator: {"kind": {"const": "cat"}} against {"kind": {"const": "dog"}}). Local $refs are
# followed. Past MAX_ONE_OF branches the pairs are too many to check: refused.
MAX_ONE_OF = 128
_DISJOINT_DEPTH = 8       # nested discriminators and $ref hops followed; past them: not proven
_ALL_TYPES = frozenset(("null", "boolean", "object", "array", "string", "integer", "fraction"))


def _one_of_overlap(branches: list, root: Any) -> str | None:
    if len(branches) > MAX_ONE_OF:
        return (f"more than {MAX_ONE_OF} branches are too many to tell apart (xgrammar serves oneOf as "
                f"anyOf); use anyOf")
    for i, a in enumerate(branches):
        for j in range(i + 1, len(branches)):
            if not _disjoint(a, branches[j], root, _DISJOINT_DEPTH):
                return (f"branches {i} and {j} may both match one value (xgrammar serves oneOf as anyOf): "
                        f"tell them apart by type, or by the const/enum values of themselves or of a "
                        f"property both require, or use anyOf")
    return None


def _disjoint(a: Any, b: Any, root: Any, budget: int) -> bool:
    """Whether no value can match both schemas, by the rules above (False: not proven)."""
    a, b = _resolved(a, root, budget), _resolved(b, root, budget)
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False                       # true, or a $ref this cannot follow
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not va & vb:
        return True
    common = _types(a) & _types(b)
    if not common:
        return True
    if common != {"object"} or budget <= 0:
        return False
    pa, pb = a.get("properties"), b.get("properties")
    if not isinstance(pa, dict) or not isinstance(pb, dict):
        return False
    both = set(_required(a)) & set(_required(b)) & pa.keys() & pb.keys()
    return any(_disjoint(pa[p], pb[p], root, budget - 1) for p in sorted(both))


def _resolved(schema: Any, root: Any, budget: int) -> Any:
    """The schema with its local $ref followed (its own keywords over the target's: each is a
    constraint all the same); None where a $ref leads nowhere this can read."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        target = _pointed(root, schema["$ref"])
        budget -= 1
        if target is None or budget < 0:
            return None
        if not isinstance(target, dict):
            return target if len(schema) == 1 else None
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _pointed(root: Any, ref: str) -> Any:
    if ref != "#" and not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _values(schema: dict) -> frozenset | None:
    """The values a schema lists (const, enum) as comparable keys (1 and 1.0 are one value)."""
    listed = _listed(schema)
    return None if listed is None else frozenset(map(_value_key, listed))


def _value_key(value: Any) -> str:
    def norm(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v
    return json.dumps(norm(value), sort_keys=True)


def _types(schema: dict) -> frozenset:
    """The types of value a schema may match ("fraction": a number that is not an integer)."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if isinstance(types, list) and all(t in JSON_TYPES for t in types):
        allowed = set()
        for t in types:
            allowed |= {"integer", "fraction"} if t == "number" else {t}
    else:
        allowed = set(_ALL_TYPES)
    values = _listed(schema)
    if values is not None:
        allowed &= {"fraction" if json_type(v) == "number" else json_type(v) for v in values}
    return frozenset(allowed)


def _listed(schema: dict) -> list | None:
    if "const" in schema:
        return [schema["const"]]
    return schema["enum"] if isinstance(schema.get("enum"), list) else None


def _required(schema: dict) -> list:
    required = schema.get("required")
    return [r for r in required if isinstance(r, str)] if isinstance(required, list) else []


def _undefined_required(node: dict) -> str | None:
    """A name in `required` that `properties` does not define (xgrammar writes only those)."""
    properties = node.get("properties")
    defined = properties if isinstance(properties, dict) else {}
    return next((name for name in _required(node) if name not in defined), None)


def _escaped(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."
