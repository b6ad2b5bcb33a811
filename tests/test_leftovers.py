"""Nothing is left behind: a pair removed while a read from its prefill engine is in flight lets go of that engine's
NIXL agents once the read has ended (they stayed loaded for the life of the decode engine before), and an engine
stopped or killed at any phase of its start - vLLM loading, warming up, started but not registered - leaves nothing
either, though what it made was made after anyone could ask it. (A cluster stopped the moment after an engine was
SIGKILLed under load is test_faults.py's last test, on its cluster.)"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time

import psutil
import pytest
import ray

from actors.engine.actor import launch_engine_actor, stop_engine_actors
from actors.engine.procs import OWNER_FILE
from cluster.cli.bench.faults import kill_engine
from cluster.cli.bench.soak_accounting import shm_files
from tests.pd_helpers import PDCluster, decode_stream, wait_for


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.mark.engine
def test_a_pair_removed_with_a_read_in_flight_lets_go_of_its_nixl_agents(ray_local, gdn_model):
    """The prefill engine's vLLM processes are stopped (SIGSTOP) after its prefill, so that the decode engine's NIXL
    read of that request cannot complete (UCX needs the target's progress thread to connect); the pair is removed
    meanwhile. The agents must stay loaded while the read runs - it completes after SIGCONT with the right tokens,
    which also shows it was posted before the removal (a read started after it finds no plan and fails) - and be gone
    from NIXL once it has ended."""
    pd = PDCluster(gdn_model, [("prefill", 1), ("decode", 1)], "leftovers")
    prefill, decode = pd.engines[("prefill", 1)], pd.engines[("decode", 1)]
    p_id = pd.engine_id("prefill", 1)
    stopped: list[int] = []
    try:
        prompt = [1] + [(7 * j) % 900 + 3 for j in range(300)]
        want = asyncio.run(decode_stream(decode, prompt, None))  # colocated reference (and a warm decode engine)
        params = ray.get(prefill.prefill(prompt, "held-read")).kv_transfer_params
        names = sorted(ray.get(decode.remote_agents(p_id))[0])
        assert names  # loaded by the pair's first transfer, before the pair was listed (actors.control.coordinator)
        stopped = ray.get(prefill.pids())[1:]  # its vLLM processes (the actor answers; NIXL's threads do not)
        _signal(stopped, signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            read = pool.submit(lambda: asyncio.run(decode_stream(decode, prompt, params)))
            wait_for(lambda: ray.get(decode.num_unfinished()) > 0, 60)  # the request is in the decode engine ...
            time.sleep(1.0)  # ... and its read posted (it waits for the stopped side: it completes only if posted)
            assert not read.done()
            ray.get(decode.remove_pair(p_id))
            assert ray.get(decode.remote_agents(p_id)) == [{}]
            # the read in flight still uses them: removed now, it would fail or fault
            assert ray.get(decode.nixl_knows(names)) == [[True] * len(names)]
            _signal(stopped, signal.SIGCONT)
            stopped = []
            assert read.result(timeout=120) == want
        took = wait_for(lambda: ray.get(decode.nixl_knows(names)) == [[False] * len(names)], 30)
        print(f"{len(names)} NIXL agents of {p_id} removed {took:.2f} s after the held read completed")
    finally:
        _signal(stopped, signal.SIGCONT)
        pd.stop()


def _under(tmpdir: str) -> list[psutil.Process]:
    """The live processes running with `tmpdir` as their TMPDIR (an engine's vLLM processes inherit its own)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TMPDIR") == tmpdir and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.engine
@pytest.mark.parametrize("how, phase", [("stop", "loading vLLM"), ("kill", "loading vLLM"),
                                        ("stop", "warming up"), ("kill", "started")])
def test_an_engine_stopped_or_killed_while_it_starts_leaves_nothing(ray_local, gdn_model, how, phase):
    """A TP 2 engine (an EngineCore, two workers, CPU all-reduce segments, message queues) is stopped as a pool
    replica stops its engine (`stop_engine_actors`), or SIGKILLed and then cleaned up after as a pool replica does
    when its engine died starting: once its vLLM processes have made their files in the phase named, nothing of it
    remains - no process, no shared-memory file, no TMPDIR."""
    shm_before = shm_files()
    client, started = launch_engine_actor(gdn_model, 2, role="decode", engine_id=f"decode-{how}-{phase.split()[0]}")
    try:
        ray.get(client.ready(), timeout=60)
        tmpdir = ray.get(client.leftovers(), timeout=30).tmpdir
        # the owner file names the actor as the stop's sweep knows it (`EngineClient.actor_id`): it waits for it
        assert open(os.path.join(tmpdir, OWNER_FILE)).read().split()[2] == client.actor_id
        wait_for(lambda: ray.get(client.phase(), timeout=10).startswith(phase), 300, poll_s=0.1)
        if phase == "loading vLLM":  # the workers have started and made their segments
            wait_for(lambda: len(ray.get(client.pids(), timeout=10)) >= 4, 120, poll_s=0.1)
            time.sleep(2)
        made = sorted(shm_files() - shm_before)
        print(f"{how} at {ray.get(client.phase(), timeout=10)!r}: {len(_under(tmpdir))} processes, {len(made)} "
              f"engine files in /dev/shm")
        if how == "kill":
            kill_engine(client)
        removed = stop_engine_actors([client])
        print(f"{how}: {len(removed)} files and directories removed by the stop and its sweep")
    except BaseException:
        stop_engine_actors([client])
        raise
    left = [f"process {p.pid}" for p in _under(tmpdir)] + sorted(shm_files() - shm_before)
    left += [tmpdir] if os.path.exists(tmpdir) else []
    assert not left, f"left behind: {left}"
    if phase != "started":
        with pytest.raises(Exception):  # noqa: B017 - the start was cut short one way or another
            ray.get(started, timeout=30)
