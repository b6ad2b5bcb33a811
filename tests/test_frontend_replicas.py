"""A supervised front end that can be several: `http.replicas` processes share one port; one SIGKILLed costs at most
its own requests in flight while the others serve, Ray restarts it and it serves again by itself, the launcher's
watch says so, and the engines hold no blocks for the requests that died with it. All of them killed: /health
answers again once they are back. Last, on the same cluster, a tiny `bench soak` (a decode engine and a front end
SIGKILLed, an n-too-large request: nothing failed, nothing left behind once it has stopped the cluster)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray
import yaml

from actors.engine.settings import free_port
from cluster.cli.bench.faults import blocks_held, free_blocks
from cluster.cli.bench.soak import add_args, soak_cluster
from cluster.cli.bench.soak_accounting import shm_files
from cluster.core.config import DeployConfig
from cluster.cli.frontends import watch_frontends
from cluster.cli.launch import serve, stop_cluster
from tests.pd_helpers import wait_for

pytestmark = pytest.mark.engine
MODEL = "tiny-hybrid"
REPO = Path(__file__).resolve().parents[1]
LONG_STREAMS = 10  # in flight at the kill, each on its own connection: some land on the front end that is killed
LONG_TOKENS = 1800  # each far from its last token when its front end dies
SHM_BEFORE: set[str] = set()  # the engine files in /dev/shm before the module's cluster started
STOPPED: list[bool] = []  # set by the soak, which stops the cluster


@pytest.fixture(scope="module")
def served(ray_local, gdn_model):
    data = yaml.safe_load((REPO / "deploy.yaml").read_text())  # the default deployment, two front ends
    data["model"] = {**data["model"], "path": str(gdn_model), "name": MODEL}
    data["model"].pop("builtin", None)
    for pool in ("prefill", "decode"):
        data[pool].update(min_replicas=1, max_replicas=1)  # no autoscaling under the test's own load
    data["coordinator"] = {"name": "coordinator-frontends", "namespace": "pd-test-frontends"}
    data["http"] = {**data["http"], "port": free_port(), "replicas": 2}
    SHM_BEFORE.update(shm_files())
    cluster = serve(DeployConfig.model_validate(data), progress=print)
    try:
        yield cluster
    finally:
        if not STOPPED:  # the soak, the module's last test, stops it itself
            stop_cluster(cluster, shutdown_serve=True, progress=print)


def infos(cluster) -> list[dict]:
    return ray.get([f.info.remote() for f in cluster.frontends], timeout=30)


def all_serving(cluster) -> bool:
    try:
        return all(i["serving"] for i in infos(cluster))
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
        return False  # one is still restarting


def listeners(port: int) -> int:
    """How many sockets listen on `port` here (one per front end of the deployment: SO_REUSEPORT)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                count += state == "0A" and int(local.rsplit(":", 1)[1], 16) == port
    return count


def health(url: str) -> dict | None:
    """/health over a new connection (the kernel picks the replica per connection); None when nothing answers."""
    try:
        r = httpx.get(f"{url}/health", timeout=10, headers={"Connection": "close"})
    except httpx.HTTPError:
        return None
    return {"code": r.status_code, **r.json()}


def test_replicas_share_the_port(served):
    info = infos(served)
    assert [i["replica"] for i in info] == [0, 1] and all(i["serving"] for i in info)
    assert len({i["pid"] for i in info}) == 2
    answered = set()
    for _ in range(60):
        h = health(served.url)
        assert h is not None and h["code"] == 200, h
        answered.add(h["frontend"])
        if answered == {0, 1}:
            break
    assert answered == {0, 1}, f"only front end(s) {answered} answered 60 new connections"


def test_a_killed_frontend_restarts_while_the_other_serves(served):
    client_kw = dict(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=60)
    idle = free_blocks(served.refresh_engines())
    said: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=watch_frontends, args=(served, stop, said.append, 0.5), daemon=True)
    watcher.start()
    outcomes: list[tuple[float, float, str]] = []  # (started, ended, "ok" | error)

    def client_loop() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:  # a new client per request: a new connection, so that requests land on both front ends
                with openai.OpenAI(**client_kw) as c:
                    text = "".join(ch.choices[0].text for ch in c.completions.create(
                        model=MODEL, prompt="the state moves from prefill to decode", max_tokens=24, temperature=0,
                        stream=True))
                outcomes.append((t0, time.monotonic(), "ok" if text else "empty"))
            except Exception as e:  # noqa: BLE001 - counted
                outcomes.append((t0, time.monotonic(), type(e).__name__))

    # long streams, each on a connection of its own, in flight at the kill: those on the killed front end die with
    # it and must be aborted in the engines - they would decode for many more seconds otherwise
    streams: dict[int, str] = {}

    def long_stream(i: int) -> None:
        streams[i] = "starting"
        try:
            with openai.OpenAI(**client_kw) as c:
                for _ in c.completions.create(model=MODEL, prompt="a long answer", max_tokens=LONG_TOKENS,
                                              temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    streams[i] = "streaming"
            streams[i] = "done"
        except Exception:  # noqa: BLE001 - it died with its front end
            streams[i] = "died"

    clients = [threading.Thread(target=client_loop, daemon=True) for _ in range(4)]
    longs = [threading.Thread(target=long_stream, args=(i,), daemon=True) for i in range(LONG_STREAMS)]
    try:
        for t in clients:
            t.start()
        wait_for(lambda: sum(o[2] == "ok" for o in outcomes) >= 8, 120)
        for t in longs:
            t.start()
        wait_for(lambda: sum(v == "streaming" for v in streams.values()) == LONG_STREAMS, 60)
        before = infos(served)[0]
        port = int(served.url.rsplit(":", 1)[1])
        assert listeners(port) == 2
        killed_at = time.monotonic()
        os.kill(before["pid"], signal.SIGKILL)
        wait_for(lambda: "died" in streams.values(), 10, poll_s=0.05)
        time.sleep(0.5)  # every stream of the killed front end has seen its connection go
        dead = sum(v == "died" for v in streams.values())
        # within seconds the engines hold only what live clients still wait for: the surviving long streams and at
        # most one short request per client loop - not the dead front end's streams, far from their last token
        unfinished: list[int] = []
        running = lambda: sum(v == "streaming" for v in streams.values()) + len(clients)  # noqa: E731
        try:
            aborted_in = wait_for(lambda: unfinished.append(sum(ray.get(
                [e.num_unfinished() for e in served.refresh_engines().values()], timeout=10))) or
                unfinished[-1] <= running(), 5, poll_s=0.2)
        except AssertionError:
            raise AssertionError(f"the engines still run {unfinished[-1]} requests, {running()} live: the killed front "
                                 f"end's {dead} streams were not aborted") from None
        print(f"the killed front end's {dead} streams aborted in the engines {aborted_in:.2f} s after their clients "
              f"saw them die ({unfinished[-1]} requests left running, {running()} live)")
        # a connection made while the process is dying may land in its listening socket's queue and be reset with it
        # (as the requests in flight on it are), and a process's sockets close only when its last thread has exited
        # (its main thread shows as a zombie before that): the port is held to answering from the moment the killed
        # process's listening socket is gone
        wait_for(lambda: listeners(port) == 1, 30, poll_s=0.05)
        answers = []
        while True:  # the port keeps answering while replica 0 is away
            t = time.monotonic()
            answers.append((round(t - killed_at, 1), health(served.url), round(time.monotonic() - t, 2)))
            try:
                now = infos(served)[0]
            except Exception:  # noqa: BLE001 - restarting
                now = None
            if now is not None and now["serving"] and now["pid"] != before["pid"]:
                break
            assert time.monotonic() - killed_at < 180, "front end 0 did not serve again within 180 s"
            time.sleep(0.2)
        back_after = time.monotonic() - killed_at
        time.sleep(2)  # a few requests on the restarted front end too
    finally:
        stop.set()
        for t in clients + longs:
            t.join(timeout=120)
        watcher.join(timeout=30)
    print(f"front end 0 back after {back_after:.1f} s; {len(answers)} /health answers meanwhile, the slowest in "
          f"{max(a[2] for a in answers):.2f} s; said: {said}")
    assert now["restarts"] == before["restarts"] + 1
    bad = [a for a in answers if a[1] is None or a[1]["code"] != 200]
    assert not bad, f"the port did not answer /health (s after the kill, answer, s it took): {bad}"
    failed = [o for o in outcomes if o[2] != "ok"]
    print(f"{len(outcomes)} requests, failed: {failed}")
    # only requests in flight on the killed process may fail: at most one per client, all begun before the kill
    assert len(failed) <= len(clients) and all(o[0] <= killed_at + 0.5 for o in failed), failed
    print(f"long streams: {dead} died with the killed front end, the others {sorted(set(streams.values()))}")
    assert dead >= 1 and set(streams.values()) <= {"died", "done"}, streams
    assert sum(o[0] > killed_at + back_after for o in outcomes if o[2] == "ok") >= 1
    assert any("front end 0" in s and "restarted" in s for s in said), said
    assert any(h and h["frontend"] == 0 for h in (health(served.url) for _ in range(40)))
    held, _ = blocks_held(served.engines, idle, timeout_s=30)  # the dead front end's requests were aborted
    assert all(n == 0 for n in held.values()), f"blocks still held for the dead front end's requests: {held}"


def test_every_frontend_killed_comes_back(served):
    before = infos(served)
    for i in before:
        os.kill(i["pid"], signal.SIGKILL)
    took = wait_for(lambda: (h := health(served.url)) is not None and h["code"] == 200, 180, poll_s=0.5)
    print(f"/health answered again {took:.1f} s after both front ends were killed")
    wait_for(lambda: all_serving(served), 180, poll_s=0.5)
    after = infos(served)
    assert [a["restarts"] for a in after] == [b["restarts"] + 1 for b in before]
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=60) as c:
        out = c.completions.create(model=MODEL, prompt="back again", max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8


def test_live_soak_a_decode_engine_and_a_front_end_killed_nothing_failed_nothing_left(served, tmp_path):
    """The module's last test: 75 s of 4 streaming clients on its cluster (deploy.yaml's, 2 front ends): a decode
    engine SIGKILLed at 20 s (its pool replaces it), a front end at 40 s (Ray restarts it), an n-too-large request at
    60 s; the soak then stops the cluster and counts what is left."""
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--minutes", "1.25", "--fault-every", "20", "--faults", "kill-decode,kill-frontend,n-too-large",
                         "--clients", "4", "--settle", "150", "--out-dir", str(tmp_path)])
    STOPPED.append(True)
    report = soak_cluster(served, args, SHM_BEFORE, progress=print)
    kinds = [(f["kind"], f["problem"]) for f in report["faults"]]
    assert kinds == [("kill-decode", None), ("kill-frontend", None), ("n-too-large", None)], report["faults"]
    assert all(f["recovered_s"] is not None for f in report["faults"][:2]), report["faults"]
    t = report["traffic"]
    assert t["failed"] == 0 and t["completed"] > 0, t
    assert t["sent"] == t["completed"] + t["refused_429"] + t["refused_503"] + t["lost_with_frontend"], t
    assert report["problems"] == [], report["problems"]
    left = report["left_behind"]
    assert not left["shm_after_stop"] and not left["stragglers"] and left["nixl_agents_of_gone_prefills"] == 0
    assert left["pools_short"] == []
    assert set(left["blocks_held"].values()) == {0}, left
    assert report["start"]["engines"] != report["end"]["engines"]  # the killed decode engine was replaced
