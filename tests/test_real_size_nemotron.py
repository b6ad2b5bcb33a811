"""A Nemotron-H-8B-shaped Mamba2 hybrid at real width (its first 8 layers: 4 Mamba2, 3 MLP, 1 attention; 1.0B
parameters, random weights, the local 1,024-token vocabulary), prefill TP 2 -> decode TP 1 (each decode rank reads
halves of two prefill ranks' Mamba2 heads, conv channels and KV heads), checked token by token against vLLM's own
server on the same weights (tests/real_helpers.py, `cluster.cli.oracle`), and each byte class of the transfer shown to
reach the output."""

from __future__ import annotations

import pytest

from tests.pd_helpers import gather, run_pair
from tests.real_helpers import MAX_TOKENS, assert_every_class_seen, block_size, corrupted_classes, document, real_pd
from tests.real_helpers import pd, reference  # noqa: F401 - the module's fixtures, from `served`

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PREFILL, DECODE = "prefill-tp2", "decode-tp1"


@pytest.fixture(scope="module")
def served(ray_local):
    with real_pd("nemotron-h-8l", [("prefill", 2), ("decode", 1)], "real-nemotron") as both:
        yield both


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_disaggregated_tokens_are_vllms_own(pd, reference, first):
    block = block_size(pd)
    for n in (40, block + 50):
        prompt = document(n + 1, n)
        out = gather([run_pair(pd.routers[first], PREFILL, DECODE, prompt, MAX_TOKENS)])[0]
        reference.assert_right(prompt, out, f"{n}-token prompt, {PREFILL} -> {DECODE}, first token from {first}")


def test_the_oracle_sees_each_byte_class_of_the_transfer(pd, reference):
    assert_every_class_seen(corrupted_classes(pd, reference, PREFILL, ("decode", 1), 48, 5))
