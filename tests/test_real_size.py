"""Real architectures at real size, checked token by token against vLLM's own server on the same weights.

The models are built here with seeded random weights (`python -m cluster build-model`, `model.builtin`): Qwen3.5-0.8B's
shape at full depth (24 layers: 18 Gated DeltaNet + 6 gated attention, hidden 1024, 640-token blocks on CPU, the
vocabulary shrunk to the local 1,024-token tokenizer) and a Nemotron-H-8B-shaped Mamba2 hybrid cut to its first 8
layers (4 Mamba2, 3 MLP, 1 attention, every layer at its real width). Their logits depend on the input
(`real_model.informative_share`), so the oracle can tell a right token from a wrong one: `cluster.cli.oracle` feeds
vLLM's server (`vllm.entrypoints.openai.api_server`, eager, no prefix caching) prompt + the cluster's greedy output as
token ids with `prompt_logprobs`, and every chosen token must be its top choice or within `TOLERANCE` nats of it (bf16
noise between batch shapes measured up to 0.25; one wrong token sits 10+ nats below). The oracle's sensitivity is
shown on each byte class of the transfer: conv state, recurrent state, attention K and V, each overwritten with noise
right after it lands, must each fail the check; noise in the state pages' padding must not."""

from __future__ import annotations

import pytest
import ray

from cluster.cli.oracle import TOLERANCE, greedy_tokens
from tests.pd_helpers import colocated, gather, run_pair
from tests.real_helpers import MAX_TOKENS, assert_every_class_seen, block_size, corrupted_classes, document, real_pd
from tests.real_helpers import pd, reference  # noqa: F401 - the module's fixtures, from `served`

pytestmark = [pytest.mark.engine, pytest.mark.slow]

QWEN_P, QWEN_D1, QWEN_D2 = "prefill-tp1", "decode-tp1", "decode-tp2"
CACHING = {"enable_prefix_caching": True}


# ---- Qwen3.5-0.8B shape ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(ray_local):
    """Prefill TP 1 and decode TP 2 cache prefixes, decode TP 1 does not; vLLM's server on the same build."""
    with real_pd("qwen3.5-0.8b", [("prefill", 1), ("decode", 1), ("decode", 2)], "real-qwen",
                 per_engine={("prefill", 1): CACHING, ("decode", 2): CACHING}) as both:
        yield both


def test_the_oracle_tells_a_right_token_from_a_wrong_one(pd, reference):
    """vLLM's greedy tokens (its own server's) pass; the same output with one token replaced fails at that token, by
    far more than the tolerance - the weights are informative enough for the check to mean something."""
    prompt = document(1, 300)
    own = greedy_tokens(reference.client, reference.name, prompt, MAX_TOKENS)
    reference.assert_right(prompt, own, "vLLM's own greedy output")
    for at in (0, 3, MAX_TOKENS - 1):
        wrong = list(own)
        wrong[at] = 3 + (own[at] + 500) % 1021
        got = reference.check(prompt, wrong)
        assert got.first_over(TOLERANCE) == at and got.gaps[at] > 5.0, got.gaps


@pytest.mark.parametrize("first", ["prefill", "decode"])
@pytest.mark.parametrize("decode", [QWEN_D1, QWEN_D2])
def test_disaggregated_tokens_are_vllms_own(pd, reference, decode, first):
    """P TP 1 -> D TP 1 and D TP 2, first token sampled by either engine: prompts shorter than a block, one block, and
    two blocks and more - every token vLLM's choice."""
    block = block_size(pd)
    case = [QWEN_D1, QWEN_D2].index(decode) * 2 + (first == "decode")
    for n in (40, block - (first == "prefill"), 2 * block + 39):
        prompt = document(10_000 * case + n, n)  # each case its own prompts: no engine's prefix cache serves them
        out = gather([run_pair(pd.routers[first], QWEN_P, decode, prompt, MAX_TOKENS)])[0]
        reference.assert_right(prompt, out, f"{n}-token prompt, {QWEN_P} -> {decode}, first token from {first}")


def test_colocated_tokens_are_vllms_own(pd, reference):
    prompt = document(7, 500)
    out = gather([colocated(pd.engines[("decode", 1)], prompt, MAX_TOKENS)])[0]
    reference.assert_right(prompt, out, "decode TP 1 running the request whole")


def test_the_oracle_sees_each_byte_class_of_the_transfer(pd, reference):
    """P TP 1 -> D TP 2 (each decode rank reads half of the prefill rank's GDN heads, conv channels and KV heads): a
    700-token prompt (a whole block and part of the next) with each byte class overwritten after the read lands."""
    assert_every_class_seen(corrupted_classes(pd, reference, QWEN_P, ("decode", 2), 700, 200))


def test_prefix_hits_on_both_pools(pd, reference):
    """Prefill TP 1 and decode TP 2 both cache: a prompt that shares two whole blocks with one served before is
    prefilled from the prefill engine's cache, and the decode engine finds those blocks in its own and reads only the
    rest plus the state - fewer bytes than a prompt of the same length cold - with vLLM's tokens."""
    block = block_size(pd)
    decode = pd.engines[("decode", 2)]

    def counted(prompt):
        totals = [ray.get(pd.engines[k].transfer_totals()).cached_prompt_tokens for k in (("prefill", 1), ("decode", 2))]
        ray.get(decode.transfer_stats())
        out = gather([run_pair(pd.routers["prefill"], QWEN_P, QWEN_D2, prompt, MAX_TOKENS)])[0]
        reads = ray.get(decode.transfer_stats())
        after = [ray.get(pd.engines[k].transfer_totals()).cached_prompt_tokens for k in (("prefill", 1), ("decode", 2))]
        assert reads and all(r["ok"] for r in reads)
        reference.assert_right(prompt, out, f"{len(prompt)}-token prompt")
        return after[0] - totals[0], after[1] - totals[1], sum(r["bytes"] for r in reads)

    doc = document(21, 2 * block + 100)
    counted(doc)
    suffix = document(22, 60)[1:]
    prefill_hit, decode_hit, hit_bytes = counted(doc[:2 * block] + suffix)
    cold_hit_p, cold_hit_d, cold_bytes = counted(document(23, 2 * block) + suffix)
    assert (cold_hit_p, cold_hit_d) == (0, 0)
    assert prefill_hit == 2 * block and decode_hit == 2 * block
    assert 0 < hit_bytes < cold_bytes
