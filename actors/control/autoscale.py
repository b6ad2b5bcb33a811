"""The pools' autoscaling policy: how many engines a prefill or a decode pool wants, and when a change is decided.

Each pool is a Ray Serve deployment (`actors/control/pool.py`) whose replicas each own one engine. Serve's default
policy counts requests sent through a deployment's handles; our requests go from the router straight to the engine
actors, so the replicas report their engine's load instead (`record_autoscaling_stats`) and this policy turns it into a
replica count:

- prefill pool: prompt tokens queued or in prefill, summed over the pool, divided by `target_queued_prompt_tokens`;
- decode pool: sequences being decoded, summed, divided by `target_running_requests`; and one engine more than now
  while any engine's KV/state blocks are fuller than `max_cache_usage`.

The wanted count (clamped to [min_replicas, max_replicas]) becomes a decision only after it has asked for the same
direction for `upscale_delay_s` / `downscale_delay_s`. A pool never shrinks while one of its engines has not reported
its load (unknown is not idle). A decision carries its reason; it is logged and reported to the
coordinator, which exports it in /metrics.

This module is pure and imports only the standard library: Serve pickles `PoolPolicy` by value into its controller.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("ray.serve")  # the policy runs in Serve's controller: its log is where operators look
SIGNALS = {"prefill": ("queued_prompt_tokens",), "decode": ("running_requests", "cache_usage")}
REPORT_EVERY_S = 2.0  # how often the policy sends its pool's signal to the coordinator (for /metrics)


@dataclass(frozen=True)
class Want:
    replicas: int
    reason: str
    signals: dict[str, float]


@dataclass
class Decision:
    role: str
    before: int
    after: int
    reason: str
    signals: dict[str, float]
    time: float = field(default_factory=time.time)

    @property
    def direction(self) -> str:
        return "up" if self.after > self.before else "down"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "direction": self.direction}

    def __str__(self) -> str:
        return f"scale {self.role} pool {self.direction} {self.before} -> {self.after}: {self.reason}"


def wanted(role: str, loads: list[dict[str, float]], current: int, scaling: dict[str, Any],
           min_replicas: int, max_replicas: int) -> Want:
    """The engine count `loads` (one dict of signals per running engine) asks for. `current`: the engines running
    now (not the target: while a new engine loads, a full cache must not ask for yet another one)."""
    if role == "prefill":
        queued = sum(load.get("queued_prompt_tokens", 0.0) for load in loads)
        target = scaling["target_queued_prompt_tokens"]
        n = math.ceil(queued / target - 1e-9)
        reason = f"{queued:.0f} prompt tokens queued or in prefill, target {target} per engine"
        signals = {"queued_prompt_tokens": queued}
    elif role == "decode":
        running = sum(load.get("running_requests", 0.0) for load in loads)
        usage = max((load.get("cache_usage", 0.0) for load in loads), default=0.0)
        target = scaling["target_running_requests"]
        n = math.ceil(running / target - 1e-9)
        reason = f"{running:.1f} sequences decoding, target {target:g} per engine"
        if usage > scaling["max_cache_usage"]:
            n = max(n, current + 1)
            reason = f"KV/state cache {usage:.0%} full (limit {scaling['max_cache_usage']:.0%}); {reason}"
        signals = {"running_requests": running, "cache_usage": usage}
    else:
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    clamped = min(max(n, min_replicas), max_replicas)
    if clamped != n:
        reason += f" (wants {n}, bounded to [{min_replicas}, {max_replicas}])"
    return Want(clamped, reason, signals)


def bound_by_cores(want: Want, target: int, running: int, slots: int | None) -> Want:
    """Cores as devices: a pool whose engines own their cores grows only as far as its nodes' free cores hold more
    engines (`slots`, counted by free CPUs; replicas asked for but not yet running have not taken theirs)."""
    if slots is None:
        return want
    room = target + max(0, slots - (target - running))
    if want.replicas <= room:
        return want
    bounded = max(target, room)
    return Want(bounded, f"{want.reason} (wants {want.replicas}, bounded by free cores to {bounded})", want.signals)


class Hysteresis:
    """Turns a stream of wanted counts into decisions: a change must be asked for continuously for its delay."""

    def __init__(self, upscale_delay_s: float, downscale_delay_s: float):
        self.delays = {1: upscale_delay_s, -1: downscale_delay_s}
        self.direction = 0
        self.since = 0.0

    def step(self, role: str, want: Want, target: int, now: float) -> Decision | None:
        direction = (want.replicas > target) - (want.replicas < target)
        if direction != self.direction:
            self.direction, self.since = direction, now
        if direction == 0 or now - self.since < self.delays[direction]:
            return None
        self.direction = 0
        return Decision(role, target, want.replicas, want.reason, want.signals)


class PoolPolicy:
    """Ray Serve custom autoscaling policy of one pool (a class policy: Serve builds it once with `policy_kwargs`)."""

    def __init__(self, role: str, min_replicas: int, max_replicas: int, scaling: dict[str, Any],
                 coordinator: str | None = None, namespace: str | None = None, cores_per_engine: int = 0,
                 labels: dict[str, str] | None = None):
        self.role, self.min, self.max, self.scaling = role, min_replicas, max_replicas, scaling
        self.coordinator, self.namespace = coordinator, namespace
        self.cores_per_engine, self.labels = cores_per_engine, labels or {}
        self.hysteresis = Hysteresis(scaling["upscale_delay_s"], scaling["downscale_delay_s"])
        self._handle: Any = None
        self._last_report = 0.0

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        running = set(ctx.running_replicas)
        per_replica: dict[Any, dict[str, float]] = {}
        for name, by_replica in (ctx.aggregated_metrics or {}).items():
            for replica, value in by_replica.items():
                if replica in running and name in SIGNALS[self.role]:
                    per_replica.setdefault(replica, {})[name] = float(value)
        target = ctx.target_num_replicas
        low = max(self.min, ctx.capacity_adjusted_min_replicas)
        high = max(low, min(self.max, ctx.capacity_adjusted_max_replicas))
        want = wanted(self.role, list(per_replica.values()), len(running), self.scaling, low, high)
        if want.replicas > target and self.cores_per_engine:
            want = bound_by_cores(want, target, len(running), self._engine_slots())
        # an engine that did not report (or left out a signal it could not read, e.g. its cache usage) is unknown, not
        # idle: never shrink on partial data (growing on it is safe: the reporting engines' load is a lower bound)
        complete = [r for r, load in per_replica.items() if all(name in load for name in SIGNALS[self.role])]
        if want.replicas < target and len(complete) < len(running):
            want = Want(target, f"holding: {len(running) - len(complete)} of {len(running)} engines did not report "
                                f"their load ({want.reason})", want.signals)
        now = time.time()
        decision = self.hysteresis.step(self.role, want, target, now)
        if decision is not None:
            log.info("%s", decision)
            self._report("record_scaling", decision.to_dict())
            target = decision.after
        if now - self._last_report >= REPORT_EVERY_S:
            self._last_report = now
            self._report("record_pool_signal", self.role, {"target": target, "running": len(running),
                                                           "reporting": len(per_replica), **want.signals})
        return target, {"wanted": want.replicas, "reason": want.reason}

    def _engine_slots(self) -> int | None:
        """How many more of this pool's engines the free cores of its nodes hold (None: unknown)."""
        try:
            from actors.host.cores import engine_slots

            return engine_slots(self.cores_per_engine, self.labels)[0]
        except Exception as e:  # noqa: BLE001 - scaling goes on without the bound
            log.warning("autoscaling policy of the %s pool could not read the nodes' free cores: %s", self.role, e)
            return None

    def _report(self, method: str, *args: Any) -> None:
        """Fire-and-forget to the coordinator (absent in unit tests; a restarting coordinator just misses one)."""
        if self.coordinator is None:
            return
        try:
            from actors.clients.coordinator_client import CoordinatorClient

            if self._handle is None:
                self._handle = CoordinatorClient.named(self.coordinator, self.namespace)
            getattr(self._handle, method)(*args)
        except Exception as e:  # noqa: BLE001 - metrics must never break scaling
            self._handle = None
            log.warning("autoscaling policy of the %s pool could not reach the coordinator: %s", self.role, e)
