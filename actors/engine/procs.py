"""An engine actor's processes and what they leave on the node: vLLM's EngineCore and workers under the actor, their
shared-memory files (/dev/shm) and the engine's private TMPDIR. `EngineProcesses` is the `EngineActor`'s component
for them (its pids and memory, a graceful shutdown that removes everything, and the `leftovers` a killed engine would
leave); it owns the shared-memory files seen and the TMPDIR. `LiveEngine` holds the actor's vLLM engine itself, the
one accessor every component reads it through. `sweep_dead_engines` removes on a node whatever dead engines left there
- an engine killed at any point of its life, loading included, when nobody could ask it what it holds - and
`sweep_nodes` runs it where engines were stopped."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import tempfile
import time
from typing import Any

import psutil
import ray

from actors.clients.engine_client import Leftovers

# /dev/shm files an engine's processes create and leak when a worker is killed (SIGTERMed NIXL workers):
# CPU all-reduce segments, message-queue segments, multiprocessing semaphores
SHM_PREFIXES = ("vllm_dist_", "psm_", "sem.mp-")
TMPDIR_PREFIX = "hpd-engine-"  # each engine's private TMPDIR (vLLM's vllm_dist_* file stores land there)
OWNER_FILE = ".owner"  # in an engine's TMPDIR: "pid start-ticks actor-id" of the actor that made it (`start_ticks`)
# a /dev/shm file or TMPDIR younger than this is never swept: it may be in the making (`sweep_dead_engines`)
SWEEP_MIN_AGE_S = 2.0
log = logging.getLogger("pd.engine")


def private_tmpdir() -> str:
    """Give this process (an engine actor) a private TMPDIR, which vLLM's processes inherit (file stores, IPC
    sockets) and `shutdown` removes; its owner file names the actor (pid and start: `sweep_dead_engines` tells
    a live engine's TMPDIR from a dead one's by it; and its Ray actor id, "-" outside an actor: a sweep told that
    actor is dead waits for its process to end). It has to be the actor's own environment, set before vLLM
    starts its processes: the directory is made on the engine's node, so the launcher cannot name it in the
    runtime_env. The compile caches live elsewhere, kept across engines and restarts
    (`actors.engine.settings.compile_cache_env`).

    Inductor's precompiled headers do not follow TORCHINDUCTOR_CACHE_DIR: torch 2.13 keeps them under
    `tempfile.gettempdir()`, here the private directory, so every engine whose processes compile a kernel (vLLM
    compiles a few small ops even in eager mode, e.g. the TP > 1 vocabulary mask) built a 150 MB header of
    its own with g++ -O3 (~12 s of a core each time) before it could use the kernel already in the shared cache. Off
    (`TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0`, unless set): cached kernels load with no compiler run, and a
    kernel compiled for the first time on a machine compiles without the header."""
    os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")
    tmpdir = tempfile.mkdtemp(prefix=TMPDIR_PREFIX)
    actor_id = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
    with open(os.path.join(tmpdir, OWNER_FILE), "w") as owner:
        owner.write(f"{os.getpid()} {start_ticks(os.getpid())} {actor_id or '-'}\n")
    os.environ["TMPDIR"] = tmpdir
    tempfile.tempdir = None  # make tempfile re-read TMPDIR
    return tmpdir


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/<pid>/stat): with the pid, it names
    one process for good - a wall-clock start time moves when the system clock is stepped. None: no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _process_tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _is_resource_tracker(p: psutil.Process) -> bool:
    try:
        return any("resource_tracker" in part for part in p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def shm_inodes(pids: Any) -> set[int]:
    """Inodes of the /dev/shm files the processes `pids` have mapped or open. By inode: glibc's sem_open creates a
    semaphore under a temporary name and links it to its own, so a process's maps show "/dev/shm/sem.XXXXXX
    (deleted)", never the "sem.mp-..." name that stays behind."""
    held: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        held.add(int(fields[4]))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                        held.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
                except OSError:  # closed meanwhile
                    pass
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return held


def engine_shm_files() -> dict[int, str]:
    """The /dev/shm files an engine's processes create (SHM_PREFIXES), by inode."""
    out: dict[int, str] = {}
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIXES)]
    except FileNotFoundError:
        return out
    for name in names:
        try:
            out[os.stat(f"/dev/shm/{name}").st_ino] = f"/dev/shm/{name}"
        except OSError:  # removed meanwhile
            pass
    return out


def _shm_paths(procs: list[psutil.Process]) -> set[str]:
    """Shared-memory files that `procs` have mapped or open and that an engine creates (SHM_PREFIXES), matched by
    inode (`shm_inodes`: matched by name, a semaphore was never found, and one stayed behind per engine)."""
    held = shm_inodes(p.pid for p in procs)
    return {path for ino, path in engine_shm_files().items() if ino in held}


class LiveEngine:
    """The actor's vLLM `AsyncLLM`: None until `EngineActor.start` builds it (`set`), and again once
    `EngineProcesses.shutdown` takes it (`take`). Every component reads it through this one accessor: call it for the
    engine or None, `required()` for the engine or a RuntimeError."""

    def __init__(self) -> None:
        self._engine: Any = None

    def __call__(self) -> Any:
        return self._engine

    def required(self) -> Any:
        if self._engine is None:
            raise RuntimeError("engine not started: call start() first")
        return self._engine

    def set(self, engine: Any) -> None:
        self._engine = engine

    def take(self) -> Any:
        """The engine, which is gone from here from now on (None if it never started or has been taken)."""
        engine, self._engine = self._engine, None
        return engine


class EngineProcesses:
    """`EngineActor`'s processes and files: the actor's own process, the shared-memory files its engine's processes
    have mapped, its private TMPDIR (made here, at construction: vLLM's processes inherit it); `live` is the engine,
    taken at shutdown."""

    def __init__(self, live: LiveEngine) -> None:
        self._live = live
        self._me = psutil.Process()
        self._shm: set[str] = set()  # shared-memory files the engine's processes have mapped (they may die first)
        self.tmpdir = private_tmpdir()

    def note_shm(self) -> None:
        """Remember the shared-memory files the engine's processes have mapped now (workers map theirs at start)."""
        self._shm |= _shm_paths(_process_tree(self._me))

    def leftovers(self) -> Leftovers:
        """What this engine's processes leave behind when they are killed (see `Leftovers`)."""
        tree = _process_tree(self._me)
        self._shm |= _shm_paths(tree)
        procs = []
        for p in tree:
            try:
                procs.append((p.pid, p.create_time()))
            except psutil.NoSuchProcess:
                pass
        return Leftovers(self.node_id(), tuple(sorted(self._shm)), self.tmpdir, tuple(procs))

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pids(self) -> list[int]:
        """The actor's pid followed by every process vLLM started under it (EngineCore, workers, helpers)."""
        return [p.pid for p in _process_tree(self._me)]

    def rss_bytes(self) -> int:
        """Resident memory of the actor plus all its descendants (shared pages counted per process)."""
        total = 0
        for p in _process_tree(self._me):
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    async def shutdown(self, timeout_s: float = 30.0, building: bool = False) -> list[str]:
        """Shut the engine down, wait for its processes, and remove the shared-memory files they left behind.
        Returns the removed paths. The caller should `ray.kill` the actor afterwards. `building`: vLLM's engine is
        being built meanwhile - it may still start a process after this: the TMPDIR stays (its processes carry it),
        for the sweep once the actor is gone (`sweep_dead_engines`)."""
        children = _process_tree(self._me)[1:]
        shm = self._shm | _shm_paths(_process_tree(self._me))
        engine = self._live.take()
        if engine is not None:
            await asyncio.to_thread(engine.shutdown, timeout_s)
        # multiprocessing's resource tracker lives as long as the actor; it goes with ray.kill
        engine_procs = [p for p in children if not _is_resource_tracker(p)]
        # an engine stopped while vLLM builds it has nobody to shut it down gracefully: its processes go at once
        # (what they made is swept once the actor is gone: `sweep_dead_engines`)
        _, alive = await asyncio.to_thread(psutil.wait_procs, engine_procs, timeout_s if engine is not None else 0)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        shm_removed, tmp_files = _remove_leftovers(shm, None if building else self.tmpdir)
        return shm_removed + tmp_files


LEFTOVER_WAIT_S = 10.0  # how long a dead engine's vLLM processes get to exit by themselves before they are killed


def end_processes(procs: list[psutil.Process], wait_s: float) -> list[psutil.Process]:
    """Give `procs` `wait_s` to exit by themselves, SIGKILL the rest and wait for them (10 s); those still running."""
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=10)
    return [p for p in alive if _running(p)]  # a killed process whose parent has not reaped it yet is gone


def _owner(tmpdir: str) -> tuple[int, int, str] | None:
    """(pid, start ticks, Ray actor id or "-") from engine TMPDIR `tmpdir`'s owner file; None: it has none.
    ValueError: unreadable."""
    try:
        with open(os.path.join(tmpdir, OWNER_FILE)) as f:
            fields = f.read().split()
    except FileNotFoundError:
        return None
    if len(fields) not in (2, 3):  # two: written before owner files named the actor
        raise ValueError(f"owner file of {tmpdir}: {fields}")
    return int(fields[0]), int(fields[1]), fields[2] if len(fields) == 3 else "-"


def _owner_process(tmpdir: str) -> psutil.Process | None:
    """The running process that made engine TMPDIR `tmpdir`: its owner file's pid, with the start it names (a pid
    reused since is another process); None when it is gone or the directory has no owner file."""
    try:
        owner = _owner(tmpdir)
    except (OSError, ValueError):
        return None
    if owner is None or start_ticks(owner[0]) != owner[1]:
        return None
    try:
        p = psutil.Process(owner[0])
    except psutil.NoSuchProcess:
        return None
    return p if _running(p) else None


def _owner_alive(tmpdir: str) -> bool | None:
    """Whether the actor that made engine TMPDIR `tmpdir` lives: the process its owner file names, with the start it
    names (a pid reused since is another process). None: the directory has no owner file. (Not an flock: vLLM may
    fork the engine's processes, and a forked child shares the actor's lock for as long as it lives.)"""
    try:
        if _owner(tmpdir) is None:
            return None
    except (OSError, ValueError):
        return True  # unreadable: leave it
    return _owner_process(tmpdir) is not None


def _end_dead_owners(base: str, dead_actors: Any, wait_s: float) -> None:
    """The processes of Ray actors `dead_actors` (ids) that made engine TMPDIRs in `base` and still run: given
    `wait_s` to end, then killed. Ray reports an actor dead (and `ray.kill` returns) while its process may still be
    tearing down: its TMPDIR would look owned, its engine's files held."""
    dead_actors = set(dead_actors)
    owners = []
    for path in _engine_tmpdirs(base):
        try:
            owner = _owner(path)
        except (OSError, ValueError):
            continue
        if owner is not None and owner[2] in dead_actors:
            p = _owner_process(path)
            if p is not None:
                owners.append(p)
    if owners:
        end_processes(owners, wait_s)


def _engine_tmpdirs(base: str) -> list[str]:
    """The paths in `base` named like engine TMPDIRs (TMPDIR_PREFIX); none when `base` cannot be read."""
    try:
        return [os.path.join(base, n) for n in os.listdir(base) if n.startswith(TMPDIR_PREFIX)]
    except OSError:
        return []


def _made(tmpdir: str, st: os.stat_result) -> float:
    """When an engine TMPDIR was made: its owner file's time (the directory's own changes with every file in it)."""
    try:
        return os.stat(os.path.join(tmpdir, OWNER_FILE)).st_ctime
    except OSError:
        return st.st_ctime


def _processes_in(tmpdirs: set[str]) -> dict[str, list[psutil.Process]]:
    """The live processes whose TMPDIR is one of `tmpdirs` (an engine's vLLM processes inherit its TMPDIR), by it."""
    out: dict[str, list[psutil.Process]] = {}
    for p in psutil.process_iter():
        try:
            tmpdir = p.environ().get("TMPDIR")
            if tmpdir in tmpdirs and _running(p):
                out.setdefault(tmpdir, []).append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return out


def sweep_dead_engines(base: str | None = None, wait_s: float = LEFTOVER_WAIT_S,
                       shm_prefixes: tuple[str, ...] = SHM_PREFIXES, dead_actors: Any = ()) -> list[str]:
    """On this node, remove what dead engines left, whatever point of its life each died at (loading, warming up,
    serving, shutting down):
    - each engine TMPDIR (TMPDIR_PREFIX, this user's, in `base`: the temporary directory) whose actor is gone (the
      process its owner file names): the engine's vLLM processes still running under it (they inherit its TMPDIR)
      are given `wait_s` to exit by themselves, then killed, and the directory removed;
    - vLLM's shared-memory files (SHM_PREFIXES: CPU all-reduce segments, message queues, multiprocessing
      semaphores) of this user that no process maps or holds open - they serve nobody; a live engine's are mapped by
      its processes from the moment they exist. Files are listed before their holders are looked for, and none
      younger than SWEEP_MIN_AGE_S is touched.
    Returns the paths removed. Safe beside live engines: their actors live and their processes hold their files.
    `shm_prefixes`: the shared-memory names considered (tests narrow them to their own). `dead_actors`: ids of engine
    actors Ray has reported dead or been told to kill - those whose process is still ending get `wait_s` first."""
    base = base or tempfile.gettempdir()
    if dead_actors:
        _end_dead_owners(base, dead_actors, wait_s)
    uid, now = os.getuid(), time.time()
    dead = []
    for path in _engine_tmpdirs(base):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid or not os.path.isdir(path) or now - _made(path, st) < SWEEP_MIN_AGE_S:
            continue
        if not _owner_alive(path):  # None (no owner file: not made by this code) is judged by its processes alone
            dead.append(path)
    removed: list[str] = []
    if dead:
        running = _processes_in(set(dead))
        for path in [p for p in dead if running.get(p) and _owner_alive(p) is None]:
            dead.remove(path)  # processes run under a TMPDIR without an owner: leave them be
            running.pop(path)
        end_processes([p for ps in running.values() for p in ps], wait_s)
        for path in dead:
            if any(_running(p) for p in running.get(path, [])):
                log.warning("a dead engine's processes under %s outlived SIGKILL: its files stay", path)
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed + _remove_unheld_shm(shm_prefixes)


def _remove_unheld_shm(prefixes: tuple[str, ...] = SHM_PREFIXES) -> list[str]:
    """vLLM's shared-memory files (SHM_PREFIXES) of this user that no process maps or holds open, and that have not
    changed for SWEEP_MIN_AGE_S: unlinked. Listed first, their holders looked for after, so a file made meanwhile is
    not considered. A file changed less than SWEEP_MIN_AGE_S ago (its ctime: made, or a page of it written for the
    first time - a message queue's does that up to its last step) and unheld is looked at again once it is that old:
    one in the making is mapped by then, one its dead engine wrote last is still unheld and unchanged."""
    files = _unheld_shm(prefixes)
    young = {inode: (path, ctime) for inode, (path, ctime) in files.items() if time.time() - ctime < SWEEP_MIN_AGE_S}
    removed = _unlink({inode: path for inode, (path, _) in files.items() if inode not in young})
    if young:
        # (a ctime in the future - the clock stepped back - waits no longer than a file just made)
        wait = SWEEP_MIN_AGE_S - (time.time() - max(ctime for _, ctime in young.values()))
        time.sleep(min(SWEEP_MIN_AGE_S, max(0.0, wait)))
        again = _unheld_shm(prefixes)
        removed += _unlink({inode: path for inode, (path, ctime) in young.items() if again.get(inode) == (path, ctime)})
    return removed


def _unheld_shm(prefixes: tuple[str, ...]) -> dict[int, tuple[str, float]]:
    """vLLM's shared-memory files (`prefixes`) of this user that no process maps or holds open: {inode: (path,
    ctime)}."""
    uid = os.getuid()
    files = {}
    for inode, path in engine_shm_files().items():
        if not os.path.basename(path).startswith(prefixes):
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            files[inode] = (path, st.st_ctime)
    if not files:
        return {}
    held = shm_inodes(psutil.pids())
    return {inode: f for inode, f in files.items() if inode not in held}


def _unlink(files: dict[int, str]) -> list[str]:
    removed = []
    for path in files.values():
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def still_running(procs: Any) -> list[psutil.Process]:
    """Of `procs` ((pid, create time) pairs, as `Leftovers.procs`), those still running and not zombies - the same
    processes, not later ones that took their pids (a create time within a second of the recorded one)."""
    out = []
    for pid, created in procs:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1 and _running(p):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def sweep_after(dying: Any, wait_s: float = LEFTOVER_WAIT_S, base: str | None = None,
                shm_prefixes: tuple[str, ...] = SHM_PREFIXES, dead_actors: Any = ()) -> list[str]:
    """`sweep_dead_engines` after an engine Ray reports dead: its processes `dying` ((pid, create time),
    `Leftovers.procs`, the actor's first) are given `wait_s` to exit, then killed, before the sweep. Ray confirms an
    actor's death while its process may still be tearing down, and the engine's vLLM processes exit a moment after
    it, still mapping its shared memory: a sweep then would find the owner alive and the files held, and leave them
    for good."""
    end_processes(still_running(dying), wait_s)
    return sweep_dead_engines(base, wait_s, shm_prefixes, dead_actors)


@ray.remote(num_cpus=0)
def sweep_node(wait_s: float = LEFTOVER_WAIT_S, dying: tuple[tuple[int, float], ...] = (),
               dead_actors: tuple[str, ...] = ()) -> list[str]:
    """`sweep_dead_engines` as a Ray task: run it on the node to sweep (NodeAffinitySchedulingStrategy); with
    `dying`, `sweep_after` those processes; `dead_actors`: engine actors' ids whose processes may still be ending."""
    return sweep_after(dying, wait_s, dead_actors=dead_actors)


def sweep_nodes(node_ids: list[str] | None = None, wait_s: float = LEFTOVER_WAIT_S,
                timeout_s: float = 2 * LEFTOVER_WAIT_S + 60, dead_actors: tuple[str, ...] = ()) -> list[str]:
    """`sweep_dead_engines` on each node of `node_ids` (every alive node when None), at once; the paths removed. A
    node that cannot be reached is skipped (reported in the log). `dead_actors`: ids of engine actors just killed or
    found dead (their processes may still be ending: `sweep_dead_engines`)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        if node_ids is None:
            node_ids = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        refs = [sweep_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                .remote(wait_s, dead_actors=tuple(dead_actors)) for node in dict.fromkeys(node_ids)]
    except Exception as e:  # noqa: BLE001 - Ray itself is going: nothing to sweep with
        log.warning("could not sweep for dead engines' files: %s", e)
        return []
    removed: list[str] = []
    for ref in refs:
        try:
            removed += ray.get(ref, timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - its node may be gone
            log.warning("could not sweep a node for dead engines' files: %s", e)
    return removed


def _remove_leftovers(shm: Any, tmpdir: str | None) -> tuple[list[str], list[str]]:
    """Unlink an engine's shared-memory files and remove its private TMPDIR - only paths an engine creates
    (SHM_PREFIXES under /dev/shm, a TMPDIR_PREFIX directory). Returns (the files unlinked, the files TMPDIR held)."""
    removed = []
    for path in sorted(shm):
        if os.path.dirname(path) == "/dev/shm" and os.path.basename(path).startswith(SHM_PREFIXES):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    tmp_files: list[str] = []
    if tmpdir is not None and os.path.basename(tmpdir).startswith(TMPDIR_PREFIX):
        for root, _, files in os.walk(tmpdir):
            tmp_files += [os.path.join(root, f) for f in files]
        shutil.rmtree(tmpdir, ignore_errors=True)
    return removed, tmp_files
