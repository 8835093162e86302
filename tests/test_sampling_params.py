"""SamplingParams: vLLM's defaults and ranges, errors naming the bad field, the wire form."""

import dataclasses
import subprocess
import sys

import msgpack
import pytest

from pagedserve.services.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_match_vllm_and_validate():
    p = SamplingParams().validate()
    assert (p.n, p.max_tokens, p.min_tokens) == (1, 16, 0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.logprobs is None and p.cache_salt is None
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.beam_width, p.length_penalty, p.early_stopping) == (False, 1, 1.0, False)
    assert p.skip_special_tokens is True
    assert not p.greedy and not p.use_beam_search


def test_default_lists_are_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


def test_greedy_and_beam_search_properties():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy
    beam = SamplingParams(beam_width=4, n=2, temperature=0.8)
    assert beam.use_beam_search and beam.greedy


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("n", 0),
    ("beam_width", 0),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("logprobs", -1),
    ("logprobs", 21),
    ("seed", 2**64),
    ("stop", ["ok", ""]),
    ("stop", "not a list"),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", 5),
    ("early_stopping", "sometimes"),
    ("early_stopping", 1),
    ("cache_salt", ""),
    ("temperature", float("nan")),
    ("top_p", float("inf")),
])
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value}).validate()
    assert info.value.param == field
    assert field in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("n", True),  # bool is not an int
    ("max_tokens", 16.0),  # nor is a float
    ("top_k", "5"),
    ("seed", False),
    ("logprobs", 2.0),
    ("temperature", "0.7"),  # strings are not numbers
    ("top_p", True),
    ("repetition_penalty", None),
    ("stop_token_ids", [1, True]),
    ("stop", [1]),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("cache_salt", 3),
])
def test_wrong_types_name_the_field(field, value):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value}).validate()
    assert info.value.param == field


def test_min_tokens_must_not_exceed_max_tokens():
    SamplingParams(min_tokens=16, max_tokens=16).validate()
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(min_tokens=17, max_tokens=16).validate()
    assert info.value.param == "min_tokens"


def test_beam_search_needs_n_at_most_beam_width():
    SamplingParams(beam_width=4, n=4).validate()
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(beam_width=2, n=3).validate()
    assert info.value.param == "n"
    SamplingParams(beam_width=1, n=3).validate()  # plain sampling: n is free


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0), dict(top_k=-1), dict(top_k=1), dict(top_p=1e-9), dict(min_p=1.0),
    dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(repetition_penalty=1e-3),
    dict(logprobs=0), dict(logprobs=20), dict(seed=-5), dict(seed=2**64 - 1),
    dict(early_stopping=True), dict(early_stopping="never"), dict(temperature=1),
    dict(stop=["\n\n"], stop_token_ids=[0, 7]), dict(cache_salt="tenant-a"),
])
def test_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs).validate()


def test_error_is_a_value_error():
    assert issubclass(SamplingParamsError, ValueError)


def _wire_types_only(value):
    if isinstance(value, list):
        return all(_wire_types_only(v) for v in value)
    return value is None or type(value) in (int, float, str, bool)


def test_round_trip_through_dict_and_msgpack():
    p = SamplingParams(n=2, max_tokens=40, min_tokens=3, temperature=0.7, top_p=0.9, top_k=40,
                       min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                       seed=1234, logprobs=5, stop=["END", "\n"], stop_token_ids=[2, 9],
                       ignore_eos=True, beam_width=1, length_penalty=0.8, early_stopping="never",
                       cache_salt="salt", skip_special_tokens=False, logit_bias={7: -100.0, 3: 2.5},
                       allowed_token_ids=[4, 8]).validate()
    wire = p.to_dict()
    assert set(wire) == {f.name for f in dataclasses.fields(SamplingParams)}
    assert all(_wire_types_only(v) for v in wire.values())
    assert SamplingParams.from_dict(wire) == p
    packed = msgpack.unpackb(msgpack.packb(wire), raw=False)
    assert SamplingParams.from_dict(packed) == p


def test_to_dict_copies_lists():
    p = SamplingParams(stop=["a"])
    p.to_dict()["stop"].append("b")
    assert p.stop == ["a"]


def test_from_dict_fills_defaults_and_rejects_unknown_keys():
    assert SamplingParams.from_dict({"temperature": 0}) == SamplingParams(temperature=0)
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict({"temperature": 0.5, "best_of": 2})
    assert info.value.param == "best_of"


def test_from_dict_validates():
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict({"top_p": 0})
    assert info.value.param == "top_p"
    with pytest.raises(SamplingParamsError):
        SamplingParams.from_dict(["not", "a", "dict"])


def test_module_does_not_import_torch():
    # The router and the scheduler import it: keep torch (4 s to import) out of their start-up.
    code = "import sys, pagedserve.services.sampling_params; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("bias", [{-1: 1.0}, {5: 101.0}, {5: float("nan")}, {"5": 1.0}, {5: "x"}, [[5, 1.0]]])
def test_bad_logit_bias_rejected(bias):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(logit_bias=bias).validate()
    assert e.value.param == "logit_bias"


@pytest.mark.parametrize("ids", [[], [-1], [2 ** 64], ["5"], [True], (5,), 5])
def test_bad_allowed_token_ids_rejected(ids):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(allowed_token_ids=ids).validate()
    assert e.value.param == "allowed_token_ids"


def test_allowed_token_ids_with_beam_search_rejected():
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(beam_width=2, allowed_token_ids=[5]).validate()
    assert e.value.param == "allowed_token_ids"


def test_logit_bias_with_beam_search_rejected():
    with pytest.raises(SamplingParamsError):
        SamplingParams(beam_width=2, logit_bias={5: 1.0}).validate()


@pytest.mark.parametrize("field,value", [("logprobs", 1), ("stop_token_ids", [5]), ("min_tokens", 2),
                                         ("repetition_penalty", 1.2), ("frequency_penalty", 0.5),
                                         ("presence_penalty", -0.5)])
def test_what_beam_search_would_ignore_is_refused(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(beam_width=2, max_tokens=4, **{field: value}).validate()
    assert e.value.param == field
