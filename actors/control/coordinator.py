"""The coordinator as a named Ray actor: engines register here; it validates and plans every prefill/decode pair with
the planner and pushes each plan to the decode engine, whose workers then read exactly what the plan says."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

import ray

from actors.host.cores import start_host_cores
from actors.clients.coordinator_client import CoordinatorClient
from actors.clients.engine_client import (ENGINE_PREFIX, HEALTH_TIMEOUT_S, UNRESPONSIVE_S, WARMUP_REQUEST_PREFIX,
                                          EngineClient, Leftovers, Registration, Silence, error_text)
from cluster.core.coordinator import Coordinator, EngineRecord, RegistrationError
from cluster.core.hf_config import model_shape
from cluster.core.layout import LayoutError, layout_from_report
from cluster.core.planner import IncompatiblePair

HEALTH_INTERVAL_S = float(os.environ.get("PD_HEALTH_INTERVAL_S", "2"))  # how often the coordinator checks engines
HISTORY_KEPT = 1000  # removed engines and their clean-ups remembered (the most recent)
UNAVAILABLE_RECHECKS, UNAVAILABLE_RECHECK_S = 10, 0.25  # an unreachable engine is asked again for up to 2.5 s
FIRST_TRANSFER_TOKENS = 16  # a new pair's first transfer: a prompt this long (`_first_transfers`)
FIRST_TRANSFER_TIMEOUT_S = float(os.environ.get("PD_FIRST_TRANSFER_TIMEOUT_S", "120"))
log = logging.getLogger("pd.coordinator")


@ray.remote(num_cpus=0, max_concurrency=64)
class CoordinatorActor:
    def __init__(self, namespace: str | None = None, unresponsive_s: float = UNRESPONSIVE_S) -> None:
        """`namespace`: where its engines live (their names start with ENGINE_PREFIX); default the job's.
        `unresponsive_s`: an engine that answers no health question for this long is taken out (`Silence`)."""
        self.core = Coordinator()
        self.unresponsive_s = unresponsive_s
        self._silence: dict[str, Silence] = {}  # engine id -> how long it has not answered
        self.clients: dict[str, EngineClient] = {}  # registered engines
        self.removed: list[dict[str, Any]] = []
        # per engine, what it leaves on its node if killed (EngineClient.leftovers); removed there once it is dead
        self.leftovers: dict[str, Leftovers] = {}
        self.cleaned: dict[str, list[str]] = {}
        self._cleanups: set[asyncio.Task] = set()
        self._failure_checks: dict[str, asyncio.Future] = {}  # engine id -> its failure check running now
        self._watcher: asyncio.Task | None = None
        ctx = ray.get_runtime_context()
        self.namespace = namespace or ctx.namespace
        # restarted by Ray after a crash: the registry is rebuilt from the live engines (named ENGINE_PREFIX*)
        self.restarted = ctx.was_current_actor_reconstructed
        self._rebuild: asyncio.Task | None = None
        self.rebuilt: list[str] = []
        self._routes_moved: asyncio.Event | None = None  # set when the routes may have changed (`_moved`)
        self.host_cores = start_host_cores("coordinator")  # off the cores decode engines reserve (actors.host.cores)

    async def _ready(self) -> None:
        """Before answering anything after a restart, re-register every live engine of this namespace."""
        if not self.restarted:
            return
        if self._rebuild is None:
            self._rebuild = asyncio.get_running_loop().create_task(self._rebuild_registry())
        await asyncio.shield(self._rebuild)

    async def _rebuild_registry(self) -> None:
        t0 = time.monotonic()
        found = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == self.namespace and a["name"].startswith(ENGINE_PREFIX)]
        regs = []
        for a in found:
            try:
                engine = EngineClient.named(a["name"][len(ENGINE_PREFIX):], self.namespace)
                regs.append((await asyncio.wait_for(engine.registration(), HEALTH_TIMEOUT_S), engine))
            except Exception as e:  # noqa: BLE001 - dead or not started yet (it registers itself when it is)
                log.warning("rebuild: skipping %s: %s", a["name"], e)
        for reg, engine in sorted(regs, key=lambda x: x[0].role != "prefill"):
            try:
                await self._register(reg, engine, first_transfers=False)  # its pairs have moved state before
                self.rebuilt.append(reg.engine_id)
            except Exception as e:  # noqa: BLE001 - an engine that no longer pairs stays out, as at registration
                log.warning("rebuild: %s refused: %s", reg.engine_id, e)
        log.warning("coordinator restarted: registry rebuilt from %d live engines in %.2f s", len(self.rebuilt), time.monotonic() - t0)

    def pid(self) -> int:
        return os.getpid()

    async def rebuilt_engines(self) -> list[str]:
        await self._ready()
        return list(self.rebuilt)

    async def register(self, registration: Registration, engine: EngineClient) -> dict[str, Any]:
        """`registration`: what `EngineClient.registration` returns. Refused with RegistrationError (its message names
        the field) when the engine cannot pair with the registered ones; then nothing is registered."""
        await self._ready()
        if self.clients.get(registration.engine_id) == engine:
            # registered already, by a restarted coordinator's rebuild that found it while its own registration was
            # on the way: the same engine, its pairs negotiated - not a second engine under a taken id
            pairs = [key for key in self.core.pairs if registration.engine_id in key]
            log.info("%s registered again (the registry was rebuilt meanwhile); pairs %s", registration.engine_id, pairs)
            return {"engine_id": registration.engine_id, "pairs": pairs}
        return await self._register(registration, engine)

    async def _register(self, registration: Registration, engine: EngineClient,
                        first_transfers: bool = True) -> dict[str, Any]:
        self._ensure_watch()
        try:
            model = model_shape(registration.hf_config)
            layout = layout_from_report(registration.layout, model)
        except (LayoutError, ValueError) as e:
            raise RegistrationError(getattr(e, "field", "layout"), getattr(e, "message", str(e))) from None
        for i, rank in enumerate(registration.ranks):
            if rank["layout"] != registration.layout:
                raise RegistrationError(f"ranks[{i}].layout", "TP ranks of one engine report different layouts")
        rec = EngineRecord(
            engine_id=registration.engine_id,
            role=registration.role,
            model=registration.model,
            layout=layout,
            ranks=[{k: v for k, v in r.items() if k != "layout"} for r in registration.ranks],
        )
        rec.state = "joining"  # routers see neither it nor its pairs until every plan is installed
        try:
            pairs = self.core.register(rec)
        except (IncompatiblePair, RegistrationError) as e:
            log.warning("refused %s: %s", rec.engine_id, e)
            raise
        self.clients[rec.engine_id] = engine
        try:
            by_decode: dict[str, list[tuple[str, str]]] = {}
            for p, d in pairs:  # one call per decode engine, carrying all its new plans
                by_decode.setdefault(d, []).append((p, self.core.payload(p, d)))
            results = await asyncio.gather(*(self.clients[d].install_pairs(plans) for d, plans in by_decode.items()),
                                           return_exceptions=True)
            for d, r in zip(by_decode, results):
                # a decode engine that left meanwhile (scale-down, death) does not fail this engine's join, nor does
                # one that died before anyone noticed: confirmed dead, it is taken out of every pair here
                if not isinstance(r, BaseException) or d not in self.core.engines or d not in self.clients:
                    continue
                if await self.engine_failed(d) or d not in self.clients:  # dead or unhealthy, or gone meanwhile
                    continue
                raise r
            if first_transfers and not registration.draining:  # an engine found draining serves nobody again
                await self._first_transfers(rec.engine_id, [(p, d) for p, d in pairs if self._serving(p, d)])
        except Exception:
            self.core.deregister(rec.engine_id)
            self._moved()
            self.clients.pop(rec.engine_id, None)
            raise
        # an engine found draining when a restarted coordinator rebuilds its registry, or told to drain while its
        # plans were being pushed, stays out of new requests
        if rec.engine_id in self.core.engines and self.core.engines[rec.engine_id].state == "joining":
            self.core.set_state(rec.engine_id, "draining" if registration.draining else "ready")
            self._moved()
        if registration.leftovers is not None:
            self.leftovers[rec.engine_id] = registration.leftovers
        log.info("registered %s (%s, TP %d); pairs %s", rec.engine_id, rec.role, layout.tp, pairs)
        return {"engine_id": rec.engine_id, "pairs": pairs}

    async def _first_transfers(self, engine_id: str, pairs: list[tuple[str, str]]) -> None:
        """Before a joining engine's pairs are listed, each moves one request's state: a short prompt prefilled on the
        prefill engine and read by the decode engine with NIXL, as a user's request would be (the first READ over a
        new NIXL connection costs more than later ones; a pair that cannot move state is found here, not by a user).
        A pair whose other engine has died or left meanwhile is skipped; any other failure refuses the joining
        engine, naming the pair and the error. Pairs with a draining engine are left out (it refuses new requests)."""
        if not pairs:
            return
        prompt = list(range(1, FIRST_TRANSFER_TOKENS + 1))
        sampling = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}

        async def one(p: str, d: str) -> None:
            request_id = f"{WARMUP_REQUEST_PREFIX}{p}-{d}-{uuid.uuid4().hex[:8]}"
            prefilled = await self.clients[p].prefill(prompt, request_id)
            try:
                async for ref in self.clients[d].decode(prompt, dict(sampling), prefilled.kv_transfer_params,
                                                        request_id):
                    await ref
            except BaseException:  # the state was not read: the prefill engine frees it now (a no-op once read)
                remote_id, prefill = prefilled.kv_transfer_params.get("remote_request_id"), self.clients.get(p)
                if remote_id and prefill is not None:
                    await asyncio.gather(prefill.release([remote_id]), return_exceptions=True)
                raise

        t0 = time.monotonic()
        results = await asyncio.gather(*(asyncio.wait_for(one(p, d), FIRST_TRANSFER_TIMEOUT_S) for p, d in pairs),
                                       return_exceptions=True)
        for (p, d), r in zip(pairs, results):
            if not isinstance(r, BaseException):
                continue
            other = d if p == engine_id else p
            if not self._serving(other, engine_id) or await self.engine_failed(other):  # left, died or draining
                continue
            what = "timed out" if isinstance(r, asyncio.TimeoutError) else error_text(r)
            raise RegistrationError("pairs", f"pair {p} -> {d} could not move a request's state: {what}")
        log.info("%s: first transfers of %d pair(s) in %.2f s", engine_id, len(pairs), time.monotonic() - t0)

    def _serving(self, *engine_ids: str) -> bool:
        """Whether these engines are registered and take new requests (not draining: they refuse them)."""
        return all(e in self.clients and e in self.core.engines and self.core.engines[e].state != "draining"
                   for e in engine_ids)

    async def claim_engine_id(self, role: str) -> str:
        """A fresh engine id for a pool's new engine ("decode-3"): never a registered engine's, nor a live engine
        actor's that has not registered yet (so a restarted coordinator does not hand out a taken one)."""
        await self._ready()
        taken = {a["name"][len(ENGINE_PREFIX):] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == self.namespace and a["name"].startswith(ENGINE_PREFIX)}
        return self.core.claim_engine_id(role, taken)  # type: ignore[arg-type]

    async def drain(self, engine_id: str) -> bool:
        """Scale-down, step 1: routers stop choosing `engine_id` (and every pair with it) for new requests; what it
        holds carries on. Returns whether it was registered."""
        await self._ready()
        if engine_id not in self.core.engines:
            return False
        self.core.set_state(engine_id, "draining")
        self._moved()
        log.info("draining %s: no new requests", engine_id)
        return True

    async def deregister(self, engine_id: str) -> None:
        """Remove the engine and every pair with it (decode engines forget a departed prefill engine's agents). From
        here on no plan naming it is handed out."""
        await self._ready()
        await self._deregister(engine_id)

    def record_join(self, info: dict[str, Any]) -> None:
        """A pool replica's engine joined: its timings (actor start, engine load, registration and negotiation)."""
        self.core.joins.append(info)
        log.info("engine %s joined the %s pool in %.1f s (%s)", info["engine_id"], info["role"], info["total_s"],
                 ", ".join(f"{k} {v:.1f} s" for k, v in info["phases"].items()))

    def record_leave(self, info: dict[str, Any]) -> None:
        self.core.leaves.append(info)
        log.info("engine %s left the %s pool: %s", info["engine_id"], info["role"], info)

    def record_scaling(self, decision: dict[str, Any]) -> None:
        """An autoscaling decision (from the pool's policy in Serve's controller), with its reason."""
        self.core.record_scaling(decision)
        log.info("scale %s pool %s %d -> %d: %s", decision["role"], decision["direction"], decision["before"],
                 decision["after"], decision["reason"])

    def record_pool_signal(self, role: str, signal: dict[str, float]) -> None:
        self.core.record_pool_signal(role, signal)

    def pool_events(self) -> dict[str, list[dict[str, Any]]]:
        """Scaling decisions, engine joins and leaves, oldest first."""
        return {"scaling": list(self.core.scaling), "joins": list(self.core.joins), "leaves": list(self.core.leaves)}

    async def _deregister(self, engine_id: str) -> None:
        rec = self.core.engines.get(engine_id)
        if rec is None:
            return
        pairs = [k for k in self.core.pairs if engine_id in k]
        self.core.deregister(engine_id)
        self._moved()
        self.clients.pop(engine_id, None)
        self._silence.pop(engine_id, None)
        self.leftovers.pop(engine_id, None)
        if rec.role == "prefill":  # decode engines forget the departed prefill engine's agents
            await asyncio.gather(
                *(self.clients[d].remove_pair(engine_id) for _, d in pairs if d in self.clients), return_exceptions=True
            )

    async def engine_failed(self, engine_id: str) -> bool:
        """A router saw `engine_id` fail a request: check it now and, if it is dead or unhealthy, take it out of
        every pair (returns True). A slow answer is not a death: a busy engine keeps its pairs. Reports of one engine
        that arrive while it is being checked share that check (front ends, the watcher and registrations all
        report): a burst of them asks the engine once."""
        checks = self._failure_checks
        check = checks.get(engine_id)
        if check is None:
            check = checks[engine_id] = asyncio.ensure_future(self._check_failed(engine_id))
            check.add_done_callback(lambda _: checks.pop(engine_id, None))
        return await asyncio.shield(check)

    async def _check_failed(self, engine_id: str) -> bool:
        engine = self.clients.get(engine_id)
        if engine is None:
            return False
        for attempt in range(UNAVAILABLE_RECHECKS + 1):
            verdict = await engine.verdict()
            if verdict.state != "unreachable":
                break
            # right after a SIGKILL Ray says so until it has confirmed the death - ask again shortly rather than drop
            # a router's report (the periodic check may be seconds away)
            if attempt == UNAVAILABLE_RECHECKS or self.clients.get(engine_id) is not engine:
                break
            await asyncio.sleep(UNAVAILABLE_RECHECK_S)
        # a busy engine answers slowly now and then; one silent for unresponsive_s is stuck as a whole
        if self.clients.get(engine_id) is engine:
            verdict = self._silence.setdefault(engine_id, Silence(self.unresponsive_s)).saw(verdict)
        if not verdict.gone:  # healthy, starting, slow or unreachable for a while (a busy engine): not a death
            return False
        why = verdict.why
        if verdict.state == "dead":
            self._clean_after(engine_id)
        if self.clients.get(engine_id) is not engine:  # it left, or re-registered, while we asked
            return False
        log.warning("engine %s is %s: removing it from every pair", engine_id, why)
        self.removed = (self.removed + [{"engine_id": engine_id, "why": why, "time": time.time()}])[-HISTORY_KEPT:]
        await self._deregister(engine_id)
        return True

    async def clean_up_dead(self, timeout_s: float = 90.0) -> dict[str, list[str]]:
        """Before a stop: every registered engine is checked now, the dead ones' files removed from their nodes, and
        the clean-ups under way finished (up to `timeout_s`) - an engine killed the moment before a stop would
        otherwise leave its shared memory and TMPDIR behind with the coordinator that was to remove them. Returns
        what was removed, per engine."""
        await asyncio.gather(*(self.engine_failed(e) for e in list(self.clients)), return_exceptions=True)
        if self._cleanups:
            await asyncio.wait(set(self._cleanups), timeout=timeout_s)
        return dict(self.cleaned)

    def _clean_after(self, engine_id: str) -> None:
        """Remove what a dead engine's processes left on its node (shared memory, TMPDIR) once they have exited
        (killed if they have not within LEFTOVER_WAIT_S): a sweep of its node (`actors.engine.procs.sweep_after`)."""
        leftovers = self.leftovers.pop(engine_id, None)
        if not leftovers:
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from actors.engine.procs import sweep_node

        where = NodeAffinitySchedulingStrategy(leftovers.node_id, soft=False)
        ref = sweep_node.options(scheduling_strategy=where).remote(dying=leftovers.procs)

        async def wait() -> None:
            try:
                self.cleaned[engine_id] = await ref
                while len(self.cleaned) > HISTORY_KEPT:  # a long-running cluster's history stays bounded
                    del self.cleaned[next(iter(self.cleaned))]
                log.info("removed what dead engine %s left: %s", engine_id, self.cleaned[engine_id])
            except Exception as e:  # noqa: BLE001 - its node may be gone too
                log.warning("could not clean up after dead engine %s: %s", engine_id, e)

        task = asyncio.get_running_loop().create_task(wait())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    def cleaned_up(self) -> dict[str, list[str]]:
        """Per dead engine, the files and directories removed after it (shared memory, TMPDIR)."""
        return dict(self.cleaned)

    async def _watch(self) -> None:
        """Check every registered engine every HEALTH_INTERVAL_S; the dead leave the registry."""
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            await asyncio.gather(*(self.engine_failed(e) for e in list(self.clients)), return_exceptions=True)

    def _ensure_watch(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def removed_engines(self) -> list[dict[str, Any]]:
        return list(self.removed)

    def set_state(self, engine_id: str, state: str) -> None:
        self.core.set_state(engine_id, state)  # type: ignore[arg-type]
        self._moved()

    def _moved(self) -> None:
        """The routes may have changed: wake the routers' watch questions (`routes_after`)."""
        if self._routes_moved is not None:
            self._routes_moved.set()
            self._routes_moved = None

    async def decodes_for(self, prefill_id: str) -> list[str]:
        await self._ready()
        return self.core.decodes_for(prefill_id)

    async def ready(self, role: str) -> list[str]:
        await self._ready()
        return self.core.ready(role)  # type: ignore[arg-type]

    async def routes(self) -> dict[str, list[str]]:
        """Ready prefill engine -> approved ready decode engines: a router's question (per request, unless its routes
        watch vouches for the routes it holds)."""
        await self._ready()
        return self.core.routes()

    async def routes_after(self, known: dict[str, list[str]] | None, wait_s: float) -> dict[str, list[str]]:
        """The routes as soon as they differ from `known` (a router's copy), or as they are after `wait_s`: the
        question a router's routes watch keeps under way (`Router._watch_routes`). One slot of the actor per watching
        router while it waits."""
        await self._ready()
        deadline = time.monotonic() + max(0.0, wait_s)
        while True:
            routes = self.core.routes()
            left = deadline - time.monotonic()
            if routes != known or left <= 0:
                return routes
            if self._routes_moved is None:
                self._routes_moved = asyncio.Event()
            try:
                await asyncio.wait_for(self._routes_moved.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def client(self, engine_id: str) -> EngineClient | None:
        """The engine's client, or None once it has left."""
        await self._ready()
        return self.clients.get(engine_id)

    def pair_payload(self, prefill_id: str, decode_id: str) -> str:
        """The pair's negotiated plan as the JSON payload the decode engine installs (`install_pair`)."""
        return self.core.payload(prefill_id, decode_id)

    async def describe(self) -> dict[str, Any]:
        await self._ready()
        return self.core.describe()

    def negotiation_us(self) -> list[float]:
        return list(self.core.negotiation_us)


def start_coordinator(unresponsive_s: float | None = None, **options: Any) -> CoordinatorClient:
    """A new coordinator actor, and its client; `options` are Ray's actor options (name, namespace, max_restarts,
    ...). `unresponsive_s`: how long an engine may answer no health question before it is taken out (default
    `actors.clients.engine_client.UNRESPONSIVE_S`)."""
    kwargs: dict[str, Any] = {"namespace": options["namespace"]} if options.get("namespace") else {}
    if unresponsive_s is not None:
        kwargs["unresponsive_s"] = unresponsive_s
    return CoordinatorClient(CoordinatorActor.options(**options).remote(**kwargs))
