"""An engine actor's processes and what they leave on the node: vLLM's EngineCore and workers under the actor, their
shared-memory files (/dev/shm) and the engine's private TMPDIR. `EngineProcesses` is the `EngineActor`'s component
for them (its pids and memory, a graceful shutdown that removes everything, and the `leftovers` a killed engine would
leave); it owns the shared-memory files seen and the TMPDIR. `LiveEngine` holds the actor's vLLM engine itself, the
one accessor every component reads it through. `clean_leftovers` removes a dead engine's files on its node once its
processes are gone."""

from __future__ import annotations

import asyncio
import getpass
import logging
import os
import shutil
import tempfile
import time
from typing import Any

import psutil
import ray

from actors.engine_client import Leftovers

# /dev/shm files an engine's processes create and leak when a worker is killed (SIGTERMed NIXL workers):
# CPU all-reduce segments, message-queue segments, multiprocessing semaphores
SHM_PREFIXES = ("vllm_dist_", "psm_", "sem.mp-")
TMPDIR_PREFIX = "hpd-engine-"  # each engine's private TMPDIR (vLLM's vllm_dist_* file stores land there)
log = logging.getLogger("pd.engine")


def private_tmpdir() -> str:
    """Give this process (an engine actor) a private TMPDIR, which vLLM's processes inherit (file stores, IPC
    sockets) and `shutdown` removes. It has to be the actor's own environment, set before vLLM starts its processes:
    the directory is made on the engine's node, so the launcher cannot name it in the runtime_env. torch.compile's
    cache stays in the shared default place.

    Inductor's precompiled headers do not follow TORCHINDUCTOR_CACHE_DIR: torch 2.13 keeps them under
    `tempfile.gettempdir()`, here the private directory, so every engine whose processes compile a kernel (vLLM
    compiles a few small ops even in eager mode, e.g. the TP > 1 vocabulary mask) built a 150 MB header of
    its own with g++ -O3 (~12 s of a core each time) before it could use the kernel already in the shared cache. Off
    (`TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0`, unless set): cached kernels load with no compiler run, and a
    kernel compiled for the first time on a machine compiles without the header."""
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    )
    os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")
    tmpdir = tempfile.mkdtemp(prefix=TMPDIR_PREFIX)
    os.environ["TMPDIR"] = tmpdir
    tempfile.tempdir = None  # make tempfile re-read TMPDIR
    return tmpdir


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

    async def shutdown(self, timeout_s: float = 30.0) -> list[str]:
        """Shut the engine down, wait for its processes, and remove the shared-memory files they left behind.
        Returns the removed paths. The caller should `ray.kill` the actor afterwards."""
        children = _process_tree(self._me)[1:]
        shm = self._shm | _shm_paths(_process_tree(self._me))
        engine = self._live.take()
        if engine is not None:
            await asyncio.to_thread(engine.shutdown, timeout_s)
        # multiprocessing's resource tracker lives as long as the actor; it goes with ray.kill
        engine_procs = [p for p in children if not _is_resource_tracker(p)]
        _, alive = await asyncio.to_thread(psutil.wait_procs, engine_procs, timeout_s)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        shm_removed, tmp_files = _remove_leftovers(shm, self.tmpdir)
        return shm_removed + tmp_files


LEFTOVER_WAIT_S = 60.0  # how long a dead engine's vLLM processes get to exit before its files are left alone


@ray.remote(num_cpus=0)
def clean_leftovers(leftovers: Leftovers) -> list[str]:
    """On a dead engine's node (run it there): once none of its processes runs any more (vLLM's exit by themselves
    when the engine actor is gone; up to LEFTOVER_WAIT_S), remove the shared-memory files and the TMPDIR they left -
    4 MiB of resident /dev/shm per CPU all-reduce segment, otherwise until reboot. Returns the removed paths; removes
    nothing while any of the processes still runs."""

    def running() -> bool:
        for pid, started in leftovers.procs:
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - started) < 1e-3 and _running(p):
                    return True
            except psutil.NoSuchProcess:
                continue
        return False

    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while running():
        if time.monotonic() > deadline:
            log.warning("a dead engine's processes still run after %.0f s: its files stay", LEFTOVER_WAIT_S)
            return []
        time.sleep(0.5)
    tmpdir = leftovers.tmpdir
    had_tmpdir = os.path.isdir(tmpdir)
    removed, _ = _remove_leftovers(leftovers.shm, tmpdir)
    return removed + ([tmpdir] if had_tmpdir and not os.path.exists(tmpdir) else [])


def _remove_leftovers(shm: Any, tmpdir: str) -> tuple[list[str], list[str]]:
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
    if os.path.basename(tmpdir).startswith(TMPDIR_PREFIX):
        for root, _, files in os.walk(tmpdir):
            tmp_files += [os.path.join(root, f) for f in files]
        shutil.rmtree(tmpdir, ignore_errors=True)
    return removed, tmp_files
