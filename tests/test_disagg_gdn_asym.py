"""The live matrix on the asymmetric GDN hybrid (`gdn-asym`: value heads = 2 x key heads, as in Qwen3.5, so the conv
state's V channels are twice the Q/K width; 2 attention KV heads, replicated at TP 4): disaggregated == colocated ==
the model's rule, token for token, for prompts shorter than a block, ending exactly on a block boundary and several
blocks long, over TP pairs that include a TP 4 side, with the first token sampled by either engine (from the prefill
engine the whole prompt is transferred; from the decode engine all but the last prompt token). vLLM gives this model 384-token blocks at TP 1 and 2 but 256 at TP 4
(its state page is smaller there); CPU attention pages cannot be remapped between block sizes (the coordinator
refuses such pairs: tests/test_disagg_gdn.py), so every engine here starts with 384-token blocks."""

from __future__ import annotations

import pytest

from cluster.cli.tiny_model import ensure_model
from tests.pd_helpers import PDCluster, colocated, gather, oracle, prompts, run_pair

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PAIRS = [(1, 2), (2, 2), (1, 4), (2, 4)]
BLOCK = 384


@pytest.fixture(scope="module")
def pd(ray_local):
    cluster = PDCluster(ensure_model("gdn-asym"), [("prefill", 1), ("prefill", 2), ("decode", 2), ("decode", 4)],
                        "gdn-asym", engine_kwargs={"block_size": BLOCK})
    print(f"engine startup seconds: {cluster.startup_s}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def block(pd) -> int:
    """The engines' logical block (the hybrid page alignment: 384 tokens for this model on CPU)."""
    import ray

    blocks = {k: ray.get(e.registration()).ranks[0]["layout"]["block_size"] for k, e in pd.engines.items()}
    assert set(blocks.values()) == {BLOCK}, blocks
    return BLOCK


def cases(block: int, first: str) -> list[list[int]]:
    """Prompts (with the leading BOS) whose transferred tokens are few, one short of a whole block, exactly one
    block, and several blocks, when the first token comes from `first`."""
    whole = first == "prefill"
    return prompts(seed=31, lengths=[n - whole for n in (3, block - 1, block, 2 * block + 39)])


def test_colocated_follows_the_rule(pd, block):
    refs = gather(colocated(pd.engines[("decode", 2)], p, max_tokens=8) for p in cases(block, "decode"))
    assert refs == [oracle(p, 8) for p in cases(block, "decode")]


@pytest.mark.parametrize("first", ["prefill", "decode"])
@pytest.mark.parametrize("p_tp, d_tp", PAIRS)
def test_disaggregated_equals_colocated(pd, block, p_tp, d_tp, first):
    prompts_ = cases(block, first)
    outs = gather(run_pair(pd.routers[first], f"prefill-tp{p_tp}", f"decode-tp{d_tp}", p, max_tokens=8) for p in prompts_)
    for prompt, out in zip(prompts_, outs):
        assert out == oracle(prompt, 8), f"{len(prompt)}-token prompt, P TP {p_tp} -> D TP {d_tp}, first token: {first}"


def test_the_output_sees_every_byte_class_that_moves(pd):
    """As in test_disagg_gdn.py, on the asymmetric heads (the V channels twice the Q/K width - the offsets where the
    reference system's bug lived): P TP 2 -> D TP 4, each decode rank reading parts of one prefill rank's page."""
    from tests.pd_helpers import unseen_byte_classes

    assert unseen_byte_classes(pd, "prefill-tp2", ("decode", 4), "gdn-asym") == {}
