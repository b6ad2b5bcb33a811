"""Core lending: an engine that owns cores lends them, while it has nothing in flight, to a TP 1 engine of its node
that borrows (`borrow_idle_cores`; by default the prefill pool's). The borrower's steps then run on its own cores
plus the idle ones: at concurrency 1 a prompt is prefilled on both cores of a 2-core node instead of one, while the
decode engine that owns the second waits for that very prompt. Once the lender has a request in flight again (a
decode, or a prompt it prefills itself), the borrower's next step runs on its own cores only - a lent core is never
taken from a busy engine for longer than the one step already running on it.

Lender (`CoreLender`, in the engine actor): beside each owned core's lock file a one-byte file `core-N.busy`: "1"
while the engine is starting, stopping or has requests in flight, "0" while it is idle; rewritten on each change of
the actor's in-flight count (`EngineLoad`).

Borrower (`CoreBorrower`, in the EngineCore process, from the connector's scheduler side before each step): vLLM's
OpenMP threads (PyTorch's libgomp) are placed by GOMP_CPU_AFFINITY, which for a borrowing engine lists its own cores
and then the node's other cores (`borrow_env`); OMP_NUM_THREADS is its own cores' count. Before each step it sizes
the OpenMP team to its own cores plus the leading run of the listed other cores whose lenders are idle: libgomp starts
team thread i on the i-th listed core and leaves it there, so no thread of the team runs on a core whose engine is
busy. The size is set before vLLM builds the step's inputs (its CPU attention splits work by the team size) and in
the thread that runs the model (an in-process TP 1 engine: EngineCore's main thread schedules and runs each step).
A core is lent only while a live engine holds its lock (re-read every second: a core freed by an engine that died
idle may be borrowed for up to a second, while nobody uses it) and its byte says idle; a core no engine holds is not
borrowed (the cluster's own processes run there, and a new engine may take it), and neither is any listed after it.
Nothing claims a lent core: two borrowers on one node may both take it, each then with half of it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.host.cores import held_cores

log = logging.getLogger("pd.cores")

BORROW_ENV = "PD_BORROW_CORES"  # set by the engine actor on a borrowing engine: JSON {"dir", "own", "others"}
BUSY, IDLE = b"1", b"0"
HELD_REFRESH_S = 1.0
# a borrowing engine's OpenMP threads spin this many times (libgomp's unit) waiting for the next parallel region before
# they sleep: a step's many small regions run back to back, and a thread that slept between them made two threads
# slower than one (the tiny GDN model, 512-token prefill on the AVX-512 machine: 1 thread 25.5 ms; 2 threads
# sleeping, OMP_WAIT_POLICY=PASSIVE, 39.0 ms; spinning 3000 / 10000 / 30000 / libgomp's default 300000: 23.6 / 20.9 /
# 19.9 / 20.1 ms). Short, because a thread on a lent core spins there after the step too.
SPIN_COUNT = 10_000
# after a step that finished prompts (their decode engines about to start them), this long without borrowing: the
# decode engine marks itself busy only once the front end hands it the request, a few ms after the step, and a borrowed
# step that started meanwhile would run on its core beside that request's first decode steps
HANDOFF_S = 0.05


def busy_path(where: str, core: int) -> str:
    return os.path.join(where, f"core-{core}.busy")


class CoreLender:
    """An engine actor's side: its cores' busy bytes. Busy from creation until `ready`; then `set_in_flight` keeps
    them; `close` marks them busy again (the engine is stopping)."""

    def __init__(self, where: str, cores: tuple[int, ...]) -> None:
        self._fds = [os.open(busy_path(where, c), os.O_RDWR | os.O_CREAT, 0o644) for c in cores]
        self._ready = False
        self._idle = False
        self._write(BUSY)

    def _write(self, value: bytes) -> None:
        for fd in self._fds:
            os.pwrite(fd, value, 0)

    def ready(self, in_flight: int) -> None:
        """The engine serves from now on (start-up and warm-up done)."""
        self._ready = True
        self.set_in_flight(in_flight)

    def set_in_flight(self, in_flight: int) -> None:
        idle = self._ready and in_flight == 0
        if idle != self._idle:
            self._idle = idle
            self._write(IDLE if idle else BUSY)

    def close(self) -> None:
        self._ready = False
        self.set_in_flight(1)
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def borrow_env(where: str, own: tuple[int, ...], others: tuple[int, ...]) -> dict[str, str]:
    """The environment of an in-process TP 1 CPU engine that borrows `others` (the node's cores but its own, in the
    order it may take them): libgomp's places are its own cores, then those; its team starts at its own size."""
    places = list(own) + [c for c in others if c not in own]
    return {"OMP_NUM_THREADS": str(len(own)), "GOMP_CPU_AFFINITY": " ".join(map(str, places)),
            "GOMP_SPINCOUNT": str(SPIN_COUNT),
            BORROW_ENV: json.dumps({"dir": where, "own": list(own), "others": places[len(own):]})}


@dataclass
class CoreBorrower:
    """The EngineCore side: `before_step` sizes the OpenMP team for the step about to run; counts what it lent."""

    where: str
    own: tuple[int, ...]
    others: tuple[int, ...]
    set_threads: Callable[[int], None]  # torch._C.set_num_threads (vLLM's CPU worker stubs torch.set_num_threads)
    steps: int = 0
    borrowed_steps: int = 0
    borrowed_cores: int = 0  # cores borrowed, summed over steps
    threads: int = 0
    _fds: dict[int, int] = field(default_factory=dict)
    _held: set[int] = field(default_factory=set)
    _held_at: float = float("-inf")
    _handoff_at: float = float("-inf")
    failed: str | None = None  # why borrowing stopped for good in this process (None: it goes on)

    @classmethod
    def from_env(cls) -> "CoreBorrower | None":
        spec = os.environ.get(BORROW_ENV)
        if not spec:
            return None
        d = json.loads(spec)
        import torch

        b = cls(d["dir"], tuple(d["own"]), tuple(d["others"]), set_threads=torch._C.set_num_threads)
        b.threads = len(b.own)
        log.info("this engine runs on cores %s and borrows, in this order, %s while their engines are idle",
                 b.own, b.others)
        return b

    def _lent(self) -> int:
        """How many of `others`, from the first, are lent now."""
        now = time.monotonic()
        if now - self._held_at >= HELD_REFRESH_S:
            self._held, self._held_at = held_cores(self.where), now
        n = 0
        for core in self.others:
            if core not in self._held or self._byte(core) != IDLE:
                break
            n += 1
        return n

    def _byte(self, core: int) -> bytes:
        fd = self._fds.get(core)
        if fd is None:
            try:
                fd = self._fds[core] = os.open(busy_path(self.where, core), os.O_RDONLY)
            except FileNotFoundError:
                return BUSY
        return os.pread(fd, 1, 0)

    def before_step(self, handing_off: bool = False, computes: bool = True) -> int:
        """Size the OpenMP team for the next step; returns its size. `handing_off`: the last step finished prompts
        whose decode engines are about to start them (no borrowing for `HANDOFF_S`). `computes`: the step runs the
        model (one that does not - blocks waiting for a decode engine's read - leaves the team as it is)."""
        now = time.monotonic()
        if handing_off:
            self._handoff_at = now
        if not computes:
            return self.threads
        lent = self._lent() if now - self._handoff_at >= HANDOFF_S else 0
        want = len(self.own) + lent
        if want != self.threads:
            self.set_threads(want)
            self.threads = want
        self.steps += 1
        if lent:
            self.borrowed_steps += 1
            self.borrowed_cores += lent
        return want

    def fail(self, error: BaseException) -> None:
        """Stop borrowing for good: the team back at the engine's own cores (if even that fails, as it is)."""
        self.failed = f"{type(error).__name__}: {error}"
        log.warning("core borrowing off for this engine: %s", self.failed)
        try:
            if self.threads != len(self.own):
                self.set_threads(len(self.own))
                self.threads = len(self.own)
        except Exception:  # noqa: BLE001 - nothing more to do
            pass

    def stats(self) -> dict[str, object]:
        return {"own": list(self.own), "others": list(self.others), "steps": self.steps,
                "borrowed_steps": self.borrowed_steps, "borrowed_cores": self.borrowed_cores, "threads": self.threads,
                "failed": self.failed}


_BORROWER: CoreBorrower | None = None
_LOADED = False


def borrower() -> CoreBorrower | None:
    """This process's borrower (from BORROW_ENV), built on first use; None where the engine does not borrow."""
    global _BORROWER, _LOADED
    if not _LOADED:
        _LOADED = True
        try:
            _BORROWER = CoreBorrower.from_env()
        except Exception as e:  # noqa: BLE001 - an optimisation: the engine runs on its own cores without it
            log.warning("core borrowing off: %s: %s", type(e).__name__, e)
    return _BORROWER
