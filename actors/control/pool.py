"""Prefill and decode pools as Ray Serve deployments: one replica = one engine, and Serve's autoscaler sizes each pool
on its own signal (`actors/control/autoscale.py`).

A replica's life:
  join   - claim an engine id from the coordinator, start the engine actor (named `pd-engine-<id>`, owned by the
           replica: if the replica dies, so does its engine), wait for vLLM to load and the engine to warm up
           (`actors.engine.warmup`), register with the coordinator.
           The coordinator keeps the engine and its pairs hidden ("joining") until every pair's plan is installed,
           so the engine gets traffic only once it is fully negotiated. Timings go to the coordinator (`record_join`).
  serve  - Serve asks `record_autoscaling_stats` for the engine's load every second and `check_health` every 5 s (a
           dead engine fails the check and Serve replaces the replica).
  leave  - on scale-down (or app deletion) Serve calls `__del__`: the coordinator stops routing to the engine, the
           engine refuses new requests, the replica waits until the engine holds nothing (requests in prefill or
           decode, and prefilled state no decode engine has read yet) or `drain_timeout_s` passes (then it frees the
           unread state), deregisters it (no plan naming it is handed out again) and only then stops it.

Requests never pass through these replicas: the router calls the engine actors directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from actors.clients.coordinator_client import CoordinatorClient
from actors.host.cores import wait_for_cores
from actors.engine.actor import EngineSpec, stop_engine_actors
from actors.clients.engine_client import EngineClient, Silence

log = logging.getLogger("ray.serve")
METRIC_PUSH_INTERVAL_S = 1.0  # replicas push their engine's load to Serve's controller this often (Ray's default 10)


def pool_app_name(namespace: str, role: str) -> str:
    """The Serve application of one pool, e.g. "hybrid-pd-prefill-pool" (per namespace: one Ray cluster can host
    several deployments)."""
    return f"{namespace}-{role}-pool"


@dataclass(frozen=True)
class PoolSpec:
    """What every replica of one pool needs (`cluster.cli.launch.pool_spec` builds it from the deploy config): how its
    engine starts, the coordinator it registers with, how long a leaving engine may drain, and the node labels its
    engine must run on (the replica runs there too)."""

    engine: EngineSpec
    coordinator: str
    namespace: str
    drain_timeout_s: float
    labels: dict[str, str] = field(default_factory=dict)


class PoolReplica:
    async def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self.role = spec.engine.role
        self.engine: EngineClient | None = None
        self._silence = Silence()  # how long its engine has not answered its health
        self._condemned: str | None = None  # why the engine will not be trusted again (then every check fails)
        self.leaving = False  # set by __del__, which Serve may call while this constructor still awaits
        t0 = time.time()
        self.coordinator = CoordinatorClient.named(spec.coordinator, spec.namespace)
        self.engine_id = await self.coordinator.claim_engine_id(self.role)
        need = spec.engine.device_options.get("own_cores", 0)
        if need:  # cores as devices: a clear refusal, not an engine actor waiting for free CPUs forever
            await asyncio.to_thread(wait_for_cores, need, spec.labels, f"{self.role} pool ({self.engine_id})")
        engine, started = spec.engine.launch(self.engine_id, spec.namespace)
        self.engine = engine
        try:
            await engine.ready()
            t_actor = time.time()
            await started
            t_loaded = time.time()
            warm_up_s = (await engine.start_report())["warm_up_s"] or 0.0
            if self.leaving:
                raise RuntimeError(f"pool replica stopped while engine {self.engine_id} was loading")
            await engine.register(self.coordinator)
            t_registered = time.time()
        except BaseException:
            if self.engine is not None:  # else __del__ took it over
                self.engine = None
                await asyncio.to_thread(stop_engine_actors, [engine])
            raise
        cores = await engine.cores()
        self.joined = {
            "engine_id": self.engine_id, "role": self.role, "tp": spec.engine.tp, "cores": list(cores),
            "replica_started": t0,
            "registered": t_registered, "total_s": t_registered - t0,
            "phases": {"actor_start_s": t_actor - t0, "engine_load_s": t_loaded - t_actor - warm_up_s,
                       "warm_up_s": warm_up_s, "registration_s": t_registered - t_loaded},
        }
        self.coordinator.record_join(self.joined)
        log.info("engine %s joined the %s pool in %.1f s", self.engine_id, self.role, self.joined["total_s"])

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's load (Serve's custom autoscaling metrics; the pool's policy reads them). Nothing while the
        replica is leaving."""
        if self.engine is None:
            return {}
        return (await asyncio.wait_for(self.engine.load(), 5)).metrics()

    async def check_health(self) -> None:
        """Fail (Serve then replaces this replica) when the engine is dead, its vLLM engine failed or stopped
        stepping, or it has answered no health question for `engine_client.UNRESPONSIVE_S` (`Silence`); a busy
        engine that answers slowly now and then is not dead. Once failed it stays failed: an engine that continues
        (SIGCONT) after the coordinator took it out would serve nobody."""
        if self.engine is None:  # leaving
            return
        if self._condemned is None:
            verdict = self._silence.saw(await self.engine.verdict())
            if verdict.gone:
                self._condemned = verdict.why
        if self._condemned is not None:
            raise RuntimeError(f"engine {self.engine_id} is {self._condemned}")

    async def __del__(self) -> None:
        self.leaving = True
        engine = getattr(self, "engine", None)
        if engine is None:  # not launched yet, or the constructor is cleaning up after itself
            return
        self.engine = None
        t0 = time.time()
        info: dict[str, Any] = {"engine_id": self.engine_id, "role": self.role, "started": t0}
        try:
            await asyncio.wait_for(self.coordinator.drain(self.engine_id), 10)
        except Exception as e:  # noqa: BLE001 - a restarting coordinator: the engine refuses new requests anyway
            log.warning("drain %s: coordinator unreachable: %s", self.engine_id, e)
        try:
            await asyncio.wait_for(engine.set_draining(), 30)
            info.update(await self._wait_idle(engine, self.spec.drain_timeout_s))
            info["first_served"] = await asyncio.wait_for(engine.first_served(), 10)
        except Exception as e:  # noqa: BLE001 - dead (holds nothing) or unreachable to the end of the drain
            info["engine_error"] = f"{type(e).__name__}: {e}"[:300]
        info["drain_s"] = time.time() - t0
        try:
            await asyncio.wait_for(self.coordinator.deregister(self.engine_id), 10)
        except Exception as e:  # noqa: BLE001 - its health watcher removes a dead engine
            log.warning("deregister %s: %s", self.engine_id, e)
        t1 = time.time()
        try:
            await asyncio.to_thread(stop_engine_actors, [engine])
        except Exception as e:  # noqa: BLE001 - reported below; Serve kills the replica (and so the engine) anyway
            info["stop_error"] = f"{type(e).__name__}: {e}"[:300]
        info["stop_s"] = time.time() - t1
        log.info("engine %s left the %s pool: %s", self.engine_id, self.role, info)
        try:
            await asyncio.wait_for(self.coordinator.record_leave(info), 5)
        except Exception:  # noqa: BLE001 - bookkeeping only
            pass

    async def _wait_idle(self, engine: EngineClient, timeout_s: float) -> dict[str, Any]:
        """Wait until the engine holds nothing: no request in prefill or decode, none its scheduler keeps (on a
        prefill engine that includes prefilled state no decode engine has read yet). At the deadline free the
        prefilled state no one read."""
        deadline = time.monotonic() + timeout_s
        first = None
        while True:
            try:
                busy = await asyncio.wait_for(engine.busy(), 30)
            except ray.exceptions.ActorDiedError:
                raise  # a dead engine holds nothing
            except Exception as e:  # noqa: BLE001 - busy or briefly unreachable is not idle: ask again
                if time.monotonic() >= deadline:
                    raise
                log.warning("drain %s: no answer yet (%s)", self.engine_id, type(e).__name__)
                await asyncio.sleep(1)
                continue
            first = first or busy
            if busy.idle:
                return {"held_at_start": first.counts(), "timed_out": False}
            if time.monotonic() >= deadline:
                if busy.held and self.role == "prefill":  # prefilled state nobody read: let it go
                    await asyncio.wait_for(engine.release(list(busy.held)), 30)
                log.warning("engine %s still held %s after %.0f s of draining", self.engine_id, busy.counts(), timeout_s)
                return {"held_at_start": first.counts(), "timed_out": True, "held_at_end": busy.counts()}
            await asyncio.sleep(0.2)


def pool_deployment(role: str, spec: PoolSpec, min_replicas: int, max_replicas: int, scaling: dict[str, Any]):
    """The Serve deployment of one pool, bound to `spec` (what every replica needs to start its engine).
    min == max: a fixed pool of that size; otherwise Serve autoscaling with the pool's policy."""
    from actors.control.autoscale import PoolPolicy

    options: dict[str, Any] = {
        "name": f"{role}-pool",
        # next to its engine (a pool's placement labels; the replica checks on its own node that the engine's
        # processes are gone)
        "ray_actor_options": {"num_cpus": 0, **({"label_selector": dict(spec.labels)} if spec.labels else {})},
        # the controller kills a replica this long after asking it to stop: drain, then engine shutdown (<= 60 s)
        "graceful_shutdown_timeout_s": scaling["drain_timeout_s"] + 90,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 5,
        "health_check_timeout_s": 60,
        "max_constructor_retry_count": 3,
    }
    if max_replicas > min_replicas:
        options["autoscaling_config"] = {
            "min_replicas": min_replicas, "max_replicas": max_replicas, "initial_replicas": min_replicas,
            "look_back_period_s": scaling["look_back_s"],
            # how often replicas push their load (Ray 2.60 reads this field; it calls it deprecated in favour of an
            # environment variable that it does not read yet)
            "metrics_interval_s": METRIC_PUSH_INTERVAL_S,
            # the policy applies the configured delays itself (so that it knows when it decides); Serve's own are off
            "upscale_delay_s": 0, "downscale_delay_s": 0,
            "policy": {"policy_function": PoolPolicy, "policy_kwargs": {
                "role": role, "min_replicas": min_replicas, "max_replicas": max_replicas, "scaling": scaling,
                "coordinator": spec.coordinator, "namespace": spec.namespace,
                "cores_per_engine": spec.engine.device_options.get("own_cores", 0), "labels": dict(spec.labels)}},
        }
    else:
        options["num_replicas"] = min_replicas
    return serve.deployment(PoolReplica).options(**options).bind(spec)
