import math

import pytest

from radixengine.sampling.sampling_params import SamplingParams

FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


def test_temperature_zero_is_greedy():
    params = SamplingParams(temperature=0.0, top_k=50)
    assert params.is_greedy and params.top_k == 1


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="\n").stop_strs == ["\n"]
    assert SamplingParams(stop=["a", "b"]).stop_strs == ["a", "b"]
    assert SamplingParams().stop_strs == []


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", -1),
        ("max_new_tokens", 2.5),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("min_p", 2.0),
        ("n", 0),
        ("sampling_seed", -3),
        ("stop_token_ids", [1, "x"]),
        ("ignore_eos", "yes"),
        ("n", 129),
        *[(name, bad) for name in FLOAT_FIELDS for bad in (math.nan, math.inf, -math.inf)],
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_field_is_rejected():
    with pytest.raises(ValueError, match="unknown sampling parameter.*best_of"):
        SamplingParams.from_dict({"max_new_tokens": 4, "best_of": 2})


def test_min_new_tokens_cannot_exceed_max():
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=2, min_new_tokens=3)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_logit_bias_is_rejected(bad):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"3": bad})
