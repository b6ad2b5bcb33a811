"""Whether an engine makes progress (`ProgressWatch`, owned by `EngineActor` as `progress`): a hung engine - alive,
but its EngineCore stopped (SIGSTOP, a deadlocked step, a wedged worker) - keeps vLLM's `errored` flag clear and
answers Ray, so health on those alone calls it healthy forever while its requests wait with it.

The watch asks the EngineCore a trivial question (the free-block count, a utility call) once a second. vLLM's
EngineCore answers utility calls between steps, so the answer takes at most one step: a question outstanding for
longer than `threshold_s` - the slowest answer seen so far, twice, plus `PD_ENGINE_STALL_S` (default 10 s: one step of
vLLM-CPU's default batch, thousands of prompt tokens, can take seconds on a larger model; the first such step teaches
the watch how slow a step gets) - means the engine is not
stepping. `stalled()` says so; the engine's health turns false, the coordinator takes it out of every
pair, and its pool's replica is replaced. Answered from the actor's memory: a health question never waits on the
EngineCore."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Awaitable, Callable

log = logging.getLogger("pd.engine")
PROBE_INTERVAL_S = 1.0


def stall_margin_s() -> float:
    return float(os.environ.get("PD_ENGINE_STALL_S", "10"))


class ProgressWatch:
    def __init__(self, engine_id: str, ask: Callable[[], Awaitable[Any]], margin_s: float | None = None):
        self.engine_id, self._ask = engine_id, ask
        self.margin_s = stall_margin_s() if margin_s is None else margin_s
        self.slowest_s = 0.0  # the slowest answer so far (a long step)
        self.asked_at: float | None = None  # when the outstanding question was asked (None: none outstanding)
        self._task: asyncio.Task | None = None

    @property
    def threshold_s(self) -> float:
        return 2 * self.slowest_s + self.margin_s

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def stalled(self) -> str | None:
        """Why the engine is not stepping (None: it is, or nobody asks yet)."""
        if self.asked_at is None:
            return None
        waited = time.monotonic() - self.asked_at
        if waited <= self.threshold_s:
            return None
        return f"stuck: its EngineCore has not answered between steps for {waited:.0f} s (threshold " \
               f"{self.threshold_s:.0f} s)"

    async def _run(self) -> None:
        while True:
            self.asked_at = time.monotonic()
            try:
                await self._ask()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - an engine that cannot answer at all is vLLM's errored case
                log.warning("engine %s: progress question failed: %s", self.engine_id, e)
            took = time.monotonic() - self.asked_at
            if took > self.threshold_s:  # it was stalled (stopped and continued): not a step to learn from
                log.warning("engine %s answers again after %.1f s without one", self.engine_id, took)
            else:
                self.slowest_s = max(self.slowest_s, took)
            self.asked_at = None
            await asyncio.sleep(PROBE_INTERVAL_S)
