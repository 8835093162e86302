"""The differential suite (loadgen/differential.py): a few hundred requests a vLLM client sends,
from tests/data/differential.jsonl, against our whole stack as real processes, compared with the
expectations recorded in that file (status, field set and types, SSE framing, greedy content).

Against another server, on demand: start vLLM (../shared/peers/) on a model folder, then

    PAGEDSERVE_DIFF_PEER_URL=http://127.0.0.1:8011 [PAGEDSERVE_DIFF_MODEL=DIR] pytest tests/test_differential.py -s

starts our stack on the same model (the peer's /v1/models `root`, or PAGEDSERVE_DIFF_MODEL), sends
both the same requests and prints every difference; those on cases marked `deliberate` (the
README's list) are printed but do not fail the test. `python -m pagedserve.loadgen.differential compare`
does the same against two servers already running.
"""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from pagedserve.loadgen import differential
from pagedserve.loadgen.differential_cases import build_cases
from pagedserve.loadgen.stack import Stack

PEER_URL = os.environ.get("PAGEDSERVE_DIFF_PEER_URL")


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return differential.load_cases()


def test_the_data_file_holds_the_current_cases_each_with_an_expectation(cases):
    # Rewrite it with `python -m pagedserve.loadgen.differential record --url <our stack on the tiny llama>`.
    assert [{k: v for k, v in c.items() if k != "expect"} for c in cases] == build_cases()
    assert len(cases) >= 300 and all("status" in c["expect"] for c in cases)
    statuses = {c["expect"]["status"] for c in cases}
    assert {200, 400, 404, 405} <= statuses
    assert sum("content" in c["expect"] for c in cases) >= 150, "greedy content is recorded"
    assert sum("sse" in c["expect"] for c in cases) >= 50, "streams are recorded"


def test_our_stack_gives_the_recorded_answers(tiny_llama, cases):
    # tiny_llama is the model the expectations were recorded on (services.tiny_model, seed 0).
    stack = Stack(tiny_llama)
    try:
        ours = asyncio.run(differential.observe_all(stack.url, cases, concurrency=24))
    finally:
        stack.stop()
    expected = {c["id"]: c["expect"] for c in cases}
    counted, _ = differential.report(cases, ours, expected, honour_deliberate=False)
    assert not counted, "differences from the recording:\n" + "\n".join(counted)


def _peer_model(url: str) -> str:
    import httpx
    root = httpx.get(url.rstrip("/") + "/v1/models", timeout=10).json()["data"][0].get("root")
    model = os.environ.get("PAGEDSERVE_DIFF_MODEL") or root
    if not model or not Path(model, "config.json").exists():
        pytest.fail(f"set PAGEDSERVE_DIFF_MODEL to the folder the peer serves (it reports {root!r})")
    return model


@pytest.mark.skipif(not PEER_URL, reason="on demand: set PAGEDSERVE_DIFF_PEER_URL to a running vLLM")
def test_against_a_peer_only_deliberate_differences(cases):
    stack = Stack(_peer_model(PEER_URL))
    try:
        ours = asyncio.run(differential.observe_all(stack.url, cases, concurrency=16))
    finally:
        stack.stop()
    peer = asyncio.run(differential.observe_all(PEER_URL, cases, concurrency=16))
    counted, deliberate = differential.peer_report(cases, ours, peer)
    for line in deliberate + counted:
        print(line)
    print(f"{len(cases)} cases: {len(counted)} differences, {len(deliberate)} deliberate")
    assert not counted, f"{len(counted)} differences that are not deliberate (printed above)"


def _chunk(*choice_fields: str) -> str:
    choice = {"index": "int", "text": "str", **{f: "str" for f in choice_fields}}
    return differential.json.dumps({"choices": ["list", [choice]], "id": "str"}, sort_keys=True)


def test_a_stream_merged_for_being_behind_differs_in_no_field():
    # Under load the router merges a stream's queued tokens (services/router/pacing.py): a
    # five-token choice can arrive as its final chunk alone, and the text-only kind goes missing.
    recorded = {"sse": {"chunk_shapes": [_chunk("finish_reason"), _chunk()]}}
    merged = {"sse": {"chunk_shapes": [_chunk("finish_reason")]}}
    assert differential.differences(merged, recorded) == []
    assert differential.differences(recorded, merged) == []
    # A kind with a field no chunk on the other side has is a difference, merged or not ...
    extra = {"sse": {"chunk_shapes": [_chunk("finish_reason", "logprobs")]}}
    assert differential.differences(extra, recorded)
    # ... and so is losing the final chunk's field (only text chunks left).
    no_finish = {"sse": {"chunk_shapes": [_chunk()]}}
    assert differential.differences(no_finish, recorded)
