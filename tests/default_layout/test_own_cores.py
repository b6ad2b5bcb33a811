"""Cores as devices on live engines: the embedded default's layout (prefill TP 1 and decode TP 1 pools as Ray Serve
deployments, each engine owning a core; the folder's cluster, conftest.py, after test_http.py has used it) - every
thread of every vLLM process of an engine runs only on that engine's cores, and no two engines share one; a further
engine is refused naming the cores and who holds them (so is a deployment whose pools cannot all get cores, before
anything starts); and the engine Serve starts in place of a SIGKILLed one gets the cores the dead one freed, and
serves. The cluster's own processes (front end, engine actors) keep off the decode engine's core, the replacement's
included."""

from __future__ import annotations

import os
import time

import openai
import psutil
import pytest
import ray

from actors.host.cores import CoresUnavailable, lease_cores, thread_affinities, wait_for_cores
from cluster.cli.bench.faults import kill_engine
from cluster.core.config import DeployConfig, DeployError
from cluster.cli.launch import start_cluster
from tests.default_layout.shared import KEY, MODEL
from tests.pd_helpers import oracle, prompts, wait_for

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", autouse=True)
def two_cores(ray_local):
    if len(ray.nodes()) != 1 or ray.cluster_resources().get("CPU") != 2:
        pytest.fail("this module expects the suite's local Ray of one node with 2 CPUs (tests/conftest.py)")


def engines_by_role(cluster) -> dict[str, tuple[str, object]]:
    """{role: (engine id, client)} of the engines registered now (one per pool here)."""
    found = {}
    for engine_id, client in cluster.refresh_engines().items():
        found[engine_id.split("-")[0]] = (engine_id, client)
    assert set(found) == {"prefill", "decode"}, found
    return found


def vllm_processes(client) -> list[int]:
    """The engine's vLLM processes (its EngineCore; workers at TP > 1), not the actor nor multiprocessing's tracker."""
    out = []
    for pid in ray.get(client.pids(), timeout=30)[1:]:
        try:
            if not any("resource_tracker" in part for part in psutil.Process(pid).cmdline()):
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def lent_threads(pid: int, lent: set[int]) -> dict[int, int]:
    """{tid: core} of process `pid`'s threads pinned each to one core of `lent`: a borrowing engine's OpenMP team
    threads on the cores it borrows (`actors.host.core_lending`)."""
    return {tid: c[0] for tid, c in thread_affinities(pid).items() if len(c) == 1 and c[0] in lent}


def check_own_cores(cluster) -> dict[str, tuple[int, ...]]:
    """Every thread of every vLLM process of each engine runs only on that engine's cores - but a borrowing engine's
    OpenMP team threads, one on each core it may borrow, pinned there (what they do is
    `test_the_prefill_engine_borrows_the_idle_decode_core_and_only_then`'s); the engines' cores are disjoint. Returns
    {role: cores}."""
    owned = {}
    for role, (engine_id, client) in engines_by_role(cluster).items():
        cores = tuple(ray.get(client.cores(), timeout=30))
        assert len(cores) == 1, f"{engine_id} (TP 1) owns {cores}"
        borrowing = ray.get(client.borrowed(), timeout=30)
        assert (borrowing is not None) == (role == "prefill"), (engine_id, borrowing)  # the default: prefill only
        lent = set(borrowing["others"]) if borrowing else set()
        procs = vllm_processes(client)
        assert procs, f"{engine_id} has no vLLM process"
        for pid in procs:
            threads = thread_affinities(pid)
            assert len(threads) > 5, (engine_id, pid, threads)  # OpenMP, gloo, NIXL, zmq threads...
            team = lent_threads(pid, lent)
            assert len(team) <= len(lent), (engine_id, team)
            strays = {tid: c for tid, c in threads.items() if not set(c) <= set(cores) and tid not in team}
            assert not strays, f"{engine_id} owns {cores} but threads of its process {pid} may run on {strays}"
        owned[role] = cores
    assert not set(owned["prefill"]) & set(owned["decode"]), owned
    return owned


def check_host_off_decode(cluster, owned: dict[str, tuple[int, ...]]) -> None:
    """The cluster's own processes - the HTTP front end and both engine actors (vLLM's client side) - run, every
    thread, on the cores the decode engine does not reserve (here: the prefill engine's), within a few of their
    checks (`actors.host.cores.HostCores`, every 5 s)."""
    pids = {"front end": ray.get(cluster.frontends[0].info.remote(), timeout=30)["pid"]}
    for role, (engine_id, client) in engines_by_role(cluster).items():
        pids[f"{engine_id} (actor)"] = ray.get(client.pids(), timeout=30)[0]
    host = set(owned["prefill"])

    def strays() -> dict[str, dict[int, tuple[int, ...]]]:
        return {who: bad for who, pid in pids.items()
                if (bad := {t: c for t, c in thread_affinities(pid).items() if set(c) != host})}

    try:
        wait_for(lambda: not strays(), 20, poll_s=0.5)
    except Exception:  # noqa: BLE001 - say which threads, not only that it timed out
        found = {who: f"{len(bad)} thread(s), e.g. {next(iter(bad.items()))}" for who, bad in strays().items()}
        pytest.fail(f"threads of the cluster's own processes outside the host cores {sorted(host)}: {found}")


def answers_right(cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    for prompt in prompts(seed=11, lengths=(40, 300)):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        assert got.choices[0].token_ids == oracle(prompt, 8), got.choices[0]


def test_each_engines_processes_run_only_on_cores_of_its_own(served):
    owned = check_own_cores(served)
    assert sorted(owned["prefill"] + owned["decode"]) == [0, 1]
    answers_right(served)


def test_the_clusters_own_processes_keep_off_the_decode_engines_core(served):
    owned = check_own_cores(served)
    check_host_off_decode(served, owned)
    answers_right(served)


def cpu_seconds(pid: int, tids) -> float:
    total = 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def test_the_prefill_engine_borrows_the_idle_decode_core_and_only_then(served):
    """Core lending, live: at concurrency 1 each prompt's prefill steps run on the prefill engine's core and the
    idle decode engine's (the OpenMP thread pinned there does work); while the decode engine has a request in flight
    no prefill step borrows, and that thread stays idle. The answers are the model's either way."""
    roles = engines_by_role(served)
    _, prefill = roles["prefill"]
    decode_core = tuple(ray.get(roles["decode"][1].cores(), timeout=30))
    (pid,) = vllm_processes(prefill)
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    ask = prompts(seed=13, lengths=(500, 600, 700))

    def borrowed() -> dict:
        return ray.get(prefill.borrowed(), timeout=30)

    def one(prompt: list[int], n: int = 8) -> list[int]:
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        return got.choices[0].token_ids

    for prompt in ask:  # settle: the decode engine idle between requests
        assert one(prompt) == oracle(prompt, 8)
    before = borrowed()
    assert before["others"] == list(decode_core), before
    for prompt in ask:
        time.sleep(0.1)  # past the pause after a prefill hands its prompt to the decode engine (HANDOFF_S)
        assert one(prompt) == oracle(prompt, 8)
    after = borrowed()
    team = lent_threads(pid, set(decode_core))
    assert len(team) == 1, team
    assert after["borrowed_steps"] - before["borrowed_steps"] >= len(ask), (before, after)

    # a request decoding: the decode engine is busy until it ends
    stream = client.completions.create(model=MODEL, prompt=[1] + [7] * 40, max_tokens=600, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(4):
        next(chunks)
    during, cpu0 = borrowed(), cpu_seconds(pid, team)
    for prompt in ask:
        assert one(prompt, 4) == oracle(prompt, 4)
    end, cpu1 = borrowed(), cpu_seconds(pid, team)
    rest = [c for c in chunks]
    assert rest and rest[-1].choices[0].finish_reason == "length"
    assert len(rest) > 100, "the long request ended before the others were asked: the window proves nothing"
    assert end["steps"] - during["steps"] >= len(ask), (during, end)
    assert end["borrowed_steps"] == during["borrowed_steps"], (during, end)
    assert cpu1 - cpu0 < 0.05, (cpu0, cpu1)


@ray.remote(num_cpus=0)
def _try_to_take_a_core(node_id: str) -> tuple[str, str]:
    """On the engines' node: a third engine's lease, and a pool replica's wait for free CPUs."""
    out = []
    try:
        lease_cores(1, "decode-9", node_id, who="decode pool")
        out.append("leased")
    except CoresUnavailable as e:
        out.append(str(e))
    try:
        wait_for_cores(1, None, "decode pool (decode-9)", timeout_s=2)
        out.append("free CPUs")
    except CoresUnavailable as e:
        out.append(str(e))
    return tuple(out)


def test_an_engine_without_free_cores_is_refused_naming_them(served, gdn_model):
    engines_by_role(served)
    node_id = ray.get(served.engines[next(iter(served.engines))].node_id(), timeout=30)
    lease, wait = ray.get(_try_to_take_a_core.remote(node_id), timeout=60)
    assert lease.startswith("decode pool: decode-9 needs 1 core(s) of its own"), lease
    assert "0 free of its 2 (0-1)" in lease and "prefill-" in lease and "decode-" in lease and "share_cores" in lease
    assert wait.startswith("decode pool (decode-9): a new engine needs 1 core(s) of its own on one node, and none"), wait
    # a deployment whose pools can never all get cores is refused before anything starts (3 ranks on 2 CPUs)
    three = DeployConfig.model_validate({
        "model": {"path": str(gdn_model), "name": MODEL}, "decode": {"tp": 2},
        "coordinator": {"name": "coordinator-cores-refused", "namespace": "pd-test-cores-refused"}})
    t0 = time.monotonic()
    with pytest.raises(DeployError, match=r"decode: 1 engine\(s\) of TP 2 need 2 core\(s\) of their own each"):
        start_cluster(three, progress=print)
    assert time.monotonic() - t0 < 10


def test_the_engine_that_replaces_a_killed_one_gets_its_freed_cores(served):
    before = check_own_cores(served)
    dead_id, victim = engines_by_role(served)["decode"]
    children = kill_engine(victim)
    psutil.wait_procs(children, timeout=60)

    def replaced() -> bool:
        try:
            now = served.refresh_engines()
        except Exception:  # noqa: BLE001 - a coordinator busy with the death
            return False
        return dead_id not in now and any(e.startswith("decode-") for e in now)

    took = wait_for(replaced, 300, poll_s=2)
    print(f"{dead_id} replaced after {took:.0f} s: {sorted(served.engines)}")
    after = check_own_cores(served)
    assert after["decode"] == before["decode"]  # the core the dead engine held, the only one free
    assert after["prefill"] == before["prefill"]
    check_host_off_decode(served, after)  # the new decode engine reserves the core again
    answers_right(served)
