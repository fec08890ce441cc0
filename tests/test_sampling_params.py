"""SamplingParams validation: every bad field is a typed InvalidRequestError naming the field."""

import pytest

from kvfleet.errors import InvalidRequestError
from kvfleet.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, param", [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"min_tokens": True}, "min_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"logprobs": 21}, "logprobs"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
])
def test_bad_fields_raise_invalid_request_error(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_good_extremes_are_accepted():
    SamplingParams(seed=2**64 - 1, top_k=-1, temperature=0, stop="x", logprobs=0, min_p=1.0)
    SamplingParams(seed=-(2**63), max_tokens=None)


def test_mutated_params_are_rechecked():
    p = SamplingParams()
    p.temperature = -1
    with pytest.raises(InvalidRequestError):
        p.validate()
