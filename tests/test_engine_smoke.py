"""A vLLM engine in a Ray actor loads the tiny GDN model and generates; a second engine at TP 2 agrees."""

from __future__ import annotations

import random

import psutil
import pytest

from cluster.models import expected_next_token

pytestmark = pytest.mark.engine

MAX_TOKENS = 24


def token_prompts() -> dict[str, list[int]]:
    rng = random.Random(11)
    return {
        f"{n}-tokens": [1] + [rng.randrange(3, 1024) for _ in range(n)]
        for n in (4, 40, 600)  # 600: several attention blocks at TP 1 and TP 2
    }


@pytest.fixture(scope="module")
def engines(ray_local, gdn_model):
    """Two independent engines on the GDN model, TP 1 and TP 2, started together."""
    from actors.engine import launch_engine_actor, stop_engine_actors

    launched = {tp: launch_engine_actor(gdn_model, tp) for tp in (1, 2)}
    handles = {tp: handle for tp, (handle, _) in launched.items()}
    try:
        startup = dict(zip(launched, ray_local.get([ref for _, ref in launched.values()])))
        print(f"engine startup seconds: {startup}")
        yield handles
    finally:
        stop_engine_actors(list(handles.values()))  # a no-op when the last test stopped them


def test_engines_are_healthy(engines, ray_local):
    for tp, handle in engines.items():
        health = ray_local.get(handle.health.remote())
        assert health["started"] and health["healthy"] and health["tp"] == tp


@pytest.mark.parametrize("name", list(token_prompts()))
def test_tp1_and_tp2_agree_token_for_token(engines, ray_local, name):
    prompt = token_prompts()[name]
    outs = ray_local.get(
        [h.generate.remote(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True) for h in engines.values()]
    )
    assert outs[0]["token_ids"] == outs[1]["token_ids"]
    assert len(outs[0]["token_ids"]) == MAX_TOKENS
    ids = list(prompt)  # and both follow the rule the model's weights implement
    for token in outs[0]["token_ids"]:
        assert token == expected_next_token(ids)
        ids.append(token)


def test_text_prompt_with_logprobs(engines, ray_local):
    prompt = "The prefill engine hands its cache blocks to the decode engine, and the decode engine"
    outs = ray_local.get([h.generate.remote(prompt=prompt, max_tokens=8, logprobs=2) for h in engines.values()])
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and outs[0]["text"] == outs[1]["text"]
    assert outs[0]["prompt_token_ids"][0] == 1  # BOS from the tokenizer
    assert outs[0]["text"]
    for step in outs[0]["logprobs"]:
        (_, top_lp), (_, second_lp) = step[0], step[1]
        assert top_lp > -0.01 and top_lp - second_lp > 4  # sharp model: a clear winner every step


def test_memory_and_processes_are_reported(engines, ray_local):
    for tp, handle in engines.items():
        pids = ray_local.get(handle.pids.remote())
        rss = ray_local.get(handle.rss_bytes.remote())
        print(f"TP {tp}: {len(pids)} processes, RSS {rss / 2**30:.2f} GiB")
        assert len(pids) >= 2 + tp  # actor, EngineCore, one worker per rank
        assert 2**30 < rss < 16 * 2**30


def test_stop_leaves_no_engine_processes(engines, ray_local):
    from actors.engine import stop_engine_actors

    pids = [pid for h in engines.values() for pid in ray_local.get(h.pids.remote())]
    removed = stop_engine_actors(list(engines.values()))
    print(f"removed shared-memory files: {removed}")
    alive = [pid for pid in pids if psutil.pid_exists(pid)]
    alive = [pid for pid in alive if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"engine processes still alive: {alive}"
