"""OpenAI's parallel_tool_calls=false with tool_choice "required": at most one call.

Black-box finding: the field was dropped as unknown, and "required" wrote up to 5 calls for a client
that asked for one (vLLM keeps only the first). The grammar now ends the array after one call.
"""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from pagedserve.services.router.errors import APIError
from pagedserve.services.router.openai_schema import ChatCompletionRequest, parse_body
from pagedserve.services.router.tools import tool_plan

TOOLS = [{"type": "function", "function": {"name": "get_w", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {}}}}]
ONE = '[{"name":"other","parameters":{}}]'
TWO = '[{"name":"other","parameters":{}},{"name":"get_w","parameters":{"city":"x"}}]'


def _plan(**fields):
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required", **fields})
    return tool_plan(req)


def _accepts(schema: dict, text: str) -> bool:
    # The compact JSON form the router compiles (services/guided/backends.py XGrammarBackend._parse).
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                           strict_mode=True)
    return _is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("fields", [{}, {"parallel_tool_calls": True}, {"parallel_tool_calls": None}])
def test_parallel_calls_stay_allowed_by_default(fields):
    schema = _plan(**fields).schema
    assert "maxItems" not in schema
    assert _accepts(schema, ONE) and _accepts(schema, TWO)


def test_parallel_tool_calls_false_allows_exactly_one_call():
    plan = _plan(parallel_tool_calls=False)
    assert plan.schema["minItems"] == plan.schema["maxItems"] == 1
    assert _accepts(plan.schema, ONE) and not _accepts(plan.schema, TWO)
    assert [name for name, _ in plan.parts(ONE)] == ["other"]


def test_a_named_function_is_one_call_either_way():
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "parallel_tool_calls": False,
         "tool_choice": {"type": "function", "function": {"name": "get_w"}}})
    assert tool_plan(req).named == "get_w"


def test_parallel_tool_calls_must_be_a_boolean():
    with pytest.raises(APIError) as e:
        parse_body(json.dumps({"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "no"}).encode(),
                   ChatCompletionRequest)
    assert e.value.param == "parallel_tool_calls"


# Black-box findings (second round): a tool whose parameters use $defs (pydantic's schema of a nested
# model) was a 400 with tool_choice "required" ("Cannot find field '$defs'": its refs pointed at the
# root of the array schema) though it worked named; and a name with a quote or backslash came back
# JSON-escaped, or, with a quote, lost every call (tool_calls [] after the model had called).
NESTED = {"type": "function", "function": {"name": "put", "parameters": {
    "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
    "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}}}


def _required(tools, **fields):
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required", **fields})
    return tool_plan(req)


def test_required_hoists_the_tools_defs_to_the_schema_root():
    plan = _required([NESTED, TOOLS[1]])
    call = '[{"name":"put","parameters":{"item":{"n":3}}}]'
    assert _accepts(plan.schema, call) and not _accepts(plan.schema, '[{"name":"put","parameters":{"item":{}}}]')
    assert plan.parts(call) == [("put", '{"item":{"n":3}}')]
    assert "$defs" in NESTED["function"]["parameters"]      # the request's tools stay as sent


def test_required_refuses_one_def_name_with_two_schemas():
    other = json.loads(json.dumps(NESTED))
    other["function"]["name"] = "put2"
    other["function"]["parameters"]["$defs"]["Item"] = {"type": "string"}
    with pytest.raises(APIError) as e:
        _required([NESTED, other])
    assert e.value.param == "tools"


@pytest.mark.parametrize("name", ['f"x', "a\\b", "tab\tx", "日本"])
def test_required_call_names_are_read_as_json_strings(name):
    plan = _required([{"type": "function", "function": {"name": name}}])
    text = json.dumps([{"name": name, "parameters": {}}], separators=(",", ":"), ensure_ascii=False)
    assert _accepts(plan.schema, text)
    assert plan.parts(text) == [(name, "{}")]
    assert plan.parts(text[:len('[{"name":"') + 2]) == []     # a name not complete yet names no call
