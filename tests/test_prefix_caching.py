"""Prefix caching in P/D on live engines (tiny GDN hybrid, vLLM's mamba_cache_mode "align"): a prefill engine computes
only the prompt past its longest cached prefix, a decode engine reads only the attention blocks it lacks plus the state,
and either side may cache without the other - outputs equal to the model's rule token for token throughout."""

from __future__ import annotations

import random

import pytest
import ray

from cluster.cli.tiny_circuit import expected_next_token
from tests.pd_helpers import PDCluster, colocated, gather, oracle, run_pair

pytestmark = pytest.mark.engine

CACHING = {"enable_prefix_caching": True}
P_CACHED, P_PLAIN, D_CACHED, D_PLAIN = "prefill-tp1", "prefill-tp2", "decode-tp2", "decode-tp1"


@pytest.fixture(scope="module")
def pd(ray_local, gdn_model):
    """Prefill TP 1 and decode TP 2 cache prefixes; prefill TP 2 and decode TP 1 do not: every pair of the four mixes
    (both, prefill only, decode only, neither)."""
    cluster = PDCluster(gdn_model, [("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)], "prefix",
                        per_engine={("prefill", 1): CACHING, ("decode", 2): CACHING})
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def block(pd) -> int:
    layouts = {r["layout"]["block_size"] for h in pd.engines.values() for r in ray.get(h.registration()).ranks}
    assert len(layouts) == 1
    return layouts.pop()


def engine(pd, engine_id: str):
    return next(h for (role, tp), h in pd.engines.items() if f"{role}-tp{tp}" == engine_id)


def cached(pd, engine_id: str) -> int:
    """The engine's running total of prompt tokens found in its own prefix cache."""
    return ray.get(engine(pd, engine_id).transfer_totals()).cached_prompt_tokens


def document(seed: int, n: int = 900) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 1024) for _ in range(n - 1)]


def words(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def request(pd, first: str, prefill: str, decode: str, prompt: list[int]) -> dict:
    """One greedy request through a given pair: its output, the prompt tokens each engine found cached, and the decode
    engine's reads (one record per decode rank)."""
    before = {e: cached(pd, e) for e in (prefill, decode)}
    ray.get(engine(pd, decode).transfer_stats())
    out = gather([run_pair(pd.routers[first], prefill, decode, prompt)])[0]
    reads = ray.get(engine(pd, decode).transfer_stats())
    assert reads and all(r["ok"] for r in reads)
    return {"out": out, "prefill_hit": cached(pd, prefill) - before[prefill],
            "decode_hit": cached(pd, decode) - before[decode], "reads": reads}


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_a_prefill_side_hit_computes_only_the_rest(pd, block, first):
    """Prefill TP 1 (caching) -> decode TP 1 (not). vLLM's "align" mode keeps a prefill's recurrent state at the last
    block boundary it reaches, so a later prompt that extends the first one past that boundary (the next turn of a
    conversation, or the same document with another question) is prefilled from there on, with the same output; one
    that leaves it before that boundary is computed whole (no state to start from). The first token from either
    engine (the prefill side computes the whole prompt, or all but its last token)."""
    doc = document(11 if first == "prefill" else 12)
    turn = doc[:700]
    warm = request(pd, first, P_CACHED, D_PLAIN, turn)
    assert warm["out"] == oracle(turn)
    assert warm["prefill_hit"] == 0  # a new document: nothing cached yet
    boundary = (len(turn) - (first == "decode")) // block * block
    for prompt, hit in ((turn + warm["out"] + words(1, 40), boundary), (doc[:boundary] + words(2, 3), boundary),
                        (doc[:boundary + 30], boundary), (doc[:boundary - 40] + words(3, 60), 0)):
        got = request(pd, first, P_CACHED, D_PLAIN, prompt)
        assert got["out"] == oracle(prompt), f"a {len(prompt)}-token prompt with a cached prefix"
        assert got["prefill_hit"] == hit, f"{len(prompt)}-token prompt: prefill-side hit {got['prefill_hit']}"
        assert got["decode_hit"] == 0 and all(r["cached_tokens"] == 0 for r in got["reads"])  # D does not cache


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_a_decode_side_hit_reads_only_the_blocks_it_lacks(pd, block, first):
    """Prefill TP 2 (not caching) -> decode TP 2 (caching): a prompt sharing whole attention blocks with one read
    before makes the decode engine read only the blocks after them plus the state (which it reads anyway, so any
    shared block counts, not only a boundary where it kept a state) - exactly the bytes of a cold read of a fresh
    prompt of the same length less those blocks' - with the same output, and transfer.verify checks what it read."""
    seed = 20 if first == "prefill" else 30
    doc = document(seed + 1)
    assert request(pd, first, P_PLAIN, D_CACHED, doc[:700])["out"] == oracle(doc[:700])
    n = 660
    cold = request(pd, first, P_PLAIN, D_CACHED, document(seed + 2, n))
    shorter = request(pd, first, P_PLAIN, D_CACHED, document(seed + 3, n - block))
    assert cold["decode_hit"] == shorter["decode_hit"] == 0
    per_block = sum(r["bytes"] for r in cold["reads"]) - sum(r["bytes"] for r in shorter["reads"])
    assert per_block > 0
    decode = engine(pd, D_CACHED)
    ray.get(decode.set_verify(1.0))
    try:
        verified = ray.get(decode.transfer_totals())
        prompt = doc[:600] + words(3, n - 600)
        got = request(pd, first, P_PLAIN, D_CACHED, prompt)
        after = ray.get(decode.transfer_totals())
    finally:
        ray.get(decode.set_verify(0.0))
    assert got["out"] == oracle(prompt)
    hit = got["decode_hit"]
    assert hit == 600 // block * block
    assert {r["cached_tokens"] for r in got["reads"]} == {hit}  # every decode rank skipped the same blocks
    assert sum(r["bytes"] for r in got["reads"]) == sum(r["bytes"] for r in cold["reads"]) - hit // block * per_block
    assert got["prefill_hit"] == 0  # prefill TP 2 does not cache
    assert after.verified - verified.verified == 1 and after.verify_failures == verified.verify_failures


def test_a_prompt_cached_whole_on_the_decode_side_reads_nothing(pd, block):
    """A prompt the decode engine holds entirely (the same 4-block prompt again, first token from the prefill engine:
    the decode side loads exactly those blocks and their state) reads no byte and still gives the same output; the
    prefill engine's blocks are let go (its pending sends drain)."""
    prompt = document(131)[:4 * block]
    first = request(pd, "prefill", P_PLAIN, D_CACHED, prompt)
    again = request(pd, "prefill", P_PLAIN, D_CACHED, prompt)
    assert first["out"] == again["out"] == oracle(prompt)
    assert sum(r["bytes"] for r in first["reads"]) > 0
    assert [r["bytes"] for r in again["reads"]] == [0, 0] and again["decode_hit"] == 4 * block
    assert ray.get(engine(pd, P_PLAIN).pending_sends()) == []


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_both_sides_cached(pd, block, first):
    """Prefill TP 1 and decode TP 2, both caching: prompts sharing prefixes of several lengths (shorter than a block,
    on a block boundary, several blocks) hit on both sides where they share whole blocks, with the same outputs."""
    doc = document(41 if first == "prefill" else 42)
    request(pd, first, P_CACHED, D_CACHED, doc[:800])
    for shared in (block - 1, block, block + 1, 3 * block, 5 * block + 7):
        prompt = doc[:shared] + words(shared, 20)
        got = request(pd, first, P_CACHED, D_CACHED, prompt)
        assert got["out"] == oracle(prompt), f"{shared} shared tokens"
        whole = shared // block * block
        assert got["prefill_hit"] <= whole and got["decode_hit"] <= whole and got["prefill_hit"] % block == 0
        if shared >= 2 * block:
            assert got["prefill_hit"] > 0 and got["decode_hit"] > 0


def test_state_a_decode_engine_read_serves_its_own_later_hits(pd, block):
    """The decode engine caches what it read. A read that ends on a block boundary (first token from the prefill
    engine) leaves the state there: a later request that engine runs whole (degraded mode) starts from it - a hit on
    bytes it never computed - with the same output. A read that ends inside a block leaves attention blocks but no
    state at their boundaries: such a request is computed from the start, again with the same output. The prompts
    continue just past the boundary, where the next token depends on the prefix's recurrent memory (checked against
    the rule with that memory wiped), so a wrong or missing state would show."""
    boundary = 4 * block
    decode = engine(pd, D_CACHED)

    def sensitive(doc: list[int]) -> list[list[int]]:
        """Prompts = the prefix + 2 tokens whose next token needs the recurrent memory of the prefix."""
        def wiped(prompt: list[int]) -> list[int]:
            return [1] + [0] * (boundary - 1) + prompt[boundary:]

        found = [doc[:boundary] + words(s, 2) for s in range(200)]
        found = [p for p in found if expected_next_token(p) != expected_next_token(wiped(p))]
        assert len(found) >= 2
        return found[:2]

    for doc, read_len, hit in ((document(51), boundary, boundary), (document(52), boundary + 60, 0)):
        read = request(pd, "prefill", P_PLAIN, D_CACHED, doc[:read_len])
        assert read["out"] == oracle(doc[:read_len]) and sum(r["bytes"] for r in read["reads"]) > 0
        for prompt in sensitive(doc):
            before = cached(pd, D_CACHED)
            assert gather([colocated(decode, prompt)])[0] == oracle(prompt)
            assert cached(pd, D_CACHED) - before == hit
            hit = boundary  # the first colocated request computed (and kept) the state at the boundary itself
