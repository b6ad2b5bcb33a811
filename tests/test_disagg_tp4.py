"""A TP 4 decode side on the Mamba2 hybrid: prefill TP 1 -> decode TP 4 (two heads per decode rank, the one B/C group
replicated on all four). TP 4 on two cores is slow: short requests only. The GDN family's TP 4 decode side runs in
test_disagg_gdn_asym.py (P TP 1/2 -> D TP 4, every byte class included), whose asymmetric model (value heads = 2 x
key heads, KV heads replicated) is the harder case of the same reads; the symmetric gdn model's P TP 2 -> D TP 4
ran here until its engines' start (~2.5 min of CI) outweighed what it added."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.core.models import ensure_model
from tests.pd_helpers import PDCluster, gather, oracle, prompts, run_pair

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module", params=[("mamba2", 1)], ids=["mamba2-P1"])
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
