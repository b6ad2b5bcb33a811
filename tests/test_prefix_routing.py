"""Cache-aware routing's pure part (`cluster.core.prefix`): the hybrid rule (attention blocks past the last state
checkpoint are no hit), the record's eviction order and correction, and the cost function."""

from __future__ import annotations

import random

import pytest

from cluster.core.prefix import (EngineView, PrefixRecord, Resumable, block_hashes, choose_decode, choose_prefill,
                                 local_is_sooner, prefill_cost)

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
    from actors.engine_prefix import EnginePrefixes
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
