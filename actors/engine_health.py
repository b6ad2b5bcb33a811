"""What an engine actor says of its state (`Health`, `Busy`), and one verdict on its health for everything that
asks: the coordinator (its watch, and a router's report of a failed request) and a pool replica (Serve's health
check). Both used to decide it themselves, with different timeouts.

    verdict = await engine_health(handle)
    if verdict.gone: ...   # dead, or its vLLM engine failed
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

from ray.exceptions import ActorDiedError, ActorUnavailableError

HEALTH_TIMEOUT_S = 10.0  # an engine slower than this to answer its health question is busy, not dead

State = Literal["healthy", "starting", "failed", "dead", "unreachable", "slow"]


@dataclass(frozen=True)
class Health:
    """What an engine actor says of itself (`EngineActor.health`)."""

    started: bool
    healthy: bool


@dataclass(frozen=True)
class Busy:
    """What keeps a draining engine from leaving (`EngineActor.busy`): requests in prefill or decode on it, requests
    vLLM's front end still tracks, and the ids of requests its scheduler still holds (on a prefill engine: prefilled
    state no decode engine has read yet)."""

    prefills: int = 0
    decodes: int = 0
    unfinished: int = 0
    held: tuple[str, ...] = ()

    @property
    def idle(self) -> bool:
        return not (self.prefills or self.decodes or self.unfinished or self.held)

    def counts(self) -> dict[str, int]:
        """As numbers (held: how many), for logs and the pools' leave events."""
        return {"prefills": self.prefills, "decodes": self.decodes, "unfinished": self.unfinished, "held": len(self.held)}


@dataclass(frozen=True)
class Verdict:
    """`state`: healthy (started, its EngineCore answers) · starting (its vLLM engine is not built yet) · failed (its
    vLLM engine failed) · dead (the actor is gone) · unreachable (Ray cannot reach it right now: often a death Ray
    has not confirmed yet, ask again shortly) · slow (no answer within the timeout: a busy engine, not a dead one).
    `why` says it in words."""

    state: State
    why: str

    @property
    def gone(self) -> bool:
        """The engine will not serve again: take it out of the cluster."""
        return self.state in ("failed", "dead")


async def engine_health(handle: Any, timeout_s: float = HEALTH_TIMEOUT_S) -> Verdict:
    """Ask one engine actor (an `EngineActor` handle) how it is."""
    try:
        health: Health = await asyncio.wait_for(handle.health.remote(), timeout_s)
    except ActorDiedError as e:
        return Verdict("dead", f"dead ({type(e).__name__})")
    except ActorUnavailableError as e:
        return Verdict("unreachable", f"unreachable ({type(e).__name__})")
    except asyncio.TimeoutError:
        return Verdict("slow", f"no answer within {timeout_s:.0f} s")
    except Exception as e:  # noqa: BLE001 - any other failure to answer: treated like a slow engine, not a death
        return Verdict("slow", f"could not answer ({type(e).__name__}: {e})")
    if not health.started:
        return Verdict("starting", "its vLLM engine is starting")
    if not health.healthy:
        return Verdict("failed", "unhealthy (its vLLM engine failed)")
    return Verdict("healthy", "healthy")
