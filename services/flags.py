"""Command-line flags derived from a config dataclass: each field is written once, with its help,
its choices and its check, and argparse is built from it (no flag restates a field).

    @dataclass
    class Config:
        rate: float = opt(math.inf, "requests per second", check=lambda v: v > 0 or "must be > 0")

    parser = argparse.ArgumentParser(); add_flags(parser, Config)
    config = from_args(Config, parser.parse_args())    # raises ConfigError naming the flag

Field name `max_concurrency` becomes `--max-concurrency`; a bool becomes `--x/--no-x`; a
`list[...]` field takes words or comma-separated values; `X | None` accepts the word `none`. No torch here:
every process and the load generator import it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, Callable


class ConfigError(ValueError):
    """A bad value for a flag: the message names the flag and is meant for one line on stderr."""


def opt(default: Any = dataclasses.MISSING, help: str = "", *, choices: typing.Sequence | None = None,
        check: Callable[[Any], bool | str] | None = None, env: str | None = None,
        flag: str | None = None, aliases: typing.Sequence[str] = (), metavar: str | None = None,
        positional: bool = False) -> Any:
    """A dataclass field with what its flag needs. `check(value)` returns True, or False / a reason;
    `env` names an environment variable read when the flag is absent (after the default)."""
    meta = {"help": help, "choices": choices, "check": check, "env": env, "flag": flag,
            "aliases": tuple(aliases), "metavar": metavar, "positional": positional}
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue                      # a field set by code, not by a flag
        kind, optional = _unwrap(hints[f.name])
        default = _default_of(f)
        help_text = f.metadata["help"]
        if f.metadata["choices"]:
            help_text += f" ({'|'.join(map(str, f.metadata['choices']))})"
        if default is not dataclasses.MISSING and default not in (None, "", []) and kind is not bool:
            help_text += f" [default: {_show(default)}]"
        if f.metadata["env"]:
            help_text += f" [env: {f.metadata['env']}]"
        names = [flag_name(f), *f.metadata["aliases"]]
        is_list = typing.get_origin(kind) is list
        if f.metadata["positional"]:
            parser.add_argument(f.name, nargs="*" if is_list else None, help=help_text, metavar=f.metadata["metavar"])
        elif kind is bool:
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(*names, dest=f.name, default=argparse.SUPPRESS, help=help_text,
                                metavar=f.metadata["metavar"] or f.name.split("_")[-1].upper(),
                                nargs="+" if is_list else None, required=default is dataclasses.MISSING)


def from_args(cls: type, namespace: argparse.Namespace | dict, **overrides: Any):
    """The config built from parsed flags (strings) and overrides (typed), every field checked."""
    given = dict(vars(namespace) if isinstance(namespace, argparse.Namespace) else namespace)
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif f.name in given:
            values[f.name] = parse_value(f, hints[f.name], given[f.name])
        elif f.metadata.get("env") and os.environ.get(f.metadata["env"]):
            values[f.name] = parse_value(f, hints[f.name], os.environ[f.metadata["env"]])
    config = cls(**values)
    check_config(config)
    return config


def check_config(config) -> None:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        choices, check = f.metadata.get("choices"), f.metadata.get("check")
        if choices and value is not None and value not in choices:
            raise ConfigError(f"{flag_name(f)}: {_show(value)!r} is not one of {', '.join(map(str, choices))}")
        if check and value is not None:
            verdict = check(value)
            if verdict is not True:
                raise ConfigError(f"{flag_name(f)} {_show(value)}: {verdict or 'invalid value'}")
    # Checks across fields: a method of the config that returns a reason, or None when all is well.
    reason = config.cross_check() if hasattr(config, "cross_check") else None
    if reason:
        raise ConfigError(reason)


def parse_value(f: dataclasses.Field, hint: Any, raw: Any) -> Any:
    """A flag's typed value from its text. A list flag takes several words, each of which may be a
    comma-separated list: `--percentiles 50,90,99` and `--percentiles 50 90 99` alike."""
    kind, optional = _unwrap(hint)
    if isinstance(raw, list):
        raw = ",".join(raw)
    if not isinstance(raw, str):
        return raw                        # argparse gave a bool
    if optional and raw.lower() in ("none", "null", ""):
        return None
    try:
        if typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            return [_scalar(item, part.strip()) for part in raw.split(",") if part.strip()]
        return _scalar(kind, raw)
    except ValueError:
        raise ConfigError(f"{flag_name(f)}: {raw!r} is not {_kind_name(kind)}") from None


def _scalar(kind: Any, raw: str) -> Any:
    if kind is float:
        return float(raw)                 # accepts "inf"
    if kind is int:
        return int(raw)
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(raw)
    return raw


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """(the type inside, whether None is allowed) for X, X | None and Optional[X]."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return hint, False


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _kind_name(kind: Any) -> str:
    if typing.get_origin(kind) is list:
        return f"a comma-separated list of {_kind_name(typing.get_args(kind)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false"}.get(kind, "a string")


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)
