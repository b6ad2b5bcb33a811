"""The engine actor's typed calls into its KV connector's workers, one per TP rank (`ConnectorRanks`, owned by
`EngineActor` as `ranks`). vLLM carries a call to its workers as a method name over `collective_rpc`
(`actors.engine.connector.PDWorkerExtension.pd_call`); this is the one module that names the connector's methods - each
method here runs `PlannedPullWorker.pd_<name>` on every rank and returns the ranks' values in rank order.
`tests/test_layers.py` holds the two sides together: every method here has its worker method and every worker
method its method here, and no other module names one.

Three kinds: the planned-read data path (registration, pair plans, transfer records, releasing blocks, NIXL
agents), `transfer.verify`'s checksums, and test hooks (corruption and slow handshakes on purpose)."""

from __future__ import annotations

from typing import Any, Callable


class WorkerCallError(RuntimeError):
    """A connector method failed on a TP rank of the engine (the message names the method, rank and error)."""


class ConnectorRanks:
    def __init__(self, engine_id: str, engine: Callable[[], Any]):
        self.engine_id = engine_id
        self._engine = engine  # the actor's vLLM AsyncLLM (None until started)

    async def _all(self, method: str, *args: Any) -> list[Any]:
        """`method` on every TP rank; the ranks' values in rank order, or WorkerCallError naming the first rank
        that failed (a worker never raises through `collective_rpc`: see `PDWorkerExtension`)."""
        engine = self._engine()
        if engine is None:
            raise WorkerCallError(f"{method}: engine {self.engine_id} is not started")
        answers = await engine.collective_rpc("pd_call", args=(f"pd_{method}", *args))
        for rank, answer in enumerate(answers):
            if "error" in answer:
                raise WorkerCallError(f"pd_{method} failed on TP rank {rank} of engine {self.engine_id}: "
                                      f"{answer['error']}")
        return [answer["ok"] for answer in answers]

    # ---- the planned-read data path ------------------------------------------------------------------------------
    async def registration(self) -> list[dict[str, Any]]:
        """Each rank's layout, NIXL metadata and side-channel address (what the coordinator negotiates with)."""
        return await self._all("registration")

    async def install_pair(self, prefill_engine_id: str, payload: str) -> list[list[int]]:
        """A negotiated pair plan (`cluster.core.wire`) on every decode rank; each rank's remote ranks."""
        return await self._all("install_pair", prefill_engine_id, payload)

    async def remove_pair(self, prefill_engine_id: str) -> list[None]:
        return await self._all("remove_pair", prefill_engine_id)

    async def stats(self) -> list[list[dict[str, Any]]]:
        """Per rank, the transfer records since the last call."""
        return await self._all("stats")

    async def release(self, request_ids: list[str]) -> list[list[str]]:
        """Per rank, which of these prefill-side requests it freed the blocks of."""
        return await self._all("release", list(request_ids))

    async def borrowed(self) -> list[dict[str, Any] | None]:
        """Per rank, its core lending (actors.host.core_lending): steps run and steps that borrowed; None: it does not
        borrow."""
        return await self._all("borrowed")

    async def pending_sends(self) -> list[list[str]]:
        """Per rank, prefill-side requests whose blocks still wait for a decode engine's read."""
        return await self._all("pending_sends")

    async def remote_agents(self, prefill_engine_id: str) -> list[dict[str, bool]]:
        """Per rank, the prefill engine's NIXL agents it has loaded (name -> NIXL still holds it)."""
        return await self._all("remote_agents", prefill_engine_id)

    async def nixl_knows(self, agent_names: list[str]) -> list[list[bool]]:
        """Per rank, whether NIXL still holds each named remote agent."""
        return await self._all("nixl_knows", list(agent_names))

    # ---- transfer.verify -----------------------------------------------------------------------------------------
    async def set_verify(self, fraction: float) -> list[None]:
        return await self._all("set_verify", fraction)

    async def verify_poll(self) -> list[dict[str, Any]]:
        """Per rank, the sampled reads whose bytes have landed and await a verdict."""
        return await self._all("verify_poll")

    async def verify_done(self, verdicts: dict[str, bool], checking: list[str] = ()) -> list[None]:
        """Verdicts for requests whose reads landed; `checking`: requests whose check is still under way."""
        return await self._all("verify_done", verdicts, list(checking))

    async def checksums(self, items: list[tuple[int, int, list[int], list[int]]]) -> list[dict[int, int]]:
        """Per rank, checksums of the listed block ranges (a prefill engine's side of a verify check)."""
        return await self._all("checksums", items)

    # ---- test hooks ----------------------------------------------------------------------------------------------
    async def plant_corruption(self, count: int, rank: int) -> list[None]:
        return await self._all("plant_corruption", count, rank)

    async def corrupt_next_read(self, specs_by_rank: list[list[dict[str, Any]]], seed: int) -> list[None]:
        return await self._all("corrupt_next_read", specs_by_rank, seed)

    async def set_handshake_delay(self, seconds: float) -> list[None]:
        return await self._all("set_handshake_delay", seconds)

    async def delayed_handshakes(self) -> list[int]:
        return await self._all("delayed_handshakes")

    async def stale_handshakes(self) -> list[int]:
        return await self._all("stale_handshakes")
