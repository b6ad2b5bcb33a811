"""Cores as devices, on the node: which cores an engine owns, held for as long as its actor lives.

An engine that owns cores takes them from its node's cores (`node_cores`: the cores its actor process may run on,
or PD_NODE_CORES where the node sets it) by locking one file per core with `flock` (`lease_cores`). The kernel drops
a lock when the process holding it dies, however it dies, so the cores of a SIGKILLed engine are free again for the
engine that replaces it, with no one to clean up. Each file names its holder, so that an engine that finds no free
core says who holds them. Ray places the engine on a node with enough free CPUs (the actor takes `num_cpus` = its
cores), and the lock files say which cores on that node.

The files live in a directory per Ray node (PD_CORE_LOCK_DIR, default /tmp/hybrid-pd-cores/<node id>): several Ray
nodes on one machine (test clusters) each account for their own cores, as Ray does for their CPUs.

Reserved cores: an engine whose pool reserves its cores (`reserve_cores`; by default a decode pool that owns its
cores) marks its lock files so, and the cluster's own processes on the node - the HTTP front ends, the engine actors'
Python side (vLLM's client: output handling, detokenizing, the decode channel), the coordinator - keep off those cores
(`HostCores`), as a GPU host's threads stay off the GPU: a decode step is then not preempted by a token's HTTP
delivery or an engine's bookkeeping. They run on the node's other cores instead, prefill engines' ones included
(`host_cores`).
"""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass, field
from typing import IO

from cluster.core.config import PlacementConfig
from cluster.core.cores import format_cores, parse_cores

NODE_CORES_ENV = "PD_NODE_CORES"  # a node's cores for engines (cpu-list syntax); default: the process's affinity
LOCK_DIR_ENV = "PD_CORE_LOCK_DIR"
DEFAULT_LOCK_DIR = "/tmp/hybrid-pd-cores"
HOST_CORES_ENV = "PD_HOST_CORES"  # "all": the cluster's own processes run on every core (no `HostCores` pinning)
HOST_CORES_INTERVAL_S = 5.0


class CoresUnavailable(RuntimeError):
    """An engine could not get the cores it needs on its node."""


def node_cores() -> tuple[int, ...]:
    """The cores engines on this node may own: PD_NODE_CORES if set (each must be one this process may run on), else
    every core this process may run on."""
    allowed = os.sched_getaffinity(0)
    text = os.environ.get(NODE_CORES_ENV, "").strip()
    if not text:
        return tuple(sorted(allowed))
    cores = parse_cores(text)
    outside = sorted(set(cores) - allowed)
    if outside:
        raise CoresUnavailable(f"{NODE_CORES_ENV}={text} names core(s) {format_cores(outside)} that this node's "
                               f"processes may not run on (allowed: {format_cores(sorted(allowed))})")
    return cores


def lock_dir(node_id: str) -> str:
    return os.path.join(os.environ.get(LOCK_DIR_ENV, DEFAULT_LOCK_DIR), node_id)


@dataclass
class CoreLease:
    """Cores held by this process until `release` (or until it dies)."""

    cores: tuple[int, ...]
    _files: list[IO[str]] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for f in self._files:
            try:
                fcntl.flock(f, fcntl.LOCK_UN)
            finally:
                f.close()
        self._files.clear()


RESERVED_MARK = "reserved"  # a lock file's second line when its core is reserved (see the module docstring)


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip() or "an unnamed holder"
    except OSError:
        return "an unnamed holder"


def lease_cores(count: int, owner: str, node_id: str, *, who: str = "",
                cores: tuple[int, ...] | None = None, reserved: bool = False) -> CoreLease:
    """Take `count` free cores of this node (the lowest free ones) for `owner`; raise `CoresUnavailable`, naming the
    cores and their holders, when fewer are free. `who` prefixes the message (e.g. "decode pool"). `reserved`: the
    cluster's own processes keep off these cores (`host_cores`)."""
    cores = node_cores() if cores is None else cores
    where = lock_dir(node_id)
    os.makedirs(where, exist_ok=True)
    taken: list[int] = []
    files: list[IO[str]] = []
    busy: dict[int, str] = {}
    for core in cores:
        if len(taken) == count:
            break
        path = os.path.join(where, f"core-{core}")
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            busy[core] = _holder(path)
            continue
        f.seek(0)
        f.truncate()
        f.write(f"{owner} (pid {os.getpid()})\n" + (f"{RESERVED_MARK}\n" if reserved else ""))
        f.flush()
        taken.append(core)
        files.append(f)
    lease = CoreLease(tuple(taken), files)
    if len(taken) < count:  # then the loop saw every core: each is in `taken` or in `busy`
        lease.release()
        held = "; ".join(f"core {c}: {h}" for c, h in sorted(busy.items())) or "none"
        free = len(cores) - len(busy)
        raise CoresUnavailable(
            f"{who + ': ' if who else ''}{owner} needs {count} core(s) of its own but node {node_id[:12]} has "
            f"{free} free of its {len(cores)} ({format_cores(cores)}); held: {held}. Give the node more cores, lower "
            "the pool's tp or max_replicas, or set share_cores: true on the pool to let its engines share cores")
    return lease


def flocked_inodes() -> set[int] | None:
    """The inode of every file some process holds an flock on (/proc/locks), or None where the kernel does not say.
    Inodes only: the device numbers /proc/locks gives need not be those stat() gives on every filesystem (overlays);
    a lock file whose inode a lock elsewhere shares at most keeps its core from the host until that lock goes."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    held = set()
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK":  # "N: -> FLOCK ...": a process waiting for the lock
            continue
        try:
            held.add(int(parts[5].rsplit(":", 1)[1]))
        except (ValueError, IndexError):
            continue
    return held


def _pid_alive(holder: str) -> bool:
    """Whether the process a lock file's first line names ("owner (pid N)") lives (where /proc/locks is unreadable)."""
    import psutil

    pid = holder.rpartition("(pid ")[2].rstrip(")")
    return pid.isdigit() and psutil.pid_exists(int(pid))


def _held_lock_files(where: str) -> dict[int, list[str]]:
    """{core: its lock file's lines} for each lock file in `where` that a live process holds an flock on (a holder
    that died leaves its file behind, but the kernel dropped its lock)."""
    try:
        names = [n for n in os.listdir(where) if n.startswith("core-") and n[5:].isdigit()]
    except FileNotFoundError:
        return {}
    held = flocked_inodes()
    out = {}
    for name in names:
        path = os.path.join(where, name)
        try:
            with open(path) as f:
                lines = f.read().splitlines()
                inode = os.fstat(f.fileno()).st_ino
        except OSError:
            continue
        alive = inode in held if held is not None else _pid_alive(lines[0] if lines else "")
        if alive:
            out[int(name[5:])] = lines
    return out


def held_cores(where: str) -> set[int]:
    """The cores whose lock files in directory `where` live engines hold now."""
    return set(_held_lock_files(where))


def reserved_cores(node_id: str) -> set[int]:
    """The cores of this node that engines hold now with `reserved`."""
    return {core for core, lines in _held_lock_files(lock_dir(node_id)).items()
            if RESERVED_MARK in (line.strip() for line in lines[1:])}


def host_cores(node_id: str, allowed: tuple[int, ...] | set[int],
               reserved: set[int] | None = None) -> tuple[int, ...]:
    """Where the cluster's own processes run on this node: the cores of `allowed` (the process's own) that no engine
    holds reserved (`reserved`, read from the node's lock files when not given), or all of `allowed` when engines
    reserve every one of them (a process must run somewhere)."""
    reserved = reserved_cores(node_id) if reserved is None else reserved
    free = tuple(sorted(c for c in allowed if c not in reserved))
    return free or tuple(sorted(allowed))


class HostCores:
    """Keeps every thread of this process on `host_cores`: pinned at `start`, then checked every `interval_s`
    seconds in a daemon thread (engines come and go: a decode engine that joins later reserves its cores then, one
    that leaves frees them). Threads started by a pinned thread inherit its cores. PD_HOST_CORES=all turns it off:
    every process runs where the kernel puts it."""

    def __init__(self, node_id: str, who: str, interval_s: float = HOST_CORES_INTERVAL_S) -> None:
        self.node_id, self.who, self.interval_s = node_id, who, interval_s
        self.allowed = tuple(sorted(os.sched_getaffinity(0)))  # what this process was given: pinning stays within
        self.cores: tuple[int, ...] = self.allowed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def enabled() -> bool:
        return os.environ.get(HOST_CORES_ENV, "").strip().lower() != "all"

    def apply(self) -> tuple[int, ...]:
        """Pin every thread of this process to the host cores now; returns them."""
        reserved = reserved_cores(self.node_id)
        cores = host_cores(self.node_id, self.allowed, reserved)
        want = set(cores)
        for tid in os.listdir("/proc/self/task"):
            try:
                if os.sched_getaffinity(int(tid)) != want:
                    os.sched_setaffinity(int(tid), want)
            except (ProcessLookupError, OSError):  # a thread that ended meanwhile
                continue
        if cores != self.cores:
            import logging

            logging.getLogger("pd.cores").info("%s runs on cores %s (engines reserve %s)", self.who,
                                               format_cores(cores),
                                               format_cores(sorted(reserved & set(self.allowed))) or "none")
            self.cores = cores
        return cores

    def start(self) -> "HostCores":
        if not self.enabled() or self._thread is not None:
            return self
        self.apply()
        self._thread = threading.Thread(target=self._loop, name="pd-host-cores", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.apply()
            except Exception:  # noqa: BLE001 - an optimisation: never let it take the process down
                pass

    def stop(self) -> None:
        self._stop.set()


def start_host_cores(who: str) -> HostCores | None:
    """`HostCores` for this Ray worker's node, started; None outside Ray or where it is turned off."""
    if not HostCores.enabled():
        return None
    try:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not in a Ray worker: nothing to keep off
        return None
    return HostCores(node_id, who).start()


def bind_this_thread(cores: tuple[int, ...]) -> None:
    """Restrict the calling thread to `cores`: processes and threads it starts from now on inherit the mask."""
    os.sched_setaffinity(threading.get_native_id(), set(cores))


def unbind_thread(tid: int, cores: set[int]) -> None:
    """Give thread `tid` of this process `cores` again (a thread that ended meanwhile is left alone)."""
    try:
        os.sched_setaffinity(tid, cores)
    except (ProcessLookupError, OSError):
        pass


def thread_affinities(pid: int) -> dict[int, tuple[int, ...]]:
    """Every thread of process `pid` and the cores it may run on ({tid: cores}); threads that end meanwhile are
    left out."""
    out: dict[int, tuple[int, ...]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            out[int(tid)] = tuple(sorted(os.sched_getaffinity(int(tid))))
        except (ProcessLookupError, OSError):
            pass
    return out


def free_cpus_per_node() -> dict[str, float] | None:
    """Each live Ray node's free CPUs by node id (None where this Ray cannot say)."""
    try:
        from ray._private.state import available_resources_per_node

        return {node: float(res.get("CPU", 0.0)) for node, res in available_resources_per_node().items()}
    except Exception:  # noqa: BLE001 - a private API: the callers fall back to the nodes' totals
        return None


def engine_slots(need: int, labels: dict[str, str] | None = None) -> tuple[int, str]:
    """How many more engines of `need` cores each fit in the free CPUs of the live Ray nodes that carry `labels`, and
    those nodes' free CPUs in words (for messages)."""
    import ray

    placement = PlacementConfig(labels=labels or {})
    free = free_cpus_per_node() or {}
    slots, seen = 0, []
    for node in ray.nodes():
        if not node.get("Alive") or not placement.allows(node):
            continue
        cpus = free.get(node["NodeID"], 0.0)
        slots += int(cpus // need)
        seen.append(f"{node.get('NodeManagerAddress')} {cpus:g}")
    return slots, ", ".join(seen) or "no live node"


def wait_for_cores(need: int, labels: dict[str, str] | None, who: str, timeout_s: float = 60.0) -> None:
    """Before an engine that owns `need` cores is created: wait (up to `timeout_s`: a dead engine's CPUs come back to
    Ray a moment after it dies) until a node it may run on has that many CPUs free; else raise `CoresUnavailable`
    naming the pool and the nodes' free CPUs, rather than leave the engine waiting for a node forever."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        slots, seen = engine_slots(need, labels)
        if slots:
            return
        if time.monotonic() >= deadline:
            raise CoresUnavailable(
                f"{who}: a new engine needs {need} core(s) of its own on one node, and none has that many free CPUs "
                f"(free CPUs per node: {seen}) after {timeout_s:.0f} s. Give the nodes more cores, lower the pool's "
                "tp or max_replicas, or set share_cores: true on the pool")
        time.sleep(1.0)


def normal_priority(who: str) -> bool:
    """Give every thread of this process nice 0 (threads it starts, and its child processes, inherit it). Ray starts
    its worker processes - every actor - at nice 15 (its `worker_niceness`), so that on a busy node an engine's steps
    and the front end's token stream yield to any ordinary process, the benchmark client and vLLM's own server
    included. Raising a priority needs CAP_SYS_NICE (root); without it this logs and leaves the nice value as it is.
    PD_RAY_NICENESS=1 keeps Ray's niceness. Returns whether every thread is at nice 0."""
    import logging

    if os.environ.get("PD_RAY_NICENESS") == "1":  # an operator who wants the engines to yield, as Ray's workers do
        return False
    ok = True
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) > 0:
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            ok = False
    if not ok:
        logging.getLogger("pd.engine").warning(
            "%s: could not raise this process's priority to nice 0 (no CAP_SYS_NICE); it runs at Ray's worker niceness "
            "(RAY_worker_niceness, 15 by default)", who)
    return ok
