"""A TP 4 decode side: prefill TP 2 -> decode TP 4 on the tiny GDN hybrid (each decode rank slices one prefill rank's
pages) and prefill TP 1 -> decode TP 4 on the Mamba2 hybrid (two heads per decode rank, the one B/C group replicated
on all four). TP 4 on two cores is slow: short requests only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.models import ensure_model
from tests.pd_helpers import PDCluster, gather, oracle, prompts, run_pair, unseen_byte_classes

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module", params=[("gdn", 2), ("mamba2", 1)], ids=["gdn-P2", "mamba2-P1"])
def setup(request, ray_local):
    """The model kind, the prefill TP and the engines (`pd`)."""
    kind, p_tp = request.param
    cluster = PDCluster(ensure_model(kind), [("prefill", p_tp), ("decode", 4)], f"tp4-{kind}")
    print(f"engine startup seconds: {cluster.startup_s}")
    yield SimpleNamespace(kind=kind, p_tp=p_tp, pd=cluster)
    cluster.stop()


def test_prefill_to_decode_tp4(setup):
    cases = prompts(seed=21, lengths=(5, 300))
    outs = gather(run_pair(setup.pd.router, f"prefill-tp{setup.p_tp}", "decode-tp4", p, max_tokens=6) for p in cases)
    for prompt, out in zip(cases, outs):
        assert out == oracle(prompt, 6, setup.kind), f"{setup.kind}: {len(prompt)}-token prompt"


def test_the_output_sees_every_byte_class_that_moves(setup):
    """As in test_disagg_gdn.py, with each decode rank holding a quarter of the heads. GDN only: a Mamba2 query
    garbled by noise still reads the latest entry whenever the noise's component on that entry's key is positive
    (its SiLU keeps the negative ones small, and the decay makes the latest entry the largest), so whether the
    C channels / conv row 1 change the output depends on the noise drawn - at D TP 4 with this test's draws, conv
    row 1 did not (test_disagg_mamba2.py sees every class at P TP 1 -> 2 and 2 -> 1)."""
    if setup.kind == "mamba2":
        pytest.skip("Mamba2's garbled query is seen only for some noise draws (docstring)")
    assert unseen_byte_classes(setup.pd, f"prefill-tp{setup.p_tp}", ("decode", 4), setup.kind, max_tokens=2) == {}
