"""The pools' autoscaling policy without engines: what each pool's signal asks for, when a wish becomes a decision,
and what the policy reads from (and ignores in) Serve's autoscaling context. Also the coordinator's pool bookkeeping
and the pool settings of the deployment file."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.control.autoscale import Hysteresis, PoolPolicy, Want, wanted
from cluster.core.config import DeployConfig, ScalingConfig
from cluster.core.coordinator import Coordinator, RegistrationError

SCALING = ScalingConfig(target_queued_prompt_tokens=1000, target_running_requests=4, max_cache_usage=0.8,
                        upscale_delay_s=2, downscale_delay_s=10).model_dump()


@pytest.mark.parametrize("queued, current, want", [
    ([0], 1, 1), ([999], 1, 1), ([1000], 1, 1), ([1001], 1, 2), ([600, 600], 2, 2), ([2500, 0], 2, 3), ([90000], 1, 4),
    ([], 2, 1),  # no engine reporting yet: the floor
])
def test_prefill_wants_queued_tokens_over_target(queued, current, want):
    got = wanted("prefill", [{"queued_prompt_tokens": q, "running_requests": 99} for q in queued], current, SCALING, 1, 4)
    assert got.replicas == want
    assert got.signals == {"queued_prompt_tokens": sum(queued)}
    raw = -(-sum(queued) // 1000)
    assert "prompt tokens" in got.reason and ("bounded" in got.reason) == (raw != want)


@pytest.mark.parametrize("running, usage, current, want", [
    ([0], [0.0], 1, 1), ([4], [0.1], 1, 1), ([5], [0.1], 1, 2), ([3, 3], [0.2, 0.1], 2, 2), ([1, 0], [0.1, 0.0], 2, 1),
    ([1], [0.85], 1, 2),  # cache nearly full: one more engine whatever the sequence count
    ([1, 1], [0.9, 0.1], 2, 3),
    ([9], [0.95], 3, 3),  # ...bounded by max_replicas
])
def test_decode_wants_running_sequences_and_cache_headroom(running, usage, current, want):
    loads = [{"running_requests": r, "cache_usage": u, "queued_prompt_tokens": 1e9} for r, u in zip(running, usage)]
    got = wanted("decode", loads, current, SCALING, 1, 3)
    assert got.replicas == want
    assert got.signals == {"running_requests": sum(running), "cache_usage": max(usage)}
    assert ("cache" in got.reason) == (max(usage) > 0.8)


def test_unknown_role_is_an_error():
    with pytest.raises(ValueError, match="role"):
        wanted("router", [], 1, SCALING, 1, 2)


def test_hysteresis_decides_only_after_the_delay_in_one_direction():
    h = Hysteresis(upscale_delay_s=2, downscale_delay_s=10)
    up, down, same = Want(2, "more", {}), Want(1, "less", {}), Want(1, "steady", {})
    assert h.step("prefill", up, 1, now=100.0) is None
    assert h.step("prefill", up, 1, now=101.9) is None
    d = h.step("prefill", up, 1, now=102.0)
    assert (d.before, d.after, d.direction, d.reason) == (1, 2, "up", "more")
    # a wish that flips direction starts its clock again
    assert h.step("prefill", down, 2, now=103.0) is None
    assert h.step("prefill", Want(2, "steady", {}), 2, now=108.0) is None
    assert h.step("prefill", down, 2, now=109.0) is None
    assert h.step("prefill", down, 2, now=118.9) is None
    d = h.step("prefill", down, 2, now=119.0)
    assert (d.before, d.after, d.direction) == (2, 1, "down") and str(d).startswith("scale prefill pool down 2 -> 1")
    assert h.step("prefill", same, 1, now=200.0) is None


def ctx(target: int, running: list[str], metrics: dict[str, dict[str, float]], lo: int = 1, hi: int = 2):
    return SimpleNamespace(running_replicas=running, target_num_replicas=target, aggregated_metrics=metrics,
                           capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi, policy_state={})


def test_pool_policy_reads_its_own_signal_of_running_replicas_only(monkeypatch):
    import actors.control.autoscale as autoscale

    clock = [1000.0]
    monkeypatch.setattr(autoscale.time, "time", lambda: clock[0])
    policy = PoolPolicy("prefill", 1, 2, SCALING)
    reported = []
    policy._report = lambda method, *args: reported.append((method, args))
    busy = {"queued_prompt_tokens": {"r1": 3000.0, "gone": 9e9}, "running_requests": {"r1": 50.0}}
    assert policy(ctx(1, ["r1"], busy)) == (1, {"wanted": 2, "reason": "3000 prompt tokens queued or in prefill, "
                                                                          "target 1000 per engine (wants 3, bounded to [1, 2])"})
    clock[0] += 2.5
    n, state = policy(ctx(1, ["r1"], busy))
    assert n == 2
    decisions = [args[0] for method, args in reported if method == "record_scaling"]
    assert [(d["role"], d["before"], d["after"], d["direction"]) for d in decisions] == [("prefill", 1, 2, "up")]
    signals = [args for method, args in reported if method == "record_pool_signal"]
    assert signals[0] == ("prefill", {"target": 1, "running": 1, "reporting": 1, "queued_prompt_tokens": 3000.0})
    # a decode-only signal does not move the prefill pool; the idle pool shrinks after the downscale delay
    idle = {"running_requests": {"r1": 80.0, "r2": 80.0}, "queued_prompt_tokens": {"r1": 0.0, "r2": 0.0}}
    assert policy(ctx(2, ["r1", "r2"], idle))[0] == 2
    clock[0] += 10
    assert policy(ctx(2, ["r1", "r2"], idle))[0] == 1
    # a capacity-adjusted minimum above the configured one wins
    assert policy(ctx(1, ["r1"], {}, lo=2, hi=2))[1]["wanted"] == 2


def test_coordinator_hands_out_fresh_engine_ids_and_keeps_pool_events():
    c = Coordinator()
    assert [c.claim_engine_id("decode") for _ in range(2)] == ["decode-0", "decode-1"]
    assert c.claim_engine_id("prefill", taken={"prefill-0", "prefill-1"}) == "prefill-2"
    with pytest.raises(RegistrationError, match="role"):
        c.claim_engine_id("router")
    for d in ("up", "up", "down"):
        c.record_scaling({"role": "decode", "direction": d, "before": 1, "after": 2, "reason": "r", "time": 1.0})
    c.record_pool_signal("decode", {"target": 2, "running_requests": 5.0})
    pools = c.describe()["pools"]
    assert pools["decisions"] == [{"role": "decode", "direction": "down", "count": 1}, {"role": "decode", "direction": "up", "count": 2}]
    assert pools["signals"]["decode"]["running_requests"] == 5.0 and len(pools["last_decisions"]) == 3


def test_pool_settings_in_the_deployment_file():
    cfg = DeployConfig.model_validate({"prefill": {"min_replicas": 1, "max_replicas": 3, "scaling": {"upscale_delay_s": 1}}})
    assert cfg.prefill.autoscaling and not cfg.decode.autoscaling
    assert cfg.prefill.scaling.upscale_delay_s == 1 and cfg.decode.scaling.target_running_requests == 8
    for bad, field in [({"prefill": {"min_replicas": 0}}, "prefill.min_replicas"),
                       ({"decode": {"scaling": {"max_cache_usage": 1.5}}}, "decode.scaling.max_cache_usage"),
                       ({"decode": {"scaling": {"target_running_requests": 0}}}, "decode.scaling.target_running_requests"),
                       ({"decode": {"scaling": {"downscale_delay": 3}}}, "decode.scaling.downscale_delay")]:
        with pytest.raises(Exception) as e:
            DeployConfig.model_validate(bad)
        assert field in str(e.value), str(e.value)


def test_pool_policy_never_shrinks_on_missing_reports(monkeypatch):
    """An engine whose load did not arrive (busy, slow to answer) is unknown, not idle: no scale-down on partial data;
    growth on partial data is fine (the reporting engines' load is a lower bound)."""
    import actors.control.autoscale as autoscale

    clock = [0.0]
    monkeypatch.setattr(autoscale.time, "time", lambda: clock[0])
    policy = PoolPolicy("decode", 1, 3, SCALING)
    policy._report = lambda *a: None
    partial_idle = {"running_requests": {"r1": 0.0}, "cache_usage": {"r1": 0.0}}
    for _ in range(5):
        n, state = policy(ctx(2, ["r1", "r2"], partial_idle, hi=3))
        clock[0] += 5
    assert n == 2 and state["reason"].startswith("holding: 1 of 2 engines did not report")
    partial_busy = {"running_requests": {"r1": 13.0}, "cache_usage": {"r1": 0.1}}
    assert [policy(ctx(2, ["r1", "r2"], partial_busy, hi=3))[0] for clock[0] in (100.0, 103.0)] == [2, 3]
    # an engine that reports its sequences but could not read its cache usage (EngineActor leaves the signal out
    # rather than report 0) is not known to be idle either
    policy = PoolPolicy("decode", 1, 3, SCALING)
    policy._report = lambda *a: None
    no_usage = {"running_requests": {"r1": 0.0, "r2": 0.0}, "cache_usage": {"r1": 0.0}}
    for clock[0] in range(200, 230, 5):
        n, state = policy(ctx(2, ["r1", "r2"], no_usage, hi=3))
    assert n == 2 and state["reason"].startswith("holding: 1 of 2 engines did not report"), state


def test_a_full_cache_asks_for_one_engine_more_than_are_running_not_than_the_target(monkeypatch):
    """While the engine the pool already decided on is loading (target 2, one running), a full cache must not grow
    the pool again and again."""
    import actors.control.autoscale as autoscale

    clock = [0.0]
    monkeypatch.setattr(autoscale.time, "time", lambda: clock[0])
    policy = PoolPolicy("decode", 1, 6, SCALING)
    policy._report = lambda *a: None
    full = {"running_requests": {"r1": 2.0}, "cache_usage": {"r1": 0.95}}
    targets = []
    target = 1
    for _ in range(20):
        target = policy(ctx(target, ["r1"], full, hi=6))[0]
        targets.append(target)
        clock[0] += 1
    assert max(targets) == 2 and targets[-1] == 2
