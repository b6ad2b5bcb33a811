"""Stuck or busy: the rule that judges an engine whose EngineCore has not answered between steps for a while.

vLLM's EngineCore answers a utility call between steps, so an unanswered question means a step (or something in the
EngineCore's loop) has not ended. That alone cannot tell a hung engine from a busy one: a SIGSTOPped or deadlocked
EngineCore and one compiling a kernel (torch.compile's first use, ~12 s of a core) or running a long prefill on a
large model look the same to a clock. Their processes do not: a stopped process is in state T, a deadlocked one uses
no CPU, a compiling or computing one burns it. So the rule reads the engine's process tree (the EngineCore, its TP
workers and their helpers, compile subprocesses included) and calls an unanswered engine:

- stepping - it answered within `threshold_s` (twice the slowest answer seen, plus `margin_s`);
- stuck - past the threshold, a process of the tree is stopped, or the tree used less than `idle_cores` of CPU over
  the last `window_s` and no compile-cache lock is held on its node (an engine waiting for another's compile sleeps);
- busy - past the threshold but burning CPU (or waiting on a held compile lock): waited for, up to `busy_limit_s`,
  after which it is stuck all the same (a spinning hung kernel, an endless loop).

Pure: readings come in (`Reading`), a `Judgement` goes out; `actors.engine.progress` reads /proc and asks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

CPU_BUSY_LIMIT_S = 600.0  # CPU hosts: a compile or a long prefill of a large model can take minutes
CUDA_BUSY_LIMIT_S = 180.0  # GPU hosts: a hung kernel spins a host core while the GPU does nothing; autotuning is shorter


def default_busy_limit_s(device: str) -> float:
    return CUDA_BUSY_LIMIT_S if device == "cuda" else CPU_BUSY_LIMIT_S


@dataclass(frozen=True)
class Reading:
    """One look at an engine's processes: when (monotonic seconds), each process's CPU seconds so far by (pid, start)
    - its own and its reaped children's, so that a finished compile subprocess still counts - the pids stopped by a
    signal (state T), and whether a compile-cache lock is held on the node."""

    t: float
    cpu_s: dict[tuple[int, float], float] = field(default_factory=dict)  # (pid, start) -> CPU seconds
    stopped: tuple[int, ...] = ()
    compile_lock: bool = False


def cpu_used(first: Reading, last: Reading) -> float:
    """CPU seconds the tree used between two readings: per process, what it added (a process that started meanwhile:
    all it used; one that ended: nothing more)."""
    return sum(max(0.0, s - first.cpu_s.get(key, 0.0)) for key, s in last.cpu_s.items())


@dataclass(frozen=True)
class Judgement:
    state: Literal["stepping", "busy", "stuck"]
    why: str = ""


@dataclass(frozen=True)
class StallRule:
    """`margin_s`: PD_ENGINE_STALL_S (default 10); `window_s`: how far back CPU use is judged; `idle_cores`: less CPU
    than this many cores over the window is idle; `busy_limit_s`: the longest an engine may burn CPU without
    answering."""

    margin_s: float = 10.0
    window_s: float = 5.0
    idle_cores: float = 0.05
    busy_limit_s: float = CPU_BUSY_LIMIT_S

    def threshold_s(self, slowest_s: float) -> float:
        return 2 * slowest_s + self.margin_s

    def judge(self, waited_s: float | None, slowest_s: float, readings: Sequence[Reading]) -> Judgement:
        """`waited_s`: how long the outstanding question has waited (None: none outstanding); `readings`: oldest
        first, the last one current. With no readings (the tree cannot be read) the clock alone decides: stuck past
        the threshold."""
        threshold = self.threshold_s(slowest_s)
        if waited_s is None or waited_s <= threshold:
            return Judgement("stepping")
        silent = f"its EngineCore has not answered between steps for {waited_s:.1f} s (threshold {threshold:.1f} s)"
        if not readings:
            return Judgement("stuck", f"stuck: {silent}; its processes could not be read")
        last = readings[-1]
        if last.stopped:
            return Judgement("stuck", f"stuck: {silent}; process{'es' if len(last.stopped) > 1 else ''} "
                                      f"{', '.join(map(str, last.stopped))} stopped")
        if waited_s > self.busy_limit_s:
            return Judgement("stuck", f"stuck: {silent}, busy past its limit of {self.busy_limit_s:.0f} s")
        start = next((r for r in reversed(readings) if last.t - r.t >= self.window_s), readings[0])
        span = last.t - start.t
        if span <= 0:
            return Judgement("busy", f"busy: {silent}; its CPU use is not measured yet")
        cores = cpu_used(start, last) / span
        if cores >= self.idle_cores:
            return Judgement("busy", f"busy: {silent}, using {cores:.2f} cores")
        if last.compile_lock:
            return Judgement("busy", f"busy: {silent}, waiting for a compile (a compile-cache lock is held)")
        return Judgement("stuck", f"stuck: {silent}, idle ({cores:.3f} cores over {span:.0f} s)")
