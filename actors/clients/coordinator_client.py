"""Every call the project makes to the coordinator actor (`actors.control.coordinator.CoordinatorActor`), typed: the
coordinator's counterpart of `actors.clients.engine_client.EngineClient`. Only this module calls the coordinator actor's
methods (`tests/test_layers.py` holds the project's own code to it); the rest holds a `CoordinatorClient`.

Each method returns what the actor's method returns, as a Ray ObjectRef: `await` it in async code, `ray.get` it
elsewhere, and put a deadline on either (a coordinator restarting after a crash answers nothing meanwhile).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    from ray import ObjectRef

    from actors.clients.engine_client import EngineClient, Registration


class CoordinatorClient:
    """The coordinator actor, by handle. Picklable (engines and pools receive it inside Ray calls)."""

    def __init__(self, handle: Any):
        self.handle = handle

    @classmethod
    def of(cls, coordinator: Any) -> "CoordinatorClient":
        """A client of `coordinator`: a CoordinatorClient as it is, or an actor handle wrapped."""
        return coordinator if isinstance(coordinator, cls) else cls(coordinator)

    @classmethod
    def named(cls, name: str, namespace: str) -> "CoordinatorClient":
        """The named coordinator actor (ValueError if there is none)."""
        return cls(ray.get_actor(name, namespace=namespace))

    def __repr__(self) -> str:
        return f"CoordinatorClient({self.handle})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CoordinatorClient) and self.handle == other.handle

    def __hash__(self) -> int:
        return hash(self.handle)

    def kill(self, no_restart: bool = True) -> None:
        """End the actor (by default for good; `no_restart=False`: Ray restarts it, as after a crash)."""
        ray.kill(self.handle, no_restart=no_restart)

    # ---- engines joining and leaving -------------------------------------------------------------------------------
    def register(self, registration: "Registration", engine: "EngineClient") -> "ObjectRef[dict[str, Any]]":
        """Register an engine: pairs negotiated and plans pushed; RegistrationError (naming the field) if refused."""
        return self.handle.register.remote(registration, engine)

    def claim_engine_id(self, role: str) -> "ObjectRef[str]":
        """A fresh engine id for a pool's new engine ("<role>-<n>")."""
        return self.handle.claim_engine_id.remote(role)

    def drain(self, engine_id: str) -> "ObjectRef[bool]":
        """Stop routing new requests to the engine (it finishes those it has)."""
        return self.handle.drain.remote(engine_id)

    def deregister(self, engine_id: str) -> "ObjectRef[None]":
        return self.handle.deregister.remote(engine_id)

    def engine_failed(self, engine_id: str) -> "ObjectRef[bool]":
        """Report an engine that failed a request: checked, and taken out of every pair if dead or unhealthy."""
        return self.handle.engine_failed.remote(engine_id)

    def set_state(self, engine_id: str, state: str) -> "ObjectRef[None]":
        return self.handle.set_state.remote(engine_id, state)

    # ---- what the routers and front ends read ----------------------------------------------------------------------
    def ready(self, role: str) -> "ObjectRef[list[str]]":
        """The ready engines of a pool."""
        return self.handle.ready.remote(role)

    def routes(self) -> "ObjectRef[dict[str, list[str]]]":
        """Each ready prefill engine's approved decode engines."""
        return self.handle.routes.remote()

    def routes_after(self, known: dict[str, list[str]] | None, wait_s: float) -> "ObjectRef[dict[str, list[str]]]":
        """The routes once they differ from `known`, or as they are after `wait_s` (a router's routes watch)."""
        return self.handle.routes_after.remote(known, wait_s)

    def client(self, engine_id: str) -> "ObjectRef[EngineClient | None]":
        """A registered engine's client (None once it has left)."""
        return self.handle.client.remote(engine_id)

    def decodes_for(self, prefill_id: str) -> "ObjectRef[list[str]]":
        return self.handle.decodes_for.remote(prefill_id)

    def pair_payload(self, prefill_id: str, decode_id: str) -> "ObjectRef[str]":
        """The negotiated plan of a pair as pushed to the decode engine (JSON)."""
        return self.handle.pair_payload.remote(prefill_id, decode_id)

    def describe(self) -> "ObjectRef[dict[str, Any]]":
        """Engines (role, state, TP, ...), pairs and pool scaling state."""
        return self.handle.describe.remote()

    # ---- pool events and history -----------------------------------------------------------------------------------
    def record_join(self, info: dict[str, Any]) -> "ObjectRef[None]":
        return self.handle.record_join.remote(info)

    def record_leave(self, info: dict[str, Any]) -> "ObjectRef[None]":
        return self.handle.record_leave.remote(info)

    def record_scaling(self, decision: dict[str, Any]) -> "ObjectRef[None]":
        return self.handle.record_scaling.remote(decision)

    def record_pool_signal(self, role: str, signal: dict[str, float]) -> "ObjectRef[None]":
        return self.handle.record_pool_signal.remote(role, signal)

    def pool_events(self) -> "ObjectRef[dict[str, list[dict[str, Any]]]]":
        """Scaling decisions, joins and leaves (bounded lists, each event with its wall time)."""
        return self.handle.pool_events.remote()

    def removed_engines(self) -> "ObjectRef[list[dict[str, Any]]]":
        """Engines taken out after a failure, with why (the last 1000)."""
        return self.handle.removed_engines.remote()

    def clean_up_dead(self, timeout_s: float = 90.0) -> "ObjectRef[dict[str, list[str]]]":
        """Check every engine now and finish removing what dead ones left (before a stop)."""
        return self.handle.clean_up_dead.remote(timeout_s)

    def cleaned_up(self) -> "ObjectRef[dict[str, list[str]]]":
        """Per dead engine, the files removed from its node."""
        return self.handle.cleaned_up.remote()

    # ---- the process -----------------------------------------------------------------------------------------------
    def pid(self) -> "ObjectRef[int]":
        return self.handle.pid.remote()

    def rebuilt_engines(self) -> "ObjectRef[list[str]]":
        """After a restart: the engines whose registrations it rebuilt (waits for the rebuild)."""
        return self.handle.rebuilt_engines.remote()

    def negotiation_us(self) -> "ObjectRef[list[float]]":
        return self.handle.negotiation_us.remote()
