"""Core lending without engines (actors.host.core_lending): a lender's busy bytes follow its requests in flight; a
borrower takes the leading run of the node's other cores whose engines hold their lock and are idle, and gives them
back the step after; and, in a real process with PyTorch's libgomp placed as an engine's (`borrow_env`), the OpenMP
thread on a lent core does the work while it is lent and none once its engine is busy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import actors.host.core_lending as cl
from actors.host.core_lending import BORROW_ENV, CoreBorrower, CoreLender, borrow_env, busy_path
from actors.host.cores import lease_cores
from cluster.core.config import DeployConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def node(tmp_path, monkeypatch):
    monkeypatch.setenv("PD_CORE_LOCK_DIR", str(tmp_path))
    return str(tmp_path / "node-a")


def _byte(where: str, core: int) -> bytes:
    with open(busy_path(where, core), "rb") as f:
        return f.read(1)


def test_a_lender_is_busy_until_ready_and_then_follows_its_requests(node):
    lease = lease_cores(2, "decode-0", "node-a", cores=(2, 3))
    lender = CoreLender(node, lease.cores)
    try:
        assert _byte(node, 2) == _byte(node, 3) == b"1"  # starting: nothing to lend yet
        lender.set_in_flight(0)
        assert _byte(node, 2) == b"1"  # not before it is ready
        lender.ready(0)
        assert _byte(node, 2) == _byte(node, 3) == b"0"
        lender.set_in_flight(3)
        assert _byte(node, 3) == b"1"
        lender.set_in_flight(0)
        assert _byte(node, 3) == b"0"
    finally:
        lender.close()
        lease.release()
    assert _byte(node, 2) == b"1"  # stopping


def test_a_borrower_takes_the_leading_idle_held_cores_and_gives_them_back(node, monkeypatch):
    monkeypatch.setattr(cl, "HELD_REFRESH_S", 0.0)  # re-read the locks every step
    monkeypatch.setattr(cl, "HANDOFF_S", 30.0)  # a pause no slow machine outlasts between two calls
    sizes: list[int] = []
    b = CoreBorrower(node, (0,), (1, 2), set_threads=sizes.append, threads=1)
    assert b.before_step() == 1  # nobody holds 1 or 2: nothing to borrow
    d1 = lease_cores(1, "decode-1", "node-a", cores=(1,))
    d2 = lease_cores(1, "decode-2", "node-a", cores=(2,))
    l1, l2 = CoreLender(node, (1,)), CoreLender(node, (2,))
    try:
        assert b.before_step() == 1  # held but starting
        l2.ready(0)
        assert b.before_step() == 1  # 2 is idle, but 1 before it is not: the OpenMP team is a prefix
        l1.ready(0)
        assert b.before_step() == 3
        l2.set_in_flight(1)
        assert b.before_step() == 2
        l1.set_in_flight(2)
        assert b.before_step() == 1
        l1.set_in_flight(0)
        l2.set_in_flight(0)
        assert b.before_step() == 3
        assert b.before_step(handing_off=True) == 1  # prompts just finished: their decodes are about to start
        assert b.before_step() == 1
        assert b.before_step(computes=False) == 1  # a step without the model: neither sized nor counted
        b._handoff_at -= cl.HANDOFF_S
        assert b.before_step() == 3
        d1.release()  # its engine died (the kernel drops the lock); its byte still says idle
        assert b.before_step() == 1
    finally:
        l1.close(), l2.close()
        d1.release(), d2.release()
    assert sizes == [3, 2, 1, 3, 1, 3, 1]  # the team is resized only when it changes
    assert b.stats() == {"own": [0], "others": [1, 2], "steps": 11, "borrowed_steps": 4, "borrowed_cores": 7,
                         "threads": 1, "failed": None}


def test_the_step_hook_reads_the_hand_off_and_fails_open(node, monkeypatch):
    """`actors.engine.connector.size_team_for_step`, vLLM's scheduler step's hook: the prompts the metadata hands to
    decode engines pause borrowing; steps without scheduled tokens leave the team; an error turns borrowing off, the
    team back at the engine's own cores, and the step goes on."""
    from types import SimpleNamespace

    from actors.engine.connector import size_team_for_step

    sizes: list[int] = []
    b = CoreBorrower(node, (0,), (1,), set_threads=sizes.append, threads=1)
    monkeypatch.setattr(cl, "_BORROWER", b)
    monkeypatch.setattr(cl, "_LOADED", True)
    monkeypatch.setattr(cl, "HELD_REFRESH_S", 0.0)
    d1 = lease_cores(1, "decode-1", "node-a", cores=(1,))
    l1 = CoreLender(node, (1,))
    l1.ready(0)
    step = SimpleNamespace(total_num_scheduled_tokens=512)
    try:
        size_team_for_step(SimpleNamespace(reqs_to_send={}), step)
        assert b.threads == 2
        size_team_for_step(SimpleNamespace(reqs_to_send={"r1": 0.0}), SimpleNamespace(total_num_scheduled_tokens=0))
        assert b.threads == 2 and b.steps == 1  # an empty step: the team as it was
        size_team_for_step(SimpleNamespace(reqs_to_send={}), step)
        assert b.threads == 1  # r1's decode is about to start there
        b._handoff_at -= cl.HANDOFF_S
        size_team_for_step(SimpleNamespace(reqs_to_send={}), step)
        assert b.threads == 2

        calls = []

        def once_broken(n: int) -> None:  # the resize fails, the reset to the engine's own cores works
            calls.append(n)
            if len(calls) == 1:
                raise OSError("no more threads")

        b.set_threads = once_broken
        l1.set_in_flight(1)
        size_team_for_step(SimpleNamespace(reqs_to_send={}), step)  # does not raise
        assert b.failed == "OSError: no more threads" and b.stats()["failed"] == b.failed
        assert calls == [1, 1] and b.threads == 1
        l1.set_in_flight(0)
        size_team_for_step(SimpleNamespace(reqs_to_send={}), step)
        assert b.steps == 3 and b.threads == 1 and calls == [1, 1]  # off for good: idle lender, no borrowing
    finally:
        l1.close()
        d1.release()


def test_borrow_env_places_own_cores_first_then_the_others():
    env = borrow_env("/x/node", (3,), (0, 1, 2))
    assert env["OMP_NUM_THREADS"] == "1" and env["GOMP_CPU_AFFINITY"] == "3 0 1 2"
    assert json.loads(env[BORROW_ENV]) == {"dir": "/x/node", "own": [3], "others": [0, 1, 2]}


def test_borrowing_is_the_prefill_pools_default_where_it_can_be():
    base = {"model": {"builtin": "gdn"}}
    cfg = DeployConfig.model_validate(base)
    assert cfg.prefill.borrows_cores("prefill") and not cfg.decode.borrows_cores("decode")
    cfg = DeployConfig.model_validate(base | {"prefill": {"share_cores": True}})
    assert not cfg.prefill.borrows_cores("prefill")
    cfg = DeployConfig.model_validate(base | {"prefill": {"tp": 2}})
    assert not cfg.prefill.borrows_cores("prefill")
    cfg = DeployConfig.model_validate(base | {"prefill": {"borrow_idle_cores": False}})
    assert not cfg.prefill.borrows_cores("prefill")
    with pytest.raises(Exception, match="borrow_idle_cores: true needs tp: 1"):
        DeployConfig.model_validate(base | {"prefill": {"tp": 2, "borrow_idle_cores": True}})
    with pytest.raises(Exception, match="borrow_idle_cores: true needs cores of the pool's own"):
        DeployConfig.model_validate(base | {"decode": {"share_cores": True, "borrow_idle_cores": True}})


CHILD = r"""
import json, os, sys, time
from actors.host.core_lending import CoreLender, borrower
import torch

where = sys.argv[1]
b = borrower()
x, w = torch.randn(512, 1024), torch.randn(1024, 1024)

def lent_threads():
    # this process's threads pinned to the lent core alone, and the CPU seconds each has used
    out = {}
    for t in os.listdir("/proc/self/task"):
        if os.sched_getaffinity(int(t)) == {1}:
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[t] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out

def work():
    for _ in range(200):
        x @ w

lender = CoreLender(where, (1,))  # the lease on core 1 is the parent's
lender.ready(0)
lent = b.before_step()
before = lent_threads()
work()
during = lent_threads()
lender.set_in_flight(1)
kept = b.before_step()
time.sleep(0.2)  # past libgomp's spin after the last parallel region
start = lent_threads()
work()
end = lent_threads()
print(json.dumps({"lent": lent, "kept": kept, "before": before, "during": during, "start": start, "end": end}))
"""


def test_the_thread_on_a_lent_core_works_only_while_it_is_lent(node):
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs cores 0 and 1")
    import torch

    lease = lease_cores(1, "decode-0", "node-a", cores=(1,))
    env = dict(os.environ, **borrow_env(node, (0,), (1,)), PYTHONPATH=str(ROOT),
               LD_PRELOAD=str(Path(torch.__file__).parent / "lib" / "libgomp.so.1"))
    try:
        out = subprocess.run(["taskset", "-c", "0,1", sys.executable, "-c", CHILD, node], env=env,
                             capture_output=True, text=True, timeout=120, check=True)
    finally:
        lease.release()
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["lent"] == 2 and got["kept"] == 1, got
    assert got["before"] == {}, got  # no OpenMP thread on core 1 before the first lent step
    assert len(got["during"]) == 1, got  # libgomp started team thread 1 on the lent core...
    (tid, cpu), = got["during"].items()
    assert cpu > 0.05, got  # ...and it took its share of the work
    assert got["start"].keys() == got["end"].keys() == {tid}, got
    assert got["end"][tid] - got["start"][tid] < 0.02, got  # lender busy: the thread stays parked on its core
