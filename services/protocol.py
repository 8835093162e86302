"""Every message between pagedserve processes, declared once: typed, versioned, msgpack on the wire.

Wire form (ZeroMQ multipart): frame 0 is a msgpack map {"v": VERSION, "t": type name, "b": body};
numpy array fields travel as extra frames after it, uncopied, described in the body by
{"__array__": frame index, "dtype", "shape"}. Messages nested in a list (RequestUpdate,
CompletionDelta) travel as rows, [value per field in declaration order]. The per-sequence lists of a step (ExecuteStep.seqs,
StepResult.results, RequestUpdates.tokens) travel as columns, {field: [value per item]}: one list per field instead of one
map per sequence, so both ends check and build them with a few C-level passes, not a Python loop
over every field of every sequence (at 256 sequences that loop was most of the decode cost). `decode` checks the version, the type name and every
field's type, and raises ProtocolError for anything else — loops log it, answer with an Error
message where there is someone to answer, and carry on.

Sockets and who talks (tcp or ipc endpoints, all on loopback in tests):
  router    --DEALER--> scheduler ROUTER   AddRequest, AbortRequest, GetStats, Ping
  scheduler --ROUTER--> router             RequestUpdates (one per router per step), Error, StatsReply, Pong
  scheduler --DEALER--> kvstore ROUTER     ResumeStore, ResetStore, ApplyOps, GetPoolInfo, GetStats, Ping
                                           -> StoreSnapshot, Pong, ApplyOpsReply, PoolInfo, StatsReply, Pong
  scheduler --DEALER--> worker ROUTER      ExecuteStep, Ping -> StepResult, Pong (rank 0 answers for the group)
  worker    --DEALER--> kvstore ROUTER     GetPoolInfo, ReportMemory -> PoolInfo (or a 503 while it sizes), Pong
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

VERSION = 7   # 2: ExecuteStep.seqs and StepResult.results as columns, nested messages as rows;
#             3: prompt logprobs (ExecuteStep, StepResult, RequestUpdate)
#             4: ReportMemory, PoolInfo.step_event_handles (the GPU path)
#             5: sampling params carry structured_outputs (AddRequest, ExecuteStep.new_params)
#             6: RequestUpdate's final phases (queued_s, ..., num_preemptions), GetStats.router_id,
#                Pong.sender names the scheduler's replica; the host tier (PoolInfo.host_cache_blocks),
#                ResumeStore -> StoreSnapshot
#             7: async scheduling: SeqWork.token_ids may be [PENDING_TOKEN]; the kvstore's set_tokens op


class ProtocolError(ValueError):
    """A message that cannot be decoded: wrong version, unknown type, missing or mistyped field."""


# ---- messages ----------------------------------------------------------------------------------

@dataclass
class Ping:
    sender: str = ""
    time: float = 0.0


@dataclass
class Pong:
    sender: str = ""
    time: float = 0.0
    role: str = ""
    ready: bool = True


@dataclass
class Error:
    message: str
    code: int = 400                      # HTTP-like: 400 bad request, 404 unknown, 503 unavailable
    type: str = "invalid_request_error"
    param: str | None = None
    request_id: str | None = None


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict                         # SamplingParams.to_dict()
    arrival_time: float = 0.0
    true_output_len: int | None = None   # a benchmark's true output length (the Orca baselines reserve it)


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class CompletionDelta:
    index: int
    token_ids: list[int]                 # new tokens since the last update
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list | None = None     # per new token: [[id, logprob], ...]
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0


@dataclass
class RequestUpdate:
    request_id: str
    outputs: list[CompletionDelta]
    finished: bool = False
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Once, when asked for: an entry [logprob, rank, [[id, logprob], ...]] per prompt token after the first.
    prompt_logprobs: list | None = None
    # On the final update only: the request's phases in seconds on the engine's clock, as vLLM's
    # per-request histograms take them (queued: arrival to first scheduled; prefill: to the first
    # token; decode: first to last token; inference: scheduled to last token; a preemption stays
    # inside the phase it interrupted).
    queued_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    inference_s: float = 0.0
    num_preemptions: int = 0
    num_host_cached_tokens: int = 0      # of num_cached_tokens, those the host tier gave back


@dataclass(slots=True)
class TokenDelta:
    """The update of nearly every request in nearly every step, sent as columns: one new token for
    the only choice (index 0) of a request still running, without top logprobs. The router reads it
    as RequestUpdate(request_id, [CompletionDelta(0, [token_id], [logprob], None, None,
    cumulative_logprob)])."""
    request_id: str
    token_id: int
    logprob: float = 0.0
    cumulative_logprob: float = 0.0


@dataclass
class RequestUpdates:
    """All of one step's updates for one router, in one message; a request is in one list or the other."""
    updates: list[RequestUpdate]
    tokens: list[TokenDelta] = field(default_factory=list)


@dataclass
class GetStats:
    # A router asking for its /metrics: a candidate to export the engine's own series
    # (services/scheduler/exporter.py). Empty for anyone else (tools, the kvstore's callers).
    router_id: str = ""


@dataclass
class StatsReply:
    stats: dict


@dataclass
class GetPoolInfo:
    pass


@dataclass
class ReportMemory:
    """A worker rank's profile, for a kvstore that sizes its pools from free GPU memory
    (services/kvstore/sizing.py): the activation bytes its largest step needs beyond what stays allocated."""
    rank: int
    reserve_bytes: int


@dataclass
class PoolInfo:
    block_size: int
    block_bytes: int                     # per worker rank (each rank's pool holds its KV heads)
    num_device_blocks: int
    num_host_blocks: int
    device_pool_names: list[str]         # one per tensor-parallel rank
    host_pool_names: list[str]
    device: str = "cpu"
    enable_prefix_caching: bool = True   # the scheduler's mirror must run the same policy
    allocation: str = "paged"            # kvstore.allocator.make_policy(allocation, max_model_len)
    max_model_len: int = 0               # what orca-max reserves per request
    ipc_handles: list = field(default_factory=list)   # CUDA only: pickled IPC handles per rank
    event_handles: list = field(default_factory=list) # CUDA only: the copies_done event per rank
    step_event_handles: list = field(default_factory=list)   # CUDA only: the step_done event per rank
    host_cache_blocks: int = 0           # the host tier's most blocks (0: none); the mirror runs it too


@dataclass
class ResetStore:
    """A scheduler whose mirror diverged from the replica: forget every sequence, the cache and the
    step number. Its mirror starts empty, so the replica must too; pools, and the workers'
    mappings, stay."""
    sender: str = ""


@dataclass
class ResumeStore:
    """A (re)started scheduler's first word to its kvstore: free every sequence of the scheduler
    before it (their full hashed blocks stay cached), forget step numbers, and answer with the
    store's state, from which the new scheduler builds its mirror: the cache outlives it."""
    sender: str = ""


@dataclass
class StoreSnapshot:
    snapshot: dict                       # kvstore.store.BlockStore.snapshot(): no bytes
    released: int = 0                    # sequences of the scheduler before that were freed


@dataclass
class ApplyOps:
    """One step's block operations, in the order the scheduler's mirror applied them."""
    step: int
    ops: list[list]                      # [op name, *args]; see kvstore.replay.OPS


@dataclass
class ApplyOpsReply:
    step: int
    results: list                        # one per op: see kvstore.replay.encode_result
    num_free_device_blocks: int = 0
    num_free_host_blocks: int = 0
    error: str | None = None


@dataclass(slots=True)
class SeqWork:
    """One sequence's share of a step, as the worker needs it."""
    seq_id: int
    token_ids: list[int]
    start_pos: int
    # Draws wanted from this sequence's last logits: [seq_id, params_key, seq_index,
    # beam_candidates, num_output_tokens] each (several for the n samples of a fresh prompt).
    # num_output_tokens counts the outputs the scheduler holds: with token_ids [PENDING_TOKEN] the
    # draw is one further on (the one in flight comes first).
    samples: list[list] = field(default_factory=list)


@dataclass
class ExecuteStep:
    step: int
    seqs: list[SeqWork]
    # Block-table changes since the last step, not whole tables: {seq_id: [start, *blocks]} sets
    # table[start:] = blocks; `freed` drops tables the worker no longer needs.
    table_updates: dict = field(default_factory=dict)
    freed: list[int] = field(default_factory=list)
    # Sampling params travel once per request: {params_key: SamplingParams.to_dict()}, dropped when done.
    new_params: dict = field(default_factory=dict)
    dropped_params: list[str] = field(default_factory=list)
    # Only for requests whose params use penalties: {seq_id: [prompt ids, output ids]}.
    histories: dict = field(default_factory=dict)
    # Only for prefill chunks that want prompt logprobs: {seq_id: [k, the prompt token after the
    # chunk or -1 at the prompt's end]}.
    prompt_logprobs: dict = field(default_factory=dict)


# SampleResult.token_id of a draw not made: its grammar is still compiling. The scheduler takes the
# step's last token back (computes it again next step) and the request waits; the others go on.
WAITS_FOR_GRAMMAR = -2

# A token not drawn yet (async scheduling: services/scheduler/scheduler.py, schedule_ahead). As a
# SeqWork's only token it means "the token this sequence draws in the step before this one", which the
# worker takes from its own last draw; in the block store it holds that token's slot until set_tokens.
PENDING_TOKEN = -3


@dataclass(slots=True)
class SampleResult:
    """One draw from a step's logits (the worker's answer for one wanted sample)."""
    seq_id: int
    token_id: int = -1
    logprob: float = 0.0
    top_logprobs: list | None = None     # [[id, logprob], ...] when the request asked for logprobs
    candidates: list = field(default_factory=list)   # beam search: [[id, logprob], ...]


@dataclass
class StepResult:
    step: int
    results: list[SampleResult]
    error: str | None = None
    elapsed: float = 0.0
    # For the chunks of ExecuteStep.prompt_logprobs: {seq_id: [start position, entries]}, an entry
    # [logprob, rank, [[id, logprob], ...]] per position whose next prompt token it scores.
    prompt_logprobs: dict = field(default_factory=dict)
    # Bytes of the worker's compiled grammars (services/guided/cache.py), for the metrics: carried
    # by every step rather than asked for, so that no stats call comes between a step and its reply.
    grammar_cache_bytes: int = 0


MESSAGES: dict[str, type] = {cls.__name__: cls for cls in (
    Ping, Pong, Error, AddRequest, AbortRequest, RequestUpdate, RequestUpdates, GetStats, StatsReply,
    GetPoolInfo, ReportMemory, PoolInfo, ResetStore, ResumeStore, StoreSnapshot, ApplyOps, ApplyOpsReply, ExecuteStep, StepResult)}
_NESTED = {"outputs": CompletionDelta, "updates": RequestUpdate}
_COLUMNS = {(ExecuteStep, "seqs"): SeqWork, (StepResult, "results"): SampleResult,   # sent as columns
            (RequestUpdates, "tokens"): TokenDelta}


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
_COLUMN_TYPES = frozenset(_COLUMNS.values())


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
