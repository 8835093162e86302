"""The codec of the messages services/protocol.py declares: msgpack on the wire, typed decode.

Generic over the message dataclasses: it knows none of them by name. protocol.py hands it the
version, the message types and which fields nest or travel as columns (`register`), and re-exports
encode, decode, ProtocolError and Columns, so callers import them from the protocol as before.
(Kept apart from the declarations so that a file reads as one job: what travels, or how.)

Wire form (ZeroMQ multipart): frame 0 is a msgpack map {"v": VERSION, "t": type name, "b": body};
numpy array fields travel as extra frames after it, uncopied, described in the body by
{"__array__": frame index, "dtype", "shape"}. Messages nested in a list (RequestUpdate,
CompletionDelta) travel as rows, [value per field in declaration order]. The per-sequence lists of a step (ExecuteStep.seqs,
StepResult.results, RequestUpdates.tokens) travel as columns, {field: [value per item]}: one list per field instead of one
map per sequence, so both ends check and build them with a few C-level passes, not a Python loop
over every field of every sequence (at 256 sequences that loop was most of the decode cost). `decode` checks the version, the type name and every
field's type, and raises ProtocolError for anything else — loops log it, answer with an Error
message where there is someone to answer, and carry on.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import types
import typing
from typing import Any

import msgpack
import numpy as np


class ProtocolError(ValueError):
    """A message that cannot be decoded: wrong version, unknown type, missing or mistyped field."""


# ---- what is registered ------------------------------------------------------------------------
# Module globals, not a codec object: encode and decode run per message on every loop's hot path,
# and a global lookup is the cheapest there is. One protocol per process (services/protocol.py).

VERSION: int | None = None
MESSAGES: dict[str, type] = {}                  # type name -> message class, the top-level messages
_NESTED: dict[str, type] = {}                   # field name -> the class of its list's items (rows)
_COLUMNS: dict[tuple[type, str], type] = {}     # (message class, field name) -> item class (columns)
_COLUMN_TYPES: frozenset = frozenset()


def register(version: int, messages: dict[str, type], nested: dict[str, type],
             columns: dict[tuple[type, str], type]) -> None:
    """Make these the messages encode and decode speak (services/protocol.py calls it once, at import)."""
    global VERSION, MESSAGES, _NESTED, _COLUMNS, _COLUMN_TYPES
    VERSION, MESSAGES, _NESTED, _COLUMNS = version, messages, nested, columns
    _COLUMN_TYPES = frozenset(columns.values())
    for cache in (_SPECS, _COLUMN_SPECS, _NAMES, _GETTERS, _ENCODERS):   # built from the old tables
        cache.clear()


class Columns:
    """A list of `cls` items held as columns, {field: [value per item]}, by a sender that builds
    them that way (no item objects): it encodes exactly as the list of items would, and the
    receiver decodes a list of cls. Only for the column fields (_COLUMNS)."""
    __slots__ = ("cls", "columns")

    def __init__(self, cls: type, columns: dict[str, list]):
        self.cls, self.columns = cls, columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), ()))


# ---- encoding ----------------------------------------------------------------------------------

def encode(msg: Any) -> list[bytes]:
    """A message dataclass -> multipart frames (header + raw array buffers)."""
    name = type(msg).__name__
    if MESSAGES.get(name) is not type(msg):
        raise ProtocolError(f"not a protocol message: {type(msg)!r}")
    frames: list[Any] = [b""]
    body = {n: _to_wire(getattr(msg, n), frames) for n in _field_names(type(msg))}
    frames[0] = msgpack.packb({"v": VERSION, "t": name, "b": body}, use_bin_type=True)
    return frames


def _to_wire(value: Any, frames: list) -> Any:
    # Arrays may stand only as top-level fields; nested messages only in the _NESTED lists.
    # Everything else is handed to msgpack as it is (no per-element walk: this is the hot path).
    if type(value) is Columns:
        return value.columns if len(value) else []
    if isinstance(value, np.ndarray):
        frames.append(np.ascontiguousarray(value).data)
        return {"__array__": len(frames) - 1, "dtype": value.dtype.str, "shape": list(value.shape)}
    if type(value) is list and value and dataclasses.is_dataclass(value[0]):
        cls = type(value[0])
        if cls in _COLUMN_TYPES:
            return {n: list(map(get, value)) for n, get in _column_getters(cls)}
        return list(map(_encoder(cls), value))
    if type(value) is tuple:
        return list(value)
    return value


def decode(frames: list) -> Any:
    """Multipart frames -> a typed message; ProtocolError for anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    try:
        head = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types on garbage
        raise ProtocolError(f"undecodable header: {e}") from None
    if not isinstance(head, dict) or not {"v", "t", "b"} <= head.keys():
        raise ProtocolError("header must be a map with v, t and b")
    if head["v"] != VERSION:
        raise ProtocolError(f"protocol version {head['v']!r} not supported (this side speaks {VERSION})")
    cls = MESSAGES.get(head["t"]) if isinstance(head["t"], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {head['t']!r}")
    if not isinstance(head["b"], dict):
        raise ProtocolError(f"{cls.__name__}: body must be a map")
    return _build(cls, head["b"], frames)


def _build(cls: type, body: dict, frames: list) -> Any:
    kwargs = {}
    for name, required, check, nested in _field_specs(cls):
        if name not in body:
            if required:
                raise ProtocolError(f"{cls.__name__}: missing field {name!r}")
            continue
        value = body[name]
        if len(frames) > 1 and type(value) is dict and "__array__" in value:
            value = _from_wire(value, frames)
        if nested is not None and type(value) is dict:
            value = _build_columns(cls, name, nested, value)
        elif nested is not None:
            if type(value) is not list or (value and nested in _COLUMN_TYPES) or not _only(value, _LIST):
                _bad(cls, name, value)
            value = [_build_row(nested, v) for v in value]
        elif not check(value):
            _bad(cls, name, value)
        kwargs[name] = value
    if len(body) > len(kwargs) and set(body) - {n for n, *_ in _field_specs(cls)}:
        raise ProtocolError(f"{cls.__name__}: unknown fields {_names(set(body) - set(kwargs))}")
    return cls(**kwargs)


def _build_row(cls: type, row: list) -> Any:
    """[value per field, in declaration order] -> cls; trailing fields with defaults may be left out."""
    specs = _field_specs(cls)
    if len(row) > len(specs) or any(required for _, required, _, _ in specs[len(row):]):
        raise ProtocolError(f"{cls.__name__}: {len(row)} values for {len(specs)} fields")
    for value, (name, _, check, nested) in zip(row, specs):
        if nested is not None:
            if type(value) is not list or not _only(value, _LIST):
                _bad(cls, name, value)
        elif not check(value):
            _bad(cls, name, value)
    obj = cls(*row)
    for name, _, _, nested in specs:
        if nested is not None and name in _NESTED:
            setattr(obj, name, [_build_row(nested, v) for v in getattr(obj, name)])
    return obj


def _build_columns(owner: type, name: str, cls: type, columns: dict) -> list:
    """{field: [value per item]} -> [cls(...) per item], every column checked in one pass."""
    specs = _column_specs(cls)
    if set(columns) - {n for n, *_ in specs}:
        raise ProtocolError(f"{owner.__name__}.{name}: unknown columns {_names(set(columns) - {n for n, *_ in specs})}")
    present = [(n, columns[n]) for n, _, _ in specs if n in columns]
    if not present:
        return []
    length = len(present[0][1]) if type(present[0][1]) is list else -1
    for n, required, check in specs:
        if n not in columns:   # (a column sent as nil is present, and checked: it is no list)
            if required:
                raise ProtocolError(f"{owner.__name__}.{name}: missing column {n!r}")
            continue
        col = columns[n]
        if type(col) is not list or len(col) != length or not check(col):
            raise ProtocolError(f"{owner.__name__}.{name}: bad column {n!r}")
    names = [n for n, _ in present]
    if names == [n for n, *_ in specs[:len(names)]]:   # leading fields (always, from encode): positional
        return list(map(cls, *(c for _, c in present)))
    return [cls(**dict(zip(names, row))) for row in zip(*(c for _, c in present))]


_SPECS: dict[type, list] = {}
_COLUMN_SPECS: dict[type, list] = {}


def _column_specs(cls: type) -> list:
    specs = _COLUMN_SPECS.get(cls)
    if specs is None:
        hints = typing.get_type_hints(cls)
        specs = [(f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                  _column_checker(hints[f.name])) for f in dataclasses.fields(cls)]
        _COLUMN_SPECS[cls] = specs
    return specs


_INT, _NUMBER, _LIST = frozenset({int}), frozenset({int, float}), frozenset({list})


def _only(values, types_: frozenset) -> bool:
    """Every value's exact type is in types_ (a C-level pass: no Python call per value)."""
    return set(map(type, values)) <= types_


_SIMPLE = {int: _INT, float: _NUMBER, str: frozenset({str}), bool: frozenset({bool}),
           type(None): frozenset({type(None)}), list: _LIST, dict: frozenset({dict})}


def _exact_types(hint: Any) -> frozenset | None:
    """The exact value types a field of this declared type may hold, when a set of types says it
    all (int, float, str, bool, None, bare list or dict, and unions of them); else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = [_exact_types(h) for h in typing.get_args(hint)]
        return frozenset().union(*parts) if all(p is not None for p in parts) else None
    return _SIMPLE.get(hint) if isinstance(hint, type) else None


def _column_checker(hint: Any):
    """A predicate over a whole column of one field."""
    exact = _exact_types(hint)
    if exact is not None:
        return lambda col: _only(col, exact)
    if typing.get_origin(hint) is list and typing.get_args(hint) == (int,):
        return lambda col: _only(col, _LIST) and _only(itertools.chain.from_iterable(col), _INT)
    check = _checker(hint)
    return lambda col: all(map(check, col))


_NAMES: dict[type, tuple[str, ...]] = {}


_GETTERS: dict[type, list] = {}


def _column_getters(cls: type) -> list:
    getters = _GETTERS.get(cls)
    if getters is None:
        getters = _GETTERS[cls] = [(n, operator.attrgetter(n)) for n in _field_names(cls)]
    return getters


_ENCODERS: dict[type, Any] = {}


def _encoder(cls: type):
    """A nested message -> its wire row [value per field, in declaration order], read by one C-level
    attrgetter (built once per class). Rows, not maps: no key strings to pack and unpack per item."""
    enc = _ENCODERS.get(cls)
    if enc is None:
        names = _field_names(cls)
        get = operator.attrgetter(*names) if len(names) > 1 else (lambda o: (getattr(o, names[0]),))
        nested = [i for i, n in enumerate(names) if n in _NESTED]

        def enc(obj, get=get, nested=nested):
            if not nested:
                return get(obj)
            row = list(get(obj))
            for i in nested:
                if row[i]:
                    row[i] = list(map(_encoder(type(row[i][0])), row[i]))
            return row
        _ENCODERS[cls] = enc
    return enc


def _field_names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _field_specs(cls: type) -> list:
    """(name, required, type check, nested message class) per field, computed once per class."""
    specs = _SPECS.get(cls)
    if specs is None:
        hints = typing.get_type_hints(cls)
        specs = [(f.name,
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                  _checker(hints[f.name]), _NESTED.get(f.name) or _COLUMNS.get((cls, f.name)))
                 for f in dataclasses.fields(cls)]
        _SPECS[cls] = specs
    return specs


def _names(keys: set) -> list[str]:
    """Unknown keys for an error message: any msgpack type (sorted as text: mixed types do not compare)."""
    return sorted(map(repr, keys))


def _bad(cls: type, name: str, value: Any):
    raise ProtocolError(f"{cls.__name__}.{name}: unexpected {type(value).__name__} value")


def _from_wire(value: Any, frames: list) -> Any:
    try:
        buf = frames[value["__array__"]]
        return np.frombuffer(buf, dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    except Exception as e:
        raise ProtocolError(f"bad array frame: {e}") from None


def _checker(hint: Any):
    """A fast predicate for one declared field type (lists are checked element by element)."""
    exact = _exact_types(hint)
    if exact is not None:
        return lambda v: type(v) in exact
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_checker(h) for h in typing.get_args(hint)]
        return lambda v: any(p(v) for p in parts)
    if hint is Any:
        return lambda v: True
    if hint is np.ndarray:
        return lambda v: isinstance(v, np.ndarray)
    if origin is list:   # (None, int, float, bool, str, bare list and dict: _exact_types above)
        args = typing.get_args(hint)
        if args[0] is int:
            return lambda v: type(v) is list and _only(v, _INT)
        if args[0] is float:
            return lambda v: type(v) is list and _only(v, _NUMBER)
        inner = _checker(args[0])
        return lambda v: type(v) is list and all(inner(x) for x in v)
    if origin is dict:
        return lambda v: type(v) is dict
    if isinstance(hint, type):
        return lambda v: isinstance(v, hint)
    return lambda v: True
