"""A request's structured-output constraint: read from the API's fields, checked by compiling it.

Three ways to ask, as vLLM takes them (one per request):
    response_format      OpenAI's {"type": "json_object"} and {"type": "json_schema", "json_schema":
                         {"name", "schema", "strict"}} ({"type": "text"} asks for nothing)
    structured_outputs   vLLM's {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_*             vLLM's older guided_json, guided_regex, guided_choice, guided_grammar
The result is services.guided.spec's wire form, which travels in SamplingParams. `check` compiles
it in the router's compile process (services/guided/compile_process.py; the event loop awaits): a
constraint that cannot compile is a 400 naming the problem before anything is queued; the worker
then compiles the same constraint from its own cache.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Future

from pagedserve.services.guided import spec as specs
from pagedserve.services.guided.compile_process import CompilerUnavailable
from pagedserve.services.guided.limits import GrammarError
from pagedserve.services.router.errors import APIError, bad_request, unavailable

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# vLLM's structured_outputs keys this server does not serve: a 400, not a silently ignored constraint.
UNSERVED_KEYS = ("structural_tag", "whitespace_pattern")
QUEUE_DEADLINES = 4     # a constraint waits behind others' compiles for at most this many compile deadlines


def constraint_of(req, backend: str) -> tuple[dict | None, str | None]:
    """The request's constraint in wire form and the field it came from (None, None: no
    constraint); a 400 for an ill-formed or doubled one."""
    asked = []   # (param, kind, value)
    rf = req.response_format
    if rf is not None:
        asked += _response_format(rf)
    so = req.structured_outputs
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        for k in UNSERVED_KEYS:
            if so.get(k) is not None:
                raise bad_request(f"structured_outputs.{k} is not supported", f"structured_outputs.{k}")
        kinds = [k for k in specs.KINDS if so.get(k) not in (None, False)]
        if len(kinds) != 1:
            raise bad_request(f"structured_outputs takes exactly one of {', '.join(specs.KINDS)}",
                              "structured_outputs")
        asked.append((f"structured_outputs.{kinds[0]}", kinds[0], so[kinds[0]]))
    for field, kind in GUIDED.items():
        value = getattr(req, field)
        if value is not None:
            asked.append((field, kind, value))
    if not asked:
        return None, None
    if len(asked) > 1:
        raise bad_request(f"give one structured-output constraint, got {', '.join(a[0] for a in asked)}", asked[1][0])
    param, kind, value = asked[0]
    try:
        return specs.make(kind, value, backend, param), param
    except specs.SpecError as e:
        raise bad_request(e.message, e.param) from None


def _response_format(rf: dict) -> list:
    kind = rf.get("type", "text")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("response_format json_schema needs a json_schema object", "response_format.json_schema")
        if not isinstance(js.get("name"), str) or not js["name"]:
            raise bad_request("response_format.json_schema.name is required", "response_format.json_schema.name")
        schema = js.get("schema")
        if schema is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format.json_schema.schema")
        return [("response_format.json_schema.schema", "json", schema)]
    raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                      "response_format.type")


async def check(cache, constraint: dict | None, param: str | None, timeout_s: float | None = None,
                ready: Future | None = None) -> None:
    """Compile the constraint (cached) off the event loop; a GrammarError (the cache's limits, or
    a compile past --grammar-compile-timeout) is a 400, a compile that outlasts the request's time
    left (--request-timeout), when that comes first, a 504. `ready`: the compiler's start-up
    (CompileProcess.ready), awaited before the compile deadline starts and counted in the time left."""
    if constraint is None:
        return
    if ready is not None:
        t0 = asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(ready)), timeout_s)
        except CompilerUnavailable as e:
            raise unavailable(str(e)) from None
        except asyncio.TimeoutError:
            raise APIError(504, "starting the grammar compiler took longer than the request's "
                                "--request-timeout", param) from None
        if timeout_s is not None:
            timeout_s -= asyncio.get_running_loop().time() - t0
    await _compiled(cache, constraint, param, timeout_s)


async def _compiled(cache, constraint: dict, param: str | None, timeout_s: float | None) -> None:
    """Wait for the constraint's compile. Its deadline counts from when the compile starts, not
    from when it joined the queue of the one compile thread: 40 schemas sent at once, each 0.3 s
    to compile, were refused as too slow from the 17th on. The wait in the queue is bounded apart
    (QUEUE_DEADLINES compile deadlines: then a 503, to retry), and all of it by the time left."""
    loop = asyncio.get_running_loop()
    deadline = cache.limits.compile_timeout_s
    # shield: the compile goes on for the cache (a cancelled entry would fail every later request
    # with the same constraint), only this request stops waiting.
    job = asyncio.shield(asyncio.wrap_future(cache.submit(constraint)))
    t0 = loop.time()
    end = None if timeout_s is None else t0 + timeout_s
    while True:
        ran = cache.running_for(constraint)          # None: still queued
        wait = deadline - (ran or 0.0) if ran is not None else min(deadline, QUEUE_DEADLINES * deadline - (loop.time() - t0))
        if end is not None:
            wait = min(wait, end - loop.time())
        try:
            await asyncio.wait_for(asyncio.shield(job), max(0.0, wait))
            return
        except GrammarError as e:
            raise bad_request(str(e), param) from None
        except CompilerUnavailable as e:
            raise unavailable(str(e)) from None
        except asyncio.TimeoutError:
            pass
        if end is not None and loop.time() >= end:
            raise APIError(504, "compiling the structured-output constraint took longer than the request's "
                                "--request-timeout", param) from None
        ran = cache.running_for(constraint)
        if ran is not None and ran >= deadline:
            raise bad_request(f"the {constraint['kind']} constraint did not compile within {deadline:g} s "
                              f"(--grammar-compile-timeout)", param) from None
        if ran is None and loop.time() - t0 >= QUEUE_DEADLINES * deadline:
            raise unavailable(f"the grammar compiler is busy with other constraints (queued "
                              f"{QUEUE_DEADLINES * deadline:g} s); retry later")
