"""An engine actor's part in pairing (`PairsMixin`): its registration (every TP rank's NIXL agent metadata, region
bases and run-time layout), the negotiated pair plans the coordinator pushes to a decode engine's workers, NIXL's
remote agents, and the decode side's transfer records and totals. Each reaches the workers through the actor's
`ranks` (`actors.connector_ranks.ConnectorRanks`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from actors.connector_ranks import ConnectorRanks

from actors.coordinator_client import CoordinatorClient
from actors.engine_client import EngineClient, Registration
from cluster.core.hf_config import load_config
from cluster.core.metrics import TransferTotals

UNREAD_STATS_KEPT = 4096  # per-request transfer records kept until someone reads them (the totals keep counting)


class PairsMixin:
    """`EngineActor`'s registration, pair plans and transfer records (needs `engine`, `engine_id`, `ranks`, `role`,
    `served_model`, `model_dir`, `draining`, `leftovers`, `_require_engine`, `_self_handle`, set by the actor)."""

    engine: Any
    engine_id: str
    ranks: ConnectorRanks

    def _init_pairs(self) -> None:
        self._unread: list[dict[str, Any]] = []
        # running totals for /metrics: a decode engine's reads, verify outcomes, and every engine's prompt tokens found
        # in its own prefix cache (a prefill engine's prefills, a decode engine's reads and colocated requests)
        self._totals = TransferTotals()
        self._coordinator: Any = None  # the coordinator it registered with (transfer.verify asks it for engines)

    async def registration(self) -> Registration:
        """What the coordinator needs (`Registration`)."""
        self._require_engine()
        ranks = await self.ranks.registration()
        hf_config = load_config(self.model_dir)
        return Registration(self.engine_id, self.role, self.served_model, hf_config,
                            sorted(ranks, key=lambda r: r["tp_rank"]), self.draining, self.leftovers())

    async def register(self, coordinator: Any, registration: Registration | None = None) -> dict[str, Any]:
        """Register with the coordinator (which pushes negotiated plans to decode engines). `registration` lets a
        caller pass an edited registration (tests of what the coordinator does with wrong values)."""
        self._coordinator = CoordinatorClient.of(coordinator)  # transfer.verify asks it for prefill engines' clients
        me = EngineClient(self._self_handle(), self.engine_id)
        return await self._coordinator.register(registration or await self.registration(), me)

    async def install_pair(self, prefill_engine_id: str, payload: str) -> list[list[int]]:
        """Give every decode worker the negotiated plan for one prefill engine."""
        self._require_engine()
        return await self.ranks.install_pair(prefill_engine_id, payload)

    async def install_pairs(self, plans: list[tuple[str, str]]) -> None:
        """`install_pair` for several prefill engines at once: [(prefill engine id, payload)]."""
        for prefill_engine_id, payload in plans:
            await self.install_pair(prefill_engine_id, payload)

    async def remote_agents(self, prefill_engine_id: str) -> list[dict[str, bool]]:
        """Per decode rank, the prefill engine's NIXL agents it has loaded (name -> NIXL still holds it)."""
        self._require_engine()
        return await self.ranks.remote_agents(prefill_engine_id)

    async def set_handshake_delay(self, seconds: float) -> None:
        """Test hook: every decode rank's NIXL handshakes take `seconds` longer."""
        self._require_engine()
        await self.ranks.set_handshake_delay(seconds)

    async def delayed_handshakes(self) -> list[int]:
        """Test hook: per decode rank, handshakes that have entered the `set_handshake_delay` delay."""
        self._require_engine()
        return await self.ranks.delayed_handshakes()

    async def stale_handshakes(self) -> list[int]:
        """Per decode rank, handshakes whose agents were dropped because their pair was re-negotiated meanwhile."""
        self._require_engine()
        return await self.ranks.stale_handshakes()

    async def nixl_knows(self, agent_names: list[str]) -> list[list[bool]]:
        """Per decode rank, whether NIXL still holds each named remote agent."""
        self._require_engine()
        return await self.ranks.nixl_knows(list(agent_names))

    async def remove_pair(self, prefill_engine_id: str) -> None:
        """The prefill engine left: its pair plan and NIXL agents go, and transfer.verify's client of it."""
        self._forget_prefill(prefill_engine_id)
        if self.engine is not None:
            await self.ranks.remove_pair(prefill_engine_id)

    async def _collect_stats(self) -> None:
        """Move the workers' new per-request transfer records here, adding them to the running totals."""
        fresh = [s for rank in await self.ranks.stats() for s in rank]
        self._unread = (self._unread + fresh)[-UNREAD_STATS_KEPT:]
        for s in fresh:
            if not s.get("ok", True):  # a failed read moved nothing useful
                continue
            self._totals.transfers += bool(s["bytes"])  # a full local prefix hit reads nothing
            self._totals.bytes += s["bytes"]
            self._totals.descriptors += s["descriptors"]
            self._totals.seconds += s["ms"] / 1e3
            if s["decode_rank"] == 0:  # every rank of a read reports the same local hit
                self._totals.cached_prompt_tokens += s.get("cached_tokens", 0)

    async def transfer_stats(self) -> list[dict[str, Any]]:
        """Per request and decode rank: bytes, descriptors, milliseconds of the NIXL reads (drained on read)."""
        self._require_engine()
        await self._collect_stats()
        out, self._unread = self._unread, []
        return out

    async def transfer_totals(self) -> TransferTotals:
        """Running totals since start (see `TransferTotals`). Not drained: what /metrics exports as counters."""
        self._require_engine()
        await self._collect_stats()
        return dataclasses.replace(self._totals)
