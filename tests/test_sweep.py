"""What a dead engine leaves is swept (`actors.engine.procs.sweep_dead_engines`), whenever it died - loading included,
when nobody could ask it what it held. Real processes play an engine actor (it makes its private TMPDIR, its owner
file naming it, and maps a shared-memory segment of vLLM's kind) and a vLLM process under it (its TMPDIR inherited):
while the actor lives nothing of it is touched; once it is SIGKILLed its process is killed, its TMPDIR and segment
removed - and a segment some live process maps stays, as does one too young to judge."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

import actors.engine.procs as procs

REPO = Path(__file__).resolve().parents[1]
OURS = ("psm_hpdtest_",)  # the segments these tests make: the sweeps here touch no other file of the machine

ENGINE = """
import mmap, os, subprocess, sys, time
sys.path.insert(0, {repo!r})
from actors.engine.procs import private_tmpdir
tmpdir = private_tmpdir()
fd = os.open({shm!r}, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
segment = mmap.mmap(fd, 4096)
os.close(fd)
core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # inherits TMPDIR
print(tmpdir, core.pid, flush=True)
time.sleep(300)
"""

HOLDER = """
import mmap, os, time
fd = os.open({shm!r}, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
segment = mmap.mmap(fd, 4096)
os.close(fd)
print("ok", flush=True)
time.sleep(300)
"""


MAPPER = """
import mmap, os, time
time.sleep(0.3)
fd = os.open({shm!r}, os.O_RDWR)
segment = mmap.mmap(fd, 4096)
os.close(fd)
print("ok", flush=True)
time.sleep(300)
"""


def _start(code: str) -> tuple[subprocess.Popen, list[str]]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().split()


def test_a_dead_engines_files_go_and_a_live_ones_stay(tmp_path, monkeypatch):
    monkeypatch.setattr(procs, "SWEEP_MIN_AGE_S", 0.5)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the engines' TMPDIRs are made here (and swept from here)
    tag = uuid.uuid4().hex[:8]
    seg, held = (f"/dev/shm/psm_hpdtest_{tag}_{kind}" for kind in ("engine", "held"))
    engine, (tmpdir, core_pid) = _start(ENGINE.format(repo=str(REPO), shm=seg))
    holder, _ = _start(HOLDER.format(shm=held))
    core = psutil.Process(int(core_pid))
    try:
        assert os.path.dirname(tmpdir) == str(tmp_path) and os.path.isdir(tmpdir)
        time.sleep(0.6)
        removed = procs.sweep_dead_engines(str(tmp_path), wait_s=1, shm_prefixes=OURS)
        assert not {tmpdir, seg, held} & set(removed)  # a live engine, a held segment: untouched
        assert os.path.isdir(tmpdir) and os.path.exists(seg) and core.is_running()

        engine.kill()  # the actor dies; its process lives on, holding the engine's TMPDIR in its environment
        engine.wait()
        time.sleep(0.6)
        t0 = time.monotonic()
        removed = procs.sweep_dead_engines(str(tmp_path), wait_s=1, shm_prefixes=OURS)
        took = time.monotonic() - t0
        assert tmpdir in removed and seg in removed, removed
        assert not os.path.exists(tmpdir) and not os.path.exists(seg)
        assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE  # killed after its wait
        assert os.path.exists(held) and held not in removed  # another process maps it
        assert took < 15, took
    finally:
        for p in (engine, holder):
            p.kill()
            p.wait()
        try:
            core.kill()
        except psutil.NoSuchProcess:
            pass
        for path in (seg, held):
            if os.path.exists(path):
                os.unlink(path)


def test_an_engine_reported_dead_while_its_processes_linger_is_swept_once_they_end(tmp_path, monkeypatch):
    """Ray confirms a SIGKILLed actor's death while its process may still be tearing down, and the engine's vLLM
    processes exit a moment later, still mapping its segments: a sweep at that moment finds a live owner and held
    files. The coordinator's sweep names the dead engine's processes (`Leftovers.procs`): they get their wait, are
    killed if still there, and only then is the node swept - here the actor is still running when the sweep starts,
    as on a slow machine."""
    monkeypatch.setattr(procs, "SWEEP_MIN_AGE_S", 0.5)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    seg = f"/dev/shm/psm_hpdtest_{uuid.uuid4().hex[:8]}_lingering"
    engine, (tmpdir, core_pid) = _start(ENGINE.format(repo=str(REPO), shm=seg))
    actor, core = psutil.Process(engine.pid), psutil.Process(int(core_pid))
    try:
        time.sleep(0.6)
        assert procs.sweep_dead_engines(str(tmp_path), wait_s=1, shm_prefixes=OURS) == []  # the owner "lives"
        dying = ((actor.pid, actor.create_time()), (core.pid, core.create_time()))
        t0 = time.monotonic()
        removed = procs.sweep_after(dying, wait_s=1, base=str(tmp_path), shm_prefixes=OURS)
        took = time.monotonic() - t0
        assert tmpdir in removed and seg in removed, removed
        assert not os.path.exists(tmpdir) and not os.path.exists(seg)
        assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in (actor, core))  # killed
        assert took < 15, took
        assert procs.sweep_after(dying, wait_s=1, base=str(tmp_path), shm_prefixes=OURS) == []  # gone: nothing twice
    finally:
        for p in (actor, core):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        engine.wait()
        if os.path.exists(seg):
            os.unlink(seg)


def test_a_later_process_on_a_dead_engines_pid_is_not_touched():
    """`Leftovers.procs` names processes by (pid, create time): a process that took a dead one's pid is another."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = psutil.Process(sleeper.pid)
        assert procs.still_running([(me.pid, me.create_time() - 5.0)]) == []
        assert [p.pid for p in procs.still_running([(me.pid, me.create_time())])] == [me.pid]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_young_unheld_segment_is_judged_once_it_is_old_enough(tmp_path, monkeypatch):
    """Files are judged only once they have not changed for SWEEP_MIN_AGE_S: one just made may be between its creation
    and its mapping (here a process maps it meanwhile: it stays), and a dead engine's message queue may have been
    written for the last time a moment ago (nobody maps it: the same sweep removes it, once it is that old)."""
    monkeypatch.setattr(procs, "SWEEP_MIN_AGE_S", 2.5)
    tag = uuid.uuid4().hex[:8]
    made, orphan = (f"/dev/shm/psm_hpdtest_{tag}_{kind}" for kind in ("made", "orphan"))
    Path(orphan).write_bytes(b"x" * 4096)
    Path(made).write_bytes(b"x" * 4096)
    mapper = None
    try:
        # maps the file as it is (no truncate, no write: its ctime stays), a moment after the sweep has listed it
        mapper = subprocess.Popen([sys.executable, "-c", MAPPER.format(shm=made)], stdout=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        removed = procs.sweep_dead_engines(str(tmp_path), wait_s=0, shm_prefixes=OURS)
        took = time.monotonic() - t0
        assert mapper.stdout.readline().strip() == "ok"
        assert orphan in removed and not os.path.exists(orphan), removed
        assert made not in removed and os.path.exists(made)  # mapped while the sweep waited for it to age
        assert 1.5 <= took < 6, took
    finally:
        if mapper is not None:
            mapper.kill()
            mapper.wait()
        for path in (made, orphan):
            if os.path.exists(path):
                os.unlink(path)


def test_an_actor_killed_a_moment_ago_is_waited_for(tmp_path, monkeypatch):
    """`ray.kill` returns, and Ray reports an actor dead, while its process may still be ending: its TMPDIR would look
    owned and its segments held. A sweep told the actor is dead (its Ray id, which the owner file names) waits for the
    process (killed after `wait_s`), then removes what it left; untold, it leaves a live owner's files alone."""
    monkeypatch.setattr(procs, "SWEEP_MIN_AGE_S", 0.5)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    seg = f"/dev/shm/psm_hpdtest_{uuid.uuid4().hex[:8]}_ending"
    engine, (tmpdir, core_pid) = _start(ENGINE.format(repo=str(REPO), shm=seg))
    core = psutil.Process(int(core_pid))
    actor_id = uuid.uuid4().hex
    try:
        owner = Path(tmpdir, procs.OWNER_FILE)
        pid, ticks, _ = owner.read_text().split()
        owner.write_text(f"{pid} {ticks} {actor_id}\n")
        time.sleep(0.6)
        assert procs.sweep_dead_engines(str(tmp_path), wait_s=1, shm_prefixes=OURS, dead_actors=("other",)) == []
        removed = procs.sweep_dead_engines(str(tmp_path), wait_s=1, shm_prefixes=OURS, dead_actors=(actor_id,))
        assert tmpdir in removed and seg in removed, removed
        assert engine.wait(timeout=10) is not None
        assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE
    finally:
        engine.kill()
        engine.wait()
        try:
            core.kill()
        except psutil.NoSuchProcess:
            pass
        if os.path.exists(seg):
            os.unlink(seg)


@pytest.mark.parametrize("name", ["other_prefix_hpdtest", "psm_hpdtest_dir"])
def test_only_vllms_kinds_of_files_are_swept(tmp_path, monkeypatch, name):
    monkeypatch.setattr(procs, "SWEEP_MIN_AGE_S", 0.0)
    path = f"/dev/shm/{name}_{uuid.uuid4().hex[:8]}"
    if name.endswith("dir"):
        os.mkdir(path)  # a directory of that name is no segment
    else:
        Path(path).write_bytes(b"x")
    try:
        swept = procs.sweep_dead_engines(str(tmp_path), wait_s=0, shm_prefixes=("other_prefix_hpdtest", *OURS))
        assert path not in swept and os.path.exists(path)
    finally:
        (os.rmdir if os.path.isdir(path) else os.unlink)(path)
