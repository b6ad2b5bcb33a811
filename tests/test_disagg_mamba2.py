"""Disaggregated prefill/decode on the tiny Mamba2 hybrid (GraniteMoeHybrid, n_groups 1: B/C replicated on every
rank) at (P, D) TP = (1, 2) and (2, 1), against the same requests run colocated on one engine."""

from __future__ import annotations

import pytest

from cluster.models import ensure_model
from tests.pd_helpers import PDCluster, colocated, gather, prompts, run_pair

pytestmark = pytest.mark.engine

PAIRS = [(1, 2), (2, 1)]


@pytest.fixture(scope="module")
def pd(ray_local):
    cluster = PDCluster(ensure_model("mamba2"), [("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)], "mamba2")
    print(f"engine startup seconds: {cluster.startup_s}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def reference(pd):
    """Each request run whole on one engine (decode TP 1 and prefill TP 2, no transfer): they agree."""
    a = gather(colocated(pd.engines[("decode", 1)], p) for p in prompts())
    b = gather(colocated(pd.engines[("prefill", 2)], p) for p in prompts())
    assert a == b
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

    plan = ray.get(pd.coordinator.pair_plan.remote("prefill-tp2", "decode-tp1"))
    import json

    reads = json.loads(plan)["pair"]["state_reads"][0]
    by_region = {}
    for r in reads:
        by_region.setdefault(r["region"], []).append(r["remote_rank"])
    assert by_region == {"conv0": [0, 1], "conv1": [0], "conv2": [0], "ssm": [0, 1]}
