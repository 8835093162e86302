"""Block operations as an op log: recorded on the scheduler's mirror, replayed on the kvstore.

The scheduler plans on a *mirror*, a pool-less BlockStore wrapped by RecordingStore, so it never
waits for the kvstore inside a step. Every mutating call that changed something is logged as
[op name, *args] (msgpack-friendly: ints, lists, None) with its encoded result; once per step the
log travels as protocol.ApplyOps and `apply_ops` replays it on the authoritative BlockStore (the one
with the pools, which also moves the bytes). BlockStore is deterministic, so the replica's results
equal the mirror's unless a message was lost.

What is left out of the log, because it changes nothing: failed operations (ok=False; the store
checks capacity before touching state), empty appends, and mark_computed calls that register no new
block (most of them in decode: a block fills once every block_size tokens).

apply_ops checks the whole log before applying any of it — op names, argument types, and whether
each sequence exists in the right pool at that point of the log — so a malformed batch raises
ReplayError and changes nothing. An op that still fails while applying means the replica has
diverged from the mirror: ReplicaDiverged, with the results of the ops applied before it.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

from pagedserve.kvstore.block_table import DEVICE, HOST
from pagedserve.kvstore.store import AllocResult, AppendResult, BatchAppendResult, BlockStore, SwapResult, wire_keys

OPS = ("allocate", "append_slots", "append_tokens", "set_tokens", "mark_computed", "fork", "free", "swap_out",
       "swap_in")


class ReplayError(ValueError):
    """A malformed op log: nothing of it was applied (the kvstore answers it as a malformed request)."""


class ReplicaDiverged(RuntimeError):
    """An op of a well-formed log failed on the replica: it no longer matches the mirror."""

    def __init__(self, index: int, results: list, message: str):
        super().__init__(f"ops[{index}] failed on the replica: {message}")
        self.index = index
        self.results = results


# ---- results -----------------------------------------------------------------------------------

_NO_COPIES = [True, []]  # the result of nearly every append: shared, never mutated by callers


def encode_result(r: Any) -> Any:
    """A store result -> plain lists that survive msgpack unchanged (so mirror == replica)."""
    kind = type(r)
    if r is None or kind is bool:   # bool: mark_computed's "a block was keyed", not part of a reply
        return None
    if (kind is AppendResult or kind is BatchAppendResult) and not r.copies:
        return _NO_COPIES if r.ok else [False, []]
    if kind is AppendResult:
        return [r.ok, [[s, d] for s, d in r.copies]]
    if kind is BatchAppendResult:
        return [r.ok, [[i, s, d] for i, s, d in r.copies]]
    if kind is AllocResult:
        return [r.ok, r.num_cached_tokens]
    if kind is SwapResult:
        return [r.ok, [[a, b] for a, b in r.mapping]]
    raise TypeError(f"no wire form for {kind.__name__}")



# ---- recording on the mirror -------------------------------------------------------------------

class _Recorded(NamedTuple):
    """How one mutating BlockStore method is logged.

    when: the calls that may have changed the store, by their result r ("ok": r.ok; "result": r
    is true; "always"); the others are left out of the log.
    wire(store, r, *the method's arguments): the op's wire arguments [*args], read after the call
    (from the store's own state where that is cheaper), or None for a call that changed nothing
    all the same (an empty batch): left out too.
    args(*the method's arguments), where given: the arguments as both the store and wire take them
    (a one-shot iterable of ids becomes one list of ints).
    The logged result is always encode_result(r), what apply_ops answers on the replica."""
    when: str
    wire: Callable[..., list | None]
    args: Callable[..., tuple] | None = None


def _ids(seq_ids) -> tuple:
    return ([int(s) for s in seq_ids],)


# Every recorded op, stated once. Its callables take the BlockStore method's parameters, in order
# and by the same names (_recording holds them to it), every one passed, defaults filled in.
_RECORDED: dict[str, _Recorded] = {
    "allocate": _Recorded("ok", lambda store, r, seq_id, token_ids, extra_keys, max_total_tokens: [
        int(seq_id), [int(t) for t in token_ids], wire_keys(extra_keys), max_total_tokens]),
    # The store's own copy of the new tokens: already plain ints, and a slice is cheaper than
    # converting them again.
    "append_slots": _Recorded("ok", lambda store, r, seq_id, token_ids: [
        int(seq_id), store.last_token_ids(seq_id, len(token_ids))] if len(token_ids) else None),
    "append_tokens": _Recorded("ok", lambda store, r, seq_ids, token_ids: [
        list(seq_ids), list(map(int, token_ids))] if seq_ids else None),
    "set_tokens": _Recorded("always", lambda store, r, seq_ids, positions, token_ids: [
        list(seq_ids), list(positions), list(map(int, token_ids))] if seq_ids else None),
    # r: whether a block was keyed (most calls in decode key none: nothing to replay).
    "mark_computed": _Recorded("result", lambda store, r, seq_id, num_computed_tokens: [
        int(seq_id), int(num_computed_tokens)]),
    "fork": _Recorded("always", lambda store, r, parent_id, child_id: [int(parent_id), int(child_id)]),
    "free": _Recorded("always", lambda store, r, seq_id: [int(seq_id)]),
    "swap_out": _Recorded("ok", lambda store, r, seq_ids: [seq_ids], args=_ids),
    "swap_in": _Recorded("ok", lambda store, r, seq_ids: [seq_ids], args=_ids),
}
assert set(_RECORDED) == set(OPS), "every op is recorded, and only the ops"

_WHEN = {"ok": "r.ok", "result": "r", "always": "True"}

# One template for every recorded method. It is compiled per op with the store method's own
# parameter list, not written as a (self, *args, **kwargs) wrapper: on CPython 3.11 forwarding
# *args/**kwargs costs ~250 ns more per call, and mark_computed runs for every sequence every step.
_METHOD = """
def {name}(self, {params}):
    {prepare}r = base(self, {args})
    if {when}:
        op = wire(self, r, {args})
        if op is not None:
            self._ops.append([{name!r}, *op])
            self._results.append(encode_result(r))
    return r
"""


def _recording(name: str, rec: _Recorded):
    """The RecordingStore method for op `name`: BlockStore's, then its op and result logged."""
    base = getattr(BlockStore, name)
    params = list(inspect.signature(base).parameters.values())[1:]
    names = [p.name for p in params]
    if any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params):
        raise TypeError(f"BlockStore.{name}: only plain parameters can be recorded")
    for fn, skip in ((rec.wire, 2), (rec.args, 0)):   # wire's first two: the store, the result
        if fn is not None and list(inspect.signature(fn).parameters)[skip:] != names:
            raise TypeError(f"{name}: its recording does not take BlockStore.{name}'s {names}")
    args = ", ".join(names)
    defaults = {f"_default_{p.name}": p.default for p in params if p.default is not p.empty}
    src = _METHOD.format(
        name=name, args=args, when=_WHEN[rec.when],
        params=", ".join(p.name if p.default is p.empty else f"{p.name}=_default_{p.name}" for p in params),
        prepare="" if rec.args is None else f"{args}, = prepare({args})\n    ")
    scope = dict(defaults, base=base, wire=rec.wire, prepare=rec.args, encode_result=encode_result)
    exec(compile(src, f"<RecordingStore.{name}>", "exec"), scope)
    method = scope[name]
    method.__qualname__, method.__doc__, method.__module__ = f"RecordingStore.{name}", base.__doc__, __name__
    method.__wrapped__ = base   # inspect.signature and help() show the store's annotated signature
    return method


class RecordingStore(BlockStore):
    """A BlockStore that also logs its state changes: the scheduler's mirror. It is the store
    itself (a subclass), so every read and property is the store's own, at the store's cost; only
    the mutating operations (OPS) are wrapped, each by _recording from its _RECORDED entry, to write
    its op in the log's wire form."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ops: list[list] = []
        self._results: list = []

    def drain(self) -> tuple[list[list], list]:
        """The ops recorded since the last drain and their encoded results; clears the log."""
        ops, results = self._ops, self._results
        self._ops, self._results = [], []
        return ops, results

    def restore(self, snapshot: dict) -> None:
        """Take the replica's state (BlockStore.restore): nothing to record, the replica has it
        already, and what was recorded before it no longer applies."""
        super().restore(snapshot)
        self._ops, self._results = [], []


for _name, _rec in _RECORDED.items():
    setattr(RecordingStore, _name, _recording(_name, _rec))
del _name, _rec


# ---- replay on the kvstore ---------------------------------------------------------------------

def apply_ops(store: BlockStore, ops: list) -> list:
    """Replay an op log on `store`; one encoded result per op.

    ReplayError (nothing applied) for a malformed log; ReplicaDiverged when an op fails midway."""
    plan = _plan(store, ops)
    results = []
    append = results.append
    for i, (fn, args) in enumerate(plan):
        try:
            r = fn(*args)
        except (ValueError, RuntimeError, TypeError) as e:
            raise ReplicaDiverged(i, results, str(e)) from None
        append(encode_result(r))
    return results


def _plan(store: BlockStore, ops: Any) -> list[tuple]:
    """Check every op against the store's state as the log would change it -> (method, args)."""
    if type(ops) is not list:
        raise ReplayError("ops must be a list")
    shadow = _Shadow(store)
    methods = {name: getattr(store, name) for name in OPS}
    plan = []
    for i, op in enumerate(ops):
        if type(op) is not list or not op:
            raise ReplayError(f"ops[{i}]: an op is a non-empty list [name, *args]")
        name = op[0]
        check = _CHECKS.get(name) if type(name) is str else None
        if check is None:
            raise ReplayError(f"ops[{i}]: unknown op {name!r}")
        try:
            plan.append((methods[name], check(shadow, op)))
        except ReplayError as e:
            raise ReplayError(f"ops[{i}] ({name}): {e}") from None
    return plan


_UNSEEN = object()


class _Shadow:
    """Where each sequence touched by the log would be, and how many tokens it would hold."""

    def __init__(self, store: BlockStore):
        self.store = store
        self.seqs: dict[int, list | None] = {}   # seq id -> [location, num_tokens]; None: absent

    def get(self, seq_id: int) -> list | None:
        s = self.seqs.get(seq_id, _UNSEEN)
        if s is _UNSEEN:
            store = self.store
            s = self.seqs[seq_id] = [store.location(seq_id), store.num_tokens(seq_id)] if seq_id in store else None
        return s

    def existing_all(self, seq_ids: list[int], location: str) -> list[list]:
        """existing(i, location) for each of seq_ids (checked ints), the unseen ones asked of the
        store in one call: a decode step's append_tokens names every running sequence."""
        seqs = self.seqs
        unseen = [i for i in seq_ids if i not in seqs]
        if unseen:
            seqs.update(zip(unseen, self.store.states_of(unseen)))
        got = [seqs[i] for i in seq_ids]
        for seq_id, s in zip(seq_ids, got):
            if s is None or s[0] != location:
                self.existing(seq_id, location)   # raises the right ReplayError
        return got

    def existing(self, seq_id: Any, location: str | None = None) -> list:
        if type(seq_id) is not int:
            raise ReplayError(f"sequence id must be an int, not {type(seq_id).__name__}")
        s = self.get(seq_id)
        if s is None:
            raise ReplayError(f"unknown sequence {seq_id}")
        if location is not None and s[0] != location:
            raise ReplayError(f"sequence {seq_id} is on {s[0]}, not {location}")
        return s

    def new(self, seq_id: Any) -> None:
        if type(seq_id) is not int:
            raise ReplayError(f"sequence id must be an int, not {type(seq_id).__name__}")
        if self.get(seq_id) is not None:
            raise ReplayError(f"sequence {seq_id} already exists")


def _arity(op: list, lo: int, hi: int) -> None:
    if not lo <= len(op) - 1 <= hi:
        want = lo if lo == hi else f"{lo} to {hi}"
        raise ReplayError(f"takes {want} arguments, got {len(op) - 1}")


def _int_list(value: Any, what: str) -> list[int]:
    if type(value) is list and (len(value) == 1 and type(value[0]) is int or set(map(type, value)) <= _INT):
        return value
    raise ReplayError(f"{what} must be a list of ints")


_INT = frozenset({int})


def _check_keys(keys: Any) -> None:
    for k in keys:
        if type(k) is list:
            _check_keys(k)
        elif k is not None and type(k) not in (int, str, bytes, float, bool):
            raise ReplayError(f"extra key of type {type(k).__name__} has no stable encoding")


def _check_allocate(shadow: _Shadow, op: list) -> tuple:
    _arity(op, 2, 4)
    seq_id, tokens = op[1], _int_list(op[2], "token_ids")
    extra = op[3] if len(op) > 3 else []
    max_total = op[4] if len(op) > 4 else None
    shadow.new(seq_id)
    if not tokens:
        raise ReplayError("a sequence needs at least one token")
    if type(extra) is not list:
        raise ReplayError("extra_keys must be a list")
    _check_keys(extra)
    if max_total is not None and (type(max_total) is not int or max_total < 0):
        raise ReplayError("max_total_tokens must be a non-negative int or None")
    try:
        shadow.store.policy.blocks_to_reserve(len(tokens), max_total, shadow.store.block_size)
    except ValueError as e:
        raise ReplayError(str(e)) from None
    shadow.seqs[seq_id] = [DEVICE, len(tokens)]
    return seq_id, tokens, tuple(extra), max_total


def _check_append(shadow: _Shadow, op: list) -> tuple:
    if len(op) != 3:
        _arity(op, 2, 2)
    s = shadow.existing(op[1], DEVICE)
    s[1] += len(_int_list(op[2], "token_ids"))
    return op[1], op[2]


def _check_append_tokens(shadow: _Shadow, op: list) -> tuple:
    _arity(op, 2, 2)
    ids, tokens = _int_list(op[1], "seq_ids"), _int_list(op[2], "token_ids")
    if len(ids) != len(tokens):
        raise ReplayError(f"{len(ids)} sequence ids but {len(tokens)} tokens")
    if len(set(ids)) != len(ids):
        raise ReplayError("duplicate sequence ids")
    for s in shadow.existing_all(ids, DEVICE):
        s[1] += 1
    return ids, tokens


def _check_set_tokens(shadow: _Shadow, op: list) -> tuple:
    _arity(op, 3, 3)
    ids, positions, tokens = (_int_list(op[1], "seq_ids"), _int_list(op[2], "positions"),
                              _int_list(op[3], "token_ids"))
    if not len(ids) == len(positions) == len(tokens):
        raise ReplayError(f"{len(ids)} sequence ids, {len(positions)} positions, {len(tokens)} tokens")
    for seq_id, pos in zip(ids, positions):
        if not 0 <= pos < shadow.existing(seq_id)[1]:
            raise ReplayError(f"sequence {seq_id} has no position {pos}")
    return ids, positions, tokens


def _check_mark(shadow: _Shadow, op: list) -> tuple:
    if len(op) != 3:
        _arity(op, 2, 2)
    s = shadow.existing(op[1], DEVICE)
    n = op[2]
    if type(n) is not int or not 0 <= n <= s[1]:
        raise ReplayError(f"sequence {op[1]} has {s[1]} tokens, not {n!r} computed")
    return op[1], n


def _check_fork(shadow: _Shadow, op: list) -> tuple:
    _arity(op, 2, 2)
    parent = shadow.existing(op[1])
    shadow.new(op[2])
    shadow.seqs[op[2]] = list(parent)
    return op[1], op[2]


def _check_free(shadow: _Shadow, op: list) -> tuple:
    _arity(op, 1, 1)
    shadow.existing(op[1])
    shadow.seqs[op[1]] = None
    return (op[1],)


def _swap_checker(src: str, dst: str):
    def check(shadow: _Shadow, op: list) -> tuple:
        _arity(op, 1, 1)
        ids = _int_list(op[1], "seq_ids")
        if len(set(ids)) != len(ids):
            raise ReplayError(f"duplicate sequence ids in {ids}")
        for s in [shadow.existing(i, src) for i in ids]:
            s[0] = dst
        return (ids,)
    return check


_CHECKS = {"allocate": _check_allocate, "append_slots": _check_append, "append_tokens": _check_append_tokens,
           "set_tokens": _check_set_tokens,
           "mark_computed": _check_mark,
           "fork": _check_fork, "free": _check_free,
           "swap_out": _swap_checker(DEVICE, HOST), "swap_in": _swap_checker(HOST, DEVICE)}
assert set(_CHECKS) == set(OPS)
