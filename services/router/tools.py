"""Tool calling through structured output: tool_choice "required" or a named function.

The output is constrained to JSON the tools' argument schemas accept (as vLLM does it without a
model-specific parser), and the choice comes back in OpenAI's `tool_calls` shape:
    named      {"type": "function", "function": {"name": N}}: the output is N's arguments object
    required   the output is [{"name": one of the tools, "parameters": its arguments}, ...] (one or more)
tool_choice "auto" (the default when tools are given) would need a parser for the model's own
tool-call syntax: a 400, as is "none"'s opposite without tools. Streaming a tool call is a 400 too.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from services.router.errors import bad_request

ANY_ARGUMENTS = {"type": "object"}


@dataclass
class ToolPlan:
    named: str | None        # the named function, or None for "required"
    schema: dict             # what the output must satisfy

    def calls(self, text: str) -> list[dict] | None:
        """The choice's text -> OpenAI tool_calls, or None when it does not parse (cut by length)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:
            pairs = [(self.named, text)]    # the arguments as the model wrote them
        else:
            pairs = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False, separators=(",", ":")))
                     for c in value]
        return [{"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                 "function": {"name": name, "arguments": args}} for name, args in pairs]


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
    if req.stream:
        raise bad_request("tool calls cannot be streamed yet", "stream")
    if choice == "required":
        return ToolPlan(None, {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"enum": [name]}, "parameters": params},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, params in tools.items()]}})
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in tools:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan(name, tools[name])
    raise bad_request('tool_choice must be "none", "required", "auto" or {"type": "function", "function": '
                      '{"name": ...}}', "tool_choice")


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
