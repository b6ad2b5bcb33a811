"""The OpenAI-style completions protocol: the request model, error bodies and response objects. Pure (no Ray, no
vLLM), so that every rule here is tested in milliseconds and fuzzed.

Accepted: `model`, `prompt` (a string, a list of token ids, or a one-element list of either), `max_tokens`,
`temperature`, `top_p`, `seed`, `stop` (a string or up to 4), `n` = 1, `stream`, `stream_options.include_usage`,
`presence_penalty`, `frequency_penalty`, `user`, and vLLM's `ignore_eos` / `min_tokens`. Parameters this service does
not implement (`logprobs`, `echo`, `best_of` > 1, `suffix`, `logit_bias`) are refused with 400 naming them rather than
silently ignored; any other unknown field is refused too.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_SEED = 2**63 - 1


class APIError(Exception):
    """An error the service returns as an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _utf8(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: StrictInt | None = Field(1, ge=1, le=1, description="only one choice per request")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = Field(None, max_length=256)
    ignore_eos: StrictBool | None = False
    min_tokens: StrictInt | None = Field(0, ge=0)
    # refused unless at their defaults (listed so the error names them instead of "extra field")
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], (str, list)):
                if len(v) != 1:
                    raise ValueError(f"batched prompts are not supported: send one prompt per request, got {len(v)}")
                v = v[0]
            if isinstance(v, list) and not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v, list) and any(t < 0 for t in v):
                raise ValueError("token ids must be >= 0")
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, str):
            _utf8(v)
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        for s in stops:
            if not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters")
            _utf8(s)
        return stops or None

    def check_supported(self) -> None:
        """400 for parameters this service does not implement (set to anything but their defaults)."""
        for name, default_ok in (("logprobs", self.logprobs is None), ("echo", not self.echo),
                                 ("best_of", self.best_of in (None, 1)), ("suffix", self.suffix is None),
                                 ("logit_bias", not self.logit_bias)):
            if not default_ok:
                raise APIError(400, f"'{name}' is not supported by this service", param=name, code="unsupported_parameter")

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        """Keyword arguments for vLLM's SamplingParams."""
        out: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "ignore_eos": bool(self.ignore_eos),
            "min_tokens": min(self.min_tokens or 0, max_tokens),
        }
        if self.seed is not None:
            out["seed"] = self.seed
        if self.stop:
            out["stop"] = list(self.stop)
        return out


def validation_error(e: ValidationError) -> APIError:
    """The first problem of a request that failed validation, as a 400 naming the parameter."""
    err = e.errors()[0]
    loc = err["loc"]
    param = str(loc[0]) if loc else None
    if param == "stream_options" and len(loc) > 1 and isinstance(loc[1], str):
        param = f"stream_options.{loc[1]}"
    kind = err.get("type", "")
    if kind == "missing":
        return APIError(400, f"'{param}' is a required property", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: '{param}'", param=param, code="unknown_parameter")
    if param is None:
        return APIError(400, f"the request body must be a JSON object: {err['msg']}", code="invalid_type")
    if param == "prompt" and not kind.startswith("value_error"):
        return APIError(400, "invalid 'prompt': expected a string or a list of token ids", param=param, code="invalid_type")
    return APIError(400, f"invalid '{param}': {err['msg'].removeprefix('Value error, ')}", param=param, code="invalid_value")


def request_schema() -> dict[str, Any]:
    """The completions request as a self-contained JSON schema (for the OpenAPI document: clients and fuzzers)."""
    schema = CompletionRequest.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(x: Any) -> Any:
        if isinstance(x, dict):
            if "$ref" in x:
                return inline(defs[x["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in x.items()}
        if isinstance(x, list):
            return [inline(v) for v in x]
        return x

    return inline(schema)


def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def completion(rid: str, model: str, text: str, finish_reason: str | None, usage: dict[str, int], created: int | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created or int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage,
    }


def chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_list(name: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "hybrid-pd"}]}
