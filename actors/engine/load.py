"""An engine actor's load and draining (`EngineLoad`, the `EngineActor`'s component that owns them): what the pools'
autoscaling reads (`Load`), what keeps a draining engine from leaving (`Busy`), the refusal of new requests while it
drains (`EngineDraining`), the routers' load counters (`EngineActor.resumable`) and when the engine first served.
The serving component reports requests starting and ending here (`prefill_started`, `decode_done`, `served`, ...),
and `EngineActor.generate` its direct requests (`direct_request`); nobody else writes these counters. Each change
of the requests in flight goes to the engine's core lender (`actors.host.core_lending`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

from actors.host.core_lending import CoreLender
from actors.clients.engine_client import WARMUP_REQUEST_PREFIX, Busy, Load
from actors.engine.procs import LiveEngine

log = logging.getLogger("pd.engine")


class EngineDraining(RuntimeError):
    """The engine is leaving its pool: it finishes what it holds but takes no new request (the router retries on
    another pair)."""


class EngineLoad:
    """`EngineActor`'s load and draining. `live`: the engine (`LiveEngine`)."""

    def __init__(self, engine_id: str, live: LiveEngine) -> None:
        self.engine_id, self._live = engine_id, live
        self.draining = False
        self._prefill_tokens = 0  # prompt tokens of prefills admitted and not finished
        self._prefills = 0
        self._queued_tokens = 0  # prompt tokens of prefills here past their predicted hits (every front end's)
        self._decodes = 0
        self._direct = 0  # requests through EngineActor.generate
        self._total_blocks = 0  # the block pool's size (all free right after start)
        self._usage = 0.0  # fraction of blocks in use, refreshed in the background (EngineCore may be mid-step)
        self._usage_task: asyncio.Task | None = None
        self._usage_error: str | None = None  # why the last cache-usage refresh failed (None: it worked)
        # wall time this engine first served a request: a prefill engine's first prefill done, a decode engine's first
        # tokens out (engine warm-up excluded)
        self._first_served_at: float | None = None
        self.lender: CoreLender | None = None  # told each change of the requests in flight (actors.host.core_lending)

    # ---- what the serving component reports -------------------------------------------------------------------------
    def refuse_if_draining(self) -> None:
        if self.draining:
            raise EngineDraining(f"engine {self.engine_id} is draining (leaving its pool) and takes no new requests")

    def prefill_started(self, tokens: int, uncached: int) -> None:
        """A prefill of `tokens` prompt tokens, `uncached` of them past its predicted prefix hit, is admitted."""
        self._prefills += 1
        self._prefill_tokens += tokens
        self._queued_tokens += uncached
        self._lend()

    def prefill_done(self, tokens: int, uncached: int) -> None:
        """The prefill `prefill_started` counted has ended (done or failed)."""
        self._prefills -= 1
        self._prefill_tokens -= tokens
        self._queued_tokens -= uncached
        self._lend()

    def decode_started(self) -> None:
        self._decodes += 1
        self._lend()

    def decode_done(self) -> None:
        self._decodes -= 1
        self._lend()

    @contextlib.contextmanager
    def direct_request(self) -> Iterator[None]:
        """A request outside the routers' paths (`EngineActor.generate`: warm-up, tests, tools): in flight while it
        runs, so the engine's cores are not lent meanwhile, but no part of the load the routers and autoscaler see."""
        self._direct += 1
        self._lend()
        try:
            yield
        finally:
            self._direct -= 1
            self._lend()

    def _lend(self) -> None:
        if self.lender is not None:
            self.lender.set_in_flight(self.in_flight)

    @property
    def in_flight(self) -> int:
        """Prefills and decodes running here (every front end's)."""
        return self._prefills + self._decodes + self._direct

    def served(self, request_id: str) -> None:
        """A request was served (a prefill done, a decode's tokens out): the first one's time is kept. A pair's
        warm-up transfer (WARMUP_REQUEST_PREFIX) serves nobody."""
        if not request_id.startswith(WARMUP_REQUEST_PREFIX):
            self._first_served_at = self._first_served_at or time.time()

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens of the prefills running here past their predicted prefix hits."""
        return self._queued_tokens

    @property
    def decodes(self) -> int:
        """Requests being decoded here."""
        return self._decodes

    async def count_pool(self) -> int:
        """The started engine's block pool: its size (all blocks free right after start), kept for the cache usage."""
        self._total_blocks = await self.free_blocks()
        return self._total_blocks

    # ---- load and draining (the pool's autoscaling signal; scale-down) -------------------------------------------
    async def load(self) -> Load:
        """This engine's load, answered at once (the autoscaler must not read a busy engine as an idle one): prompt
        tokens queued or in prefill, sequences being decoded, and the fraction of its KV/state blocks in use (as of
        the last background refresh: the scheduler answers between steps)."""
        if self._live() is not None and self._total_blocks and (self._usage_task is None or self._usage_task.done()):
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
        engine = self._live()
        if engine is not None:
            held = tuple(await engine.engine_core.call_utility_async("pd_held_requests"))
        return Busy(prefills=self._prefills, decodes=self._decodes, unfinished=self.num_unfinished(), held=held)

    def first_served(self) -> float | None:
        return self._first_served_at

    async def free_blocks(self) -> int:
        """Free blocks in the engine's KV/state block pool (its scheduler's count; needs the project's connector)."""
        return int(await self._live.required().engine_core.call_utility_async("pd_free_blocks"))

    def num_unfinished(self) -> int:
        """Requests this engine's front end still tracks (running, waiting, or waiting for remote state)."""
        engine = self._live()
        return engine.get_num_unfinished_requests() if engine is not None else 0
