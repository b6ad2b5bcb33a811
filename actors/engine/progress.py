"""Whether an engine makes progress (`ProgressWatch`, owned by `EngineActor` as `progress`): a hung engine - alive,
but its EngineCore stopped (SIGSTOP, a deadlocked step, a wedged worker) - keeps vLLM's `errored` flag clear and
answers Ray, so health on those alone calls it healthy forever while its requests wait with it.

The watch asks the EngineCore a trivial question (the free-block count, a utility call) once a second; vLLM's
EngineCore answers utility calls between steps, so the answer takes at most one step. Meanwhile it reads the
engine's process tree once a second (`ProcessTree`: CPU seconds and run state from /proc, and whether a compile-cache
lock is held on the node). A question outstanding past the threshold - twice the slowest answer seen so far, plus
`PD_ENGINE_STALL_S` (default 10 s) - is judged by `cluster.core.progress.StallRule`: stuck when a process is stopped
or the tree idles, busy (waited for, up to `PD_ENGINE_BUSY_LIMIT_S`) while it burns CPU - compiling, or in a long
step. `stalled()` says why it is stuck; the engine's health turns false, the coordinator takes it out of every pair,
and its pool's replica is replaced. Answered from the actor's memory: a health question never waits on the
EngineCore."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Any, Awaitable, Callable

import psutil

from actors.host.cores import flocked_inodes
from actors.engine.procs import start_ticks
from cluster.core.progress import Judgement, Reading, StallRule, default_busy_limit_s

log = logging.getLogger("pd.engine")
PROBE_INTERVAL_S = 1.0
READINGS_KEPT = 30  # one a second: the rule looks back `window_s`


def stall_rule(device: str = "cpu") -> StallRule:
    """The rule from the engine's environment: PD_ENGINE_STALL_S (the margin, default 10 s) and
    PD_ENGINE_BUSY_LIMIT_S (default by device: `cluster.core.progress.default_busy_limit_s`)."""
    limit = os.environ.get("PD_ENGINE_BUSY_LIMIT_S")
    return StallRule(margin_s=float(os.environ.get("PD_ENGINE_STALL_S", "10")),
                     busy_limit_s=float(limit) if limit else default_busy_limit_s(device))


def compile_lock_dirs() -> list[str]:
    """Where the compilers this engine's processes run keep their lock files: inductor's (its cache's locks/)."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return [os.path.join(root, "locks")] if root else []


class ProcessTree:
    """Readings of the processes under `root` (the engine actor): vLLM's EngineCore, its workers and their children;
    the actor itself and multiprocessing's resource tracker are not the engine's work."""

    def __init__(self, root: psutil.Process | None = None, lock_dirs: list[str] | None = None):
        self.root = root or psutil.Process()
        self.lock_dirs = compile_lock_dirs() if lock_dirs is None else lock_dirs

    def read(self) -> Reading:
        cpu: dict[tuple[int, float], float] = {}
        stopped: list[int] = []
        try:
            children = self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for p in children:
            try:
                with p.oneshot():
                    if any("resource_tracker" in part for part in p.cmdline()):
                        continue
                    t = p.cpu_times()
                    cpu[(p.pid, start_ticks(p.pid) or 0)] = t.user + t.system + t.children_user + t.children_system
                    # stopped by a signal; a debugger's tracing stop (py-spy, gdb, strace) is not a hang
                    if p.status() == psutil.STATUS_STOPPED:
                        stopped.append(p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return Reading(time.monotonic(), cpu, tuple(stopped), self._compile_lock())

    def _compile_lock(self) -> bool:
        """Whether any process on this node holds a lock file of the compile caches (someone compiles: an engine that
        waits for it sleeps meanwhile)."""
        inodes = set()
        for where in self.lock_dirs:
            try:
                with os.scandir(where) as entries:
                    inodes |= {e.inode() for e in entries if e.name.endswith(".lock")}
            except OSError:
                continue
        if not inodes:
            return False
        held = flocked_inodes()
        return bool(held and inodes & held)


class ProgressWatch:
    def __init__(self, engine_id: str, ask: Callable[[], Awaitable[Any]], rule: StallRule | None = None,
                 tree: ProcessTree | None = None):
        self.engine_id, self._ask = engine_id, ask
        self.rule = rule or stall_rule()
        self.tree = tree or ProcessTree()
        self.slowest_s = 0.0  # the slowest answer so far (a long step)
        self.asked_at: float | None = None  # when the outstanding question was asked (None: none outstanding)
        self.readings: collections.deque[Reading] = collections.deque(maxlen=READINGS_KEPT)
        self._tasks: list[asyncio.Task] = []
        self._said: str | None = None  # the last busy/stuck state logged

    @property
    def margin_s(self) -> float:
        return self.rule.margin_s

    @property
    def threshold_s(self) -> float:
        return self.rule.threshold_s(self.slowest_s)

    def start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._run()), loop.create_task(self._sample())]

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    def judge(self) -> Judgement:
        waited = None if self.asked_at is None else time.monotonic() - self.asked_at
        judgement = self.rule.judge(waited, self.slowest_s, list(self.readings))
        if judgement.state != "stepping" and judgement.state != self._said:
            log.warning("engine %s is %s", self.engine_id, judgement.why)
        self._said = judgement.state if judgement.state != "stepping" else None
        return judgement

    def stalled(self) -> str | None:
        """Why the engine is stuck (None: it steps, or is busy, or nobody asks yet)."""
        judgement = self.judge()
        return judgement.why if judgement.state == "stuck" else None

    async def _sample(self) -> None:
        while True:
            try:  # in a thread: a scan of /proc and /proc/locks is milliseconds the actor's loop serves tokens in
                self.readings.append(await asyncio.to_thread(self.tree.read))
            except Exception as e:  # noqa: BLE001 - without readings the clock alone decides (`StallRule.judge`)
                log.warning("engine %s: reading its processes failed: %s", self.engine_id, e)
            await asyncio.sleep(PROBE_INTERVAL_S)

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
            if took > self.threshold_s:  # stalled or busy past the threshold: not a step to learn the threshold from
                log.warning("engine %s answers again after %.1f s without one", self.engine_id, took)
            else:
                self.slowest_s = max(self.slowest_s, took)
            self.asked_at = None
            await asyncio.sleep(PROBE_INTERVAL_S)
