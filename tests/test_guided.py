"""Structured outputs below the API: the constraint's wire form, the bounded compile cache, the
worker's matchers (rebuilt from tokens, held to EOS when lost), the batched bitmask, and the
offline engine taking a constraint through SamplingParams (both engines)."""
from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest
import torch

from pagedserve.services.guided import spec as specs
from pagedserve.services.guided.backends import GrammarError, make_backend
from pagedserve.services.guided.cache import CompileCache
from pagedserve.services.sampling_params import SamplingParams, SamplingParamsError
from pagedserve.services.steps import SampleRequest
from pagedserve.services.worker.guides import Guides
from pagedserve.services.worker.sampler import SamplingRow, apply_token_bitmask, sample

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                         "note": {"type": "string", "maxLength": 8}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from pagedserve.services.worker.model_loader import load_tokenizer
    return load_tokenizer(tiny_llama)


def test_the_wire_form_is_canonical_and_checked():
    a = specs.make("json", {"b": 1, "a": {"type": "object"}})
    b = specs.make("json", '{"a": {"type": "object"}, "b": 1}')
    assert a == b and specs.key(a) == specs.key(b)
    assert specs.key(a) != specs.key(specs.make("json", {"b": 1}, "guidance"))
    for kind, value in [("json", "[1,"), ("json", 5), ("regex", ""), ("choice", []), ("choice", ["a", 1]), ("xml", "a")]:
        with pytest.raises(specs.SpecError):
            specs.make(kind, value)
    p = SamplingParams(structured_outputs=a)
    assert SamplingParams.from_dict(p.to_dict()) == p
    for bad in ({"kind": "json"}, {**a, "backend": "outlines"}, {**a, "kind": "yaml"}):
        with pytest.raises(SamplingParamsError):
            SamplingParams(structured_outputs=bad).validate()
    for clash in (dict(beam_width=2), dict(ignore_eos=True), dict(min_tokens=1, max_tokens=4)):
        with pytest.raises(SamplingParamsError):
            SamplingParams(structured_outputs=a, **clash).validate()


def test_the_compile_cache_is_bounded_lru_and_remembers_failures(tokenizer):
    made = []

    def factory(name):
        made.append(name)
        return make_backend(name, tokenizer, 2048, (2,))

    cache = CompileCache(factory, capacity=2)
    try:
        c1, c2, c3 = (specs.make("regex", r) for r in ("a+", "b+", "c+"))
        first = cache.compile(c1)
        assert cache.compile(c1) is first and (cache.hits, cache.misses) == (1, 1)
        cache.compile(c2)
        cache.compile(c3)          # evicts c1, the least recently used
        assert len(cache) == 2
        cache.compile(c1)
        assert cache.misses == 4 and len(cache) == 2
        bad = specs.make("regex", "(a")
        for _ in range(2):
            with pytest.raises(GrammarError, match="parenthesis"):
                cache.compile(bad)
        assert cache.misses == 5 and made == ["xgrammar"]   # one backend, made once
    finally:
        cache.close()


@pytest.mark.parametrize("schema, where", [
    ({"allOf": [{"type": "integer"}, {"type": "string"}]}, "#/allOf"),
    ({"type": "object", "properties": {"a": {"not": {"type": "integer"}}}}, "#/properties/a/not"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "#/if"),
    ({"type": "array", "contains": {"const": 5}}, "#/contains"),
    ({"anyOf": []}, "#/anyOf"),
    # The black-box check of 2026-12-07: each answered "stop" with a text its schema refuses.
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "#/uniqueItems"),
    ({"type": "number", "multipleOf": 0.5}, "#/multipleOf"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "#/dependentRequired"),
    ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "#/dependentSchemas"),
    # Black-box findings: "stop" answers 1 (an enum value of the wrong type) and {} (no "b").
    ({"type": "string", "enum": ["a", 1]}, "#/enum/1: 1 is not of type"),
    ({"type": "object", "required": ["b"]}, '#/required: "b" is required'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, '"b" is required'),
])
def test_xgrammar_refuses_keywords_it_would_not_enforce(tokenizer, schema, where):
    """These compiled and were ignored: answers that ended with "stop" did not validate
    ({"anyOf": []} gave "" and allOf [integer, string] gave '[true]')."""
    backend = make_backend("xgrammar", tokenizer, 2048, (2,))
    with pytest.raises(GrammarError, match=re.escape(where)):
        backend.compile(specs.make("json", schema))
    # A property *named* like a keyword, and keywords inside data, are no schema keywords.
    backend.compile(specs.make("json", {"type": "object", "properties": {"not": {"type": "integer"}},
                                        "required": ["not"], "enum": [{"not": 1, "contains": 1}]}))


CAT = {"type": "object", "required": ["pet", "meow"],
       "properties": {"pet": {"type": "string", "const": "cat"}, "meow": {"type": "integer"}}}
DOG = {"type": "object", "required": ["pet"], "properties": {"pet": {"enum": ["dog", "wolf"]}}}
ONE_OF_SERVED = [
    {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
    {"$defs": {"Cat": CAT, "Dog": DOG}, "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
     "discriminator": {"propertyName": "pet"}},                          # pydantic's discriminated union
    {"oneOf": [{"enum": ["a", "b"]}, {"const": "c"}, {"type": "boolean"}]},
]
ONE_OF_REFUSED = [
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},                 # 1 matches both
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
               {"type": "object", "properties": {"b": {"type": "integer"}}}]},   # {} matches both
    {"oneOf": [{"type": "object", "properties": {"k": {"const": 1}}},
               {"type": "object", "properties": {"k": {"const": 2}}}]},          # k not required: {}
    {"type": "array", "items": {"oneOf": [{"const": 1}, {"enum": [2, 1.0]}]}},
    {"oneOf": [{"$ref": "#/$defs/missing"}, {"type": "string"}]},
]


@pytest.mark.parametrize("schema", ONE_OF_REFUSED, ids=[str(i) for i in range(len(ONE_OF_REFUSED))])
def test_xgrammar_refuses_a_one_of_whose_branches_may_overlap(tokenizer, schema):
    """Black-box finding: xgrammar compiles oneOf as anyOf, so 1 passed oneOf [integer, number],
    which refuses it. A oneOf is served where its branches are provably disjoint (README)."""
    backend = make_backend("xgrammar", tokenizer, 2048, (2,))
    with pytest.raises(GrammarError, match=r"oneOf: branches \d and \d may both match one value"):
        backend.compile(specs.make("json", schema))
    for fine in ONE_OF_SERVED:
        backend.compile(specs.make("json", fine))


NO_VALUE = [
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"], "additionalProperties": False},
     '#/required: "b" is required'),
    ({"type": "integer", "enum": ["a"]}, "#/enum: none of its values is of type"),
    ({"type": "integer", "const": "a"}, '#/const: "a" is not of type "integer"'),
    ({"type": "object", "properties": {"a": {"type": "boolean", "enum": [0, 1]}}, "required": ["a"]},
     "#/properties/a/enum"),
    ({"enum": []}, "#/enum"),
    ({"type": []}, "#/type"),
    ({"type": "object", "required": ["a"], "properties": {"a": {"type": "string", "pattern": r"a[^\s\S]"}}},
     "matches no text at all"),
]


@pytest.mark.parametrize("backend", specs.BACKENDS)
@pytest.mark.parametrize("schema, why", NO_VALUE, ids=[str(i) for i in range(len(NO_VALUE))])
def test_a_schema_that_no_value_matches_is_refused(tokenizer, backend, schema, why):
    """Black-box findings: these compiled on xgrammar and wrote what the schema refuses ('"a"' for
    an integer, {"a":1} without the required "b"). llguidance finds them unsatisfiable itself."""
    b = make_backend(backend, tokenizer, 2048, (2,))
    with pytest.raises(GrammarError, match=re.escape(why) if backend == "xgrammar" else "nsatisfiable|empty"):
        b.compile(specs.make("json", schema, backend))
    # What stays: an enum of integral numbers for an integer, a number for a number, a required
    # name matched by additional properties on llguidance.
    b.compile(specs.make("json", {"type": "integer", "enum": [1, 2.0]}, backend))
    b.compile(specs.make("json", {"type": ["number", "null"], "const": 3}, backend))


def _req(seq_id, params, output, has_history=True):
    return SampleRequest(seq_id, params, [], list(output), 0, 0, "k1", has_history)


@pytest.mark.parametrize("backend", specs.BACKENDS)
def test_matchers_advance_and_are_rebuilt_from_tokens(tokenizer, backend):
    guides = Guides(lambda: tokenizer, 2048, (2,))
    try:
        params = SamplingParams(structured_outputs=specs.make("regex", "[0-9]{3}-[a-z]{3}", backend))
        text = "123-abc"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        guides.cache.compile(params.structured_outputs)   # compiled: no row waits
        plain = SampleRequest(9, SamplingParams(), [], [])
        masks = []
        for k, t in enumerate(ids):   # seq 1 walks the tokens one step at a time
            reqs = [plain, _req(1, params, ids[:k], has_history=False)]
            rows, bitmask, waiting = guides.start_masks(reqs).result()
            assert rows == [1] and bitmask.shape == (1, 64) and waiting == []    # only the guided row gets a mask
            masks.append(bitmask)
            guides.advance(reqs, [5, t])
        # seq 2 arrives with the same tokens already generated (a recompute): rebuilt from them.
        rows, rebuilt, _ = guides.start_masks([_req(2, params, ids[:-1])]).result()
        assert torch.equal(rebuilt, masks[-1])
        # The whole text done: only EOS is left.
        _, end, _ = guides.start_masks([_req(1, params, ids)]).result()
        assert _allowed(end) == [2]
        # Lost and nothing to rebuild from: held to EOS rather than let out of the grammar.
        _, lost, _ = guides.start_masks([_req(3, params, ids[:2], has_history=False)]).result()
        assert _allowed(lost) == [2]
        guides.forget(["k1"])
        assert not guides.seqs
    finally:
        guides.close()


def _allowed(bitmask):
    return [t for t in range(2048) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]


@pytest.mark.parametrize("backend", specs.BACKENDS)
def test_a_guided_output_stays_valid_utf8(tokenizer, backend):
    """Inside a JSON string, after a lone lead byte 0xED only 80-9F may follow (A0-BF would encode
    a UTF-16 surrogate, which decodes to U+FFFD and broke a maxLength); no ASCII token may follow
    an incomplete character; a complete one lets everything back in."""
    b = make_backend(backend, tokenizer, 2048, (2,))
    schema = {"type": "object", "required": ["s"], "additionalProperties": False,
              "properties": {"s": {"type": "string", "maxLength": 16}}}
    m = b.matcher(b.compile(specs.make("json", schema, backend)))
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    # The tiny model's tokenizer is byte-level BPE: every byte is a token of its own.
    token_of_byte = {byte: tokenizer.convert_tokens_to_ids(ch) for byte, ch in bytes_to_unicode().items()}
    for t in tokenizer('{"s":"', add_special_tokens=False)["input_ids"] + [token_of_byte[0xED]]:
        assert b.accept(m, t)

    def allowed_now():
        bitmask = torch.zeros(1, 64, dtype=torch.int32)
        b.fill([m], bitmask, [0])
        return set(_allowed(bitmask))
    now = allowed_now()
    assert token_of_byte[0x9F] in now and token_of_byte[0x80] in now
    assert not now & {token_of_byte[x] for x in range(0xA0, 0xC0)}          # a surrogate
    assert not now & {token_of_byte[x] for x in range(0x20, 0x7F)}          # mid-character ASCII
    assert b.accept(m, token_of_byte[0x95]) and b.accept(m, token_of_byte[0x9C])   # U+D55C, a Hangul syllable
    assert token_of_byte[ord("x")] in allowed_now()


def test_the_bitmask_masks_only_its_rows():
    logits = torch.randn(3, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 4
    bitmask[0, 2] = 1 << 1          # token 65
    masked = logits.clone()
    apply_token_bitmask(masked, [1], bitmask)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [4, 65]
    rows = [SamplingRow(SamplingParams(temperature=t, seed=1), [], []) for t in (0.0, 1.0, 0.0)]
    out = sample(logits, rows, 2, allowed=([1], bitmask))
    assert out.token_ids[1] in (4, 65)
    assert out.logprobs[1] == pytest.approx(torch.log_softmax(logits[1], -1)[out.token_ids[1]].item())   # raw


@pytest.mark.parametrize("backend", specs.BACKENDS)
def test_the_offline_engine_keeps_to_a_json_schema(tiny_llama, backend):
    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig
    with Engine(EngineConfig(model=tiny_llama, num_device_blocks=64)) as eng:
        params = SamplingParams(n=4, max_tokens=96, temperature=1.0, seed=11,
                                structured_outputs=specs.make("json", SCHEMA, backend))
        out = eng.generate(["record:"], params)[0]
        valid = jsonschema_rs.validator_for(SCHEMA)
        stopped = [o for o in out.outputs if o.finish_reason == "stop"]
        assert len(stopped) >= 3
        for o in stopped:
            assert valid.is_valid(json.loads(o.text)), o.text
        assert not eng.guides.seqs, "finished requests leave no matchers behind"
        # Fuzzed schemas (nested objects, arrays, enums, numbers, patterns): every stop validates.
        from pagedserve.loadgen.bench_structured import fuzz
        stopped, valid, n = fuzz(eng, 12, backend, max_tokens=128, seed=5)
        assert valid == stopped >= n // 2
        with pytest.raises(GrammarError, match="foo"):
            eng.generate(["x"], SamplingParams(structured_outputs=specs.make(
                "json", {"type": "object", "properties": {"a": {"type": "foo"}}}, backend)))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_sequences_keep_to_their_grammar(tiny_llama, mode):
    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig
    pattern = r"(\d )+"
    with Engine(EngineConfig(model=tiny_llama, num_device_blocks=8, num_host_blocks=32,
                             preemption_mode=mode)) as eng:
        params = [SamplingParams(n=2, max_tokens=40, temperature=1.0, seed=i,
                                 structured_outputs=specs.make("regex", pattern)) for i in range(3)]
        outs = eng.generate([f"row {i}:" for i in range(3)], params)
        assert eng.stats()[f"preempted_by_{mode}"] > 0
        for out in outs:
            for o in out.outputs:
                assert re.fullmatch(pattern if o.finish_reason == "stop" else r"(\d )*\d?", o.text), o.text
