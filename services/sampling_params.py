"""Sampling parameters of one request, shared by router, scheduler and worker.

This module owns `SamplingParams` (vLLM's fields, defaults and ranges), its validation and its wire
form. It imports nothing heavy (no torch) because the router and the scheduler import it too.

Semantics follow vLLM:
- temperature 0 means greedy (below 1e-5 counts as 0, as in vLLM, so logits are never divided by a
  vanishing number); beam search (beam_width > 1) is always greedy and deterministic.
- top_k 0 or -1 disables top-k; top_p 1.0 disables top-p; min_p 0.0 disables min-p.
- logprobs None asks for nothing; k >= 0 asks for the sampled token's logprob plus the top-k
  alternatives (of the raw model distribution).
- stop strings are checked by the router; stop_token_ids, EOS and max_tokens by the scheduler.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from pagedserve.services.guided import spec as guided_spec

# Below this a temperature counts as greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# vLLM's default --max-logprobs.
MAX_LOGPROBS = 20
# msgpack carries integers in [-2**63, 2**64): a seed outside cannot travel.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
# Other integers must fit in an int64 (torch tensors, msgpack).
_INT_MAX = 2**63 - 1
# The most sequences one request may ask for (n, beam width): the router keeps a state per choice
# before the scheduler, which admits at most its max_num_seqs, can refuse the request.
MAX_N = 1024


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range or of the wrong type; `.param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    # token id -> bias added to its logit before sampling (OpenAI's logit_bias, in [-100, 100]).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's whitelist: when set (never empty), only these token ids can be sampled.
    allowed_token_ids: list[int] | None = None
    # k >= 0: each prompt token's logprob given the tokens before it, plus the top-k alternatives
    # (vLLM's prompt_logprobs; what completions' echo with logprobs shows for the prompt).
    prompt_logprobs: int | None = None
    # A structured-output constraint, services.guided.spec's wire form {kind, spec, backend}: the
    # worker masks each step's logits to the tokens its grammar allows.
    structured_outputs: dict | None = None

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling reads the token history (the worker must be sent it)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.use_beam_search or self.temperature < SAMPLING_EPS

    def validate(self) -> "SamplingParams":
        """Raise SamplingParamsError for the first bad field; return self so calls can chain."""
        # Types first, so the range checks below can compare without surprises.
        for name in ("n", "max_tokens", "min_tokens", "top_k", "beam_width"):
            _require_int(name, getattr(self, name))
        for name in ("seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "length_penalty"):
            _require_number(name, getattr(self, name))
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be a boolean, got {getattr(self, name)!r}")

        if not 1 <= self.n <= MAX_N:
            raise SamplingParamsError("n", f"n must be in [1, {MAX_N}], got {self.n}")
        if not 1 <= self.beam_width <= MAX_N:
            raise SamplingParamsError("beam_width", f"beam_width must be in [1, {MAX_N}], got {self.beam_width}")
        for name in ("max_tokens", "min_tokens", "top_k"):
            if getattr(self, name) > _INT_MAX:
                raise SamplingParamsError(name, f"{name} must fit in 64 bits, got {getattr(self, name)}")
        if self.use_beam_search and self.n > self.beam_width:
            raise SamplingParamsError(
                "n", f"n ({self.n}) must not exceed beam_width ({self.beam_width}) in beam search")
        if self.use_beam_search:
            # Beam search ranks raw log-probabilities (as transformers' beam search without logits
            # processors) and stops on EOS and length only; what it would ignore is refused.
            # Beams are re-ranked every step; their per-token logprobs are not tracked (yet).
            ignored = [name for name, on in (
                ("logprobs", self.logprobs is not None), ("stop_token_ids", bool(self.stop_token_ids)),
                ("min_tokens", self.min_tokens > 0), ("repetition_penalty", self.repetition_penalty != 1.0),
                ("frequency_penalty", self.frequency_penalty != 0.0),
                ("presence_penalty", self.presence_penalty != 0.0)) if on]
            if ignored:
                raise SamplingParamsError(ignored[0], f"{ignored[0]} is not supported with beam search")
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            raise SamplingParamsError(
                "temperature", f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise SamplingParamsError(
                "top_k", f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0.0:
            raise SamplingParamsError("repetition_penalty",
                                      f"repetition_penalty must be greater than 0, got {self.repetition_penalty}")
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise SamplingParamsError("seed", f"seed must fit in 64 bits, got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise SamplingParamsError(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamsError("stop", f"stop must be a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise SamplingParamsError("stop", "stop must not contain an empty string")
        _require_token_ids("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            _require_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                # vLLM refuses it too: an empty whitelist leaves nothing to sample.
                raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must not be empty")
        for s in self.stop:
            _require_utf8("stop", s)
        # Checked by type, not `in (False, True, "never")`, which would let 0 and 1 pass as booleans.
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise SamplingParamsError("early_stopping",
                                      f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise SamplingParamsError(
                "cache_salt", f"cache_salt must be a non-empty string when given, got {self.cache_salt!r}")
        if self.cache_salt is not None:
            _require_utf8("cache_salt", self.cache_salt)
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamsError("logit_bias", f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        for token_id, bias in self.logit_bias.items():
            _require_int("logit_bias", token_id)
            _require_number("logit_bias", bias)
            if not 0 <= token_id <= _INT_MAX or not -100.0 <= bias <= 100.0:
                raise SamplingParamsError("logit_bias", f"logit_bias needs token ids >= 0 and biases in "
                                                        f"[-100, 100], got {token_id}: {bias}")
        # Beams are ranked on raw logprobs, which neither a bias nor a whitelist would touch.
        for name in ("logit_bias", "allowed_token_ids"):
            if getattr(self, name) and self.use_beam_search:
                raise SamplingParamsError(name, f"{name} does not apply to beam search")
        if self.structured_outputs is not None:
            try:
                guided_spec.check(self.structured_outputs)
            except ValueError as e:
                raise SamplingParamsError("structured_outputs", f"structured_outputs {e}") from None
            # The grammar ends on EOS: a request that may not end there (beams ranked on raw
            # logprobs, ignore_eos, min_tokens past the grammar's end) could not keep to it.
            clash = [name for name, on in (("use_beam_search", self.use_beam_search), ("ignore_eos", self.ignore_eos),
                                           ("min_tokens", self.min_tokens > 0)) if on]
            if clash:
                raise SamplingParamsError(clash[0], f"{clash[0]} cannot be combined with structured output")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The wire form: only ints, floats, strs, bools, None and lists of those (msgpack-friendly)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, (list, tuple)) else value
        out["logit_bias"] = [[t, b] for t, b in self.logit_bias.items()]   # msgpack maps want str keys
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Decode and validate the wire form; unknown keys are an error (they mean a version skew)."""
        if not isinstance(data, dict):
            raise SamplingParamsError("sampling_params",
                                      f"sampling params must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise SamplingParamsError(str(key), f"unknown sampling parameter {key!r}")
        kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}
        if "logit_bias" in kwargs:
            pairs = kwargs["logit_bias"]
            if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2
                                                               for p in pairs):
                raise SamplingParamsError("logit_bias", f"logit_bias must be [[token id, bias], ...], got {pairs!r}")
            kwargs["logit_bias"] = {t: b for t, b in pairs}
        return cls(**kwargs).validate()


def _require_int(name: str, value: Any) -> None:
    # bool is a subclass of int in Python; a JSON `true` must not pass for n=1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}")


def _require_token_ids(name: str, ids: Any) -> None:
    if not isinstance(ids, list):
        raise SamplingParamsError(name, f"{name} must be a list of token ids, got {ids!r}")
    for token_id in ids:
        _require_int(name, token_id)
        if not 0 <= token_id <= _INT_MAX:
            raise SamplingParamsError(name, f"{name} must be non-negative 64-bit integers, got {token_id}")


def _require_utf8(name: str, value: str) -> None:
    # A lone surrogate (JSON "\ud800") is a valid Python str that no UTF-8 wire can carry.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SamplingParamsError(name, f"{name} is not valid Unicode (a lone surrogate): {value!r}") from None


def _require_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(name, f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SamplingParamsError(name, f"{name} must be finite, got {value!r}")
