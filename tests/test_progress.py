"""Stuck or busy (`cluster.core.progress.StallRule`, `actors.engine.progress`): an engine whose EngineCore has not
answered past its threshold is stuck when a process of it is stopped or its processes idle, busy (waited for, up to
its limit) while they burn CPU or wait on a held compile lock. The rule is replayed over readings recorded from a live
engine (tests/data/progress-readings.json: a compile, a SIGSTOP, a long prefill, idle spells), and `ProcessTree`'s
readings are checked on real processes: one spinning, one stopped, one asleep, and a compile lock held by another."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from actors.engine.progress import ProcessTree, ProgressWatch
from cluster.core.progress import Reading, StallRule, cpu_used, default_busy_limit_s

DATA = Path(__file__).parent / "data" / "progress-readings.json"
RULE = StallRule(margin_s=10.0, window_s=5.0, idle_cores=0.05, busy_limit_s=600.0)


def recorded() -> list[tuple[str, Reading]]:
    out = []
    for r in json.loads(DATA.read_text())["readings"]:
        cpu = {(pid, started): s for pid, started, s in r["cpu_s"]}
        out.append((r["label"], Reading(r["t"], cpu, tuple(r["stopped"]), r["compile_lock"])))
    return out


def judged(label: str, waited_s: float = 12.0, slowest_s: float = 0.5) -> list[str]:
    """The rule's state at each recorded reading labelled `label`, as if a question had waited `waited_s` there
    (the readings up to that one as its history)."""
    readings = recorded()
    states = []
    for i, (lab, _) in enumerate(readings):
        if lab == label:
            states.append(RULE.judge(waited_s, slowest_s, [r for _, r in readings[: i + 1]]).state)
    assert states, f"no reading labelled {label!r}"
    return states


def test_a_compiling_engine_is_busy_and_a_stopped_or_idle_one_stuck():
    """Over the recording: while it compiled (inductor's workers burning CPU, a compile lock held), loaded vLLM or
    prefilled 4,000 tokens, an unanswered engine is busy; while its processes were stopped it is stuck at once; once
    idle for the window (a deadlocked engine looks so), stuck."""
    assert set(judged("warming up (logprobs)")) == {"busy"}
    assert set(judged("loading vLLM")[1:]) == {"busy"}  # the first has no CPU history yet
    assert judged("long prefill") == ["busy"]
    assert set(judged("stopped")) == {"stuck"}
    idle = judged("idle")
    assert idle[-1] == "stuck" and idle[0] == "busy"  # the window still held the long prompt's steps
    why = RULE.judge(12.0, 0.5, [r for _, r in recorded()[: [lab for lab, _ in recorded()].index("stopped") + 1]]).why
    assert why.startswith("stuck: its EngineCore has not answered between steps for 12.0 s") and "stopped" in why


def test_the_clock_still_decides_before_the_threshold_and_past_the_limit():
    readings = [r for lab, r in recorded() if lab == "warming up (logprobs)"]
    assert RULE.judge(None, 0.5, readings).state == "stepping"  # nothing outstanding
    assert RULE.judge(10.9, 0.5, readings).state == "stepping"  # within 2 x 0.5 + 10 s
    assert RULE.judge(11.1, 0.5, readings).state == "busy"
    past = RULE.judge(601.0, 0.5, readings)
    assert past.state == "stuck" and "busy past its limit of 600 s" in past.why
    assert RULE.judge(12.0, 0.5, []).state == "stuck"  # unreadable processes: the clock alone, as before


def test_cpu_is_counted_per_process_and_a_new_process_counts_whole():
    a = Reading(0.0, {(1, 0.0): 5.0, (2, 0.0): 1.0})
    b = Reading(5.0, {(1, 0.0): 5.5, (3, 9.0): 2.0})  # 2 ended, 3 started (a compile worker)
    assert cpu_used(a, b) == pytest.approx(2.5)
    reused = Reading(5.0, {(1, 7.0): 0.1})  # pid 1 again, another process: counted from nothing
    assert cpu_used(a, reused) == pytest.approx(0.1)


def test_one_stopped_rank_makes_the_engine_stuck_while_the_others_spin():
    """A TP engine with one worker stopped and the others spinning in a collective waiting for it burns CPU, but
    will never step: stuck."""
    readings = [Reading(float(t), {(1, 0.0): 1.0 * t, (2, 0.0): 0.5}, stopped=(2,)) for t in range(8)]
    judgement = RULE.judge(12.0, 0.5, readings)
    assert judgement.state == "stuck" and "process 2 stopped" in judgement.why


def test_waiting_for_a_compile_lock_is_busy():
    idle = [Reading(float(t), {(1, 0.0): 3.0}) for t in range(8)]
    locked = idle[:-1] + [Reading(7.0, {(1, 0.0): 3.0}, compile_lock=True)]
    assert RULE.judge(12.0, 0.5, idle).state == "stuck"
    busy = RULE.judge(12.0, 0.5, locked)
    assert busy.state == "busy" and "waiting for a compile" in busy.why


def test_busy_limits_by_device():
    assert default_busy_limit_s("cpu") > default_busy_limit_s("cuda") > 0


# ---- ProcessTree on real processes --------------------------------------------------------------------------------
def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def _rate(tree: ProcessTree, pid: int, s: float = 1.0) -> tuple[float, Reading]:
    a = tree.read()
    time.sleep(s)
    b = tree.read()
    used = sum(v - a.cpu_s.get(k, 0.0) for k, v in b.cpu_s.items() if k[0] == pid)
    return used / (b.t - a.t), b


def test_process_tree_reads_cpu_and_stops():
    spin = _child("while True: pass")
    sleep = _child("import time; time.sleep(60)")
    try:
        time.sleep(0.5)
        tree = ProcessTree(psutil.Process(), lock_dirs=[])
        busy, _ = _rate(tree, spin.pid)
        idle, _ = _rate(tree, sleep.pid)
        assert busy > 0.5 and idle < 0.05, (busy, idle)
        os.kill(spin.pid, signal.SIGSTOP)
        time.sleep(0.2)
        stopped, reading = _rate(tree, spin.pid, 0.5)
        assert spin.pid in reading.stopped and sleep.pid not in reading.stopped and stopped < 0.05
        os.kill(spin.pid, signal.SIGCONT)
        assert spin.pid not in tree.read().stopped
    finally:
        for p in (spin, sleep):
            p.kill()
            p.wait()


def test_process_tree_sees_a_compile_lock_held_by_another_process(tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "abc.lock").write_text("")
    tree = ProcessTree(psutil.Process(), lock_dirs=[str(locks)])
    assert tree.read().compile_lock is False
    holder = _child(f"import fcntl, time; f = open({str(locks / 'abc.lock')!r}); "
                    "fcntl.flock(f, fcntl.LOCK_EX); time.sleep(60)")
    try:
        deadline = time.monotonic() + 10
        while not tree.read().compile_lock and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tree.read().compile_lock is True
    finally:
        holder.kill()
        holder.wait()
    assert tree.read().compile_lock is False
    with open(locks / "abc.lock") as f:  # and one this process holds itself
        fcntl.flock(f, fcntl.LOCK_EX)
        assert tree.read().compile_lock is True


def test_the_watch_calls_a_silent_stopped_engine_stuck_and_a_spinning_one_busy():
    """`ProgressWatch` end to end over a stand-in EngineCore (a child process) whose answers never come: stuck once
    the threshold has passed if the child is stopped, busy while it spins."""
    import asyncio

    async def never() -> None:
        await asyncio.sleep(3600)

    async def run(code: str, stop: bool) -> tuple[str, str]:
        # the stand-in's parent plays the engine actor: the watch reads the tree under it, as under an actor
        parent = _child(f"import subprocess, sys; subprocess.run([sys.executable, '-c', {code!r}])")
        try:
            root = psutil.Process(parent.pid)
            deadline = time.monotonic() + 10
            while not root.children() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            (core,) = root.children()
            watch = ProgressWatch("e", never, StallRule(margin_s=1.0, window_s=1.0), ProcessTree(root, []))
            watch.start()
            if stop:
                os.kill(core.pid, signal.SIGSTOP)
            await asyncio.sleep(0.5)
            early = watch.judge().state
            await asyncio.sleep(2.0)
            judgement = watch.judge()
            watch.stop()
            return early, judgement.state
        finally:
            for p in psutil.Process(parent.pid).children(recursive=True):
                p.kill()
            parent.kill()
            parent.wait()

    assert asyncio.run(run("while True: pass", stop=True)) == ("stepping", "stuck")
    assert asyncio.run(run("while True: pass", stop=False)) == ("stepping", "busy")
    assert asyncio.run(run("import time; time.sleep(60)", stop=False)) == ("stepping", "stuck")
