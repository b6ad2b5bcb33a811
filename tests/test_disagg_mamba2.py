"""Disaggregated prefill/decode on the tiny Mamba2 hybrid (GraniteMoeHybrid, n_groups 1: B/C replicated on every
rank) at (P, D) TP = (1, 2) and (2, 1), against the same requests run colocated on one engine and the rule the
model's weights implement (`cluster.cli.tiny_circuit.expected_next_token`, kind mamba2); and a TP 4 decode side,
P TP 1 -> D TP 4 (two heads per decode rank, the one B/C group replicated on all four; TP 4 on two cores is slow:
short requests only). The GDN family's TP 4 decode side runs in test_disagg_gdn_asym.py, whose asymmetric model
(value heads = 2 x key heads, KV heads replicated) is the harder case of the same reads."""

from __future__ import annotations

import pytest
import ray

from cluster.cli.tiny_model import ensure_model
from tests.pd_helpers import PDCluster, colocated, gather, oracle, prompts, run_pair, unseen_byte_classes

pytestmark = pytest.mark.engine

PAIRS = [(1, 2), (2, 1)]


@pytest.fixture(scope="module")
def pd(ray_local):
    # the DS conv-state layout (vLLM's stock NIXL layout, the one CUDA engines run), where the GDN modules run SD
    cluster = PDCluster(ensure_model("mamba2"), [("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2), ("decode", 4)],
                        "mamba2", extra_env={"VLLM_SSM_CONV_STATE_LAYOUT": "DS"})
    print(f"engine startup seconds: {cluster.startup_s}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def reference(pd):
    """Each request run whole on one engine (decode TP 1 and prefill TP 2, no transfer): they agree, and follow the
    model's rule."""
    a = gather(colocated(pd.engines[("decode", 1)], p) for p in prompts())
    b = gather(colocated(pd.engines[("prefill", 2)], p) for p in prompts())
    assert a == b == [oracle(p, kind="mamba2") for p in prompts()]
    assert {r["layout"]["conv_layout"] for e in pd.engines.values() for r in ray.get(e.registration()).ranks} == {"DS"}
    return a


@pytest.mark.parametrize("p_tp, d_tp", PAIRS)
def test_disaggregated_equals_colocated(pd, reference, p_tp, d_tp):
    outs = gather(run_pair(pd.router, f"prefill-tp{p_tp}", f"decode-tp{d_tp}", p) for p in prompts())
    for prompt, out, ref in zip(prompts(), outs, reference):
        assert out == ref, f"{len(prompt)}-token prompt, P TP {p_tp} -> D TP {d_tp}"


def test_replicated_groups_read_from_one_rank_each(pd, reference):
    """With one B/C group replicated on both prefill ranks, the TP 1 decode engine reads each rank's x and ssm
    heads, and B/C once (from rank 0), never twice."""
    import ray

    plan = ray.get(pd.coordinator.pair_payload("prefill-tp2", "decode-tp1"))
    import json

    reads = json.loads(plan)["pair"]["state_reads"][0]
    by_piece = {}
    for r in reads:
        by_piece.setdefault(r["piece"], []).append(r["remote_rank"])
    assert by_piece == {"conv0": [0, 1], "conv1": [0], "conv2": [0], "ssm": [0, 1]}


@pytest.mark.parametrize("p_tp, d_tp", PAIRS)
def test_the_output_sees_every_byte_class_that_moves(pd, p_tp, d_tp):
    """As in test_disagg_gdn.py: noise in each conv channel group (x, B, C) and each conv row in every Mamba2 layer,
    each recurrent head of each layer, attention K and V, right after the decode engine's read lands, changes the
    output; noise in bytes the model never reads does not."""
    assert unseen_byte_classes(pd, f"prefill-tp{p_tp}", ("decode", d_tp), "mamba2") == {}


@pytest.mark.parametrize("first", ["prefill", "decode"])
@pytest.mark.parametrize("p_tp, d_tp", PAIRS)
def test_prompts_on_block_boundaries(pd, p_tp, d_tp, first):
    """Transferred tokens a few, one short of a block, exactly one block and several blocks (with the first token
    from the prefill engine the whole prompt is transferred, from the decode engine all but its last token): the
    model's rule, token for token, and the decode engine read exactly that many tokens."""
    import ray

    decode = pd.engines[("decode", d_tp)]
    block = ray.get(decode.registration()).ranks[0]["layout"]["block_size"]
    whole = first == "prefill"  # prompts() adds a BOS: a length n gives n + 1 tokens
    lengths = (3, block - 1, block, 2 * block + 39)
    cases = prompts(seed=43, lengths=[n - whole for n in lengths])
    ray.get(decode.transfer_stats())  # drain earlier requests
    outs = gather(run_pair(pd.routers[first], f"prefill-tp{p_tp}", f"decode-tp{d_tp}", p) for p in cases)
    for prompt, out in zip(cases, outs):
        assert out == oracle(prompt, kind="mamba2"), f"{len(prompt)}-token prompt, P TP {p_tp} -> D TP {d_tp}, first: {first}"
    read = sorted({s["tokens"] for s in ray.get(decode.transfer_stats())})
    assert read == sorted(lengths), read


def test_prefill_to_decode_tp4(pd):
    cases = prompts(seed=21, lengths=(5, 300))
    outs = gather(run_pair(pd.router, "prefill-tp1", "decode-tp4", p, max_tokens=6) for p in cases)
    for prompt, out in zip(cases, outs):
        assert out == oracle(prompt, 6, "mamba2"), f"{len(prompt)}-token prompt, P TP 1 -> D TP 4"
