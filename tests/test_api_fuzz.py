"""Schemathesis against the router's own OpenAPI schema (GET /openapi.json of a running stack):
no generated request, valid or not, gets a 5xx, and afterwards no request is left holding blocks
(the kvstore's pool and the scheduler's queues are back at their baseline).

The stack serves a tiny model whose context is 64 tokens, so that a generated max_tokens cannot
make one request run for minutes on a CPU. `make test` runs a few examples per operation;
`make fuzz` sets API_FUZZ_EXAMPLES much higher.
"""
from __future__ import annotations

import collections
import json
import os
import time
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from pagedserve.loadgen.stack import Stack

EXAMPLES = int(os.environ.get("API_FUZZ_EXAMPLES", "4"))


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory):
    from pagedserve.services.tiny_model import build_tiny_model
    model = str(build_tiny_model(tmp_path_factory.mktemp("fuzz-model") / "llama", max_len=64))
    stack = Stack(model, "--num-device-blocks", "64", "--log-level", "WARNING")
    stack.baseline = engine_load(stack.url)
    yield stack
    assert stack.stop() == 0, "".join(stack.lines[-40:])


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def engine_load(url: str) -> dict:
    """What a request in flight holds: blocks of the kvstore's pool, places in the queues."""
    kv = get(url + "/v1/kv")
    metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    queued = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting",
                                     "pagedserve:num_requests_swapped")))
    return {"device_blocks_used": kv["device_blocks_used"], "host_blocks_used": kv.get("host_blocks_used", 0),
            "queued": queued}


def test_no_generated_request_gets_a_server_error(fuzz_stack):
    """Every operation of the schema, EXAMPLES generated requests each (positive and negative:
    schemathesis also breaks the schema on purpose); the first 5xx fails with its reproduction."""
    schema = schemathesis.openapi.from_url(fuzz_stack.url + "/openapi.json")
    schema.config.update(base_url=fuzz_stack.url)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/completions" for op in operations)
    model = get(fuzz_stack.url + "/v1/models")["data"][0]["id"]
    served = collections.Counter()
    for operation in operations:
        # The two routes that reach the engine get more: most generated bodies are 400s.
        examples = EXAMPLES * (4 if operation.path.endswith("completions") else 1)

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def call(case):
            if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
                case.body["model"] = model   # a generated name is a 404 before the engine sees it
            response = case.call(timeout=60)
            served[operation.path, response.status_code // 100] += 1
            case.validate_response(response, checks=[not_a_server_error])
        call()
    print("responses by route and status class:", dict(served))
    if EXAMPLES >= 50:   # the long form reaches the engine (the short one may draw only 400s)
        assert sum(n for (path, status), n in served.items() if status == 2 and path.endswith("completions")), served


def test_no_request_is_left_holding_blocks(fuzz_stack):
    """Runs after the fuzzing above (pytest keeps file order): everything it sent has let go."""
    deadline = time.monotonic() + 30
    while (load := engine_load(fuzz_stack.url)) != fuzz_stack.baseline:
        assert time.monotonic() < deadline, (load, fuzz_stack.baseline)
        time.sleep(0.5)
