"""`bench soak`: its bookkeeping without engines - the fault schedule, how each request's outcome is counted (a request
broken by a front-end kill apart from a failed one), burst and n-too-large answers, idle baselines of engines that
joined during the soak, the verdict. (The live soak, on a running cluster, is test_frontend_replicas.py's last test.)"""

from __future__ import annotations

import argparse

import pytest

from cluster.cli.bench.soak import add_args, soak_config
from cluster.cli.bench.soak_accounting import (FAULTS, Request, broken_connection, burst_counts, check_n_too_large,
                                              fault_schedule, idle_baselines, lost_with_frontend, orphans,
                                              parse_faults, problems, shm_files, shm_held, shm_of, tally)


# ---- the schedule --------------------------------------------------------------------------------------------------
def test_round_robin_schedule_one_fault_per_interval_none_at_the_end():
    s = fault_schedule(["kill-decode", "burst", "n-too-large"], 60, 20 * 60)
    assert [t for t, _ in s] == [60.0 * k for k in range(1, 20)]  # 19: none at 1200 s, when the load ends
    assert [k for _, k in s[:5]] == ["kill-decode", "burst", "n-too-large", "kill-decode", "burst"]
    assert fault_schedule(["burst"], 20, 75) == [(20, "burst"), (40, "burst"), (60, "burst")]
    assert fault_schedule(["burst"], 60, 60) == []


def test_random_schedule_is_seeded_and_draws_from_the_list():
    a = fault_schedule(list(FAULTS), 10, 600, "random", seed=3)
    assert a == fault_schedule(list(FAULTS), 10, 600, "random", seed=3)
    assert a != fault_schedule(list(FAULTS), 10, 600, "random", seed=4)
    assert {k for _, k in a} <= set(FAULTS) and len({k for _, k in a}) > 3
    with pytest.raises(ValueError):
        fault_schedule(["burst"], 0, 60)


def test_fault_names_and_defaults():
    assert parse_faults("kill-decode, burst,kill-decode") == ["kill-decode", "burst"]
    for bad in ("kill-everything", "", "burst,nope"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_faults(bad)
    p = argparse.ArgumentParser()
    add_args(p)
    a = p.parse_args([])
    assert (a.minutes, a.fault_every, a.faults, a.frontends, a.order, a.deploy) == (20, 60, list(FAULTS), 2,
                                                                                      "round-robin", "deploy.yaml")
    with pytest.raises(SystemExit):
        p.parse_args(["--faults", "kill-all"])


def test_soak_config_has_the_front_ends_a_port_and_a_namespace_of_its_own():
    from cluster.core.config import DeployConfig

    base = DeployConfig.model_validate({})
    cfg = soak_config(base, 3, 8123)
    assert (cfg.http.replicas, cfg.http.port) == (3, 8123)
    assert cfg.coordinator.namespace == f"{base.coordinator.namespace}-soak" != base.coordinator.namespace
    assert cfg.prefill == base.prefill and cfg.decode == base.decode and base.http.replicas == 1
    assert soak_config(base, 2).http.port == base.http.port


# ---- outcomes --------------------------------------------------------------------------------------------------------
def test_broken_connections_are_transport_errors_and_cut_streams():
    assert broken_connection("malformed: RemoteProtocolError: peer closed connection without sending complete message")
    assert broken_connection("malformed: ReadError: ")
    assert broken_connection("malformed: ConnectError: [Errno 111] Connection refused")
    assert broken_connection("malformed: done=False ids=1 usage=None chunks=3")
    assert not broken_connection("malformed: HTTP 500: b'boom'")
    assert not broken_connection("malformed: done=True ids=1 usage=7 chunks=7")  # short: the cluster's fault
    assert not broken_connection("failed_midstream: error event after 3 chunks: x")
    assert not broken_connection(None)


def test_a_request_is_lost_with_a_front_end_only_in_the_kill_window():
    kills = [100.0]
    cut = "malformed: RemoteProtocolError: peer closed connection"
    assert lost_with_frontend(Request(95.0, 100.2, "malformed", cut), kills)  # in flight at the kill
    assert lost_with_frontend(Request(101.0, 101.1, "malformed", "malformed: ConnectError: refused"), kills)  # just after
    assert not lost_with_frontend(Request(95.0, 99.0, "malformed", cut), kills)  # ended before
    assert not lost_with_frontend(Request(90.0, 120.0, "malformed", cut), kills)  # broke long after: not the kill
    assert not lost_with_frontend(Request(106.0, 107.0, "malformed", cut), kills)  # started after the window
    assert not lost_with_frontend(Request(95.0, 100.5, "failed_midstream", "failed_midstream: x"), kills)
    assert not lost_with_frontend(Request(95.0, 100.5, "malformed", "malformed: HTTP 502: b''"), kills)
    assert not lost_with_frontend(Request(95.0, 100.5, "malformed", cut), [])


def test_tally_counts_each_class_and_failed_is_everything_unexplained():
    cut = "malformed: ReadError: "
    reqs = [Request(0, 1, "complete"), Request(0, 1, "complete"), Request(1, 2, "refused_503"),
            Request(1, 2, "refused_429", "refused_4xx: HTTP 429: b''"), Request(9, 10.5, "malformed", cut),
            Request(20, 21, "malformed", cut), Request(2, 3, "failed_midstream", "failed_midstream: x"),
            Request(3, 4, "refused_4xx", "refused_4xx: HTTP 400: b''")]
    t = tally(reqs, [10.0])
    assert t == {"sent": 8, "completed": 2, "failed": 3, "refused_429": 1, "refused_503": 1, "lost_with_frontend": 1,
                 "failed_midstream": 1, "malformed": 1, "unexpected_4xx": 1}
    assert tally(reqs, [])["failed"] == 4 and tally([], [])["sent"] == 0


def test_burst_and_n_too_large_answers():
    assert burst_counts([200, 200, 429, 503, 500, "ReadError", "malformed", "503 without Retry-After"]) == {
        "200": 2, "429": 1, "503": 1, "other": 4}
    good = {"error": {"message": "n must be at most 128, got 1000: each choice is a request of its own on this cluster",
                      "type": "BadRequest", "param": "n", "code": 400, "reason": "n_over_limit"}}
    assert check_n_too_large(400, good, 128) is None
    assert check_n_too_large(400, {"error": {**good["error"], "reason": None, "code": "n_over_limit"}}, 128) is None
    assert "HTTP 200" in check_n_too_large(200, {"choices": []}, 128)
    assert "n_over_limit" in check_n_too_large(400, {"error": {**good["error"], "reason": "invalid_json"}}, 128)
    assert "limit 64" in check_n_too_large(400, good, 64)
    assert "HTTP 500" in check_n_too_large(500, "Internal Server Error", 128)


# ---- engines that joined, and the verdict ----------------------------------------------------------------------------
def test_idle_baselines_of_engines_that_joined_come_from_their_pool():
    start = {"prefill-0": 8000, "decode-0": 7999}
    live = ["prefill-0", "decode-1", "decode-2", "prefill-3"]
    got = idle_baselines(start, live, {"decode-2": 8100, "decode-1": 10})
    assert got == {"prefill-0": 8000, "decode-1": 7999, "decode-2": 8100, "prefill-3": 8000}
    assert idle_baselines({}, ["decode-5"], {}) == {}  # nothing to compare with: left out


def _report(**left) -> dict:
    base = {"blocks_held": {"prefill-0": 0, "decode-1": 0}, "shm_unowned": {}, "shm_after_stop": {},
            "faulted_engine_files": [], "stragglers": [], "nixl_agents_of_gone_prefills": 0}
    return {"traffic": {"failed": 0}, "faults": [{"index": 1, "kind": "kill-decode", "problem": None,
                                                  "recovered_s": 41.0, "awaits": "its replacement"}],
            "left_behind": {**base, **left}}


def test_verdict_passes_only_with_nothing_failed_or_left():
    assert problems(_report()) == []
    r = _report()
    r["traffic"]["failed"] = 2
    assert problems(r) == ["2 request(s) failed"]
    assert "blocks still held after the load: decode-1 3" in problems(_report(blocks_held={"decode-1": 3}))[0]
    assert "did not answer" in problems(_report(blocks_held={"decode-1": None}))[0]
    assert "no process holds: {'/dev/shm/psm_1'" in problems(_report(shm_unowned={"/dev/shm/psm_1": "10:00:00"}))[0]
    assert "after it stopped" in problems(_report(shm_after_stop={"/dev/shm/sem.mp-x": "10:00:00"}))[0]
    assert "still running" in problems(_report(stragglers=[1234]))[0]
    assert "NIXL agents" in problems(_report(nixl_agents_of_gone_prefills=2))[0]
    assert problems(_report(pools_short=["prefill 0 of 1"])) == [
        "pools without their min_replicas ready engines at the end (ready of min): prefill 0 of 1"]
    r = _report()
    r["faults"][0].update(recovered_s=None)
    assert problems(r) == ["fault 1 kill-decode: its replacement not seen in time"]
    r["faults"][0].update(problem="could not be done: RuntimeError: no ready decode engine")
    assert problems(r) == ["fault 1 kill-decode: could not be done: RuntimeError: no ready decode engine"]


def test_orphans_are_new_shm_files_no_process_holds():
    import multiprocessing
    import os
    import uuid

    path = f"/dev/shm/psm_soaktest_{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        assert path in shm_files() and shm_held({path}) == {path} and orphans({path}) == {}  # held open here
        os.close(fd)
        fd = None
        assert list(orphans({path})) == [path] and shm_held({path}) == set()
    finally:
        if fd is not None:
            os.close(fd)
        os.unlink(path)
    assert orphans({path}) == {}  # gone: nothing to report
    # a multiprocessing semaphore: mapped under glibc's temporary name, found by its inode
    lock = multiprocessing.get_context("spawn").Lock()
    sem = "/dev/shm/sem." + lock._semlock.name.lstrip("/")
    assert sem in shm_files() and shm_held({sem}) == {sem} and orphans({sem}) == {}
    assert sem in shm_of([os.getpid()])  # what a process holds, as recorded of an engine before its fault


def test_the_watch_outlives_a_look_that_fails():
    """The coordinator restarting (a kill-coordinator fault) makes the registry unanswerable for a while: the watch
    says so once and looks again, and goes on checking the faults' aftermath (in the 20-minute soak an unanswered
    look ended the watch, and every later replacement went "not seen")."""
    import threading

    from cluster.cli.bench.soak import Soak

    soak = Soak.__new__(Soak)
    soak.t0, soak.stop, said, looks = 0.0, threading.Event(), [], []

    def check_pending():
        looks.append(len(looks))
        if len(looks) in (2, 3):
            raise RuntimeError("the actor is restarting")
        if len(looks) >= 6:
            soak.stop.set()

    soak.check_pending, soak.sample_idle, soak.progress = check_pending, lambda: None, said.append
    soak.watch()
    assert len(looks) >= 6
    assert len(said) == 1 and "could not look (RuntimeError: the actor is restarting)" in said[0]


def test_a_killed_engine_replaced_under_its_own_id_counts_as_replaced():
    """Pools hand a dead engine's id to its replacement ("prefill-0" again): once the death was noticed, an engine
    ready under that id is the replacement (the 20-minute soak called two recovered kills "not seen")."""
    import time

    from cluster.cli.bench.soak import Fault, Soak

    soak = Soak.__new__(Soak)  # its aftermath check only: no cluster
    ready = {"prefill": ["prefill-0"]}
    soak.ready = lambda role: list(ready[role])
    fault = Fault.__new__(Fault)
    fault.t = time.perf_counter()
    check = soak._engine_aftermath(fault, "prefill-0", {"prefill-0"})
    assert check() is None  # not noticed yet: the dead engine still listed
    ready["prefill"] = []
    assert check() is None  # noticed, nothing ready
    ready["prefill"] = ["prefill-0"]
    assert check().startswith("noticed after") and "replaced by prefill-0" in check()
