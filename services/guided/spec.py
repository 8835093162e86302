"""A structured-output constraint as it travels in SamplingParams: {"kind", "spec", "backend"}.

No grammar engine is imported here (the scheduler and SamplingParams import this module). Every
kind's spec is one string, so that a constraint hashes, compares and packs the same everywhere:
    json         a JSON schema, as canonical JSON (sorted keys, compact)
    json_object  "" (any JSON object)
    regex        the pattern
    choice       a JSON list of the strings to pick from
    grammar      an EBNF grammar (xgrammar's GBNF dialect; guidance also takes Lark)
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Measured with the tiny model's tokenizer and a 32k one (README, "Structured outputs"):
# xgrammar's masks cost 3-4 us a step against llguidance's 15-40 us; its compile is 4-16 ms once
# per schema (cached), llguidance's ~1 ms. The step is what every request pays: xgrammar.
BACKENDS = ("xgrammar", "guidance")
DEFAULT_BACKEND = "xgrammar"


class SpecError(ValueError):
    """A constraint of the wrong shape; `.param` names the request field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


def make(kind: str, value: Any, backend: str = DEFAULT_BACKEND, param: str = "structured_outputs") -> dict:
    """A request's constraint (as the client wrote it) -> the wire form; SpecError when ill-shaped."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise SpecError(param, f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise SpecError(param, f"a JSON schema must be an object, got {type(value).__name__}")
        spec = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    elif kind == "json_object":
        spec = ""
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise SpecError(param, f"a {kind} must be a non-empty string")
        spec = value
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise SpecError(param, "choice must be a non-empty list of non-empty strings")
        spec = json.dumps(value, ensure_ascii=False)
    else:
        raise SpecError(param, f"unknown structured output kind {kind!r}; one of {', '.join(KINDS)}")
    return {"kind": kind, "spec": spec, "backend": backend}


def check(data: Any) -> None:
    """Raise ValueError unless data is a wire-form constraint (what SamplingParams.validate asks)."""
    if not isinstance(data, dict) or set(data) != {"kind", "spec", "backend"}:
        raise ValueError(f"must be {{kind, spec, backend}}, got {data!r}")
    if data["kind"] not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {data['kind']!r}")
    if not isinstance(data["spec"], str):
        raise ValueError("spec must be a string")
    if data["backend"] not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {data['backend']!r}")


def key(data: dict) -> str:
    """What the compile caches key on: the same constraint under the same engine."""
    raw = f"{data['backend']}\0{data['kind']}\0{data['spec']}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()
