"""Command-line flags derived from a config dataclass: each field is written once, with its help,
its choices and its check, and argparse is built from it (no flag restates a field).

    @dataclass
    class Config:
        rate: float = opt(math.inf, "requests per second", check=lambda v: v > 0 or "must be > 0")

    parser = argparse.ArgumentParser(); add_flags(parser, Config)
    config = from_args(Config, parser.parse_args())    # raises ConfigError naming the flag

Field name `max_concurrency` becomes `--max-concurrency`; a bool becomes `--x/--no-x`; a
`list[...]` field takes words or comma-separated values and may be repeated (`--api-key a --api-key b`);
`X | None` accepts the word `none`; `parse=` turns the text into the value where the type alone
cannot (JSON, byte sizes). `to_argv` writes fields back as flags, for a launcher that starts a
process with some of its own settings. No torch here: every process and the load generator import it.
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


class ProcessConfig:
    """What every process's config dataclass does the same way, written once: its flags come from
    its fields (add_flags), its values from parsed flags (from_args), and validate() runs every
    field's check and the subclass's cross_check (check_config)."""

    def validate(self):
        check_config(self)
        return self

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        add_flags(parser, cls)

    @classmethod
    def from_args(cls, namespace: argparse.Namespace | dict, **overrides: Any):
        return from_args(cls, namespace, **overrides)


def opt(default: Any = dataclasses.MISSING, help: str = "", *, choices: typing.Sequence | None = None,
        check: Callable[[Any], bool | str] | None = None, env: str | None = None,
        flag: str | None = None, aliases: typing.Sequence[str] = (), metavar: str | None = None,
        positional: bool = False, parse: Callable[[str], Any] | None = None, split: bool = True,
        show: Callable[[Any], list[str]] | None = None) -> Any:
    """A dataclass field with what its flag needs. `check(value)` returns True, or False / a reason;
    `env` names an environment variable read when the flag is absent (after the default);
    `parse(text)` builds the value (raising ValueError) and `show(value)` the words that give it
    back (to_argv); `split=False` keeps commas in list items."""
    meta = {"help": help, "choices": choices, "check": check, "env": env, "flag": flag,
            "aliases": tuple(aliases), "metavar": metavar, "positional": positional, "parse": parse,
            "split": split, "show": show}
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
        # Every optional flag says its default (an unset one: "none"), unless its help already does.
        if default is not dataclasses.MISSING and not f.metadata["positional"] and "default" not in help_text:
            help_text += f" [default: {_shown_default(default)}]"
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
            # A list flag extends: repeating it adds to what the earlier ones gave.
            parser.add_argument(*names, dest=f.name, default=argparse.SUPPRESS, help=help_text,
                                metavar=f.metadata["metavar"] or f.name.split("_")[-1].upper(),
                                action="extend" if is_list else "store", nargs="+" if is_list else None,
                                required=default is dataclasses.MISSING)


def from_args(cls: type, namespace: argparse.Namespace | dict, **overrides: Any):
    """The config built from parsed flags (strings) and overrides (typed), every field checked."""
    given = dict(vars(namespace) if isinstance(namespace, argparse.Namespace) else namespace)
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif "help" not in f.metadata:
            continue                      # set by code: a namesake in the namespace is someone else's flag
        elif f.name in given:
            values[f.name] = parse_value(f, hints[f.name], given[f.name])
        elif f.metadata.get("env") and os.environ.get(f.metadata["env"]):
            raw = os.environ[f.metadata["env"]]
            if typing.get_origin(_unwrap(hints[f.name])[0]) is list:
                raw = raw.split(",")      # a variable holds a list comma-separated, whatever split says
            values[f.name] = parse_value(f, hints[f.name], raw)
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
    if not isinstance(raw, (str, list)):
        return raw                        # argparse gave a bool, or a caller a typed value
    words = raw if isinstance(raw, list) else [raw]
    if optional and len(words) == 1 and words[0].lower() in ("none", "null", ""):
        return None
    parse = f.metadata.get("parse")
    try:
        if typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            if parse:                     # the parser reads a whole list from each word (JSON)
                return [v for w in words for v in parse(w)]
            if not f.metadata.get("split", True):
                # Each word is one item, an empty one included: `--api-key "$UNSET"` must be
                # refused by the field's check, not dropped into "no key at all" (an open server).
                return [_scalar(item, w.strip()) for w in words]
            parts = [p.strip() for w in words for p in w.split(",")]
            return [_scalar(item, p) for p in parts if p]
        return parse(words[-1]) if parse else _scalar(kind, words[-1])
    except ValueError as e:
        reason = f"is not {_kind_name(kind)}" if not parse else f"is not valid: {e}"
        raise ConfigError(f"{flag_name(f)}: {','.join(words)!r} {reason}") from None


def to_argv(config: Any, names: typing.Iterable[str]) -> list[str]:
    """The named fields of `config` as the flags that give them (None and empty lists are left
    out: absent flags take the defaults). The inverse of add_flags + from_args for those fields."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    argv: list[str] = []
    for name in names:
        f, value = fields[name], getattr(config, name)
        if value is None or value == []:
            continue
        if isinstance(value, bool):
            argv.append(flag_name(f) if value else "--no-" + flag_name(f)[2:])
        elif f.metadata.get("show"):
            argv += [flag_name(f), *f.metadata["show"](value)]
        elif isinstance(value, list):
            argv += [flag_name(f), *map(str, value)]
        else:
            argv += [flag_name(f), str(value)]
    return argv


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


def _shown_default(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value in (None, "", []) else _show(value)
