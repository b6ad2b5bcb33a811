"""An engine actor's part in pairing (`EnginePairs`, the `EngineActor`'s component): its registration (every TP
rank's NIXL agent metadata, region bases and run-time layout), the negotiated pair plans the coordinator pushes to a
decode engine's workers, NIXL's remote agents, and the decode side's transfer records. It owns the engine's running
`TransferTotals` (the serving, transfer.verify and prefix-record components add to them: it hands them the object),
the coordinator it registered with, and the clients of its prefill engines (transfer.verify asks them for checksums,
`prefill_checksums`). Each reaches the workers through the actor's `ranks`
(`actors.engine.connector_ranks.ConnectorRanks`)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Callable

import ray

from actors.engine.connector_ranks import ConnectorRanks
from actors.clients.coordinator_client import CoordinatorClient
from actors.clients.engine_client import HEALTH_TIMEOUT_S, EngineClient, Leftovers, Registration
from actors.engine.procs import LiveEngine
from cluster.core.hf_config import load_config
from cluster.core.metrics import TransferTotals

CHECKSUM_PATIENCE_S = 10.0  # a prefill engine that has not answered checksums this long has its verdict asked
UNREAD_STATS_KEPT = 4096  # per-request transfer records kept until someone reads them (the totals keep counting)


class EnginePairs:
    """`EngineActor`'s registration, pair plans and transfer records. `ranks`: its connector's workers; `live`: the
    engine; `draining` and `leftovers`: what a registration reports of the engine's load and processes components."""

    def __init__(self, engine_id: str, role: str | None, served_model: str, model_dir: str, ranks: ConnectorRanks,
                 live: LiveEngine, *, draining: Callable[[], bool], leftovers: Callable[[], Leftovers]) -> None:
        self.engine_id, self.role, self.served_model, self.model_dir = engine_id, role, served_model, model_dir
        self.ranks, self._live, self._draining, self._leftovers = ranks, live, draining, leftovers
        self._unread: list[dict[str, Any]] = []
        # running totals for /metrics: a decode engine's reads, verify outcomes, and every engine's prompt tokens found
        # in its own prefix cache (a prefill engine's prefills, a decode engine's reads and colocated requests)
        self.totals = TransferTotals()
        self.coordinator: CoordinatorClient | None = None  # the coordinator it registered with
        self._prefill_clients: dict[str, Any] = {}  # prefill engine id -> its client, asked of the coordinator once

    async def registration(self) -> Registration:
        """What the coordinator needs (`Registration`)."""
        self._live.required()
        ranks = await self.ranks.registration()
        hf_config = load_config(self.model_dir)
        return Registration(self.engine_id, self.role, self.served_model, hf_config,
                            sorted(ranks, key=lambda r: r["tp_rank"]), self._draining(), self._leftovers())

    async def register(self, coordinator: Any, registration: Registration | None = None) -> dict[str, Any]:
        """Register with the coordinator (which pushes negotiated plans to decode engines). `registration` lets a
        caller pass an edited registration (tests of what the coordinator does with wrong values)."""
        self.coordinator = CoordinatorClient.of(coordinator)  # transfer.verify asks it for prefill engines' clients
        me = EngineClient(ray.get_runtime_context().current_actor, self.engine_id)
        return await self.coordinator.register(registration or await self.registration(), me)

    async def install_pair(self, prefill_engine_id: str, payload: str) -> list[list[int]]:
        """Give every decode worker the negotiated plan for one prefill engine."""
        self._live.required()
        return await self.ranks.install_pair(prefill_engine_id, payload)

    async def install_pairs(self, plans: list[tuple[str, str]]) -> None:
        """`install_pair` for several prefill engines at once: [(prefill engine id, payload)]."""
        for prefill_engine_id, payload in plans:
            await self.install_pair(prefill_engine_id, payload)

    async def remote_agents(self, prefill_engine_id: str) -> list[dict[str, bool]]:
        """Per decode rank, the prefill engine's NIXL agents it has loaded (name -> NIXL still holds it)."""
        self._live.required()
        return await self.ranks.remote_agents(prefill_engine_id)

    async def set_handshake_delay(self, seconds: float) -> None:
        """Test hook: every decode rank's NIXL handshakes take `seconds` longer."""
        self._live.required()
        await self.ranks.set_handshake_delay(seconds)

    async def delayed_handshakes(self) -> list[int]:
        """Test hook: per decode rank, handshakes that have entered the `set_handshake_delay` delay."""
        self._live.required()
        return await self.ranks.delayed_handshakes()

    async def stale_handshakes(self) -> list[int]:
        """Per decode rank, handshakes whose agents were dropped because their pair was re-negotiated meanwhile."""
        self._live.required()
        return await self.ranks.stale_handshakes()

    async def nixl_knows(self, agent_names: list[str]) -> list[list[bool]]:
        """Per decode rank, whether NIXL still holds each named remote agent."""
        self._live.required()
        return await self.ranks.nixl_knows(list(agent_names))

    async def remove_pair(self, prefill_engine_id: str) -> None:
        """The prefill engine left: its pair plan and NIXL agents go, and transfer.verify's client of it."""
        self._prefill_clients.pop(prefill_engine_id, None)  # `prefill_checksums` asks the coordinator again
        if self._live() is not None:
            await self.ranks.remove_pair(prefill_engine_id)

    async def _collect_stats(self) -> None:
        """Move the workers' new per-request transfer records here, adding them to the running totals."""
        fresh = [s for rank in await self.ranks.stats() for s in rank]
        self._unread = (self._unread + fresh)[-UNREAD_STATS_KEPT:]
        for s in fresh:
            if not s.get("ok", True):  # a failed read moved nothing useful
                continue
            self.totals.transfers += bool(s["bytes"])  # a full local prefix hit reads nothing
            self.totals.bytes += s["bytes"]
            self.totals.descriptors += s["descriptors"]
            self.totals.seconds += s["ms"] / 1e3
            if s["decode_rank"] == 0:  # every rank of a read reports the same local hit
                self.totals.cached_prompt_tokens += s.get("cached_tokens", 0)

    async def transfer_stats(self) -> list[dict[str, Any]]:
        """Per request and decode rank: bytes, descriptors, milliseconds of the NIXL reads (drained on read)."""
        self._live.required()
        await self._collect_stats()
        out, self._unread = self._unread, []
        return out

    async def transfer_totals(self) -> TransferTotals:
        """Running totals since start (see `TransferTotals`). Not drained: what /metrics exports as counters."""
        self._live.required()
        await self._collect_stats()
        return dataclasses.replace(self.totals)

    async def prefill_checksums(self, prefill_id: str, items: list[tuple[int, int, list[int], list[int]]],
                                still_checking: Callable[[], Awaitable[Any]] | None = None) -> dict[int, int]:
        """A prefill engine's checksums of `items` (transfer.verify). Its client is asked of the coordinator once and
        kept until a call to it fails or its pair is removed: a coordinator that is restarting (or wedged) must not
        fail the checks of requests whose prefill engine is alive (unverifiable is not verified: they would fail).
        The engine answers between its steps: while it has not answered, every CHECKSUM_PATIENCE_S its verdict is
        asked (`EngineClient.stuck`, the rule everyone uses) - a busy engine (a long step, a compile) is waited for,
        `still_checking()` telling the decode workers so; a stuck or dead one fails the check."""
        prefill = self._prefill_clients.get(prefill_id)
        if prefill is None:
            if self.coordinator is None:
                raise RuntimeError("this engine has not registered with a coordinator")
            prefill = await asyncio.wait_for(self.coordinator.client(prefill_id), 10)
            if prefill is None:
                raise RuntimeError(f"prefill engine {prefill_id} has left")
            self._prefill_clients[prefill_id] = prefill
        answer = asyncio.ensure_future(prefill.checksums(items))
        try:
            while True:
                done, _ = await asyncio.wait({answer}, timeout=CHECKSUM_PATIENCE_S)
                if done:
                    return answer.result()
                stuck = await prefill.stuck(HEALTH_TIMEOUT_S)
                if stuck is not None:
                    raise RuntimeError(f"prefill engine {prefill_id} is {stuck.why}")
                if still_checking is not None:
                    await still_checking()
        except Exception:
            self._prefill_clients.pop(prefill_id, None)  # gone, or replaced under its id: ask again next time
            raise
        finally:
            answer.cancel()
