from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"top_k": -1},
        {"max_tokens": 0},
        {"min_tokens": 5, "max_tokens": 4},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
        {"seed": -(2**63) - 1},
        {"seed": 2**63},
        {"logprobs": -1},
        {"ignore_eos": "yes"},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"repetition_penalty": float("inf")},
        {"min_p": 1.5},
        {"logit_bias": {3: 101.0}},
        {"logit_bias": {-1: 1.0}},
    ],
)
def test_invalid_params_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_params_normalize_stop_arguments():
    p = SamplingParams(stop="\n", stop_token_ids=[5, 6])
    assert p.stop == ("\n",) and p.stop_token_ids == (5, 6)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    hash(p)
