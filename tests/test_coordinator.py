"""The coordinator's registry (no Ray): pools join, pairs are planned once per layout pair, refusals register nothing,
payloads carry exactly the negotiated plan, departures remove every pair."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cluster.core.coordinator import Coordinator, EngineRecord, RegistrationError
from cluster.core.hf_config import load_config, model_shape
from cluster.core.layout import offline_layout
from cluster.core.planner import plan_pair
from cluster.core.wire import pair_from_dict, pair_to_dict

MODEL = model_shape(load_config("configs/models/qwen3.5-0.8b.json"))


def layout(tp: int, dtype: str = "bfloat16", conv_layout: str = "DS"):
    return offline_layout(MODEL, tp, dtype, "float32", conv_layout=conv_layout)


def record(role: str, i: int, tp: int, dtype: str = "bfloat16", model: str = "m", conv_layout: str = "DS") -> EngineRecord:
    lay = layout(tp, dtype, conv_layout)
    ranks = [{"agent_metadata": bytes([i, r]) * 8, "region_bases": [4096 * (r + 1)] * lay.num_regions, "device_id": r}
             for r in range(tp)]
    return EngineRecord(f"{role}-{i}", role, model, lay, ranks)


def test_pools_pair_up_with_one_plan_per_layout_pair():
    c = Coordinator()
    for i in range(3):
        c.register(record("prefill", i, 1))
    new = c.register(record("decode", 0, 2))
    assert sorted(new) == [(f"prefill-{i}", "decode-0") for i in range(3)]
    c.register(record("decode", 1, 4))
    assert len(c.pairs) == 6 and c.plans_computed == 2  # (TP1 -> TP2) and (TP1 -> TP4)
    assert c.pair("prefill-2", "decode-1") is c.pair("prefill-0", "decode-1")
    assert c.pair("prefill-0", "decode-1") == plan_pair(layout(1), layout(4))


def test_payload_is_the_negotiated_plan_and_the_prefill_ranks():
    c = Coordinator()
    c.register(record("prefill", 7, 2))
    c.register(record("decode", 0, 1))
    body = json.loads(c.payload("prefill-7", "decode-0"))
    assert pair_from_dict(body["pair"]) == c.pair("prefill-7", "decode-0")
    assert body["pair"] == json.loads(json.dumps(pair_to_dict(plan_pair(layout(2), layout(1)))))
    assert [bytes.fromhex(r["agent_metadata"]) for r in body["prefill_ranks"]] == [bytes([7, r]) * 8 for r in range(2)]


def test_refused_engine_registers_nothing():
    c = Coordinator()
    c.register(record("prefill", 0, 1))
    c.register(record("decode", 0, 2))
    with pytest.raises(RegistrationError, match="dtype"):
        c.register(record("prefill", 1, 1, dtype="float16"))
    with pytest.raises(RegistrationError, match="model"):
        c.register(record("decode", 1, 2, model="other"))
    with pytest.raises(RegistrationError, match="already registered"):
        c.register(record("decode", 0, 2))
    assert sorted(c.engines) == ["decode-0", "prefill-0"] and list(c.pairs) == [("prefill-0", "decode-0")]


def test_an_engine_in_the_other_conv_layout_is_refused_with_both_values():
    """SD engines pair with SD engines (and DS with DS) at any TP pair; a DS engine joining SD pools is refused,
    naming the field and both layouts, and registers nothing."""
    c = Coordinator()
    c.register(record("prefill", 0, 1, conv_layout="SD"))
    assert c.register(record("decode", 0, 2, conv_layout="SD")) == [("prefill-0", "decode-0")]
    with pytest.raises(RegistrationError, match=r"conv_layout: prefill has 'SD', decode has 'DS'; both engines must keep "
                                                r"conv state in one layout"):
        c.register(record("decode", 1, 2, conv_layout="DS"))
    assert sorted(c.engines) == ["decode-0", "prefill-0"]


def test_third_member_of_a_pool_is_still_checked():
    c = Coordinator()
    c.register(record("decode", 0, 2))
    c.register(record("decode", 1, 2))
    with pytest.raises(RegistrationError, match="dtype"):
        c.register(record("decode", 2, 2, dtype="float32"))


def test_departures_and_draining():
    c = Coordinator()
    for i in range(2):
        c.register(record("prefill", i, 1))
        c.register(record("decode", i, 2))
    c.set_state("decode-1", "draining")
    assert c.decodes_for("prefill-0") == ["decode-0"] and c.ready("decode") == ["decode-0"]
    assert c.routes() == {"prefill-0": ["decode-0"], "prefill-1": ["decode-0"]}
    c.set_state("prefill-0", "draining")
    assert c.routes() == {"prefill-1": ["decode-0"]}
    c.set_state("prefill-0", "ready")
    c.deregister("prefill-1")
    assert all("prefill-1" not in k for k in c.pairs)
    with pytest.raises(KeyError, match="not registered"):
        c.pair("prefill-1", "decode-0")
    c.register(dataclasses.replace(record("prefill", 1, 1)))  # may come back under the same id
    assert ("prefill-1", "decode-0") in c.pairs


def test_scale_benchmark_runs_and_caches():
    from cluster.cli.bench.scale import bench_scale

    rows = bench_scale([1, 3])
    assert [r["pairs"] for r in rows] == [1, 9]
    assert all(r["coordinator_plans_computed"] == 1 for r in rows)
    assert rows[-1]["pairwise_plans_computed"] == 9
