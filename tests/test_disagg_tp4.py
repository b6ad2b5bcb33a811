"""Prefill TP 2 -> decode TP 4 on the tiny GDN hybrid (each decode rank slices one prefill rank's pages). TP 4 on two
cores is slow: short requests only."""

from __future__ import annotations

import pytest

from cluster.models import expected_next_token
from tests.pd_helpers import PDCluster, gather, prompts, run_pair

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def pd(ray_local, gdn_model):
    cluster = PDCluster(gdn_model, [("prefill", 2), ("decode", 4)], "tp4")
    print(f"engine startup seconds: {cluster.startup_s}")
    yield cluster
    cluster.stop()


def test_prefill_tp2_to_decode_tp4(pd):
    cases = prompts(seed=21, lengths=(5, 300))
    outs = gather(run_pair(pd.router, "prefill-tp2", "decode-tp4", p, max_tokens=6) for p in cases)
    for prompt, out in zip(cases, outs):
        ids = list(prompt)
        for _ in range(6):
            ids.append(expected_next_token(ids))
        assert out == ids[len(prompt):], f"{len(prompt)}-token prompt"
