"""A step profile: what one engine step costs on one machine, measured by `loadgen profile`
(loadgen/profile.py), read by `loadgen simulate --profile` (loadgen/profiled_cost.py).

The JSON file (version 1), every time in seconds:

    {"version": 1,
     "machine":  {"hostname", "cpu", "cores", "torch_threads", "device"},
     "model":    {"path", "name", "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                  "vocab", "max_model_len", "dtype", "kv_bytes_per_token"},
     "versions": {"pagedserve", "torch", "transformers", "python"},
     "created": ISO-8601 time, "took_s": seconds the profile took,
     "block_size": the KV block size the grids were measured at,
     "decode":  {"batch": [B...], "context": [C...], "seconds": [[t(B, C) for C] for B]},
         one whole engine step (schedule, model, sample, update) in which B sequences each compute
         one token, every sequence's context C tokens long (the new token included);
     "prefill": {"tokens": [Q...], "context": [P...], "seconds": [[t(Q, P) for P] for Q]},
         one whole engine step in which one sequence computes Q prompt tokens after P tokens already
         cached (a prefix-cache hit or an earlier chunk), sampling one;
     "block_size_factor": {"block_size": [b...], "factor": [f...]},
         a decode step's time at block size b divided by its time at "block_size" (factor 1 there):
         the attention kernel's cost of small blocks (and of large ones);
     "swap_out": {"block_size": [b...], "seconds_per_block": [s...]},   device pool -> host pool
     "swap_in":  {"block_size": [b...], "seconds_per_block": [s...]},   host pool -> device pool
     "copy":     {"block_size": [b...], "seconds_per_block": [s...]}}   copy-on-write, device -> device

Two optional keys, for readers of the file (parse does not read them): "notes", lines saying which
grid points the profile capped or dropped (the model's context, the KV pool); "prefill"."cached",
[[tokens found in the prefix cache, for P] for Q] (equal to the context axis: a miss is an error).

Optional:

     "api": {"request_overhead_s": s,       what a request's latency holds beside its steps (the
                                             HTTP path, the hops between the processes): the
                                             simulator adds it to every token time of a request;
             "admission_s_per_token": s,    (optional, 0 without it) what admitting a prompt costs
                                             outside the worker per prompt token (tokenizing,
                                             hashing its blocks): charged on the step that
                                             admits the request;
             "step_overhead": {"batch": [B...], "context": [C...], "seconds": [[s for C] for B]},
             "event_s": s, ...}
         a served step's time beyond the engine's at B rows of mean context C (the router's
         events, the step message, the other processes on the same cores; may be negative),
         added to every step; and (optional, 0 without it) what one token's SSE event costs the
         router and the client: a step's B events leave one after another, so the simulator
         delays each of its tokens by (B + 1) / 2 events; all measured through a real stack
         (loadgen/profile_api.py).

Recompute has no entry of its own: a preempted request's recompute is its prompt prefilled again,
which the prefill grid prices.

Grid axes are strictly increasing; every grid has at least two points per axis.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Grid1:
    x: tuple[float, ...]
    y: tuple[float, ...]


@dataclass(frozen=True)
class Grid2:
    x: tuple[float, ...]
    y: tuple[float, ...]
    z: tuple[tuple[float, ...], ...]     # z[i][j] at (x[i], y[j])


@dataclass(frozen=True)
class StepProfile:
    raw: dict                 # the whole file, as read (machine, model, versions: for reports)
    block_size: int
    decode: Grid2             # (batch, context) -> seconds
    prefill: Grid2            # (tokens, cached context) -> seconds
    block_size_factor: Grid1
    swap_out: Grid1           # block size -> seconds per block
    swap_in: Grid1
    copy: Grid1
    request_overhead_s: float = 0.0   # "api"; 0 for a profile taken without it
    step_overhead: Grid2 | None = None  # "api", (rows, mean context) -> s; None: no served-step term
    event_s: float = 0.0              # "api": one SSE event's cost to the router and the client
    admission_s_per_token: float = 0.0  # "api": a prompt's admission outside the worker, per token

    @property
    def model(self) -> dict:
        return self.raw["model"]

    @property
    def machine(self) -> dict:
        return self.raw["machine"]


def _increasing(name: str, axis, least: int = 2) -> tuple[float, ...]:
    if not isinstance(axis, list) or len(axis) < least or not all(isinstance(v, (int, float)) for v in axis):
        raise ProfileError(f"{name} must be a list of at least {least} numbers")
    if any(b <= a for a, b in zip(axis, axis[1:])):
        raise ProfileError(f"{name} must be strictly increasing, got {axis}")
    return tuple(float(v) for v in axis)


def _grid1(raw: dict, name: str, x: str, y: str) -> Grid1:
    part = raw.get(name)
    if not isinstance(part, dict):
        raise ProfileError(f"the profile has no {name!r} object")
    xs = _increasing(f"{name}.{x}", part.get(x))
    ys = part.get(y)
    if not isinstance(ys, list) or len(ys) != len(xs) or not all(isinstance(v, (int, float)) and v >= 0 for v in ys):
        raise ProfileError(f"{name}.{y} must be {len(xs)} non-negative numbers")
    return Grid1(xs, tuple(float(v) for v in ys))


def _grid2(part, name: str, x: str, y: str, least: int = 2, signed: bool = False) -> Grid2:
    """part: the grid's object ({x: [...], y: [...], "seconds": rows}); least: points per axis at
    the fewest; signed: its seconds may be negative (an overhead)."""
    if not isinstance(part, dict):
        raise ProfileError(f"the profile has no {name!r} object")
    xs, ys = _increasing(f"{name}.{x}", part.get(x), least), _increasing(f"{name}.{y}", part.get(y), least)
    z = part.get("seconds")
    if not isinstance(z, list) or len(z) != len(xs) or any(
            not isinstance(row, list) or len(row) != len(ys)
            or not all(isinstance(v, (int, float)) and (signed or v >= 0) for v in row) for row in z):
        raise ProfileError(f"{name}.seconds must be {len(xs)} rows of {len(ys)}{'' if signed else ' non-negative'} numbers")
    return Grid2(xs, ys, tuple(tuple(float(v) for v in row) for row in z))


def parse(raw: dict) -> StepProfile:
    if not isinstance(raw, dict) or raw.get("version") != VERSION:
        raise ProfileError(f"not a version-{VERSION} step profile (its 'version' is "
                           f"{raw.get('version') if isinstance(raw, dict) else None!r})")
    for part in ("machine", "model", "versions"):
        if not isinstance(raw.get(part), dict):
            raise ProfileError(f"the profile has no {part!r} object")
    bs = raw.get("block_size")
    if not isinstance(bs, int) or bs < 1:
        raise ProfileError("block_size must be a positive integer")
    return StepProfile(raw, bs, _grid2(raw.get("decode"), "decode", "batch", "context"),
                       _grid2(raw.get("prefill"), "prefill", "tokens", "context"),
                       _grid1(raw, "block_size_factor", "block_size", "factor"),
                       _grid1(raw, "swap_out", "block_size", "seconds_per_block"),
                       _grid1(raw, "swap_in", "block_size", "seconds_per_block"),
                       _grid1(raw, "copy", "block_size", "seconds_per_block"), *_api(raw))


def _api(raw: dict) -> tuple[float, Grid2 | None, float, float]:
    api = raw.get("api")
    if api is None:
        return 0.0, None, 0.0, 0.0
    value = api.get("request_overhead_s") if isinstance(api, dict) else None
    if not isinstance(value, (int, float)) or value < 0:
        raise ProfileError("api.request_overhead_s must be a non-negative number")
    event = api.get("event_s", 0.0)
    if not isinstance(event, (int, float)) or isinstance(event, bool) or not 0 <= event < 1:
        raise ProfileError("api.event_s must be a number of seconds in [0, 1)")
    admission = api.get("admission_s_per_token", 0.0)
    if not isinstance(admission, (int, float)) or isinstance(admission, bool) or not 0 <= admission < 0.01:
        raise ProfileError("api.admission_s_per_token must be a number of seconds in [0, 0.01)")
    g = _grid2(api.get("step_overhead"), "api.step_overhead", "batch", "context", least=1, signed=True)
    # An axis of one point: the same overhead all along it (interpolation wants two).
    x, y, z = g.x, g.y, g.z
    if len(x) == 1:
        x, z = (x[0], x[0] + 1), (z[0], z[0])
    if len(y) == 1:
        y, z = (y[0], y[0] + 1), tuple((row[0], row[0]) for row in z)
    return float(value), Grid2(x, y, z), float(event), float(admission)


def load(path: str | Path) -> StepProfile:
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ProfileError(f"cannot read the profile {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"the profile {path} is not JSON: {e}") from None
    return parse(raw)


def save(raw: dict, path: str | Path) -> StepProfile:
    """Check, then write: a profile that cannot be read back is never written."""
    profile = parse(raw)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(raw, indent=1) + "\n")
    return profile
