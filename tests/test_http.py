"""The OpenAI-style HTTP service on the embedded cluster (prefill TP 1 + decode TP 2, Ray Serve ingress), started by
the same functions `make run` uses, exercised with the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import ray

from actors.engine import free_port
from cluster.config import DeployConfig
from cluster.launch import start_cluster, start_http, stop_cluster
from tests.pd_helpers import wait_for

pytestmark = pytest.mark.engine
KEY = "test-key-0123456789"
MODEL = "tiny-hybrid"


@pytest.fixture(scope="module")
def served(ray_local, gdn_model):
    cfg = DeployConfig.model_validate({
        "model": {"path": str(gdn_model), "name": MODEL},
        "coordinator": {"name": "coordinator-http", "namespace": "pd-test-http"},
        "http": {"port": free_port(), "api_key": KEY, "max_body_bytes": 65536},
    })
    t0 = time.monotonic()
    cluster = start_cluster(cfg, progress=print)
    try:
        start_http(cluster, progress=print)
        print(f"cluster + HTTP up in {time.monotonic() - t0:.0f} s: {cluster.timings}")
        yield cluster
    finally:
        stop_cluster(cluster, shutdown_serve=True, progress=print)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(gdn_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gdn_model)


def colocated(served, prompt_ids: list[int], sampling: dict) -> tuple[list[int], str]:
    """The same request run whole on the decode engine (no transfer): token ids and text."""
    decode = served.engines["decode-0"]

    async def run():
        ids, text = [], ""
        stream = decode.decode.options(num_returns="streaming").remote(prompt_ids, dict(sampling), None, f"colo-{time.time_ns()}")
        async for ref in stream:
            out = await ref
            ids += out["token_ids"]
            text += out["text"]
        return ids, text

    return asyncio.run(run())


def post(served, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (dict, list)):
        return httpx.post(f"{served.url}/v1/completions", json=body, headers=headers, timeout=60, **kw)
    return httpx.post(f"{served.url}/v1/completions", content=body, headers={**headers, "Content-Type": "application/json"}, timeout=60, **kw)


PROMPTS = ["the prefill engine hands its state to the decode engine", [1] + list(range(5, 205)),
           [1] + [(i * 37) % 1000 + 3 for i in range(700)]]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["text", "200-ids", "700-ids"])
def test_completion_equals_colocated(served, client, tokenizer, prompt):
    ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    want_ids, want_text = colocated(served, ids, {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True})
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want_text and want_text
    assert got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(want_ids))
    assert got.model == MODEL and got.object == "text_completion"


def test_streamed_completion(served, client, tokenizer):
    prompt = PROMPTS[0]
    _, want_text = colocated(served, tokenizer(prompt)["input_ids"], {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1, "tokens must arrive incrementally"
    assert "".join(c.choices[0].text for c in text_chunks) == want_text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices
    assert len({c.id for c in chunks}) == 1


def test_sse_ends_with_done(served):
    with httpx.stream("POST", f"{served.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": MODEL, "prompt": "a b c", "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1]) and len(events) >= 2


def test_model_list(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_seeded_sampling_is_reproducible_and_equals_colocated(served, client, tokenizer):
    prompt = "sampling with a seed gives the same text"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=2.0, seed=1234, extra_body={"ignore_eos": True})
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    others = {client.completions.create(**{**kw, "seed": s}).choices[0].text for s in range(6)}
    assert len(others | {a}) > 1, "different seeds should sample differently at temperature 2"
    _, want = colocated(served, tokenizer(prompt)["input_ids"],
                        {"max_tokens": 12, "temperature": 2.0, "seed": 1234, "ignore_eos": True})
    assert a == want


def test_stop_sequence(served, client, tokenizer):
    prompt = PROMPTS[0]
    _, full = colocated(served, tokenizer(prompt)["input_ids"], {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True})
    stop = full[len(full) // 2:len(full) // 2 + 2]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert got.finish_reason == "stop"
    assert got.text == full[:full.index(stop)]


LONG = [1] + [5] * 2100


@pytest.mark.parametrize(
    "body, status, code, param",
    [
        ({"model": MODEL}, 400, "missing_required_parameter", "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "invalid_value", "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "context_length_exceeded", "max_tokens"),
        ({"model": MODEL, "prompt": LONG}, 400, "context_length_exceeded", "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "invalid_value", "max_tokens"),
        ({"model": MODEL, "prompt": {"text": "x"}}, 400, "invalid_type", "prompt"),
        ({"model": MODEL, "prompt": [1, 10**7]}, 400, "invalid_value", "prompt"),
        ({"model": MODEL, "prompt": "x", "n": 3}, 400, "invalid_value", "n"),
        ({"model": MODEL, "prompt": "x", "logprobs": 1}, 400, "unsupported_parameter", "logprobs"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model_not_found", "model"),
        (b'{"model": "tiny-hybrid", "prompt": ', 400, "invalid_json", None),
        (b"[]", 400, "invalid_type", None),
        (json.dumps({"model": MODEL, "prompt": "y" * 70000}).encode(), 413, "request_too_large", None),
        (b"[" * 30000 + b"]" * 30000, 400, "invalid_json", None),
        (b'{"model": "tiny-hybrid", "prompt": [' + b"1" * 5000 + b"]}", 400, "invalid_json", None),
        (b'{"model": "tiny-hybrid", "prompt": "a\\ud800b"}', 400, "invalid_value", "prompt"),
    ],
    ids=["no-prompt", "negative-max", "huge-max", "long-prompt", "max-type", "prompt-type", "token-range", "n",
         "logprobs", "unknown-model", "bad-json", "not-object", "oversized", "deep-json", "huge-number", "lone-surrogate"],
)
def test_errors_are_openai_style(served, body, status, code, param):
    r = post(served, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param) and err["message"] and err["type"]


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_routes_and_methods(served):
    r = httpx.get(f"{served.url}/v1/nowhere", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{served.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_api_key_required(served):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for key in (None, "wrong-key", KEY + "x"):
        r = post(served, body, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{served.url}/v1/models").status_code == 401
    assert httpx.get(f"{served.url}/metrics").status_code == 401
    assert httpx.get(f"{served.url}/health").status_code == 200  # liveness stays open
    assert post(served, body).status_code == 200
    bad = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_no_capacity_is_503_with_retry_after(served):
    ray.get(served.coordinator.set_state.remote("prefill-0", "draining"))
    try:
        r = post(served, {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"
        assert int(r.headers["retry-after"]) >= 1
        h = httpx.get(f"{served.url}/health")
        assert h.status_code == 503 and h.json()["ready"] == {"prefill": 0, "decode": 1}
    finally:
        ray.get(served.coordinator.set_state.remote("prefill-0", "ready"))
    assert post(served, {"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_client_disconnect_aborts_on_both_engines(served):
    decode, prefill = served.engines["decode-0"], served.engines["prefill-0"]
    assert ray.get(decode.num_unfinished.remote()) == 0
    body = {"model": MODEL, "prompt": [1] + list(range(3, 400)), "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert ray.get(decode.num_unfinished.remote()) == 1  # generating: 1500 tokens would take a minute
    # the connection is closed: the ingress cancels, the router aborts the decode request and frees the prefill side
    took = wait_for(lambda: ray.get(decode.num_unfinished.remote()) == 0, 20)
    print(f"decode request aborted {took:.2f} s after the client disconnected")
    assert ray.get(prefill.num_unfinished.remote()) == 0
    assert ray.get(prefill.pending_sends.remote(5.0)) == []
    metrics = httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert float(_metric(metrics, "pd_client_disconnects_total")) >= 1


def _metric(text: str, name: str) -> str:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return line.rsplit(" ", 1)[1]
    raise AssertionError(f"{name} not in /metrics")


def test_metrics(served, client):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3)
    text = httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert float(_metric(text, 'pd_requests_total{status="200"}')) >= 1
    assert float(_metric(text, "pd_time_to_first_token_seconds_count")) >= 1
    assert float(_metric(text, "pd_inter_token_latency_seconds_count")) >= 2
    assert float(_metric(text, "pd_transfer_bytes_total")) > 0
    assert float(_metric(text, "pd_transfer_seconds_total")) > 0
    assert float(_metric(text, 'pd_pool_engines{role="decode",state="ready"}')) == 1
    assert float(_metric(text, 'pd_pool_engines{role="prefill",state="ready"}')) == 1


def test_fuzzed_requests_never_get_a_server_error(served, tmp_path):
    """schemathesis generates requests from the service's own OpenAPI document (valid and invalid bodies, headers,
    methods) and sends them to the running service: no 5xx, every answer matches the schema's error contract."""
    import subprocess
    import sys
    from pathlib import Path

    st = Path(sys.executable).parent / "schemathesis"
    cmd = [str(st), "run", f"{served.url}/openapi.json", "--checks", "not_a_server_error", "--max-examples", "40",
           "-H", f"Authorization: Bearer {KEY}", "--generation-deterministic", "--report-dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(r.stdout[-1500:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "/v1/completions" in r.stdout


def test_short_load_loses_nothing(served):
    """16 streaming clients for 15 s (the long version: `python -m cluster bench load --clients 32 --duration 60`)."""
    from cluster.loadgen import run_load

    res = asyncio.run(run_load(served.url, MODEL, clients=16, duration_s=15, max_tokens=16, api_key=KEY))
    summary = res.summary()
    print(f"load: {summary}")
    assert summary["lost_or_malformed"] == 0, summary["first_errors"]
    assert res.ok >= 16 and res.ok == res.requests
