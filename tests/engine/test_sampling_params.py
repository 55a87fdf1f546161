"""SamplingParams: every field is validated with an error naming it; the dict form round-trips."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from pdserve.engine.sampling_params import SamplingParams

# (field, bad value): each must be rejected with a ValueError whose message names the field.
BAD_VALUES = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 4.0),
    ("max_tokens", True),
    ("max_tokens", None),
    ("min_tokens", -1),
    ("min_tokens", 17),  # > max_tokens (16)
    ("min_tokens", 1.5),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "1"),
    ("temperature", False),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.2),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", -1.0),
    ("min_p", -0.1),
    ("min_p", 1.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.0),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", 7),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", 5),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("include_stop_str_in_output", None),
    ("logit_bias", {5: 100.5}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", "5:1"),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("structured", {"kind": "regex", "spec": "a"}),
    ("allowed_token_ids", [1.0]),
    ("allowed_token_ids", 3),
    ("bad_words_token_ids", [[]]),
    ("bad_words_token_ids", [[-2]]),
    ("bad_words_token_ids", [3]),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_invalid_value_is_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_every_field_has_a_rejection_case():
    covered = {f for f, _ in BAD_VALUES}
    assert covered == {f.name for f in dataclasses.fields(SamplingParams)}


def test_error_message_shows_range_and_value():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)


def test_defaults_are_valid_and_follow_vllm():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, 0, 0.0)
    assert p.seed is None and p.logprobs is None and p.stop == () and not p.is_greedy


def test_boundary_values_are_accepted():
    p = SamplingParams(max_tokens=1, min_tokens=1, temperature=0, top_p=1, top_k=1, min_p=1,
                       repetition_penalty=0.01, presence_penalty=-2, frequency_penalty=2,
                       seed=2**63 - 1, logprobs=20)
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert isinstance(p.top_p, float) and isinstance(p.presence_penalty, float)
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(seed=0).seed == 0


def test_sequences_are_normalised_to_tuples():
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4])
    assert p.stop == ("a", "bc") and p.stop_token_ids == (3, 4)
    assert SamplingParams(stop="\n").stop == ("\n",)
    hash(p)  # frozen and all-tuple: usable as a dict key


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0


def test_params_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().max_tokens = 3


@pytest.mark.parametrize(("kwargs", "greedy"), [
    ({"temperature": 0.0}, True),
    ({"top_k": 1}, True),
    ({"temperature": 0.7, "top_k": 1}, True),
    ({"temperature": 0.7}, False),
    ({"temperature": 1e-3, "top_k": 2}, False),
    ({"temperature": 1e-7}, True),  # dividing by it would overflow: treated as 0, like vLLM
])
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_dict_round_trip_through_msgpack():
    p = SamplingParams(max_tokens=40, min_tokens=2, temperature=0.7, top_p=0.9, top_k=50,
                       min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
                       frequency_penalty=-0.5, seed=12345, stop=["\n\n", "END"],
                       stop_token_ids=[2, 7], ignore_eos=True, logprobs=5,
                       include_stop_str_in_output=True)
    d = p.to_dict()
    assert all(isinstance(v, int | float | str | bool | list | None) for v in d.values())
    wire = msgpack.unpackb(msgpack.packb(d), raw=False)
    assert SamplingParams.from_dict(wire) == p
    assert SamplingParams.from_dict(SamplingParams().to_dict()) == SamplingParams()


def test_from_dict_fills_defaults_and_rejects_unknown_keys():
    assert SamplingParams.from_dict({"max_tokens": 3}) == SamplingParams(max_tokens=3)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams.from_dict({"max_tokens": 3, "best_of": 2})
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams.from_dict([("max_tokens", 3)])


def test_from_dict_validates_values():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_dict({"temperature": -1})


def test_validate_for_model_checks_stop_token_ids():
    SamplingParams(stop_token_ids=[0, 99]).validate_for_model(100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[0, 100]).validate_for_model(100)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingParams().validate_for_model(0)


def test_allowed_token_ids_and_bad_words_are_checked_and_round_trip():
    p = SamplingParams(allowed_token_ids=[1, 2], bad_words_token_ids=[[3], [4, 5]])
    assert p.allowed_token_ids == (1, 2) and p.bad_words_token_ids == ((3,), (4, 5))
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="bad_words_token_ids must not contain empty"):
        SamplingParams(bad_words_token_ids=[[]])
    with pytest.raises(ValueError, match="allowed_token_ids must be >= 0"):
        SamplingParams(allowed_token_ids=[-1])
    with pytest.raises(ValueError, match="allowed_token_ids contains out-of-vocab"):
        SamplingParams(allowed_token_ids=[9]).validate_for_model(8)
    with pytest.raises(ValueError, match="bad_words_token_ids contains out-of-vocab"):
        SamplingParams(bad_words_token_ids=[[1, 9]]).validate_for_model(8)
