"""A step's time from a measured step profile (loadgen/step_profile.py): what `loadgen simulate
--profile` charges instead of the roofline (loadgen/cost_model.py), with the same step_time call.

seqs are (q, ctx) per sequence: q tokens computed this step, ctx its context including them. Rows
with q == 1 decode, rows with q > 1 prefill. With b the simulated block size and

    D = the number of decode rows,         C = the mean ctx of the decode rows,
    Q = the prefill rows' q summed,        P = sum(q * (ctx - q)) / Q over the prefill rows
                                               (the cached context, weighted by tokens),
    f = block_size_factor(b) / block_size_factor(profile's block_size)
        (linear in b, b clamped to the measured range; 1 at the profile's own block size),
    base = decode.seconds[0][0], the step at (batch[0], context[0]): every measured step holds
        the fixed cost of a step (schedule, launch, sample) once, so a step with both kinds
        must not count it twice,

one step takes

    decode rows only:   f * decode(D, C)
    prefill rows only:  prefill(Q, P)
    both:               f * decode(D, C) + prefill(Q, P) - base
    then, with a profile's "api" entry, + step_overhead(rows, their mean ctx), the served step
                        beyond the engine's (bilinear, extrapolated, may be < 0; the sum floored at 0)
    plus                swap_out * swap_out(b) + swap_in * swap_in(b) + copied * copy(b)

where decode() and prefill() are their grids interpolated bilinearly, swap_out(), swap_in() and
copy() (seconds per block) linearly in b; beyond a grid's ends each axis extrapolates linearly from
its last two points. No term goes below 0, and on a grid point each is that point's value exactly.
The model's shape (context length, KV bytes per token) is the profile's "model" entry.
"""
from __future__ import annotations

import bisect
import dataclasses
from pathlib import Path

from pagedserve.loadgen.cost_model import BlockMoves
from pagedserve.loadgen.step_profile import Grid1, Grid2, ProfileError, StepProfile, load
from pagedserve.services.scheduler.step_log import composition


def _segment(xs: tuple[float, ...], x: float) -> tuple[int, float]:
    """(i, t): x = (1 - t) * xs[i] + t * xs[i + 1], on the segment holding x or the end one
    nearest it (t < 0 or t > 1: extrapolation)."""
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


def _lerp(a: float, b: float, t: float) -> float:
    return (1 - t) * a + t * b     # this form gives a at t = 0 and b at t = 1 exactly


def interp1(g: Grid1, x: float) -> float:
    i, t = _segment(g.x, x)
    return max(0.0, _lerp(g.y[i], g.y[i + 1], t))


def _lerp2(g: Grid2, x: float, y: float) -> float:
    """interp2 without the floor at 0: an overhead may be negative."""
    i, tx = _segment(g.x, x)
    j, ty = _segment(g.y, y)
    at = lambda row: _lerp(g.z[row][j], g.z[row][j + 1], ty)
    return _lerp(at(i), at(i + 1), tx)


def interp2(g: Grid2, x: float, y: float) -> float:
    return max(0.0, _lerp2(g, x, y))


class ProfiledCost:
    def __init__(self, profile: StepProfile):
        self.profile = profile
        factor = profile.block_size_factor
        self._own_factor = interp1(factor, self._clamped(profile.block_size))

    def _clamped(self, block_size: int) -> float:
        xs = self.profile.block_size_factor.x
        return min(max(float(block_size), xs[0]), xs[-1])

    def block_factor(self, block_size: int) -> float:
        """The decode part's multiplier at this block size (1 at the profile's own)."""
        f = interp1(self.profile.block_size_factor, self._clamped(block_size))
        return f / self._own_factor if self._own_factor > 0 else f

    def step_time(self, seqs: list[tuple[int, int]], num_sampled: int, swap_blocks: int | BlockMoves = 0,
                  block_tokens: int = 16) -> float:
        """Seconds for one step (the module's formula). num_sampled is unused: every measured step
        samples, its LM head included in the time."""
        moves = BlockMoves.of(swap_blocks)
        p = self.profile
        return self.priced(*composition(seqs), block_tokens) + moves.swap_out * interp1(p.swap_out, block_tokens) \
            + moves.swap_in * interp1(p.swap_in, block_tokens) + moves.copied * interp1(p.copy, block_tokens)

    def priced(self, d: int, c: int, q: int, pc: int, rows: int, ctx: int, block_tokens: int = 16) -> float:
        """The compute of a step of this composition (step_log.composition: D decode rows of C
        context summed, Q prefill tokens over PC cached context, token-weighted, R rows of ctx
        context summed), no block moves: what a simulated step is charged, and what fidelity
        prices a logged step of the stack by."""
        p = self.profile
        t = 0.0
        if d:
            t += self.block_factor(block_tokens) * interp2(p.decode, d, c / d)
        if q:
            t += interp2(p.prefill, q, pc / q)
        if d and q:
            t = max(0.0, t - p.decode.z[0][0])
        if p.step_overhead is not None and rows:     # the served step beyond the engine's (may be < 0)
            t = max(0.0, t + _lerp2(p.step_overhead, rows, ctx / rows))
        return t


def _model_int(profile: StepProfile, key: str) -> int:
    v = profile.model.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ProfileError(f"model.{key} must be a positive integer, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class ProfiledServer:
    """What `simulate --profile` serves: the profiled model on the profiled machine, in a KV pool
    of kv_cache_bytes, every step priced by the profile. Read as simulate reads a cost_model.Preset."""
    path: str
    profile: StepProfile
    kv_cache_bytes: int
    max_model_len: int
    kv_bytes_per_token: int

    @classmethod
    def load(cls, path: str, kv_cache_bytes: int | None = None, max_num_seqs: int = 256) -> "ProfiledServer":
        """kv_cache_bytes None: room for max_num_seqs sequences of the model's whole context, a
        pool in which the sequence limit binds before memory does (a profile measures time, not
        the memory the machine leaves for KV)."""
        try:
            profile = load(path)
            max_len, per_token = _model_int(profile, "max_model_len"), _model_int(profile, "kv_bytes_per_token")
        except ProfileError as e:   # name the file, where load's message does not
            raise ProfileError(str(e) if str(path) in str(e) else f"--profile {path}: {e}") from None
        pool = kv_cache_bytes if kv_cache_bytes is not None else max_num_seqs * max_len * per_token
        return cls(str(path), profile, pool, max_len, per_token)

    @property
    def name(self) -> str:
        return f"profile {Path(self.path).name}"

    @property
    def description(self) -> str:
        m, machine = self.profile.model, self.profile.machine
        return f"{m.get('name') or m.get('path')} on {machine.get('device') or machine.get('hostname')}: " \
               f"measured steps ({self.path})"

    def num_kv_tokens(self) -> int:
        return self.kv_cache_bytes // self.kv_bytes_per_token

    @property
    def request_overhead_s(self) -> float:
        """The API's path, added to every token time of a request (loadgen/profile_api.py)."""
        return self.profile.request_overhead_s

    @property
    def admission_s_per_token(self) -> float:
        """A prompt's admission outside the worker, per prompt token (loadgen/profile_api.py):
        charged on the step that admits its request."""
        return self.profile.admission_s_per_token

    @property
    def event_s(self) -> float:
        """One token's SSE event, router and client (loadgen/profile_api.py): a step's tokens
        reach their clients (B + 1) / 2 events late on average."""
        return self.profile.event_s

    def cost_model(self) -> ProfiledCost:
        return ProfiledCost(self.profile)

    def priced_by(self, block_size: int) -> dict:
        """For the summary: which profile priced the run, and what it charged at its block size."""
        m, p, cost = self.profile.model, self.profile, self.cost_model()
        return {"path": self.path, "machine": p.machine,
                "model": {k: m.get(k) for k in ("name", "path", "max_model_len", "kv_bytes_per_token")},
                "block_size": p.block_size, "created": p.raw.get("created"),
                "at_block_size": {"block_size": block_size, "decode_factor": cost.block_factor(block_size),
                                  "swap_out_s_per_block": interp1(p.swap_out, block_size),
                                  "swap_in_s_per_block": interp1(p.swap_in, block_size),
                                  "copy_s_per_block": interp1(p.copy, block_size)}}
