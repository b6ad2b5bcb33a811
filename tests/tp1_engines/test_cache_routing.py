"""Cache-aware routing (routing.policy cache) on live engines: two prefill and two decode engines of the tiny GDN
hybrid, prefix caching on, small block pools (the folder's engines, conftest.py). Every hit is measured on the
engine (vLLM's own count of prompt tokens it reused), not only predicted; outputs are the model's rule and the `load`
policy's, token for token."""

from __future__ import annotations

import random

import pytest
import ray

from actors.engine.actor import stop_engine_actors
from actors.frontend.router import Router
from cluster.core.prefix import root_hash
from tests.pd_helpers import gather, oracle
from tests.tp1_engines.shared import DECODES, PREFILLS, Engines

pytestmark = pytest.mark.engine

MAX_TOKENS = 8


class Cluster:
    """The folder's engines (`tests.tp1_engines.shared.Engines`: prefix caching on, 192-block pools) with this
    module's two routers over them and their counters."""

    def __init__(self, shared: Engines):
        self.coordinator = shared.coordinator
        self.engines = shared.engines  # the folder's own dict: an engine restarted here is the one the next module sees
        self.launch = shared.launch
        self.cache = Router(self.coordinator, policy="cache")
        self.load = Router(self.coordinator, policy="load")

    def totals(self) -> dict[str, tuple[int, int]]:
        """engine id -> (prompt tokens reused from its own cache, prompt tokens it computed), running totals."""
        got = ray.get([h.transfer_totals() for h in self.engines.values()])
        return {e: (t.cached_prompt_tokens, t.computed_prompt_tokens) for e, t in zip(self.engines, got)}

    def mispredicted(self) -> int:
        return sum(t.mispredicted for t in ray.get([h.transfer_totals() for h in self.engines.values()]))


@pytest.fixture(scope="module")
def cl(tp1_engines):
    return Cluster(tp1_engines)


@pytest.fixture(scope="module")
def block(cl) -> int:
    return ray.get(cl.engines[PREFILLS[0]].prefix_record())["block_size"]


def words(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


async def ask(router: Router, prompt: list[int]) -> list[int]:
    out: list[int] = []
    async for item in router.generate(prompt, {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}):
        out += item["token_ids"]
    return out


def turn(cl, router: Router, prompt: list[int]) -> tuple[list[int], dict[str, int]]:
    """One request; its output and, per engine, the prompt tokens it reused during it."""
    before = cl.totals()
    out = gather([ask(router, prompt)])[0]
    after = cl.totals()
    return out, {e: after[e][0] - before[e][0] for e in after}


def test_turns_land_on_the_prefill_engine_holding_the_previous_turn(cl, block):
    """Three conversations, four turns each, interleaved: every turn after the first resumes on a prefill engine from
    the state checkpoint of the previous turn's prompt (the first token comes from the prefill engine, so it
    computed the whole prompt: the checkpoint is its length floored to a block) - measured as vLLM's reused tokens on
    that engine - the router says "hit", the engines' records predicted every reuse exactly, and the outputs are the
    model's rule. The first turns, which no engine can hold, are routed without asking the engines (once the router
    has their first blocks); every later turn asks them, and the engine that holds a conversation lists its first
    block."""
    convs = {c: [1] + words(100 + c, 300 + 90 * c) for c in range(3)}
    before = dict(cl.cache.choice.decisions)
    unasked, views = cl.cache.choice.unasked, cl.cache.choice.views
    mispredicted = cl.mispredicted()
    for t in range(4):
        for c, prompt in convs.items():
            out, reused = turn(cl, cl.cache, prompt)
            assert out == oracle(prompt, MAX_TOKENS), f"conversation {c}, turn {t}"
            prefill_hits = {e: n for e, n in reused.items() if e in PREFILLS and n}
            if t:
                assert list(prefill_hits.values()) == [(len(prompt_before[c]) - 1) // block * block], (c, t, reused)
            convs[c] = prompt + out + words(1000 * t + c, 120)
        prompt_before = {c: p[:-(MAX_TOKENS + 120)] for c, p in convs.items()}
    assert cl.cache.choice.decisions["hit"] - before.get("hit", 0) >= 9
    assert cl.mispredicted() == mispredicted
    assert cl.cache.choice.unasked - unasked >= 2 and cl.cache.choice.views - views >= 9
    roots = {e: ray.get(cl.engines[e].prefix_roots()) for e in PREFILLS}
    for prompt in convs.values():
        assert sum(root_hash(prompt, roots[e].block_size) in roots[e].hashes for e in PREFILLS) == 1


def test_the_cache_policy_answers_as_the_load_policy_does(cl, block):
    """The same conversations through the `cache` router, then through the `load` router: outputs equal token for
    token (and to the model's rule); every second turn through the cache router resumed its first turn's prompt on
    a prefill engine (measured there)."""
    firsts = [[1] + words(500 + c, 400) for c in range(3)]
    outs: dict[str, list[list[int]]] = {}
    hits = 0
    for policy, router in (("cache", cl.cache), ("load", cl.load)):
        answers = gather([ask(router, p) for p in firsts])
        outs[policy] = list(answers)
        for first, out1 in zip(firsts, answers):
            second = first + out1 + words(600, 100)
            out2, reused = turn(cl, router, second)
            outs[policy].append(out2)
            if policy == "cache":
                hits += sum(reused[e] for e in PREFILLS)
                assert out1 == oracle(first, MAX_TOKENS) and out2 == oracle(second, MAX_TOKENS)
    assert outs["cache"] == outs["load"]
    assert hits == 3 * ((401 - 1) // block * block)


def test_a_hot_prefix_spreads_to_a_second_engine_under_load(cl, block):
    """Six requests at once sharing a long prefix that one prefill engine holds: its queue grows with each one
    routed to it, until computing the whole prompt on the other engine is cheaper - some go there ("spread")."""
    prefix = [1] + words(700, 5 * block)
    turn(cl, cl.cache, prefix + words(701, 20))
    before = dict(cl.cache.choice.decisions)
    prompts = [prefix + words(710 + i, 2 * block) for i in range(6)]
    t0 = cl.totals()
    outs = gather([ask(cl.cache, p) for p in prompts])
    t1 = cl.totals()
    assert outs == [oracle(p, MAX_TOKENS) for p in prompts]
    assert cl.cache.choice.decisions["spread"] > before.get("spread", 0)
    computed = {e: t1[e][1] - t0[e][1] for e in PREFILLS}
    assert all(computed.values()), computed  # both prefill engines computed some of them
    # both hold the prefix's attention blocks now; a state checkpoint at its end only where a prefill stopped there
    # (the first one): a prompt spread to the other engine was computed past the prefix, its state kept at its own end
    held = ray.get([cl.engines[e].resumable(prefix + words(720, 50)) for e in PREFILLS])
    assert all(v.resumable.attention_tokens == len(prefix) // block * block for v in held)
    assert sorted(v.resumable.checkpoint_tokens for v in held) == [0, len(prefix) // block * block]


def test_an_evicted_prefix_stops_being_preferred(cl, block):
    """Two prefixes held by one prefill engine, then enough other prompts through that engine to turn its block
    pool over: its record drops them as vLLM evicts them - a request for one, sent to that engine, reuses nothing,
    as the record predicted - and the router no longer sends the other there for a hit."""
    engine_id = PREFILLS[0]
    engine = cl.engines[engine_id]
    x, y = ([1] + words(800 + i, 4 * block) for i in range(2))
    gather([_pinned(cl, engine_id, p + words(810, 10)) for p in (x, y)])
    probes = x + words(820, 30), y + words(821, 30)
    assert [ray.get(engine.resumable(p)).resumable.checkpoint_tokens for p in probes] == [4 * block] * 2
    capacity = ray.get(engine.prefix_record())["capacity"]
    for i in range(capacity // 6 + 2):  # prompts of 6 blocks through the engine until its record lets x and y go
        gather([_pinned(cl, engine_id, [2] + words(900 + i, 6 * block + 5))])
        if not any(ray.get(engine.resumable(p)).resumable.attention_tokens for p in probes):
            break
    assert [ray.get(engine.resumable(p)).resumable.checkpoint_tokens for p in probes] == [0, 0]
    mispredicted = cl.mispredicted()
    before = cl.totals()[engine_id][0]
    gather([_pinned(cl, engine_id, probes[0])])
    assert cl.totals()[engine_id][0] == before and cl.mispredicted() == mispredicted  # vLLM evicted it too
    decisions = dict(cl.cache.choice.decisions)
    turn(cl, cl.cache, probes[1])
    assert cl.cache.choice.decisions["hit"] == decisions.get("hit", 0)  # nobody holds y any more: routed on load


async def _pinned(cl, prefill_id: str, prompt: list[int]) -> list[int]:
    out: list[int] = []
    params = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    async for item in cl.cache.generate(prompt, params, pair=(prefill_id, DECODES[0])):
        out += item["token_ids"]
    return out


def test_an_engine_that_leaves_or_restarts_drops_out_of_the_picture(cl, block):
    """The prefill engine holding a conversation leaves (stopped; the coordinator takes it out): the next turn goes
    to the other engine, computed whole, with the right output. It comes back under the same id, empty: the turn
    after stays where the prefix now is."""
    prompt = [1] + words(1200, 500)
    out, _ = turn(cl, cl.cache, prompt)
    held = [e for e in PREFILLS if ray.get(cl.engines[e].resumable(prompt + out)).resumable.checkpoint_tokens]
    assert len(held) == 1
    gone, other = held[0], next(e for e in PREFILLS if e != held[0])
    stop_engine_actors([cl.engines.pop(gone)])
    try:
        ray.get(cl.coordinator.engine_failed(gone))
        second = prompt + out + words(1201, 60)
        out2, reused = turn(cl, cl.cache, second)
        assert out2 == oracle(second, MAX_TOKENS) and reused.get(other, 0) == 0
    finally:
        cl.launch(gone)  # back, with an empty cache and record (whatever happened: the folder's next module needs it)
    assert ray.get(cl.engines[gone].resumable(second)).resumable.checkpoint_tokens == 0
    third = second + out2 + words(1202, 60)
    out3, reused = turn(cl, cl.cache, third)
    assert out3 == oracle(third, MAX_TOKENS)
    assert reused[other] == (len(second) - 1) // block * block and reused[gone] == 0
