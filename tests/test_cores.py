"""Cores as devices without engines: the core-list arithmetic, the node's core leases (real flock files held by real
processes, a holder SIGKILLed), the launcher's check that every pool's engines find cores before anything starts,
the autoscaling bound, and the deploy fields."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from actors.control.autoscale import Want, bound_by_cores
from actors.host.cores import CoresUnavailable, HostCores, host_cores, lease_cores, node_cores, reserved_cores
from cluster.core.config import DeployConfig, DeployError
from cluster.core.cores import CoreSpecError, format_cores, omp_bind, parse_cores, shared_bind
from cluster.cli.placement import check_cores


def test_core_lists_parse_fold_and_split_per_rank():
    assert parse_cores("0-3,8, 10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cores("5,1,5") == (1, 5)
    assert format_cores((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    for bad in ("", "a", "3-1", "1-", "-2"):
        with pytest.raises(CoreSpecError):
            parse_cores(bad)
    assert omp_bind((1,), 1) == "1"
    assert omp_bind((0, 1), 2) == "0|1"
    assert omp_bind((7, 4, 5, 6), 2) == "4-5|6-7"
    assert omp_bind((2, 3), 1) == "2-3"
    with pytest.raises(CoreSpecError, match="cannot be split evenly over 2"):
        omp_bind((0, 1, 2), 2)
    # engines that share their node's cores: ranks split them evenly, or take them in turn
    assert [shared_bind((0, 1), tp) for tp in (1, 2, 4)] == ["0-1", "0|1", "0|1|0|1"]
    assert shared_bind((0, 1, 2, 3, 4), 2) == "0-1|2-3"
    assert shared_bind(tuple(range(8)), 4) == "0-1|2-3|4-5|6-7"


def _hold(cores: tuple[int, ...], count: int, owner: str, lock_dir: str, ready, took, reserved: bool = False) -> None:
    os.environ["PD_CORE_LOCK_DIR"] = lock_dir
    lease = lease_cores(count, owner, "node-a", cores=cores, reserved=reserved)
    took.put(lease.cores)
    ready.set()
    time.sleep(600)  # holds until killed


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PD_CORE_LOCK_DIR", str(tmp_path))
    return str(tmp_path)


def test_a_lease_takes_free_cores_and_a_killed_holder_frees_them(lock_dir):
    node = (0, 1, 2, 3)
    ctx = multiprocessing.get_context("spawn")
    ready, took = ctx.Event(), ctx.Queue()
    holder = ctx.Process(target=_hold, args=(node, 2, "prefill-0", lock_dir, ready, took))
    holder.start()
    try:
        assert ready.wait(60)
        assert took.get(timeout=10) == (0, 1)
        mine = lease_cores(1, "decode-0", "node-a", cores=node)
        assert mine.cores == (2,)  # the lowest free core, not one the other process holds
        with pytest.raises(CoresUnavailable) as refused:
            lease_cores(2, "decode-1", "node-a", cores=node, who="decode pool")
        msg = str(refused.value)
        assert msg.startswith("decode pool: decode-1 needs 2 core(s) of its own") and "1 free of its 4 (0-3)" in msg
        assert "core 0: prefill-0 (pid" in msg and "core 2: decode-0 (pid" in msg and "share_cores: true" in msg
        # a refused lease holds nothing: core 3 is still free
        assert lease_cores(1, "decode-2", "node-a", cores=node).cores == (3,)
        os.kill(holder.pid, signal.SIGKILL)  # the kernel drops a dead holder's locks: its cores are free again
        holder.join(10)
        again = lease_cores(2, "prefill-1", "node-a", cores=node)
        assert again.cores == (0, 1)
        again.release()
        mine.release()
        assert lease_cores(3, "decode-3", "node-a", cores=node).cores == (0, 1, 2)
        # each node accounts for its own cores
        assert lease_cores(4, "prefill-9", "node-b", cores=node).cores == node
    finally:
        if holder.is_alive():
            holder.kill()


def test_reserved_cores_keep_the_clusters_own_processes_off_until_their_holder_dies(lock_dir, monkeypatch):
    """A decode engine's reserved lease (in another process, as on a node) takes its cores out of `host_cores`; a
    plain lease does not; when the holder is SIGKILLed its file stays behind, but the kernel dropped the lock and the
    cores are the host's again. With every core reserved, the host keeps all of them."""
    node = (0, 1, 2, 3)
    ctx = multiprocessing.get_context("spawn")
    ready, took = ctx.Event(), ctx.Queue()
    holder = ctx.Process(target=_hold, args=(node, 2, "decode-0", lock_dir, ready, took, True))
    holder.start()
    try:
        assert ready.wait(60)
        assert took.get(timeout=10) == (0, 1)
        plain = lease_cores(1, "prefill-0", "node-a", cores=node)
        assert plain.cores == (2,)
        assert reserved_cores("node-a") == {0, 1}
        assert host_cores("node-a", node) == (2, 3)  # the prefill engine's core is the host's too
        assert host_cores("node-a", (0, 1)) == (0, 1)  # everything reserved: run anywhere rather than nowhere
        assert reserved_cores("node-b") == set()  # each node its own
        mine = lease_cores(1, "decode-1", "node-a", cores=node, reserved=True)
        assert mine.cores == (3,) and host_cores("node-a", node) == (2,)
        with open(os.path.join(lock_dir, "node-a", "core-0")) as f:
            assert f.readline().startswith("decode-0 (pid")  # what a refusal names: the first line
        import actors.host.cores as ac

        with monkeypatch.context() as m:  # where /proc/locks cannot be read: the holder's pid must be alive
            m.setattr(ac, "flocked_inodes", lambda: None)
            assert reserved_cores("node-a") == {0, 1, 3}
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        assert os.path.exists(os.path.join(lock_dir, "node-a", "core-0"))  # left behind, but nobody holds it
        assert reserved_cores("node-a") == {3}
        with monkeypatch.context() as m:
            m.setattr(ac, "flocked_inodes", lambda: None)
            assert reserved_cores("node-a") == {3}
        mine.release()
        plain.release()
        assert host_cores("node-a", node) == node
    finally:
        if holder.is_alive():
            holder.kill()


def test_host_cores_pins_every_thread_of_the_process_and_follows_the_reservations(lock_dir, monkeypatch):
    import threading

    allowed = tuple(sorted(os.sched_getaffinity(0)))
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)  # a thread that exists before the pinning
    worker.start()
    pinner = HostCores("node-a", "test", interval_s=0.1)

    def settles(want: set[int]) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if all(os.sched_getaffinity(int(t)) == want for t in os.listdir("/proc/self/task")):
                return True
            time.sleep(0.05)
        return False

    try:
        lease = lease_cores(1, "decode-0", "node-a", cores=allowed, reserved=True)
        assert pinner.apply() == allowed[1:]  # at once: every thread, the one started before included
        assert all(os.sched_getaffinity(int(t)) == set(allowed[1:]) for t in os.listdir("/proc/self/task"))
        lease.release()
        monkeypatch.setenv("PD_HOST_CORES", "all")
        assert not HostCores.enabled() and pinner.start()._thread is None  # turned off: nothing runs
        monkeypatch.delenv("PD_HOST_CORES")
        pinner.start()  # the engine left: its core is the host's again
        assert settles(set(allowed)), os.sched_getaffinity(worker.native_id)
        later = lease_cores(1, "decode-1", "node-a", cores=allowed[-1:], reserved=True)  # a decode engine joins
        assert settles(set(allowed[:-1])), os.sched_getaffinity(worker.native_id)
        later.release()
        assert settles(set(allowed))
    finally:
        pinner.stop()
        stop.set()
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), set(allowed))
            except OSError:
                pass


def test_node_cores_follow_the_process_and_pd_node_cores(monkeypatch):
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    monkeypatch.delenv("PD_NODE_CORES", raising=False)
    assert node_cores() == allowed
    monkeypatch.setenv("PD_NODE_CORES", str(allowed[-1]))
    assert node_cores() == (allowed[-1],)
    monkeypatch.setenv("PD_NODE_CORES", f"{max(allowed) + 1}")
    with pytest.raises(CoresUnavailable, match="may not run on"):
        node_cores()


def _node(node_id: str, cpus: float, labels: dict[str, str] | None = None) -> dict:
    return {"NodeID": node_id, "Alive": True, "NodeManagerAddress": f"10.0.0.{node_id[-1]}",
            "Resources": {"CPU": cpus}, "Labels": labels or {}}


def test_the_launcher_refuses_pools_that_cannot_get_cores_naming_them():
    two = [_node("n1", 2)]
    # the embedded default: P TP 1 + D TP 1, a core each; neither pool can grow on 2 cores
    assert check_cores(DeployConfig(), two) == []
    growing = DeployConfig.model_validate({"prefill": {"max_replicas": 2}, "decode": {"max_replicas": 3}})
    notes = check_cores(growing, two)
    assert notes == ["prefill pool: cores for 1 of its max_replicas 2 engines; it grows only as far as free cores "
                     "allow (prefill.share_cores: true lifts this)",
                     "decode pool: cores for 1 of its max_replicas 3 engines; it grows only as far as free cores "
                     "allow (decode.share_cores: true lifts this)"]
    showcase = DeployConfig.model_validate({"decode": {"tp": 2}})
    with pytest.raises(DeployError, match=r"decode: 1 engine\(s\) of TP 2 need 2 core\(s\) of their own each") as e:
        check_cores(showcase, two)
    assert "10.0.0.1 2" in str(e.value) and "decode.share_cores: true" in str(e.value)
    shared = DeployConfig.model_validate({"decode": {"tp": 2, "share_cores": True}})
    assert check_cores(shared, two) == []
    assert check_cores(showcase, [_node("n1", 4)]) == []
    # engines of another cluster hold cores now: the deployment starts (Ray waits for the cores), with a note
    (waiting,) = check_cores(DeployConfig(), two, free_cpus={"n1": 1})
    assert waiting.startswith("the nodes' free CPUs (10.0.0.1 1) do not hold every pool's first engines now")
    assert check_cores(DeployConfig(), two, free_cpus={"n1": 2}) == []
    # placement: the decode pool may use only the labelled node, which is too small
    placed = DeployConfig.model_validate({"decode": {"tp": 2, "placement": {"labels": {"pd": "d"}}}})
    with pytest.raises(DeployError, match="decode"):
        check_cores(placed, [_node("n1", 8), _node("n2", 1, {"pd": "d"})])
    assert check_cores(placed, [_node("n1", 1), _node("n2", 2, {"pd": "d"})]) == []
    wide = DeployConfig.model_validate({"prefill": {"cores_per_rank": 2}, "decode": {"tp": 2, "cores_per_rank": 2}})
    with pytest.raises(DeployError, match="decode"):  # 2 + 4 cores on 5
        check_cores(wide, [_node("n1", 5)])
    assert check_cores(DeployConfig.model_validate({"device": "cuda", "transfer": {"verify": 0}}), []) == []


def test_autoscaling_grows_only_as_far_as_free_cores_allow():
    want = Want(4, "20 sequences decoding", {"running_requests": 20.0})
    assert bound_by_cores(want, 1, 1, None) == want  # unknown: not bounded
    assert bound_by_cores(want, 1, 1, 5) == want
    two = bound_by_cores(want, 1, 1, 1)
    assert two.replicas == 2 and "bounded by free cores to 2" in two.reason
    # a replica asked for but not running yet has not taken its cores: they are not free for another
    assert bound_by_cores(want, 2, 1, 1).replicas == 2
    assert bound_by_cores(want, 1, 1, 0).replicas == 1


def test_share_cores_and_cores_per_rank_in_the_deploy_file():
    cfg = DeployConfig.model_validate({"prefill": {"tp": 2, "cores_per_rank": 3}, "decode": {"share_cores": True}})
    assert (cfg.prefill.cores_per_engine, cfg.decode.cores_per_engine) == (6, 0)
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND follows the cores"):
        DeployConfig.model_validate({"decode": {"env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}})
    DeployConfig.model_validate({"decode": {"share_cores": True, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}})
    # reserve_cores: the decode pool's cores by default, the prefill pool's only when asked; shared cores cannot be
    cfg = DeployConfig.model_validate({})
    assert (cfg.prefill.reserves_cores("prefill"), cfg.decode.reserves_cores("decode")) == (False, True)
    cfg = DeployConfig.model_validate({"prefill": {"reserve_cores": True}, "decode": {"reserve_cores": False}})
    assert (cfg.prefill.reserves_cores("prefill"), cfg.decode.reserves_cores("decode")) == (True, False)
    assert not DeployConfig.model_validate({"decode": {"share_cores": True}}).decode.reserves_cores("decode")
    with pytest.raises(ValueError, match="reserve_cores: true needs cores of the pool's own"):
        DeployConfig.model_validate({"decode": {"share_cores": True, "reserve_cores": True}})
