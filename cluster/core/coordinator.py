"""The coordinator's state, free of Ray: a registry of engines, validated pairs and their cached plans, and transfer
statistics. `actors/control/coordinator.py` wraps it in a named Ray actor and pushes plans to decode engines."""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from cluster.core.errors import FieldError
from cluster.core.layout import EngineLayout, fields_differ
from cluster.core.planner import IncompatiblePair, PairPlan, plan_pair
from cluster.core.wire import pair_to_dict

Role = Literal["prefill", "decode"]


class RegistrationError(FieldError):
    """An engine refused at registration; `field` names what is wrong."""


@dataclass
class EngineRecord:
    engine_id: str
    role: Role
    model: str  # the served model name
    layout: EngineLayout
    ranks: list[dict[str, Any]]  # per TP rank: agent_metadata (bytes), region_bases, device_id, memory_type
    state: Literal["joining", "ready", "draining"] = "ready"
    registered_at: float = field(default_factory=time.time)


class Coordinator:
    def __init__(self) -> None:
        self.engines: dict[str, EngineRecord] = {}
        self.pairs: dict[tuple[str, str], PairPlan] = {}
        self.negotiation_us: list[float] = []
        # plans depend only on the two layouts (engine identity travels separately in `payload`): engines of one pool
        # share a layout, so P x D pairs cost one plan per distinct (prefill layout, decode layout)
        self._plans: dict[tuple[EngineLayout, EngineLayout], PairPlan] = {}
        self.plans_computed = 0
        self._plan_json: dict[int, str] = {}  # id(plan) -> JSON (plans live in self._plans as long as this cache)
        self._ranks_json: dict[str, str] = {}  # prefill engine id -> its ranks' registrations as JSON
        # pools: autoscaling decisions (with reasons), each pool's latest signal, engines' join and leave timings
        self.scaling: deque[dict[str, Any]] = deque(maxlen=1000)
        self.decisions: dict[tuple[str, str], int] = {}  # (role, "up"|"down") -> count
        self.pool_signal: dict[str, dict[str, float]] = {}
        self.joins: deque[dict[str, Any]] = deque(maxlen=1000)
        self.leaves: deque[dict[str, Any]] = deque(maxlen=1000)
        self._next_id: dict[str, int] = {}

    # ---- membership ----
    def register(self, rec: EngineRecord) -> list[tuple[str, str]]:
        """Validate `rec` against every registered engine and plan each new prefill/decode pair. Raises
        RegistrationError (with the planner's message) and registers nothing if any pair is incompatible."""
        if rec.role not in ("prefill", "decode"):
            raise RegistrationError("role", f"must be 'prefill' or 'decode', got {rec.role!r}")
        if rec.engine_id in self.engines:
            raise RegistrationError("engine_id", f"{rec.engine_id!r} is already registered")
        if len(rec.ranks) != rec.layout.tp:
            raise RegistrationError("ranks", f"{len(rec.ranks)} rank registrations for TP {rec.layout.tp}")
        for i, r in enumerate(rec.ranks):
            if len(r.get("region_bases", ())) != rec.layout.num_regions:
                raise RegistrationError(
                    f"ranks[{i}].region_bases", f"{len(r.get('region_bases', ()))} regions, the layout has {rec.layout.num_regions}"
                )
        new: dict[tuple[str, str], PairPlan] = {}
        pool_head: dict[str, str] = {}
        t0 = time.perf_counter()
        for other in self.engines.values():
            if other.model != rec.model:
                raise RegistrationError("model", f"{rec.engine_id} serves {rec.model!r}, {other.engine_id} serves {other.model!r}")
            if other.role == rec.role:
                if other.engine_id == pool_head.get(rec.role, other.engine_id):  # the pool's members all equal its first
                    _same_pool_check(other, rec)
                    pool_head[rec.role] = other.engine_id
                continue
            p, d = (other, rec) if other.role == "prefill" else (rec, other)
            try:
                new[(p.engine_id, d.engine_id)] = self._plan(p.layout, d.layout)
            except IncompatiblePair as e:
                raise RegistrationError(
                    e.field, f"{rec.engine_id} ({rec.role}) is incompatible with {other.engine_id} ({other.role}): {e}"
                ) from e
        self.negotiation_us.append((time.perf_counter() - t0) * 1e6)
        self.engines[rec.engine_id] = rec
        self.pairs.update(new)
        return list(new)

    def _plan(self, prefill: EngineLayout, decode: EngineLayout) -> PairPlan:
        key = (prefill, decode)
        if key not in self._plans:
            self._plans[key] = plan_pair(prefill, decode)
            self.plans_computed += 1
        return self._plans[key]

    def deregister(self, engine_id: str) -> None:
        self.engines.pop(engine_id, None)
        self._ranks_json.pop(engine_id, None)
        for key in [k for k in self.pairs if engine_id in k]:
            del self.pairs[key]

    def set_state(self, engine_id: str, state: Literal["joining", "ready", "draining"]) -> None:
        self._engine(engine_id).state = state

    def claim_engine_id(self, role: Role, taken: set[str] = frozenset()) -> str:
        """The next free id of a pool's engine ("prefill-0", "prefill-1", ...), never one registered or in `taken`."""
        if role not in ("prefill", "decode"):
            raise RegistrationError("role", f"must be 'prefill' or 'decode', got {role!r}")
        for known in (*self.engines, *taken):  # after a restart: continue above the highest id still around
            head, _, num = known.rpartition("-")
            if head == role and num.isdigit():
                self._next_id[role] = max(self._next_id.get(role, 0), int(num) + 1)
        while True:
            n = self._next_id.get(role, 0)
            self._next_id[role] = n + 1
            engine_id = f"{role}-{n}"
            if engine_id not in self.engines and engine_id not in taken:
                return engine_id

    # ---- pools ----
    def record_scaling(self, decision: dict[str, Any]) -> None:
        self.scaling.append(decision)
        key = (decision["role"], decision["direction"])
        self.decisions[key] = self.decisions.get(key, 0) + 1

    def record_pool_signal(self, role: str, signal: dict[str, float]) -> None:
        self.pool_signal[role] = {**signal, "time": time.time()}

    def pools(self) -> dict[str, Any]:
        return {"decisions": [{"role": r, "direction": d, "count": n} for (r, d), n in sorted(self.decisions.items())],
                "signals": dict(self.pool_signal), "last_decisions": list(self.scaling)[-20:]}

    # ---- plans ----
    def pair(self, prefill_id: str, decode_id: str) -> PairPlan:
        try:
            return self.pairs[(prefill_id, decode_id)]
        except KeyError:
            missing = [e for e in (prefill_id, decode_id) if e not in self.engines]
            why = f"engine(s) {missing} not registered" if missing else "pair not negotiated"
            raise KeyError(f"no plan for prefill {prefill_id!r} -> decode {decode_id!r}: {why}") from None

    def payload(self, prefill_id: str, decode_id: str) -> str:
        """The plan as the decode workers receive it: the pair plan and every prefill rank's registration. Both parts
        are serialised once (per distinct plan, per prefill engine) and joined per pair."""
        pair = self.pair(prefill_id, decode_id)
        if id(pair) not in self._plan_json:
            self._plan_json[id(pair)] = json.dumps(pair_to_dict(pair))
        if prefill_id not in self._ranks_json:
            self._ranks_json[prefill_id] = json.dumps([
                {k: (v.hex() if isinstance(v, bytes) else v) for k, v in r.items() if k != "layout"}
                for r in self.engines[prefill_id].ranks
            ])
        return f'{{"pair": {self._plan_json[id(pair)]}, "prefill_ranks": {self._ranks_json[prefill_id]}}}'

    def decodes_for(self, prefill_id: str) -> list[str]:
        if prefill_id not in self.engines or self.engines[prefill_id].state != "ready":
            return []
        return [d for (p, d) in self.pairs if p == prefill_id and self.engines[d].state == "ready"]

    def ready(self, role: Role) -> list[str]:
        return [e.engine_id for e in self.engines.values() if e.role == role and e.state == "ready"]

    def routes(self) -> dict[str, list[str]]:
        """Every ready prefill engine -> the ready decode engines approved for it (what a router picks from)."""
        return {p: self.decodes_for(p) for p in self.ready("prefill")}

    def _engine(self, engine_id: str) -> EngineRecord:
        try:
            return self.engines[engine_id]
        except KeyError:
            raise KeyError(f"engine {engine_id!r} is not registered") from None

    def describe(self) -> dict[str, Any]:
        return {
            "engines": {
                e.engine_id: {"role": e.role, "tp": e.layout.tp, "state": e.state, "model": e.model} for e in self.engines.values()
            },
            "pairs": [{"prefill": p, "decode": d, "tp_ratio": plan.tp_ratio} for (p, d), plan in self.pairs.items()],
            "pools": self.pools(),
        }


def _same_pool_check(old: EngineRecord, new: EngineRecord) -> None:
    """Engines of one pool must serve the same model in the same dtypes (their TP sizes may differ)."""
    diffs = [(f"model.{n}", a, b) for n, a, b in fields_differ(old.layout.model, new.layout.model)]
    diffs += [(n, getattr(old.layout, n), getattr(new.layout, n)) for n in ("dtype", "ssm_dtype") if getattr(old.layout, n) != getattr(new.layout, n)]
    for name, a, b in diffs:
        raise RegistrationError(
            name, f"{new.engine_id} has {b!r}, {old.engine_id} of the same {new.role} pool has {a!r}; a pool serves one model in one dtype"
        )
