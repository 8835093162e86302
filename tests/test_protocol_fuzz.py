"""Hypothesis over every protocol decoder: whatever arrives, decode returns a message or raises
ProtocolError, never anything else (a TypeError escaping a decoder would kill the loop that read it),
and a message it returns holds in each field the type declared for it.

Three kinds of input: raw garbage frames; well-formed headers of every message type whose bodies
are structured but wrong (the right field names, random values, columns and rows of the wrong
shape, stray array descriptors); and real encoded messages with one field swapped for junk.
`make test` runs a modest number of examples; `make fuzz` sets FUZZ_EXAMPLES much higher.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pagedserve.services import protocol

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
fuzz = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

NAMES = sorted(protocol.MESSAGES)
# Field names of every message and of the nested / column item types, so bodies hit real fields.
FIELDS = sorted({f.name for cls in [*protocol.MESSAGES.values(), protocol.CompletionDelta,
                                    protocol.TokenDelta, protocol.SeqWork, protocol.SampleResult]
                 for f in dataclasses.fields(cls)} | {"__array__", "dtype", "shape"})

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=8), st.binary(max_size=8), st.sampled_from(FIELDS),
                    st.sampled_from(["<f4", "|u1", "object", "S3", "<i8", "bogus", "V0"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5),
    st.dictionaries(st.one_of(st.sampled_from(FIELDS), scalars.filter(lambda v: v is not None)),
                    inner, max_size=5)), max_leaves=20)


def _packable(v):
    try:
        return msgpack.packb(v, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None


@st.composite
def structured_frames(draw):
    """A header of a real type and version whose body names real fields with wrong values."""
    body = draw(st.dictionaries(st.sampled_from(FIELDS), values, max_size=8))
    head = {"v": draw(st.sampled_from([protocol.VERSION, protocol.VERSION, protocol.VERSION - 1, "4", None])),
            "t": draw(st.sampled_from(NAMES) | scalars), "b": body}
    packed = _packable(head) or _packable({"v": protocol.VERSION, "t": "Ping", "b": {}})
    extra = draw(st.lists(st.binary(max_size=64), max_size=3))
    return [packed, *extra]


def _sample_messages() -> list:
    """One real instance of every message type (the encoded form the mutations start from)."""
    delta = protocol.CompletionDelta(0, [1, 2], [-0.5, -0.25], [[[1, -0.5]], [[2, -0.25]]], "stop", -0.75)
    return [
        protocol.Ping("a", 1.0), protocol.Pong("b", 2.0, "kvstore", True),
        protocol.Error("bad", 400, "invalid_request_error", "x", "r1"),
        protocol.AddRequest("r1", [1, 2, 3], {"max_tokens": 4}, 0.5, 7), protocol.AbortRequest("r1"),
        protocol.RequestUpdate("r1", [delta], True, None, 3, 1, [[-1.0, 2, [[5, -1.0]]]]),
        protocol.RequestUpdates([protocol.RequestUpdate("r2", [delta])], [protocol.TokenDelta("r3", 9, -0.1, -0.2)]),
        protocol.GetStats(), protocol.StatsReply({"a": 1}), protocol.GetPoolInfo(),
        protocol.ReportMemory(0, 1 << 20),
        protocol.PoolInfo(16, 8192, 64, 8, ["d0"], ["h0"], "cpu", True, "paged", 2048),
        protocol.ResetStore("scheduler"), protocol.ResumeStore("scheduler"),
        protocol.StoreSnapshot({"device": {"refcounts": [0], "clean": [0], "evictable": []},
                                "index": [[b"\x01" * 16, 0]], "seqs": []}, 2),
        protocol.ApplyOps(3, [["allocate", 1, [1, 2, 3], [], None], ["free", 4]]),
        protocol.ApplyOpsReply(3, [[True, []], None], 10, 2, None),
        protocol.ExecuteStep(3, [protocol.SeqWork(1, [5, 6], 0, [[1, "k", 0, 0, 0]])],
                             {1: [0, 3, 4]}, [2], {"k": {"max_tokens": 4}}, ["j"], {1: [[5], [6]]}, {1: [2, -1]}),
        protocol.StepResult(3, [protocol.SampleResult(1, 7, -0.3, [[7, -0.3]], [[7, -0.3]])], None, 0.01,
                            {1: [0, [[-1.0, 1, []]]]}),
    ]


SAMPLES = _sample_messages()


def test_every_message_type_has_a_sample():
    assert {type(m).__name__ for m in SAMPLES} == set(protocol.MESSAGES)
    for m in SAMPLES:   # the samples themselves round-trip (mutations start from valid frames)
        protocol.decode(protocol.encode(m))


def decode_only_protocol_errors(frames) -> None:
    """Garbage is refused with a ProtocolError, or it decodes into a message whose every field holds
    its declared type (nested messages too) and which encodes and decodes back to the same frames:
    what a decoder lets through is what its reader was promised."""
    try:
        msg = protocol.decode(frames)
    except protocol.ProtocolError:
        return
    assert protocol.MESSAGES.get(type(msg).__name__) is type(msg), msg
    assert_well_typed(msg)
    again = protocol.decode(protocol.encode(msg))
    assert [bytes(f) for f in protocol.encode(again)] == [bytes(f) for f in protocol.encode(msg)]


def assert_well_typed(msg) -> None:
    hints = typing.get_type_hints(type(msg))
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        assert conforms(value, hints[f.name]), f"{type(msg).__name__}.{f.name} = {value!r} is no {hints[f.name]}"


def conforms(value, hint) -> bool:
    """value is of the declared type, written out here apart from the decoder's own checks."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, h) for h in args)
    if hint is type(None):
        return value is None
    if hint is float:
        return type(value) in (int, float)
    if hint in (int, bool, str, bytes, list, dict):
        return type(value) is hint
    if hint is np.ndarray:
        return isinstance(value, np.ndarray)
    if origin is list:
        return type(value) is list and all(conforms(v, args[0]) for v in value)
    if origin is dict:
        return type(value) is dict and all(conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items())
    if dataclasses.is_dataclass(hint):
        if type(value) is not hint:
            return False
        assert_well_typed(value)
        return True
    raise AssertionError(f"the test does not know the declared type {hint!r}")


@fuzz
@given(st.lists(st.binary(max_size=96), max_size=4))
def test_garbage_frames(frames):
    decode_only_protocol_errors(frames)


@fuzz
@given(structured_frames())
def test_structured_but_wrong_bodies(frames):
    decode_only_protocol_errors(frames)


@fuzz
@given(st.sampled_from(SAMPLES), st.data())
def test_real_messages_with_one_field_swapped(msg, data):
    head = msgpack.unpackb(protocol.encode(msg)[0], raw=False, strict_map_key=False)
    body = head["b"]
    name = data.draw(st.sampled_from(sorted(body) + ["__unknown__"]))
    value = body.get(name)
    if isinstance(value, dict) and value and data.draw(st.booleans()):   # a column or map: swap one entry
        key = data.draw(st.sampled_from(sorted(value, key=repr)))
        value = {**value, key: data.draw(values)}
    elif isinstance(value, list) and value and data.draw(st.booleans()):  # a row list: swap one item
        i = data.draw(st.integers(0, len(value) - 1))
        value = [*value[:i], data.draw(values), *value[i + 1:]]
    else:
        value = data.draw(values)
    body[name] = value
    packed = _packable(head)
    if packed is not None:
        decode_only_protocol_errors([packed, *data.draw(st.lists(st.binary(max_size=32), max_size=2))])


@fuzz
@given(st.fixed_dictionaries({"__array__": values, "dtype": values, "shape": values}), st.binary(max_size=64))
def test_array_descriptors(descriptor, buf):
    # Arrays may stand in any top-level field; a descriptor pointing at a bad frame, dtype or shape
    # is the protocol's error, not numpy's.
    head = {"v": protocol.VERSION, "t": "StatsReply", "b": {"stats": descriptor}}
    packed = _packable(head)
    if packed is not None:
        decode_only_protocol_errors([packed, buf])


@pytest.mark.parametrize("descriptor", [
    {"__array__": 1, "dtype": "object", "shape": [1]},       # object arrays from the wire: never
    {"__array__": 0, "dtype": "<f4", "shape": [-1]},          # the header frame itself
    {"__array__": 1, "dtype": "<f4", "shape": [3, 3]},        # more elements than the buffer
    {"__array__": -1, "dtype": "|u1", "shape": [8]},          # a negative index
    {"__array__": True, "dtype": "|u1", "shape": [8]},
])
def test_bad_array_descriptors_are_protocol_errors(descriptor):
    head = msgpack.packb({"v": protocol.VERSION, "t": "StatsReply", "b": {"stats": descriptor}})
    with pytest.raises(protocol.ProtocolError):
        protocol.decode([head, np.zeros(8, np.uint8).tobytes()])


# ---- what the fuzzing found (each was a TypeError escaping decode) -----------------------------

@pytest.mark.parametrize("body", [
    {"tokens": {"__array__": None, False: None}},                            # keys of mixed types
    {"tokens": {"request_id": ["r"], "token_id": [1], "cumulative_logprob": None}},   # a nil column
    {"updates": [], 7: 1, "x": 2},                                           # unknown fields, mixed types
])
def test_found_by_fuzzing(body):
    head = msgpack.packb({"v": protocol.VERSION, "t": "RequestUpdates", "b": {"updates": [], **body}})
    with pytest.raises(protocol.ProtocolError):
        protocol.decode([head])
