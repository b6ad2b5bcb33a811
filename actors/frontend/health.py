"""/health and the cluster's state on /metrics, as a front end answers them: `health_report` (200 ok, 200 degraded,
503 unavailable), kept fresh in the background by `HealthWatch` so that a /health call costs the coordinator nothing,
and `cluster_state` (pools, engines, transfer totals) for the front end's metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from actors.clients.coordinator_client import CoordinatorClient
from actors.frontend.router import Router
from cluster.core.metrics import TransferTotals

log = logging.getLogger("pd.frontend")
DEPARTED = "(departed) "  # `cluster_state`'s key prefix for the summed totals of engines that left, per role
HEALTH_REFRESH_S = 1.0  # /health's snapshot is at most this old while the coordinator answers


class HealthWatch:
    """/health's answer, kept by the front end: `health_report` run in the background every `interval_s`, and the
    last result (its snapshot) given to every /health call with its age - so that /health costs the coordinator
    nothing per call (a load balancer polling it, or a flood of it, asks the coordinator nothing more) and answers at
    once while the coordinator is slow. Its semantics are `health_report`'s (200 ok, 200 degraded, 503 unavailable;
    never 503 while requests have routes).

    A snapshot can be up to `interval_s` (plus one report) behind, so what requests meet refreshes it sooner:
    `observe` is told each generation request's outcome, and asks for a refresh at once when the outcome contradicts
    the snapshot (served while it says unavailable, refused or failed while it says 200) or the router's state changed
    (degraded mode began or ended, the coordinator stopped or started answering). A /health call made after such a
    request waits for that refresh, up to `wait_s`, then answers what it has. Refreshes are `min_gap_s` apart at
    least, so a storm of failing requests cannot turn into a storm of coordinator calls."""

    def __init__(self, coordinator: Any, router: Router, model_name: str, interval_s: float = HEALTH_REFRESH_S,
                 wait_s: float = 2.0, min_gap_s: float = 0.1, timeout_s: float = 5):
        self.coordinator, self.router, self.model_name = coordinator, router, model_name
        self.interval_s, self.wait_s, self.min_gap_s, self.timeout_s = interval_s, wait_s, min_gap_s, timeout_s
        self.snapshot: tuple[int, dict, float] | None = None  # (status code, body, time.monotonic() when taken)
        self.refreshes = 0  # refreshes ended
        self._begun = 0  # refreshes begun
        self._wanted = 0  # the first refresh that begins after the latest `kick`
        self._seen: tuple = ()  # the router's state when the last refresh began
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._ended: asyncio.Event | None = None

    async def start(self) -> None:
        """Take the first snapshot, then keep it fresh in the background (on the running event loop)."""
        self._wake, self._ended = asyncio.Event(), asyncio.Event()
        await self._refresh()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def report(self) -> tuple[int, dict]:
        """The last snapshot (after waiting up to `wait_s` for a refresh that `kick` asked for), with `age_s`: how
        many seconds ago it was taken."""
        deadline = time.monotonic() + self.wait_s
        while self.snapshot is None or self.refreshes < self._wanted:
            left = deadline - time.monotonic()
            if left <= 0 or self._ended is None:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ended.wait(), left)
        if self.snapshot is None:  # never refreshed (not started, or its first report still running)
            return 503, {"status": "unavailable", "model": self.model_name, "error": "starting"}
        code, body, taken = self.snapshot
        return code, {**body, "age_s": round(time.monotonic() - taken, 3)}

    def observe(self, served: bool) -> None:
        """A generation request was served (True), or refused for want of an engine or failed (False)."""
        contradicts = self.snapshot is not None and (self.snapshot[0] == 200) != served
        if self.snapshot is None or contradicts or self._router_state() != self._seen:
            self.kick()

    def kick(self) -> None:
        """Refresh now (or `min_gap_s` after the last refresh ended); /health waits for that refresh."""
        self._wanted = self._begun + 1
        if self._wake is not None:
            self._wake.set()

    def _router_state(self) -> tuple:
        return self.router.degraded, self.router.coordinator_unreachable

    async def _refresh(self) -> None:
        self._begun += 1
        begun = self._begun
        self._seen = self._router_state()
        try:
            code, body = await health_report(self.coordinator, self.router, self.model_name, self.timeout_s)
            self.snapshot = (code, body, time.monotonic())
        except Exception as e:  # noqa: BLE001 - keep the last snapshot (its age tells), try again next time
            log.warning("/health: could not refresh the cluster's state: %s", e)
        self.refreshes = begun
        ended, self._ended = self._ended, asyncio.Event()
        if ended is not None:
            ended.set()

    async def _run(self) -> None:
        while True:
            began = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            await asyncio.sleep(max(0.0, began + self.min_gap_s - time.monotonic()))
            self._wake.clear()  # kicks until now are answered by this refresh
            await self._refresh()


async def health_report(coordinator: Any, router: Router, model_name: str, timeout_s: float = 5) -> tuple[int, dict]:
    """/health's status code and body: 200 "ok" while a prefill/decode pair is ready; 200 "degraded" while only one
    pool has ready engines (they serve requests whole); 200 "ok" with "coordinator": "unreachable..." while the
    coordinator does not answer and the router serves on its last routes; 503 when no engine can serve. Asked while
    the coordinator restarts, it can fail the first question and answer the router's: what requests are routed on
    decides, so /health never says 503 while they are served."""
    try:
        coordinator = CoordinatorClient.of(coordinator)
        ready = {role: await asyncio.wait_for(coordinator.ready(role), timeout_s)
                 for role in ("prefill", "decode")}
        routes = await asyncio.wait_for(coordinator.routes(), timeout_s)
    except Exception as e:  # noqa: BLE001 - coordinator down or slow: unavailable, not an error page
        try:  # what requests are routed on now: the coordinator's answer, or its last routes while it restarts
            routes = await router.routes()
        except Exception:  # noqa: BLE001 - no routes to fall back on
            routes = {}
        if any(routes.values()):
            body = {"status": "ok", "model": model_name, "ready": {
                "prefill": len(routes), "decode": len({d for ds in routes.values() for d in ds})}}
            if router.coordinator_unreachable:
                body["coordinator"] = "unreachable: serving on its last routes"
            return 200, body
        return 503, {"status": "unavailable", "model": model_name, "error": type(e).__name__}
    paired = any(routes.values())
    status = "ok" if paired else "degraded" if ready["prefill"] or ready["decode"] else "unavailable"
    body = {"status": status, "model": model_name, "ready": {k: len(v) for k, v in ready.items()}}
    if status == "degraded":
        body["serving"] = "prefill engines decode" if ready["prefill"] else "decode engines prefill"
    return (200 if status != "unavailable" else 503), body


async def cluster_state(coordinator: Any, router: Router, seen: dict[str, tuple[str, TransferTotals]]) -> dict[str, Any]:
    """Pool sizes, autoscaling decisions and signals from the coordinator, and running totals from the engines
    (bounded by a timeout): the decode engines' transfers, every engine's prompt tokens found in its prefix cache."""
    desc = await asyncio.wait_for(CoordinatorClient.of(coordinator).describe(), 5)
    pools: dict[tuple[str, str], int] = {}
    for e in desc["engines"].values():
        pools[(e["role"], e["state"])] = pools.get((e["role"], e["state"]), 0) + 1
    for role in ("prefill", "decode"):
        for st in ("ready", "draining"):
            pools.setdefault((role, st), 0)
    roles = {k: e["role"] for k, e in desc["engines"].items()}

    async def one(engine_id: str) -> tuple[str, TransferTotals]:
        engine = await router.engine(engine_id, roles[engine_id])
        return roles[engine_id], await asyncio.wait_for(engine.transfer_totals(), 5)

    for engine_id, got in zip(roles, await asyncio.gather(*(one(e) for e in roles), return_exceptions=True)):
        if isinstance(got, tuple):
            seen[engine_id] = got
    for engine_id in [e for e in seen if e not in roles and not e.startswith(DEPARTED)]:
        # an engine that left: its last totals fold into its role's departed sum (the map stays as big as the pools)
        role, engine_totals = seen.pop(engine_id)
        _, departed = seen.get(DEPARTED + role, (role, TransferTotals()))
        seen[DEPARTED + role] = (role, departed + engine_totals)
    totals = TransferTotals()
    per_role = ("cached_prompt_tokens", "computed_prompt_tokens", "predicted_prompt_tokens", "mispredicted")
    by_role: dict[str, dict[str, int]] = {key: {"prefill": 0, "decode": 0} for key in per_role}
    for role, engine_totals in seen.values():  # counters never go down: engines that left count in DEPARTED sums
        totals += engine_totals
        for key in per_role:
            by_role[key][role] += getattr(engine_totals, key)
    return {"pools": pools, "transfers": totals, **by_role, "retried": router.retried,
            "routing": dict(router.choice.decisions), "routing_views": router.choice.views,
            "routing_view_seconds": router.choice.view_seconds, "routing_view_failures": router.choice.view_failures,
            "routing_unasked": router.choice.unasked,
            "scaling": desc.get("pools", {}), "colocated": dict(router.colocated), "degraded": router.degraded,
            "failed_over": router.failed_over, "waited_for_capacity": router.waited_for_capacity,
            "suspected": router.choice.suspected,
            "first_from_prefill": router.first_from_prefill,
            "stale_routed": router.stale_routed, "local_prefill": router.local_prefill}
