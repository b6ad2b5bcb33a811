"""The HTTP service on the embedded cluster (the folder's, conftest.py: the default layout as Serve pools, vLLM's
OpenAI front end over the cluster), started by the same functions `make run` uses, exercised with the official `openai`
client, raw HTTP and vLLM's own serving benchmark client. Every generated text is compared with the same request run
whole (colocated) on the decode engine - vLLM's own engine given the same sampling parameters."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import time

import httpx
import openai
import pytest
import ray

from actors.engine.settings import free_port
from tests.default_layout.shared import KEY, MODEL
from tests.pd_helpers import metric, wait_for

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(gdn_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gdn_model)


def colocated(served, prompt_ids: list[int], sampling: dict) -> tuple[list[int], str]:
    """The same request run whole on the decode engine (no transfer): token ids and text."""
    items = colocated_items(served, prompt_ids, sampling)
    return [t for i in items for t in i["token_ids"]], "".join(i["text"] for i in items)


def colocated_items(served, prompt_ids: list[int], sampling: dict) -> list[dict]:
    """The colocated run's per-step outputs (token ids, text, finish reason, logprobs when asked for)."""
    decode = served.engines["decode-0"]

    async def run():
        stream = decode.decode(prompt_ids, dict(sampling), None, f"colo-{time.time_ns()}")
        return [await ref async for ref in stream]

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


def test_chat_completion_uses_the_chat_template_and_equals_colocated(served, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "where does the state go?"}]
    ids = httpx.post(f"{served.url}/tokenize", json={"model": MODEL, "messages": messages},
                     headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    _, want = colocated(served, ids, {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True})
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want and want
    assert got.choices[0].message.role == "assistant" and got.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[0].choices[0].delta.role == "assistant"


def test_logprobs_come_from_the_decode_engine(served, client, tokenizer):
    prompt = PROMPTS[0]
    ids = tokenizer(prompt)["input_ids"]
    items = colocated_items(served, ids, {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 2})
    want = [step for i in items for step in i["logprobs"]]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(got.tokens) == len(got.token_logprobs) == len(want) == 6
    for lp, top, ranked in zip(got.token_logprobs, got.top_logprobs, want):
        assert lp == pytest.approx(ranked[0][1], abs=0.05)  # the chosen (greedy) token: the best one
        assert len(top) >= 2 and max(top.values()) == pytest.approx(ranked[0][1], abs=0.05)


def test_echo_with_prompt_logprobs_from_the_prefill_engine(served, client, tokenizer):
    prompt = "the prefill engine computes the prompt logprobs"
    ids = tokenizer(prompt)["input_ids"]
    items = colocated_items(served, ids, {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                                          "prompt_logprobs": 1})
    want = items[0]["prompt_logprobs"]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1,
                                    extra_body={"ignore_eos": True}).choices[0]
    assert got.text.startswith(prompt)
    lps = got.logprobs.token_logprobs
    assert len(lps) == len(ids) + 3 and lps[0] is None and all(lp is not None for lp in lps[1:])
    for pos in range(1, len(ids)):
        # the prompt token's own logprob, as the colocated engine scores it (TP 1 prefill vs TP 2: bf16 noise)
        expected = dict(want[pos])[ids[pos]]
        assert lps[pos] == pytest.approx(expected, abs=0.1), pos
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert plain.text == got.text


def test_n_choices_each_equal_their_seeded_colocated_run(served, client, tokenizer):
    prompt = "two choices from one request"
    ids = tokenizer(prompt)["input_ids"]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=2, temperature=2.0, seed=77,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1]
    for i, choice in enumerate(got.choices):  # vLLM's rule: child i samples with seed + i
        _, want = colocated(served, ids, {"max_tokens": 8, "temperature": 2.0, "seed": 77 + i, "ignore_eos": True})
        assert choice.text == want
    assert got.usage.completion_tokens == 16
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=2, temperature=2.0, seed=77,
                                              stream=True, extra_body={"ignore_eos": True}))
    for i, choice in enumerate(got.choices):
        assert "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) == choice.text


EXTENSIONS = {
    "top_k=1": {"temperature": 2.0, "seed": 3, "top_k": 1},
    "min_p": {"temperature": 2.0, "seed": 3, "min_p": 0.5},
    "repetition_penalty": {"temperature": 2.0, "seed": 3, "repetition_penalty": 4.0},
    "frequency_penalty": {"temperature": 2.0, "seed": 3, "frequency_penalty": 2.0},
    "stop_token_ids": {"temperature": 0.0, "stop_token_ids": "<3rd greedy token>"},
    "min_tokens": {"temperature": 0.0, "min_tokens": 3, "stop_token_ids": "<2nd greedy token>"},
    "bad_words": {"temperature": 0.0, "bad_words": "<2nd greedy token>"},
    "include_stop_str_in_output": {"temperature": 0.0, "stop": "<greedy text, 3rd piece>", "include_stop_str_in_output": True},
}


@pytest.mark.parametrize("name", EXTENSIONS)
def test_sampling_extensions_act_as_in_vllm(served, client, tokenizer, name):
    """Each vLLM sampling extension gives what the colocated vLLM engine gives with the same parameters, and
    changes the output the way it should: top_k=1 or min_p=0.5 at temperature 2 is greedy on this sharp model; a
    penalty moves a seeded temperature-2 sample elsewhere; a banned word moves greedy text off its path; a stop
    token ends it early, unless min_tokens masks it (then the text goes on past it)."""
    prompt = PROMPTS[0]
    ids = tokenizer(prompt)["input_ids"]
    greedy_ids, greedy = colocated(served, ids, {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True})
    extra = dict(EXTENSIONS[name])
    if name == "stop_token_ids":
        extra["stop_token_ids"] = [greedy_ids[2]]
    if name == "min_tokens":
        extra["stop_token_ids"] = [greedy_ids[1]]
    if name == "bad_words":
        extra["bad_words"] = [tokenizer.decode([greedy_ids[1]]).strip() or tokenizer.decode([greedy_ids[1]])]
    if name == "include_stop_str_in_output":
        extra["stop"] = [tokenizer.decode(greedy_ids[2:4])]
    stops = "stop" in extra or "stop_token_ids" in extra
    _, want = colocated(served, ids, {"max_tokens": 10, "ignore_eos": not stops, **extra})
    got = post(served, {"model": MODEL, "prompt": prompt, "max_tokens": 10, "ignore_eos": not stops, **extra})
    got = got.json()["choices"][0]["text"]
    assert got == want
    if name in ("top_k=1", "min_p"):
        assert got == greedy
    elif name == "repetition_penalty":  # (frequency_penalty's +-2 logits do not move this sharp model's sample:
        plain = {k: v for k, v in extra.items() if not k.endswith("penalty")}  # its check is the equality above)
        _, unpenalized = colocated(served, ids, {"max_tokens": 10, "ignore_eos": True, **plain})
        assert got != unpenalized
    elif name in ("bad_words", "min_tokens"):
        assert got != greedy and not got.startswith(greedy[:len(tokenizer.decode(greedy_ids[:2]))])
    elif name in ("stop_token_ids", "include_stop_str_in_output"):  # the stops end it inside the greedy text
        assert greedy.startswith(got) and len(got) < len(greedy)
        if name == "include_stop_str_in_output":
            assert got.endswith(extra["stop"][0])


def test_structured_output_and_continuous_usage(served, client):
    """vLLM's structured output (a choice, guided by its grammar backend on the decode engine) and
    `stream_options.continuous_usage_stats` (usage on every chunk)."""
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["prefill", "decode"]}})
    assert got.choices[0].text in ("prefill", "decode")
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage]
    assert counts == sorted(counts) and counts[-1] == 4 and len(counts) >= 2


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome", "oslo"]},
                                                    "days": {"type": "integer", "enum": [1, 2, 3]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "strict": True, "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["named", "required"])
def test_tool_calls_come_back_parsed(served, client, tokenizer, choice):
    """`chat.tool_call_parser` reaches vLLM's server: a named function and tool_choice "required" come back as parsed
    tool calls, streamed or not, and with the tools' `strict: true` (OpenAI's rule: vLLM then decodes the arguments
    under each tool's schema, so even the tiny model's follow it) their arguments follow the schema. Without the
    option vLLM answers 400 ("requires --tool-call-parser"): test_config checks that it reaches vLLM's arguments."""
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    messages = [{"role": "user", "content": "the weather in rome for two days?"}]
    # the tiny model's favourite tokens inside a JSON object are whitespace, which JSON allows without end: a bias
    # against them (not a ban: the call's envelope still has its newlines) lets it write the arguments
    blank = {str(i): -100 for i in range(len(tokenizer)) if tokenizer.decode([i]) and not tokenizer.decode([i]).strip()}
    kw = dict(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], tool_choice=tool_choice, max_tokens=96,
              temperature=0, logit_bias=blank, parallel_tool_calls=False)  # one call: the grammar ends it
    got = client.chat.completions.create(**kw)
    calls = got.choices[0].message.tool_calls
    assert calls, got.choices[0]
    names = {c.function.name for c in calls}
    assert len(calls) == 1 and (names == {"get_weather"} if choice == "named" else names <= {"get_weather", "get_time"})
    for call in calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert args["city"] in ("paris", "rome", "oslo") and args["days"] in (1, 2, 3), args
        else:
            assert args == {"zone": "utc"}
    stream = client.chat.completions.create(**kw, stream=True)
    streamed: dict[int, list[str]] = {}  # tool call index -> [name, arguments]
    for chunk in stream:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(d.index, ["", ""])
            entry[0] += (d.function.name or "") if d.function else ""
            entry[1] += (d.function.arguments or "") if d.function else ""
    assert [(name, json.loads(args)) for name, args in streamed.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]  # greedy: the same calls


@contextlib.contextmanager
def another_frontend(served, **settings):
    """A further front end on the module's cluster (as several front ends share one: its own router and channels),
    on a port of its own, with `settings` (`FrontendSettings` fields) over the launcher's; yields its URL."""
    from actors.frontend.server import HTTPFrontend
    from cluster.cli.frontends import frontend_settings

    frontend = HTTPFrontend.remote()
    try:
        yield ray.get(frontend.start.remote(dataclasses.replace(frontend_settings(served), port=free_port(), **settings)),
                      timeout=300)
    finally:
        try:
            ray.get(frontend.stop.remote(), timeout=60)
        finally:
            ray.kill(frontend, no_restart=True)


# a chat template that renders the user's text alone, so that a test can choose the prompt's last token
BARE_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.fixture()
def reasoning_frontend(served):
    """A second front end on the module's cluster with `chat.reasoning_parser: deepseek_r1` and a template that
    renders the user's text alone (the chat options as the launcher passes them: `cluster.cli.frontends.chat_flags`)."""
    from cluster.cli.frontends import chat_flags

    cfg = served.cfg.model_copy(update={"chat": served.cfg.chat.model_copy(
        update={"reasoning_parser": "deepseek_r1", "chat_template": BARE_TEMPLATE})})
    with another_frontend(served, chat_flags=chat_flags(cfg)) as url:
        yield url


def thinking_prompt(tokenizer) -> tuple[str, list[int], int]:
    """A user message after which the tiny model's greedy output holds `</think>` (the rule its weights implement,
    `cluster.cli.tiny_circuit.expected_next_token`): words ending in a token k successors before `</think>`. Returns
    the message, its token ids and the output length that ends 3 tokens past the marker."""
    from cluster.cli.tiny_circuit import _codes
    from cluster.cli.tiny_model import THINK, _WORDS
    from tests.pd_helpers import oracle

    start, end = tokenizer.convert_tokens_to_ids(list(THINK))
    pred = _codes(0)[2]
    for k in range(2, 12):
        last = end
        for _ in range(k):
            last = int(pred[last])
        for seed in range(20):
            rng = random.Random(seed)
            text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8))) + tokenizer.decode([last])
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            out = oracle(ids, k + 3) if ids[-1] == last else []
            at = out.index(end) if end in out else -1
            if 0 < at < len(out) - 1 and start not in out:  # some reasoning, then the marker, then some content
                return text, ids, at + 4
    raise AssertionError("no prompt found whose output holds </think>")


def test_reasoning_comes_back_split_out(served, reasoning_frontend, tokenizer):
    """`chat.reasoning_parser` reaches vLLM's server: a chat whose greedy output holds `</think>` (after a prompt
    chosen by the model's rule) comes back with the text before it as `reasoning` and the rest as `content`, streamed
    and not; the output itself equals the same request run colocated."""
    text, ids, max_tokens = thinking_prompt(tokenizer)
    messages = [{"role": "user", "content": text}]
    url = reasoning_frontend
    assert httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages},
                      headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"] == ids
    _, want = colocated(served, ids, {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    reasoning, marker, content = want.partition("</think>")
    assert marker and reasoning and content, want
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    kw = dict(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    got = c.chat.completions.create(**kw).choices[0].message
    assert (got.model_extra.get("reasoning"), got.content) == (reasoning, content)
    parts = {"reasoning": "", "content": ""}
    for chunk in c.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts["reasoning"] += delta.model_extra.get("reasoning") or ""
            parts["content"] += delta.content or ""
    assert parts == {"reasoning": reasoning, "content": content}


def test_requests_sharing_a_client_request_id_stay_apart(served, tokenizer):
    """vLLM takes a request's id from the client (X-Request-Id): two requests in flight with the same one must not
    share engine-side ids (outputs, aborts). Both complete with their own colocated answers."""
    prompts = [PROMPTS[0], "another prompt with the same request id"]
    wants = [colocated(served, tokenizer(p)["input_ids"], {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True})[1]
             for p in prompts]

    async def one(prompt):
        async with httpx.AsyncClient(timeout=120) as c:
            r = await c.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 24,
                             "temperature": 0, "ignore_eos": True, "stream": True},
                             headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "same-id"})
            assert r.status_code == 200
            return "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                           if line.startswith("data: {"))

    async def both():
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(both()) == wants


def test_tokenize_detokenize_version(served, tokenizer):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{served.url}/tokenize", json={"model": MODEL, "prompt": PROMPTS[0]}, headers=h).json()
    assert r["tokens"] == tokenizer(PROMPTS[0])["input_ids"] and r["max_model_len"] == 2048
    d = httpx.post(f"{served.url}/detokenize", json={"model": MODEL, "tokens": r["tokens"]}, headers=h).json()
    assert PROMPTS[0] in d["prompt"]
    assert httpx.get(f"{served.url}/version", headers=h).json()["version"].startswith("0.32")


LONG = [1] + [5] * 2100


@pytest.mark.parametrize(
    "body, status",
    [
        ({"model": MODEL}, 400),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400),
        ({"model": MODEL, "prompt": LONG}, 400),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400),
        ({"model": MODEL, "prompt": {"text": "x"}}, 400),
        ({"model": MODEL, "prompt": [1, 10**7]}, 400),
        ({"model": MODEL, "prompt": "x", "logprobs": 10**6}, 400),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400),
        ({"model": "gpt-4", "prompt": "x"}, 404),
        (b'{"model": "tiny-hybrid", "prompt": ', 400),
        (b"[]", 400),
        (json.dumps({"model": MODEL, "prompt": "y" * 70000}).encode(), 413),
        (b"[" * 30000 + b"]" * 30000, 400),
        (b'{"model": "tiny-hybrid", "prompt": [' + b"1" * 5000 + b"]}", 400),
        (b'{"model": "tiny-hybrid", "prompt": "a\\ud800b"}', 400),
    ],
    ids=["no-prompt", "negative-max", "huge-max", "long-prompt", "max-type", "prompt-type", "token-range",
         "logprobs-range", "temperature", "unknown-model", "bad-json", "not-object", "oversized", "deep-json",
         "huge-number", "lone-surrogate"],
)
def test_errors_are_openai_style(served, body, status):
    r = post(served, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and "param" in err and err["code"] == status


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10**6)


def test_routes_and_methods(served):
    r = httpx.get(f"{served.url}/v1/nowhere", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404
    r = httpx.get(f"{served.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405
    r = httpx.post(f"{served.url}/v1/responses", json={"model": MODEL, "input": "x"}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404  # vLLM routes the cluster does not serve are not there


def test_api_key_required(served):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for key in (None, "wrong-key", KEY + "x"):
        r = post(served, body, key=key)
        assert r.status_code == 401 and r.json()["error"]
    assert httpx.get(f"{served.url}/v1/models").status_code == 401
    assert httpx.get(f"{served.url}/metrics").status_code == 401
    assert httpx.get(f"{served.url}/health").status_code == 200  # liveness stays open
    assert post(served, body).status_code == 200
    bad = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.may_skip_in_ci("only on a Ray instance the tests start; CI sets no RAY_ADDRESS, so there it runs")
def test_the_engines_listen_on_loopback_only(served):
    """On a local Ray instance (`cluster.cli.local_ray.start_ray`, as `make run` starts one) every port the vLLM
    processes open - vLLM's own, torch.distributed's gloo, UCX's for NIXL - is on loopback, and so is the front end's
    (`http.host` 127.0.0.1). Before, each engine opened ~5 on the machine's address. Ray's own servers are not
    checked: they bind every interface whatever the caller says (docs/operations.md, Security)."""
    import ipaddress

    import psutil
    import ray

    from tests.pd_helpers import processes_under

    if os.environ.get("RAY_ADDRESS"):
        pytest.skip("the tests joined a Ray cluster (RAY_ADDRESS): its daemons' environment is not the project's")
    session = ray._private.worker._global_node.get_session_dir_path()
    found: dict[str, list[str]] = {}
    for proc in processes_under(session):
        try:
            name = proc.name()
            sockets = [c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
        for ip, port in sockets:
            if name.startswith("VLLM::") or port == served.cfg.http.port:
                found.setdefault(f"{name} ({proc.pid})", []).append(f"{ip}:{port}")
    vllm = [s for who, socks in found.items() if who.startswith("VLLM::") for s in socks]
    assert len(vllm) >= 4, f"too few vLLM listeners to say anything: {found}"
    assert any(s.endswith(f":{served.cfg.http.port}") for socks in found.values() for s in socks), found
    beyond = {who: [s for s in socks if not ipaddress.ip_address(s.rsplit(":", 1)[0].strip("[]")).is_loopback]
              for who, socks in found.items()}
    assert not any(beyond.values()), f"listening beyond loopback: {beyond}"


def test_no_capacity_is_503_with_retry_after(served):
    """With the prefill pool empty (its engine draining) the decode engine serves requests whole: 200, /health
    "degraded". With neither pool ready: 503 + Retry-After, for streams too (a stream that fails before its first
    token is a 503, not a 200), and /health 503."""
    ray.get(served.coordinator.set_state("prefill-0", "draining"))
    try:
        r = post(served, {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text
        h = httpx.get(f"{served.url}/health")
        assert h.status_code == 200 and h.json()["status"] == "degraded", h.text
        ray.get(served.coordinator.set_state("decode-0", "draining"))
        for stream in (False, True):
            r = post(served, {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": stream})
            assert r.status_code == 503 and r.json()["error"]["code"] == 503, r.text
            assert "no engine can take the request" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) >= 1
        h = httpx.get(f"{served.url}/health")
        assert h.status_code == 503 and h.json()["ready"] == {"prefill": 0, "decode": 0}
    finally:
        ray.get(served.coordinator.set_state("decode-0", "ready"))
        ray.get(served.coordinator.set_state("prefill-0", "ready"))
    assert post(served, {"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200
    assert httpx.get(f"{served.url}/health").json()["status"] == "ok"


def test_client_disconnect_aborts_on_both_engines(served):
    decode, prefill = served.engines["decode-0"], served.engines["prefill-0"]
    assert ray.get(decode.num_unfinished()) == 0
    body = {"model": MODEL, "prompt": [1] + list(range(3, 400)), "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        # two tokens: the first may come from the prefill engine, the second is the decode engine's (its reads are
        # verified by then; a client leaving during the verification is not what this test is about)
        events = (line for line in lines if line.startswith("data: {"))
        assert next(events) and next(events)
        assert ray.get(decode.num_unfinished()) == 1  # generating: 1500 tokens would take a minute
    # the connection is closed: the front end cancels, the router aborts the decode request and frees the prefill side
    took = wait_for(lambda: ray.get(decode.num_unfinished()) == 0, 20)
    print(f"decode request aborted {took:.2f} s after the client disconnected")
    assert ray.get(prefill.num_unfinished()) == 0
    assert ray.get(prefill.pending_sends(5.0)) == []
    metrics = httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert float(metric(metrics, "pd_client_disconnects_total")) >= 1



def test_metrics(served, client):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3)
    before = float(metric(httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text,
                           "pd_first_tokens_from_prefill_total"))
    list(client.completions.create(model=MODEL, prompt="count me", max_tokens=3, temperature=0, stream=True))
    text = httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert float(metric(text, "pd_first_tokens_from_prefill_total")) == before + 1  # streamed greedy: from prefill
    assert float(metric(text, "pd_requests_local_prefill_total")) == 0  # transfer.local_prefill_queue unset
    assert float(metric(text, 'pd_requests_total{status="200"}')) >= 1
    assert float(metric(text, "pd_time_to_first_token_seconds_count")) >= 1
    assert float(metric(text, "pd_inter_token_latency_seconds_count")) >= 2
    assert float(metric(text, "pd_transfer_bytes_total")) > 0
    assert float(metric(text, "pd_transfer_seconds_total")) > 0
    # transfer.verify is "all" here: every request so far was checked, and none differed
    assert float(metric(text, "pd_transfer_verified_total")) >= 1
    assert float(metric(text, "pd_transfer_verify_failures_total")) == 0
    assert float(metric(text, 'pd_pool_engines{role="decode",state="ready"}')) == 1
    assert float(metric(text, 'pd_pool_engines{role="prefill",state="ready"}')) == 1
    # prefix caching (on by default): the same 300-token prompt again - both engines find its first 256 tokens cached
    prompt = [1] + [random.Random(3).randrange(3, 1024) for _ in range(299)]
    hits = lambda text: [float(metric(text, f'pd_cached_prompt_tokens_total{{role="{r}"}}')) for r in ("prefill", "decode")]  # noqa: E731
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    before = hits(httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = hits(httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text)
    assert [a - b for a, b in zip(after, before)] == [256, 256]


def test_fuzzed_requests_never_get_a_server_error(served, tmp_path):
    """schemathesis generates requests from the service's own OpenAPI document (vLLM's request models: valid and
    invalid bodies, headers, methods) and sends them to the running service: no 5xx."""
    import subprocess
    import sys
    from pathlib import Path

    st = Path(sys.executable).parent / "schemathesis"
    cmd = [str(st), "run", f"{served.url}/openapi.json", "--checks", "not_a_server_error", "--max-examples", "25",
           "-H", f"Authorization: Bearer {KEY}", "--generation-deterministic", "--report-dir", str(tmp_path),
           "--include-path-regex", "^/(v1/completions|v1/chat/completions|tokenize|detokenize|v1/models|version|health)$"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(r.stdout[-1500:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "/v1/completions" in r.stdout and "/v1/chat/completions" in r.stdout


def test_short_load_loses_nothing(served):
    """16 streaming clients for 15 s (the long version: `python -m cluster bench load --clients 32 --duration 60`)."""
    from cluster.cli.bench.loadgen import run_load

    res = asyncio.run(run_load(served.url, MODEL, clients=16, duration_s=15, max_tokens=16, api_key=KEY))
    summary = res.summary()
    print(f"load: {summary}")
    assert summary["lost"] == 0 and summary["malformed"] == 0, summary["first_errors"]
    assert res.ok >= 16 and res.ok == res.requests


def test_vllm_bench_client_fails_no_request(served, gdn_model):
    """vLLM's own serving benchmark client, unmodified (it sends repetition_penalty, stream_options and calls
    /tokenize), against the cluster: a short version of `python -m cluster bench serve`."""
    from cluster.cli.bench.serve import run_vllm_bench

    result = run_vllm_bench(served.url, MODEL, str(gdn_model), num_prompts=8, concurrency=2, input_len=128,
                            output_len=16, api_key=KEY)
    print({k: result[k] for k in ("completed", "failed", "median_ttft_ms", "median_tpot_ms")})
    assert result["failed"] == 0 and result["completed"] == 8


AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
ROUTE_REQUESTS = {  # every route the front end serves but /health -> (method, a body it answers 200 with the key)
    "/v1/completions": ("POST", {"model": MODEL, "prompt": "x", "max_tokens": 2}),
    "/v1/chat/completions": ("POST", CHAT),
    "/tokenize": ("POST", {"model": MODEL, "prompt": "x"}),
    "/detokenize": ("POST", {"model": MODEL, "tokens": [5, 6]}),
    "/v1/models": ("GET", None), "/version": ("GET", None), "/metrics": ("GET", None),
    "/openapi.json": ("GET", None), "/docs": ("GET", None), "/docs/oauth2-redirect": ("GET", None), "/redoc": ("GET", None),
}


def test_every_route_but_health_needs_the_key(served):
    """With an API key set, every route (generation, /tokenize, /detokenize, /v1/models, /version, /metrics, the API
    documents) is 401 without it or with a wrong one, and answers with it; unknown paths are 401 too (404 with the
    key); /health is open."""
    from actors.frontend.server import VLLM_ROUTES

    assert set(ROUTE_REQUESTS) == VLLM_ROUTES | {"/metrics"}  # a route added to the front end is checked here too
    for route, (method, body) in ROUTE_REQUESTS.items():
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {KEY}"}):
            r = httpx.request(method, f"{served.url}{route}", json=body, headers=headers, timeout=60)
            assert r.status_code == 401, (route, headers, r.status_code, r.text[:200])
            assert r.json()["error"]["code"] == 401 and r.headers["www-authenticate"] == "Bearer"
        r = httpx.request(method, f"{served.url}{route}", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, (route, r.status_code, r.text[:200])
    assert httpx.get(f"{served.url}/v1/nowhere").status_code == 401
    assert httpx.get(f"{served.url}/v1/nowhere", headers=AUTH).status_code == 404
    health = httpx.get(f"{served.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["age_s"] < 5


def test_n_over_the_cap_is_a_400_naming_the_limit_before_anything_is_routed(served, client):
    """n (or best_of) above http.max_n (128): the official client raises BadRequestError naming the field and the
    limit; nothing reaches the router (no prompt token counted); counted in /metrics."""
    def scrape() -> str:
        return httpx.get(f"{served.url}/metrics", headers=AUTH).text

    before = scrape()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=129)
    assert "n must be at most 128, got 129" in str(e.value) and e.value.body["param"] == "n", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**CHAT, n=1000)
    assert "n must be at most 128, got 1000" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"best_of": 200})
    assert "best_of must be at most 128, got 200" in str(e.value) and e.value.body["param"] == "best_of"
    after = scrape()
    assert metric(after, "pd_prompt_tokens_total") == metric(before, "pd_prompt_tokens_total")
    refused = 'pd_requests_refused_total{reason="n_over_limit"}'
    assert float(metric(after, refused)) == float(metric(before, refused)) + 3
    assert len(client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2, temperature=1).choices) == 2


@pytest.fixture()
def small_frontend(served):
    """A second front end on the module's cluster (as several front ends share one: its own router and channels),
    admitting 1 request in flight and 1 waiting - so that the bound is reached with two requests while the module's
    own front end, and the tests that use it, keep the defaults."""
    with another_frontend(served, max_requests_in_flight=1, max_queued_requests=1) as url:
        yield url


def test_past_the_bound_requests_get_429_with_retry_after(served, small_frontend):
    """One stream in flight and one request waiting fill the bound: the next requests - streamed or not, completions
    or chat, and the official client's - get 429 + Retry-After at once, as plain JSON errors (a stream's 429 comes
    before any event); /v1/models, /tokenize and /health are still answered. The stream's client leaves: the waiting
    request gets its place and is served."""
    url = small_frontend
    retry_after = str(served.cfg.http.retry_after_s)

    def scrape() -> str:
        return httpx.get(f"{url}/metrics", headers=AUTH).text

    async def go():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as c:
            long = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=long) as first:
                assert first.status_code == 200
                lines = first.aiter_lines()  # held: an iterator let go of is closed, and the connection with it
                async for line in lines:
                    if line.startswith("data: {"):
                        break  # in flight: generating (2000 tokens take half a minute or more)
                waiting = asyncio.create_task(c.post("/v1/completions", json={"model": MODEL, "prompt": "y",
                                                                              "max_tokens": 4, "ignore_eos": True}))
                t_end = time.monotonic() + 30
                while float(metric(await asyncio.to_thread(scrape), "pd_requests_queued")) != 1:
                    assert time.monotonic() < t_end and not waiting.done(), \
                        f"the second request never waited in the queue: {waiting.done() and waiting.result().text}"
                    await asyncio.sleep(0.1)
                t0 = time.monotonic()
                bodies = [{"model": MODEL, "prompt": "z", "max_tokens": 4, "stream": i % 2 == 0} for i in range(6)]
                refused = await asyncio.wait_for(asyncio.gather(  # (a request held in a queue would wait here)
                    *(c.post("/v1/completions", json=b) for b in bodies),
                    c.post("/v1/chat/completions", json={**CHAT, "stream": True})), 30)
                took = time.monotonic() - t0
                with pytest.raises(openai.RateLimitError) as e:
                    await asyncio.to_thread(
                        openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60).completions.create,
                        model=MODEL, prompt="w", max_tokens=2)
                others = [await c.get("/v1/models"), await c.post("/tokenize", json={"model": MODEL, "prompt": "x"}),
                          await c.get("/health")]
            # the stream's client left: its place goes to the waiting request
            served_after = await asyncio.wait_for(waiting, 60)
        return refused, took, e.value, others, served_after

    refused, took, client_error, others, served_after = asyncio.run(go())
    print(f"{len(refused)} requests refused in {took:.2f} s")
    for r in refused:
        assert r.status_code == 429, r.text[:300]
        assert r.headers["retry-after"] == retry_after and r.headers["content-type"] == "application/json"
        assert "data:" not in r.text
        err = r.json()["error"]
        assert (err["code"], err["type"], err["reason"]) == (429, "TooManyRequests", "queue_full"), err
    assert took < 5, "refusals must not wait for a place"
    assert client_error.response.headers["retry-after"] == retry_after
    assert [r.status_code for r in others] == [200, 200, 200]
    assert served_after.status_code == 200 and served_after.json()["choices"][0]["text"]
    text = scrape()
    assert float(metric(text, 'pd_requests_refused_total{reason="queue_full"}')) == len(refused) + 1
    assert float(metric(text, 'pd_requests_total{status="429"}')) == len(refused) + 1
    assert float(metric(text, "pd_requests_queued")) == 0
    decode, prefill = served.engines["decode-0"], served.engines["prefill-0"]  # the left stream ended on the engines
    wait_for(lambda: ray.get(decode.num_unfinished()) == 0 and ray.get(prefill.num_unfinished()) == 0, 20)
