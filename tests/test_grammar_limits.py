"""Issue 28, the grammar part: no constraint stalls the worker's step loop or the router, every one
is bounded before it compiles, and the compile caches are bounded in bytes."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from pagedserve.services.guided import spec as specs
from pagedserve.services.guided.backends import GrammarError, make_backend
from pagedserve.services.guided.cache import CompileCache
from pagedserve.services.guided.limits import Limits
from pagedserve.services.sampling_params import SamplingParams
from pagedserve.services.steps import SampleRequest
from pagedserve.services.worker.guides import GRACE_S, Guides

HUGE_ENUM = {"type": "string", "enum": [f"value-{i:06d}" for i in range(100_000)]}   # ~1.5 MB


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from pagedserve.services.worker.model_loader import load_tokenizer
    return load_tokenizer(tiny_llama)


def _slow(backend, seconds: float):
    real = backend.compile

    def compile(c):
        time.sleep(seconds)
        return real(c)
    return compile


def test_a_step_does_not_wait_for_a_compile(tokenizer, monkeypatch):
    """Finding 2: the step's masks waited on the compile (masks.result() -> cache future), so a
    long compile held the whole step, and the heartbeat saw no progress. Now the row waits and
    the step goes on; once compiled, the row is drawn."""
    guides = Guides(lambda: tokenizer, 2048, (2,))
    try:
        monkeypatch.setattr(guides.cache.backend("xgrammar"), "compile", _slow(guides.cache.backend("xgrammar"), 1.0))
        params = SamplingParams(structured_outputs=specs.make("regex", "[0-9]+"))
        reqs = [SampleRequest(9, SamplingParams(), [], []), SampleRequest(1, params, [], [], 0, 0, "k1")]
        guides.prepare(params.structured_outputs)
        t0 = time.monotonic()
        rows, _, waiting = guides.start_masks(reqs).result()
        assert time.monotonic() - t0 < GRACE_S + 0.3 and rows == [1] and waiting == [1]
        guides.cache.compile(params.structured_outputs)
        assert guides.start_masks(reqs).result()[2] == []
    finally:
        guides.close()


def test_other_requests_run_while_a_grammar_compiles(tiny_llama, monkeypatch):
    """Finding 2, end to end through the scheduler: a request whose grammar compiles for 2.5 s
    waits (its last prompt token is computed again each step), a plain one runs meanwhile with
    every step far shorter than the compile, and the guided one (n=2) then keeps to its grammar."""
    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig
    with Engine(EngineConfig(model=tiny_llama, num_device_blocks=64)) as eng:
        backend = eng.guides.cache.backend("xgrammar")
        monkeypatch.setattr(backend, "compile", _slow(backend, 2.5))
        guided = eng.add_request("row:", SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=3,
                                                        structured_outputs=specs.make("regex", "[0-9]{4}")))
        plain = eng.add_request("plain:", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        longest, done = 0.0, {}
        t0 = time.monotonic()
        while eng.scheduler.has_unfinished():
            s = time.monotonic()
            for req in eng.step():
                done[req.request_id] = time.monotonic() - t0
            longest = max(longest, time.monotonic() - s)
        assert longest < 0.8, f"a step took {longest:.2f} s"
        assert done[plain] < done[guided] and done[guided] >= 2.5
        out = eng.output_of(eng.scheduler.pop_finished(guided))
        assert len(out.outputs) == 2 and all(o.text.isdigit() and len(o.text) == 4 for o in out.outputs), out


@pytest.mark.parametrize("kind, value, limit", [
    ("json", HUGE_ENUM, "--max-grammar-bytes"),
    ("json", {"type": "string", "enum": [str(i) for i in range(1001)]}, "--max-grammar-enum-values"),
    ("json", {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(501)}},
     "--max-grammar-properties"),
    ("json", json.loads('{"type": "array", "items": ' * 40 + '{}' + '}' * 40), "--max-grammar-depth"),
    ("choice", [str(i) for i in range(1001)], "--max-grammar-enum-values"),
    ("regex", "a" * (65 << 10), "--max-grammar-bytes"),
])
def test_oversized_constraints_are_refused_before_compiling(tokenizer, kind, value, limit):
    """Finding 2: a 100,000-value enum compiled for 44 s (351 MB); 5000 optional properties for 490 s."""
    cache = CompileCache(lambda name: make_backend(name, tokenizer, 2048, (2,)))
    try:
        t0 = time.monotonic()
        with pytest.raises(GrammarError, match=limit):
            cache.compile(specs.make(kind, value))
        assert time.monotonic() - t0 < 1.0
    finally:
        cache.close()


def nested_objects(levels: int) -> dict:
    """An object schema `levels` deep: each level one required property holding the next."""
    schema = {"type": "integer"}
    for _ in range(levels - 1):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    return schema


def test_the_depth_limit_counts_the_schemas_nesting_not_its_json(tokenizer):
    """Black-box finding: 16 nested objects were "nested deeper than 32" (each property is two
    levels of JSON: the properties map, then the schema). Now 32 levels of schema pass, the 33rd
    is refused naming its place, and the JSON is bounded apart (an enum value 200 deep)."""
    cache = CompileCache(lambda name: make_backend(name, tokenizer, 2048, (2,)))
    try:
        cache.compile(specs.make("json", nested_objects(32)))
        cache.compile(specs.make("json", {"anyOf": [nested_objects(31), {"type": "null"}]}))
        with pytest.raises(GrammarError, match=r"nested deeper than 32 at #(/properties/a){32} \(--max-grammar-depth"):
            cache.compile(specs.make("json", nested_objects(33)))
        deep_value = json.loads("[" * 200 + "]" * 200)
        with pytest.raises(GrammarError, match=r"JSON is nested deeper than 128 \(4 x --max-grammar-depth"):
            cache.compile(specs.make("json", {"enum": [deep_value]}))
    finally:
        cache.close()


def test_a_compile_past_its_deadline_is_a_400_at_the_router(tokenizer, monkeypatch):
    """Finding 2: the router awaited the compile until --request-timeout (a 504 at best); now the
    compile deadline ends in a 400, and the late result is refused, not cached as good."""
    from pagedserve.services.router.constraints import check
    from pagedserve.services.router.errors import APIError
    cache = CompileCache(lambda name: make_backend(name, tokenizer, 2048, (2,)), limits=Limits(compile_timeout_s=0.3))
    try:
        backend = cache.backend("xgrammar")
        monkeypatch.setattr(backend, "compile", _slow(backend, 0.6))
        c = specs.make("regex", "x+")
        t0 = time.monotonic()
        with pytest.raises(APIError) as e:
            asyncio.run(check(cache, c, "guided_regex", timeout_s=30.0))
        assert e.value.status == 400 and "--grammar-compile-timeout" in str(e.value)
        assert time.monotonic() - t0 < 0.5
        with pytest.raises(GrammarError, match="--grammar-compile-timeout"):
            cache.compile(c)
    finally:
        cache.close()


def test_the_compile_cache_is_bounded_in_bytes(tokenizer):
    """Finding 3: bounded by entries only, twelve 223 KB schemas held ~56 MB each."""
    backend = make_backend("xgrammar", tokenizer, 2048, (2,))
    one = backend.size_of(backend.compile(specs.make("regex", "a[0-9]+")))
    cache = CompileCache(lambda name: backend, capacity=100, max_bytes=int(one * 3.5))
    try:
        for i in range(8):
            cache.compile(specs.make("regex", f"a{i}[0-9]+"))
        assert 2 <= len(cache) <= 3 and 0 < cache.bytes <= cache.max_bytes
        small = CompileCache(lambda name: backend, max_bytes=one // 2)
        with pytest.raises(GrammarError, match="--grammar-cache-bytes"):
            small.compile(specs.make("regex", "a[0-9]+"))
        small.close()
    finally:
        cache.close()


def test_the_grammar_caches_sizes_are_metrics():
    """Finding 3: the router's and the worker's compile caches, in bytes, in /metrics."""
    from pagedserve.services.router.metrics import RouterMetrics
    m = RouterMetrics("tiny")
    m.grammar_cache_bytes.set_function(lambda: 4096)
    text = m.expose([{"exporter": True, "engine": "e0", "grammar_cache_bytes": 123}]).decode()
    assert 'pagedserve:grammar_cache_bytes{model_name="tiny"} 4096.0' in text
    assert 'pagedserve:worker_grammar_cache_bytes{engine="e0",model_name="tiny"} 123.0' in text


EMPTY = 'root ::= x\nx ::= x "a"'
DEAD_END = 'root ::= "a" x\nx ::= x "b"'


@pytest.mark.parametrize("backend", specs.BACKENDS)
def test_a_grammar_with_an_empty_language_is_a_400(tokenizer, backend):
    """Finding 8: it compiled, and every token was refused until max_tokens."""
    from pagedserve.services.router.constraints import check
    from pagedserve.services.router.errors import APIError
    cache = CompileCache(lambda name: make_backend(name, tokenizer, 2048, (2,)))
    try:
        with pytest.raises(APIError) as e:
            asyncio.run(check(cache, specs.make("grammar", EMPTY, backend), "guided_grammar"))
        assert e.value.status == 400 and "empty" in str(e.value)
        if backend == "xgrammar":     # a dead end after "a": empty all the same
            with pytest.raises(GrammarError, match="empty"):
                cache.compile(specs.make("grammar", DEAD_END, backend))
        for fine in ('root ::= "a"', 'root ::= ""', 'root ::= x*\nx ::= "a" x'):   # not empty
            cache.compile(specs.make("grammar", fine, backend))
    finally:
        cache.close()


# Black-box findings: each compiled, and "a" (or "(") passed the first mask with nothing to follow.
NO_TEXT = [("regex", r"a[^\s\S]"), ("regex", r"[^\s\S]"), ("regex", r"(a|b)[^\s\S]c"),
           ("grammar", "root ::= []"), ("grammar", r'root ::= "a" [^\x00-\U0010FFFF]'),
           ("grammar", 'root ::= "(" x{2} ")"\nx ::= x "a"')]
SOME_TEXT = [("regex", r"[^\s\S]*"), ("grammar", r'root ::= "a" [^\x00-\uFFFF]'),
             ("grammar", 'root ::= "(" x{0,2} ")"\nx ::= x "a"')]


@pytest.mark.parametrize("kind, value", NO_TEXT, ids=[v for _, v in NO_TEXT])
def test_a_regex_or_grammar_that_matches_no_text_is_a_400(tokenizer, kind, value):
    """An empty character class ([^\\s\\S], [^\\x00-\\U0010FFFF]) or a repetition of an empty rule
    deep in the constraint: its language is empty though its first mask is not."""
    backend = make_backend("xgrammar", tokenizer, 2048, (2,))
    with pytest.raises(GrammarError, match="matches no text at all"):
        backend.compile(specs.make(kind, value))
    for kind, fine in SOME_TEXT:     # the empty text, a class of what lies past U+FFFF, zero repeats
        backend.compile(specs.make(kind, fine))


def test_a_dead_end_is_held_to_eos_and_warned_about_once(tokenizer, caplog, monkeypatch):
    """Finding 8: a row whose mask allowed nothing drew a refused token every step (counted as
    output), with a warning per token per sequence (5.5 MB of log from one n=128 request). Here
    the compile's productive-rules test cannot read the grammar (another serialized format), as
    for a dead end it would miss: only the first mask is checked, and "a" passes it."""
    from pagedserve.services.guided import backends
    monkeypatch.setattr(backends, "language_is_empty", lambda serialized: None)
    guides = Guides(lambda: tokenizer, 2048, (2,))
    try:
        params = SamplingParams(structured_outputs=specs.make("grammar", DEAD_END))
        guides.cache.compile(params.structured_outputs)
        a = tokenizer("a", add_special_tokens=False)["input_ids"]
        reqs = [SampleRequest(i, params, [], [], i, 0, "k1") for i in range(64)]
        guides.start_masks(reqs).result()
        guides.advance(reqs, a * len(reqs))
        for _ in range(3):
            reqs = [SampleRequest(i, params, [], a, i, 0, "k1") for i in range(64)]
            rows, bitmask, _ = guides.start_masks(reqs).result()
            allowed = {(r, t) for r in range(len(rows)) for t in range(2048) if (int(bitmask[r, t // 32]) >> (t % 32)) & 1}
            assert allowed == {(r, 2) for r in range(len(rows))}    # EOS only, in every row
            guides.advance(reqs, [2] * len(reqs))
        assert len([r for r in caplog.records if "allows no next token" in r.getMessage()]) == 1
    finally:
        guides.close()


def test_the_compile_deadline_counts_from_the_compile_not_from_the_queue(tokenizer, monkeypatch):
    """Black-box finding: 40 distinct schemas sent at once, each ~0.3 s to compile, were refused as
    past the 5 s deadline from the 17th on, while they waited for the one compile thread."""
    from pagedserve.services.router.constraints import check
    cache = CompileCache(lambda name: make_backend(name, tokenizer, 2048, (2,)), limits=Limits(compile_timeout_s=1.0))
    try:
        backend = cache.backend("xgrammar")
        monkeypatch.setattr(backend, "compile", _slow(backend, 0.3))

        async def all_of_them():
            await asyncio.gather(*(check(cache, specs.make("regex", f"q{i}+"), "guided_regex", timeout_s=30.0)
                                   for i in range(6)))       # 1.8 s of compiles in the queue, 0.3 s each
        asyncio.run(all_of_them())
    finally:
        cache.close()


def test_a_constraint_queued_too_long_is_a_503_to_retry(tokenizer, monkeypatch):
    from pagedserve.services.router import constraints
    from pagedserve.services.router.errors import APIError
    monkeypatch.setattr(constraints, "QUEUE_DEADLINES", 1)
    cache = CompileCache(lambda name: make_backend(name, tokenizer, 2048, (2,)), limits=Limits(compile_timeout_s=1.0))
    try:
        backend = cache.backend("xgrammar")
        monkeypatch.setattr(backend, "compile", _slow(backend, 2.5))

        async def behind_another():
            # The one compile thread is busy for 2.5 s (that one ends in its own 400); the next
            # constraint waits past 1 x the 1 s deadline in the queue: a 503, at about 1 s.
            first = asyncio.ensure_future(constraints.check(cache, specs.make("regex", "w+"), "guided_regex"))
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            with pytest.raises(APIError) as e:
                await constraints.check(cache, specs.make("regex", "last+"), "guided_regex")
            waited = time.monotonic() - t0
            await asyncio.gather(first, return_exceptions=True)
            return e.value, waited
        error, waited = asyncio.run(behind_another())
        assert error.status == 503 and "retry" in str(error) and waited < 2.4
    finally:
        cache.close()
