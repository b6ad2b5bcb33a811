"""The request model and error bodies of the completions API (pure, no engines)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cluster.openai_api import APIError, CompletionRequest, validation_error

BASE = {"model": "m", "prompt": "hello"}


def error_of(body) -> APIError:
    try:
        req = CompletionRequest.model_validate(body)
    except ValidationError as e:
        return validation_error(e)
    try:
        req.check_supported()
    except APIError as e:
        return e
    raise AssertionError(f"accepted {body!r}")


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"prompt": "x"}, "model", "missing_required_parameter"),
        ({"model": "m"}, "prompt", "missing_required_parameter"),
        ({**BASE, "prompt": ""}, "prompt", "invalid_value"),
        ({**BASE, "prompt": []}, "prompt", "invalid_value"),
        ({**BASE, "prompt": ["a", "b"]}, "prompt", "invalid_value"),
        ({**BASE, "prompt": [1, -3]}, "prompt", "invalid_value"),
        ({**BASE, "prompt": 7}, "prompt", "invalid_type"),
        ({**BASE, "prompt": [1.5, 2]}, "prompt", "invalid_type"),
        ({**BASE, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({**BASE, "max_tokens": -5}, "max_tokens", "invalid_value"),
        ({**BASE, "max_tokens": "12"}, "max_tokens", "invalid_value"),
        ({**BASE, "max_tokens": 3.0}, "max_tokens", "invalid_value"),
        ({**BASE, "temperature": 2.5}, "temperature", "invalid_value"),
        ({**BASE, "temperature": "hot"}, "temperature", "invalid_value"),
        ({**BASE, "top_p": 0}, "top_p", "invalid_value"),
        ({**BASE, "seed": -1}, "seed", "invalid_value"),
        ({**BASE, "n": 2}, "n", "invalid_value"),
        ({**BASE, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({**BASE, "stop": [""]}, "stop", "invalid_value"),
        ({**BASE, "prompt": "a\ud800b"}, "prompt", "invalid_value"),
        ({**BASE, "stop": ["\udfff"]}, "stop", "invalid_value"),
        ({**BASE, "stream": "yes"}, "stream", "invalid_value"),
        ({**BASE, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "invalid_value"),
        ({**BASE, "frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({**BASE, "logprobs": 2}, "logprobs", "unsupported_parameter"),
        ({**BASE, "echo": True}, "echo", "unsupported_parameter"),
        ({**BASE, "best_of": 3}, "best_of", "unsupported_parameter"),
        ({**BASE, "suffix": "z"}, "suffix", "unsupported_parameter"),
        ({**BASE, "logit_bias": {"5": 1.0}}, "logit_bias", "unsupported_parameter"),
        ([1, 2], None, "invalid_type"),
    ],
)
def test_invalid_requests_are_400_naming_the_parameter(body, param, code):
    e = error_of(body)
    assert e.status == 400
    err = e.body()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
    assert err["message"] and (param is None or param.split(".")[-1] in err["message"])


@pytest.mark.parametrize(
    "prompt, expected",
    [("hi", "hi"), ([5, 6], [5, 6]), (["hi"], "hi"), ([[5, 6]], [5, 6])],
)
def test_accepted_prompt_forms(prompt, expected):
    assert CompletionRequest.model_validate({**BASE, "prompt": prompt}).prompt == expected


def test_sampling_parameters_map_to_vllm():
    req = CompletionRequest.model_validate(
        {**BASE, "temperature": 0, "top_p": 0.5, "seed": 7, "stop": "\n", "min_tokens": 50, "ignore_eos": True}
    )
    assert req.sampling(10) == {
        "max_tokens": 10, "temperature": 0.0, "top_p": 0.5, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "ignore_eos": True, "min_tokens": 10, "seed": 7, "stop": ["\n"],
    }
    assert "seed" not in CompletionRequest.model_validate(BASE).sampling(4)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
          "presence_penalty", "logprobs", "echo", "user", "min_tokens"]


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), JSONISH, max_size=8) | JSONISH)
def test_any_json_is_accepted_or_a_400(body):
    """Whatever JSON arrives, validation either accepts it or yields a 400 with a well-formed body."""
    try:
        req = CompletionRequest.model_validate(body)
        req.check_supported()
        assert req.sampling(16)["max_tokens"] == 16
    except ValidationError as e:
        err = validation_error(e)
        assert err.status == 400 and err.body()["error"]["message"]
    except APIError as err:
        assert err.status == 400 and err.code == "unsupported_parameter"
