"""An engine actor's load and draining (`LoadMixin`): what the pools' autoscaling reads (`Load`), what keeps a
draining engine from leaving (`Busy`), and the refusal of new requests while it drains (`EngineDraining`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from actors.engine_client import Busy, Load

log = logging.getLogger("pd.engine")


class EngineDraining(RuntimeError):
    """The engine is leaving its pool: it finishes what it holds but takes no new request (the router retries on
    another pair)."""


class LoadMixin:
    """`EngineActor`'s load and draining (needs `engine`, `engine_id` and `_require_engine`, set by the actor)."""

    engine: Any
    engine_id: str

    def _init_load(self) -> None:
        self.draining = False
        self._prefill_tokens = 0  # prompt tokens of prefills admitted and not finished
        self._prefills = 0
        self._decodes = 0
        self._total_blocks = 0  # the block pool's size (all free right after start)
        self._usage = 0.0  # fraction of blocks in use, refreshed in the background (EngineCore may be mid-step)
        self._usage_task: asyncio.Task | None = None
        self._usage_error: str | None = None  # why the last cache-usage refresh failed (None: it worked)
        # wall time this engine first served a request: a prefill engine's first prefill done, a decode engine's first
        # tokens out (engine warm-up excluded)
        self.first_served_at: float | None = None

    # ---- load and draining (the pool's autoscaling signal; scale-down) -------------------------------------------
    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise EngineDraining(f"engine {self.engine_id} is draining (leaving its pool) and takes no new requests")

    async def load(self) -> Load:
        """This engine's load, answered at once (the autoscaler must not read a busy engine as an idle one): prompt
        tokens queued or in prefill, sequences being decoded, and the fraction of its KV/state blocks in use (as of
        the last background refresh: the scheduler answers between steps)."""
        if self.engine is not None and self._total_blocks and (self._usage_task is None or self._usage_task.done()):
            self._usage_task = asyncio.ensure_future(self._refresh_usage())
        # an unreadable cache usage is unknown (None), not an empty cache
        return Load(float(self._prefill_tokens), float(self._decodes), self._usage if self._usage_error is None else None)

    async def _refresh_usage(self) -> None:
        try:
            self._usage = max(0.0, 1.0 - await asyncio.wait_for(self.free_blocks(), 30) / self._total_blocks)
        except Exception as e:  # noqa: BLE001 - reported, and the signal is withheld until it reads again
            error = f"{type(e).__name__}: {e}"
            if error != self._usage_error:
                log.warning("engine %s cannot read its cache usage (%s): its load reports leave cache_usage out "
                            "(its pool will not shrink on it) until it can", self.engine_id, error)
            self._usage_error = error
            return
        if self._usage_error is not None:
            log.warning("engine %s reads its cache usage again", self.engine_id)
        self._usage_error = None

    def set_draining(self) -> None:
        """Refuse new prefill/decode requests from now on (what is in flight carries on)."""
        self.draining = True

    async def busy(self) -> Busy:
        """What keeps a draining engine from leaving (see `Busy`)."""
        held: tuple[str, ...] = ()
        if self.engine is not None:
            held = tuple(await self.engine.engine_core.call_utility_async("pd_held_requests"))
        return Busy(prefills=self._prefills, decodes=self._decodes, unfinished=self.num_unfinished(), held=held)

    def first_served(self) -> float | None:
        return self.first_served_at

    async def free_blocks(self) -> int:
        """Free blocks in the engine's KV/state block pool (its scheduler's count; needs the project's connector)."""
        self._require_engine()
        return int(await self.engine.engine_core.call_utility_async("pd_free_blocks"))

    def num_unfinished(self) -> int:
        """Requests this engine's front end still tracks (running, waiting, or waiting for remote state)."""
        return self.engine.get_num_unfinished_requests() if self.engine is not None else 0
