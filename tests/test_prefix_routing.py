"""Cache-aware routing's pure part (`cluster.core.prefix`): the hybrid rule (attention blocks past the last state
checkpoint are no hit), the record's eviction order and correction, and the cost function."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from cluster.core.prefix import (EngineView, PrefixRecord, PrefixRoots, Resumable, block_hashes, choose_decode,
                                 choose_prefill, local_is_sooner, prefill_cost, root_hash)

B = 4


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def test_block_hashes_chain_on_content_and_position():
    a = tokens(1, 12)
    assert block_hashes(a, B) == block_hashes(list(a), B)  # content, not identity
    assert len(block_hashes(a, B)) == 3 and len(block_hashes(a + [7], B)) == 3 and len(block_hashes(a, B, 2)) == 2
    swapped = a[4:8] + a[:4] + a[8:]
    assert block_hashes(swapped, B)[2] != block_hashes(a, B)[2]  # a block's hash carries its whole prefix
    with pytest.raises(ValueError):
        block_hashes(a, 0)


def test_hybrid_rule_attention_past_the_last_checkpoint_is_no_hit():
    """A prefill computed 14 tokens: attention blocks 0-2 are cached, the state only at 12 (its end, floored to a
    block). A prompt sharing all three blocks resumes from 12; one sharing two has attention blocks for 8 tokens but
    no state there: nothing to resume (a decode engine still skips reading those 8)."""
    doc = tokens(2, 40)
    r = PrefixRecord(B, capacity=100, stateful=True)
    r.record(doc[:14], 14, checkpoints=(12,))
    assert r.resumable(doc[:20]) == Resumable(12, 12)
    assert r.resumable(doc[:8] + tokens(3, 12)) == Resumable(0, 8)
    assert r.resumable(doc[:13]) == Resumable(12, 12)
    assert r.resumable(doc[:12]) == Resumable(0, 8)  # vLLM computes the last token: block 2 unusable
    # a second prefill that stopped at 8 leaves a checkpoint there too: now the shorter prompt resumes
    r.record(doc[:9], 9, checkpoints=(8,))
    assert r.resumable(doc[:8] + tokens(3, 12)) == Resumable(8, 8)


def test_attention_only_models_resume_at_every_block():
    doc = tokens(4, 30)
    r = PrefixRecord(B, capacity=100, stateful=False)
    r.record(doc[:14], 14)
    assert r.resumable(doc[:8] + tokens(5, 9)) == Resumable(8, 8)


def test_capacity_evicts_a_prompt_tail_first_and_least_recent_prompt_first():
    a, b = tokens(6, 16), tokens(7, 16)
    r = PrefixRecord(B, capacity=6, stateful=False)
    r.record(a, 16)
    r.record(b, 16)  # 8 blocks into 6: a's last two blocks go, its head stays
    assert r.resumable(a + [1]) == Resumable(8, 8)
    assert r.resumable(b + [1]) == Resumable(16, 16)
    assert len(r) == 6 and r.evicted == 2


def test_checkpoints_take_a_block_of_each_state_group():
    """A hybrid engine's pool: a cached block of tokens takes a block of the attention group, a checkpoint one of
    each of the three state groups (align mode keeps no state between checkpoints)."""
    a, b = tokens(9, 12), tokens(10, 12)
    r = PrefixRecord(B, capacity=12, stateful=True, attention_groups=1, state_groups=3)
    r.record(a, 12, checkpoints=(12,))
    assert r.used == 3 + 3
    r.record(a, 12, checkpoints=(8,))  # a second checkpoint on blocks it holds
    assert r.used == 3 + 6 and r.resumable(a + [1]) == Resumable(12, 12)
    r.record(b, 12, checkpoints=(12,))  # 6 more: a's tail goes first, its head with the checkpoint at 8 stays
    assert r.used <= 12 and r.resumable(b + [1]) == Resumable(12, 12)
    assert r.resumable(a + [1]) == Resumable(8, 8)


def test_forget_drops_what_vllm_did_not_reuse():
    doc = tokens(8, 20)
    r = PrefixRecord(B, capacity=100)
    r.record(doc, 20, checkpoints=(8, 20))
    assert r.resumable(doc + [1]).checkpoint_tokens == 20
    r.forget(doc, 8)
    assert r.resumable(doc + [1]) == Resumable(8, 8)


def test_cost_prefers_a_hit_unless_its_engine_is_loaded():
    hit = EngineView("p0", Resumable(896, 896), queued_tokens=0)
    cold = EngineView("p1", Resumable(), queued_tokens=0)
    assert prefill_cost(1000, hit) == 104 and prefill_cost(1000, cold) == 1000
    assert choose_prefill(1000, [cold, hit]) == ("p0", "hit")
    busy = EngineView("p0", Resumable(896, 896), queued_tokens=2000)  # a hot prefix: its engine has a queue
    assert choose_prefill(1000, [busy, cold]) == ("p1", "spread")
    assert choose_prefill(1000, [EngineView("a"), EngineView("b", queued_tokens=5)]) == ("a", "load")
    # equal cost: the shorter queue, then the order given
    assert choose_prefill(1000, [EngineView("a", Resumable(500, 500), 500), EngineView("b", Resumable(0, 0), 0)])[0] == "b"
    assert choose_prefill(100, [EngineView("b"), EngineView("a")])[0] == "b"
    with pytest.raises(ValueError):
        choose_prefill(10, [])


def test_the_decode_engine_prefills_only_what_it_finishes_sooner():
    """`local_is_sooner`: with nothing queued at the prefill engine the decode engine never takes a prompt, whatever
    its speed; under a backlog it takes prompts while its own queue, at its speed, ends sooner - and then stops."""
    for speed in (0.3, 0.5, 1.0):
        assert not local_is_sooner(1000, 1000, 0, 0, speed)
    assert local_is_sooner(1000, 1000, 1001, 0, 0.5)  # 2000 < 2001
    assert not local_is_sooner(1000, 1000, 1000, 0, 0.5)  # a tie goes to the prefill engine
    assert local_is_sooner(1000, 1000, 4000, 1000, 0.5)  # 4000 < 5000: a second local prompt
    assert not local_is_sooner(1000, 1000, 4000, 1500, 0.5)  # 5000: it would finish no sooner
    # a prefill-side prefix hit makes the prefill engine's share smaller: the same queue keeps the prompt there
    assert local_is_sooner(1000, 1000, 1500, 0, 0.5) and not local_is_sooner(200, 1000, 1500, 0, 0.5)
    for speed in (0, -1, 1.5):
        with pytest.raises(ValueError, match="speed"):
            local_is_sooner(1, 1, 1, 1, speed)


def test_decode_choice_is_load_first_then_bytes_not_read():
    assert choose_decode([EngineView("d0", Resumable(0, 512), running=3), EngineView("d1", running=2)]) == "d1"
    assert choose_decode([EngineView("d0", running=1), EngineView("d1", Resumable(0, 512), running=1)]) == "d1"
    with pytest.raises(ValueError):
        choose_decode([])


def test_an_engine_records_the_checkpoint_before_the_prompt_end_and_learns_from_vllm():
    """vLLM keeps a prefill's state at the last block boundary strictly before the prompt's end (8 tokens of 4-token
    blocks: at 4), whatever the prefill computed; a prediction vLLM contradicts is counted and dropped."""
    from actors.engine.prefix import EnginePrefixes
    from cluster.core.metrics import TransferTotals

    totals = TransferTotals()
    e = EnginePrefixes(totals)
    assert e.predict(tokens(11, 9)) == Resumable()  # no record: an engine without prefix caching
    e.record = PrefixRecord(B, 100, stateful=True, attention_groups=1, state_groups=3)
    doc = tokens(11, 20)
    e.prefilled(doc[:8], predicted=0, reused=0, computed=8)
    assert e.predict(doc[:14]) == Resumable(4, 8) and totals.computed_prompt_tokens == 8
    e.prefilled(doc[:14], predicted=4, reused=4, computed=14)
    assert e.predict(doc[:20]) == Resumable(12, 12) and totals.mispredicted == 0
    e.prefilled(doc[:20], predicted=12, reused=4, computed=20)  # vLLM had evicted blocks past 4
    assert totals.mispredicted == 1 and totals.predicted_prompt_tokens == 16
    assert e.predict(doc[:20] + [5]) == Resumable(16, 20)  # rewritten from what it computed now


def test_a_record_keeps_the_first_blocks_it_holds_and_versions_them():
    """`roots`: the first-block hash of every prompt held, nothing else; its version moves when the set does - not
    when a prompt already held is recorded again - and a record made anew (a restarted engine) is told apart."""
    a, b = tokens(20, 12), tokens(21, 12)
    r = PrefixRecord(B, capacity=6, stateful=False)
    v0 = r.version
    r.record(a, 12)
    assert r.roots == {root_hash(a, B)} == {block_hashes(a, B)[0]} and r.version != v0
    v1 = r.version
    r.record(a + [5], 12)
    assert r.version == v1  # the same first block: no change to send
    r.record(b, 12)  # 6 blocks in a pool of 6
    assert r.roots == {root_hash(a, B), root_hash(b, B)}
    r.record(tokens(22, 12), 12)  # a's three blocks go (least recent), and with them its root
    assert root_hash(a, B) not in r.roots and len(r.roots) == 2 and r.version[1] == v1[1] + 3
    r.forget(b, 0)  # vLLM reused none of b
    assert root_hash(b, B) not in r.roots and len(r.roots) == 1
    assert root_hash(a[:B], B) is None and root_hash(a[:B + 1], B) == root_hash(a, B)  # the last token is computed
    assert PrefixRecord(B, 6).version[0] != r.version[0]


def test_an_engine_sends_its_first_blocks_only_when_they_changed(monkeypatch):
    from actors.engine import prefix as engine_prefix
    from actors.engine.prefix import EnginePrefixes
    from cluster.core.metrics import TransferTotals

    e = EnginePrefixes(TransferTotals())
    assert e.roots() == PrefixRoots((0, 0), 0, ())  # no prefix caching: block size 0, nothing resumable
    e.record = PrefixRecord(B, 100)
    doc = tokens(23, 20)
    e.prefilled(doc, predicted=0, reused=0, computed=20)
    answer = e.roots()
    assert answer.block_size == B and answer.hashes == (root_hash(doc, B),)
    assert e.roots(answer.version) is None
    e.prefilled(tokens(24, 9), predicted=0, reused=0, computed=9)
    assert len(e.roots(answer.version).hashes) == 2
    monkeypatch.setattr(engine_prefix, "ROOTS_MAX", 1)
    assert e.roots().hashes is None  # too many to send: the routers ask it about every prompt


def age(choice, seconds: float) -> None:
    """Make a router's copies of the engines' first blocks, and its last questions, `seconds` older."""
    for engine_id, copy in choice.roots._known.items():
        choice.roots._known[engine_id] = dataclasses.replace(copy, asked_at=copy.asked_at - seconds)
    for engine_id in choice.roots._asked_at:
        choice.roots._asked_at[engine_id] -= seconds


class Engines:
    """Prefill engines as a router sees them: their records, answering `resumable` and `prefix_roots` as
    `EngineActor` does; the questions asked are counted, and an engine in `silent` does not answer `prefix_roots`."""

    def __init__(self, *ids: str):
        from actors.engine.prefix import EnginePrefixes
        from cluster.core.metrics import TransferTotals

        self.prefixes = {e: EnginePrefixes(TransferTotals()) for e in ids}
        for p in self.prefixes.values():
            p.record = PrefixRecord(B, 1000)
        self.asked: list[str] = []
        self.silent: set[str] = set()

    async def resumable(self, engine_id, prompt):
        self.asked.append(engine_id)
        return EngineView(engine_id, self.prefixes[engine_id].predict(prompt))

    async def roots(self, engine_id, known):
        if engine_id in self.silent:
            raise RuntimeError("no answer")
        await asyncio.sleep(0.002)  # later than `resumable`'s answers, as a set is bigger than a view
        return self.prefixes[engine_id].roots(known)

    def prefilled(self, engine_id, prompt):
        self.prefixes[engine_id].prefilled(prompt, 0, 0, len(prompt))


def test_the_router_asks_the_engines_only_about_prompts_one_may_hold(monkeypatch):
    """PairChoice (routing.policy cache) with each engine's first blocks copied: until the first copy arrives every
    prompt is asked about (and the prompts sent meanwhile are remembered); then a prompt whose first block no engine
    holds is routed on load without a question (`unasked`), and the next turn of one this router sent is asked about
    at once (its own record of where it sent it). A prefix another front end put on an engine is not in a fresh copy;
    once the copies are stale (an idle router) the engines are asked, the copy refreshed - then a hit. A prompt sent
    again after its engine evicted it is remembered though a copy taken meanwhile lacks it. An engine that does not
    send its set is asked about every prompt; a prompt of one block is never asked about; an engine that leaves is
    forgotten."""
    from actors.frontend import pair_choice
    from actors.frontend.pair_choice import PairChoice

    async def run():
        engines = Engines("p0", "p1")
        choice = PairChoice("cache", resumable=engines.resumable, roots=engines.roots)
        routes = {"p0": ["d0"], "p1": ["d0"]}

        async def choose(prompt):
            c = await choice.choose(prompt, ["p0", "p1"], routes, set())
            await asyncio.sleep(0.01)  # the copies asked meanwhile arrive
            return c

        before = tokens(30, 40)
        c = await choose(before)
        assert sorted(engines.asked) == ["p0", "p1"] and choice.unasked == 0  # no copy yet: asked
        engines.prefilled(c.prefill, before)  # after the copy was asked for: only this router knows
        engines.asked.clear()
        again = await choose(before + [9])
        assert sorted(engines.asked) == ["p0", "p1"] and (again.prefill, again.reason) == (c.prefill, "hit")
        engines.asked.clear()
        conv = tokens(31, 40)
        first = await choose(conv)
        assert engines.asked == [] and choice.unasked == 1 and first.reason == "load"
        engines.prefilled(first.prefill, conv)
        second = await choose(conv + tokens(32, 10))  # this router sent the first turn: it asks
        assert sorted(engines.asked) == ["p0", "p1"] and (second.prefill, second.reason) == (first.prefill, "hit")
        engines.asked.clear()
        other = next(e for e in ("p0", "p1") if e != first.prefill)
        elsewhere = tokens(33, 40)
        engines.prefilled(other, elsewhere)  # another front end's prompt: not in this router's copy yet
        assert not any(choice.roots.may_hold(e, elsewhere + [7]) for e in ("p0", "p1"))
        age(choice, 2.5)  # the router was idle since: its copies are not trusted, the engines asked and copied again
        assert all(choice.roots.may_hold(e, elsewhere + [7]) for e in ("p0", "p1"))
        await asyncio.sleep(0.01)
        assert root_hash(elsewhere, B) in choice.roots._known[other].hashes
        hit = await choose(elsewhere + [8])
        assert (hit.prefill, hit.reason) == (other, "hit") and sorted(engines.asked) == ["p0", "p1"]
        engines.asked.clear()
        monkeypatch.setattr(pair_choice, "ROOTS_REFRESH_S", 0.0)
        # the engine evicted `elsewhere` (the copy still lists it) and this router sends it there again: the next
        # copy, asked before that prefill ends, lacks it - the router still knows where it sent it
        engines.prefixes[other].record.forget(elsewhere, 0)
        await choice.choose(elsewhere + [9], ["p0", "p1"], routes, set(), pair=(other, "d0"))
        choice.roots.may_hold(other, tokens(39, 40))  # (a refresh: due at once now)
        await asyncio.sleep(0.01)
        assert root_hash(elsewhere, B) not in choice.roots._known[other].hashes
        assert choice.roots.may_hold(other, elsewhere + [10])
        engines.asked.clear()
        assert (await choose(tokens(35, B))).reason == "load" and engines.asked == []  # one block: nothing resumable
        engines.silent.add("p1")
        await choose(tokens(36, 40))
        await choose(tokens(37, 40))
        assert "p1" in engines.asked and choice.roots.failures >= 1  # its copy is gone: asked about everything
        choice.left({"p0", "d0"})
        assert "p1" not in choice.roots._known and "p1" not in choice.roots._routed

    asyncio.run(run())


def test_a_copy_under_way_when_an_event_loop_ends_is_asked_again_from_the_next(monkeypatch):
    """A caller that runs each batch under its own asyncio.run: a question left unanswered when its loop ends is
    asked again from the next loop, and the copy the router had stays in use meanwhile (nobody asked about a prompt
    no engine holds)."""
    from actors.frontend import pair_choice
    from actors.frontend.pair_choice import PairChoice

    engines = Engines("p0", "p1")
    choice = PairChoice("cache", resumable=engines.resumable, roots=engines.roots)
    routes = {"p0": ["d0"], "p1": ["d0"]}

    async def choose(prompt, settle: float = 0.01):
        c = await choice.choose(prompt, ["p0", "p1"], routes, set())
        await asyncio.sleep(settle)
        return c

    asyncio.run(choose(tokens(40, 40)))  # the first copies
    monkeypatch.setattr(pair_choice, "ROOTS_REFRESH_S", 0.0)
    slow = engines.roots

    async def slower(engine_id, known):
        await asyncio.sleep(5)
        return await slow(engine_id, known)

    engines.roots = slower
    choice.roots._ask = slower
    engines.asked.clear()
    asyncio.run(choose(tokens(41, 40), settle=0))  # its questions are cancelled as the loop ends
    assert engines.asked == [] and choice.roots.failures == 0 and not choice.roots._questions
    choice.roots._ask = slow
    asyncio.run(choose(tokens(42, 40)))
    assert engines.asked == [] and choice.unasked == 2 and set(choice.roots._known) == {"p0", "p1"}
