"""Tool calling through structured output: tool_choice "required" or a named function.

The output is constrained to JSON the tools' argument schemas accept (as vLLM does it without a
model-specific parser), and the choice comes back in OpenAI's `tool_calls` shape:
    named      {"type": "function", "function": {"name": N}}: the output is N's arguments object
    required   the output is [{"name": one of the tools, "parameters": its arguments}, ...] (one or more;
               exactly one with parallel_tool_calls false)
tool_choice "auto" (the default when tools are given) would need a parser for the model's own
tool-call syntax: a 400, as is "none"'s opposite without tools. A stream sends OpenAI's tool_call
deltas (ToolCallStream): each call's id and name once its name is complete, then its arguments as
they grow. The whole answer's tool_calls are the same calls (ToolPlan.calls), cut ones included.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from pagedserve.services.router.errors import bad_request

ANY_ARGUMENTS = {"type": "object"}


@dataclass
class ToolPlan:
    named: str | None        # the named function, or None for "required"
    schema: dict             # what the output must satisfy

    def parts(self, text: str) -> list[tuple[str, str]]:
        """(name, arguments so far) of each call the text has named so far: the whole text when cut
        short (by max_tokens, a stop string) reads as far as it got."""
        return [(self.named, text)] if self.named is not None else _required_calls(text)

    def calls(self, text: str) -> list[dict]:
        """A finished choice's text -> OpenAI tool_calls: what its stream sends (ToolCallStream),
        so that streamed and whole answers agree. A call cut by max_tokens keeps its unfinished
        arguments, as vLLM's named tool calls do; the finish reason says it was cut."""
        return [_call_header(name, args) for name, args in self.parts(text)]

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" for a choice of tool_choice "required" that ended by itself after
        calling; a named function's call ends "stop" (the caller chose the tool; vLLM agrees since
        its PR 25054), and a cut one keeps its reason."""
        return "tool_calls" if reason == "stop" and called and self.named is None else reason




def _call_header(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_plan(req) -> ToolPlan | None:
    """What the request asks of tools: None (no tool call), or the plan; a 400 for what is not served."""
    if req.functions or req.function_call not in (None, "none"):
        raise bad_request("functions are not supported; use tools with tool_choice \"required\" or a named "
                          "function", "functions")
    choice = req.tool_choice
    if req.tools == []:
        raise bad_request("tools must not be empty; leave it out for no tools", "tools")
    if not req.tools:
        if choice not in (None, "none"):     # as vLLM: any tool_choice without tools is a 400
            raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
        return None
    tools = _functions(req.tools)
    if choice == "none":
        return None
    if choice in (None, "auto"):
        raise bad_request('tool_choice "auto" is not supported (it needs a tool parser for the model); use '
                          '"required", a named function, or "none"', "tool_choice")
    if choice == "required":
        tools, defs = _hoist_defs(tools)
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"enum": [name]}, "parameters": params},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, params in tools.items()]}, **defs}
        if getattr(req, "parallel_tool_calls", True) is False:
            schema["maxItems"] = 1      # OpenAI's parallel_tool_calls=false: one call, then the array ends
        return ToolPlan(None, schema)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in tools:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan(name, tools[name])
    raise bad_request('tool_choice must be "none", "required", "auto" or {"type": "function", "function": '
                      '{"name": ...}}', "tool_choice")


_DEFS_KEYS = ("$defs", "definitions")


def _hoist_defs(tools: dict[str, dict]) -> tuple[dict[str, dict], dict]:
    """The tools' parameters without their $defs / definitions, and those definitions merged for the
    "required" schema's root: nested inside it, a parameters schema's "#/$defs/X" refs would point at
    the root that no longer holds them (pydantic's schemas for nested models use them). As vLLM's
    (_get_tool_schema_defs): one name with two different schemas is a 400. The request's own tools
    stay as sent (the chat template renders them)."""
    out, defs = {}, {}
    for name, params in tools.items():
        for key in _DEFS_KEYS:
            found = params.get(key)
            for def_name, def_schema in (found.items() if isinstance(found, dict) else ()):
                if defs.setdefault(key, {}).setdefault(def_name, def_schema) != def_schema:
                    raise bad_request(f"the tools define {key} {def_name!r} with different schemas; a tool_choice "
                                      f"\"required\" schema can hold only one", "tools")
        out[name] = {k: v for k, v in params.items() if k not in _DEFS_KEYS}
    return out, defs


def _functions(tools: list) -> dict[str, dict]:
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                              f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request("a function's parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        out[fn["name"]] = params or ANY_ARGUMENTS
    return out


class ToolCallStream:
    """One streamed choice's text -> OpenAI's tool_call deltas, as the text grows.

    The grammar fixes the text's shape, compact JSON: a named function's output is its arguments
    object; "required" gives [{"name":"N","parameters":ARGS},...]. Each feed re-reads the text so
    far (short: a tool call's arguments) and sends what is new: a call's header
    {index, id, type, function: {name, arguments}} once its name is complete, then pieces of its
    arguments."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent: list[int] = []      # per call started: argument characters sent

    def feed(self, new_text: str) -> list[dict]:
        """The deltas the text so far adds: one entry per call index (a new call's header carries
        its first arguments, as vLLM sends them; OpenAI clients merge entries by index)."""
        self.text += new_text
        deltas = []
        for i, (name, args) in enumerate(self.plan.parts(self.text)):
            if i == len(self.sent):
                self.sent.append(0)
                delta = {"index": i, **_call_header(name, "")}
            elif len(args) > self.sent[i]:
                delta = {"index": i, "function": {"arguments": ""}}
            else:
                continue
            delta["function"]["arguments"] = args[self.sent[i]:]
            self.sent[i] = len(args)
            deltas.append(delta)
        return deltas


_CALL_HEAD, _CALL_ARGS = '{"name":"', ',"parameters":'


def _required_calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments so far) of each call whose name is complete in a partial
    [{"name":"N","parameters":ARGS},...]."""
    calls, i, n = [], 1, len(text)
    if not text.startswith("["):
        return calls
    while i < n:
        if text[i] == ",":
            i += 1
            continue
        if not text.startswith(_CALL_HEAD, i):
            break
        # The name is a JSON string: a quote or backslash in it comes escaped.
        quote = i + len(_CALL_HEAD) - 1
        a = _value_end(text, quote)
        if a is None:
            break
        name = json.loads(text[quote:a])
        if not text.startswith(_CALL_ARGS, a):
            break
        a += len(_CALL_ARGS)
        end = _value_end(text, a)
        calls.append((name, text[a:end if end is not None else n]))
        if end is None or end >= n or text[end] != "}":
            break
        i = end + 1
    return calls


def _value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value starting at `start`, or None if the text ends inside it."""
    depth, in_string, escaped = 0, False, False
    for j in range(start, len(text)):
        ch = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            if depth == 0:
                return j            # a scalar ended by its container
            depth -= 1
            if depth == 0:
                return j + 1
        elif ch == "," and depth == 0:
            return j
    return None
