"""Sampling parameters checked at the edge by SGLang's rules (``SamplingParams.__post_init__`` and
``verify()``): each of its refusals, its accepted corner cases, and fuzzed parameter objects that
only ever give a ``SamplingError`` or parameters the wire can carry."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcompassd import sampling
from kvcompassd.sampling import SGLANG_FIELDS, SamplingError, check_sampling
from kvcompassd.wire import Params


def check(params, vocab_size=None):
    return check_sampling(params, max_new_tokens_limit=1024, default_max_new_tokens=16, vocab_size=vocab_size)


@pytest.mark.parametrize("params,param", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 2.1}, "repetition_penalty"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 1025}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"min_new_tokens": 20}, "min_new_tokens"),  # > the default max_new_tokens 16
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"n": 2}, "n"),
    ({"regex": "a", "json_schema": "{}"}, "regex"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"stop": ["a", 3]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"sampling_seed": 2**63}, "sampling_seed"),
    ({"beam_width": 0}, "beam_width"),
    ({"beam_width": 4}, "beam_width"),  # SGLang would search; the edge carries one output back
    ({"regex": "a", "structural_tag": "{}"}, "regex"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"custom_params": [1]}, "custom_params"),
    ({"seed": 7}, "seed"),  # SGLang's field is sampling_seed: seed is a TypeError there
    ({"custom_params": {"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}}}, "sampling_params"),  # deeper than the wire
])
def test_refuses_what_sglang_refuses(params, param):
    with pytest.raises(SamplingError) as caught:
        check(params)
    assert caught.value.param == param


def test_logit_bias_keys_are_checked_against_the_vocabulary_when_known():
    assert check({"logit_bias": {"300": 1.0}})["logit_bias"] == {"300": 1.0}
    with pytest.raises(SamplingError):
        check({"logit_bias": {"300": 1.0}}, vocab_size=256)


@pytest.mark.parametrize("params", [
    {},
    None,
    {"temperature": 0, "top_k": 0},  # greedy: SGLang sets top_k = 1 before verify()
    {"temperature": 5e-7, "top_k": -5},
    {"temperature": None, "top_p": None, "top_k": None},  # None means the default
    {"top_k": -1, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 2.0},
    {"max_new_tokens": 0},
    {"max_new_tokens": 8, "min_new_tokens": 8},
    {"stop": "x", "stop_token_ids": [1, 2], "stop_regex": ["a+"]},
    {"sampling_seed": 2**63 - 1, "frequency_penalty": -2, "presence_penalty": 2},
    {"sampling_seed": -(2**63), "beam_width": 1, "watermark": {}},
    {"json_schema": "{}", "regex": None},
])
def test_accepts_what_sglang_accepts(params):
    assert check(params)["max_new_tokens"] == (params or {}).get("max_new_tokens", 16)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)


@given(st.dictionaries(st.sampled_from(sorted(SGLANG_FIELDS) + ["other"]), json_values, max_size=6))
def test_fuzzed_parameters_are_refused_cleanly_or_fit_the_wire(params):
    try:
        out = check(params)
    except SamplingError as exc:
        assert exc.param and str(exc)
        return
    assert Params().check(out, "sampling_params") == out
    assert 0 <= out["max_new_tokens"] <= 1024


scalars = st.none() | st.booleans() | st.integers(-5, 2000) | st.floats() | st.text(max_size=8)


@given(st.lists(st.dictionaries(st.sampled_from(sorted(SGLANG_FIELDS) + ["other"]), scalars, max_size=5),
                min_size=1, max_size=6))
def test_accepted_objects_remembered_answer_as_the_checks_do(objects):
    """A parameter object of scalar values once accepted is answered from memory afterwards:
    the same answer as the checks give, value for value (a -0.0 stays -0.0), and every refusal
    still refused."""
    sampling._ACCEPTED.clear()
    for params in objects * 2:  # each twice: the second time from memory if accepted
        for limit in (1024, 8):
            try:
                want = sampling._check_sampling(params, max_new_tokens_limit=limit, default_max_new_tokens=4,
                                                vocab_size=None)
            except SamplingError as exc:
                with pytest.raises(SamplingError) as caught:
                    check_sampling(params, max_new_tokens_limit=limit, default_max_new_tokens=4)
                assert caught.value.param == exc.param
                continue
            got = check_sampling(params, max_new_tokens_limit=limit, default_max_new_tokens=4)
            assert list(got.items()) == list(want.items())
            assert [repr(v) for v in got.values()] == [repr(v) for v in want.values()]
            assert got is not params


def test_a_remembered_acceptance_is_for_those_types_limits_and_short_strings_only():
    sampling._ACCEPTED.clear()
    assert check({"ignore_eos": True}) == {"ignore_eos": True, "max_new_tokens": 16}
    with pytest.raises(SamplingError):  # 1 == True, but only a boolean is one
        check({"ignore_eos": 1})
    assert check({"max_new_tokens": 1000})["max_new_tokens"] == 1000
    with pytest.raises(SamplingError):  # accepted under a limit of 1,024, not under one of 999
        check_sampling({"max_new_tokens": 1000}, max_new_tokens_limit=999, default_max_new_tokens=16)
    assert len(sampling._ACCEPTED) == 2
    check({"stop": "x" * (sampling.ACCEPTED_CHARS + 1)})
    check({"stop": ["a"]})  # (a list: not a scalar)
    assert len(sampling._ACCEPTED) == 2
    for n in range(sampling.ACCEPTED_MAX + 5):  # bounded: full, it starts again
        check({"max_new_tokens": n % 1000, "top_k": n + 1})
        assert len(sampling._ACCEPTED) <= sampling.ACCEPTED_MAX
