"""Engines dying for real (SIGKILL of the engine actor's process, by pid) under HTTP traffic: every affected request
ends with a complete response (retried on another pair when no token had streamed yet) or a clear error event - never
a hang - the coordinator takes the dead engine out of every pair, and the prefill engine holds no blocks for it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import json
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import ray

from actors.engine.actor import launch_engine_actor, stop_engine_actor
from actors.engine.settings import free_port
from actors.clients.engine_client import ENGINE_PREFIX
from cluster.cli.bench.faults import blocks_held, free_blocks
from cluster.cli.bench.faults import kill_engine as bench_kill_engine
from cluster.core.config import DeployConfig, load_deploy
from cluster.cli.launch import serve, stop_cluster
from cluster.cli.bench.soak_accounting import shm_files
from tests.pd_helpers import metric, wait_for

pytestmark = pytest.mark.engine
MODEL = "tiny-hybrid"
ROOT = Path(__file__).resolve().parent.parent
WINDOW_S = 20.0  # how soon a decode request whose prefill engine died before the read must end
SHM_BEFORE: set[str] = set()  # the engine files in /dev/shm before the module's cluster started
STOPPED: list[bool] = []  # set by the last test, which stops the cluster itself


@pytest.fixture(scope="module")
def served(ray_local, gdn_model):
    """deploy.yaml's deployment (transfer.verify, prefix caching, routing, local prefill as shipped), with only what
    a test must change: the model built for the tests, a coordinator and port of its own, two decode engines (one to
    fail over to), and the three engines sharing the 2 cores (cores as devices is tested in
    default_layout/test_own_cores.py)."""
    base = load_deploy(ROOT / "deploy.yaml").model_dump(exclude_unset=True)
    cfg = DeployConfig.model_validate({
        **base,
        "model": {**base["model"], "path": str(gdn_model)},
        "prefill": {**base["prefill"], "share_cores": True},
        "decode": {**base["decode"], "min_replicas": 2, "max_replicas": 2, "share_cores": True},
        "coordinator": {"name": "coordinator-faults", "namespace": "pd-test-faults"},
        "http": {**base["http"], "port": free_port()},
    })
    assert cfg.model.name == MODEL and cfg.transfer == load_deploy(ROOT / "deploy.yaml").transfer
    # engines as plain actors (pools="actors"): these tests kill them on purpose, and Serve would replace them
    SHM_BEFORE.update(shm_files())
    cluster = serve(cfg, progress=print, pools="actors")
    try:
        yield cluster
    finally:
        if not STOPPED:  # the last test stops it itself
            stop_cluster(cluster, shutdown_serve=True, progress=print)


@pytest.fixture(scope="module")
def idle_free(served) -> dict[str, int]:
    """Every engine's free block count while idle, by engine id: after each fault the survivors must return to it
    (tests add engines they start and drop the ones they kill)."""
    idle = free_blocks(served.engines)
    print(f"idle free blocks: {idle}")
    assert idle.keys() == served.engines.keys(), "an engine did not say how many blocks it has free"
    return idle


def kill_engine(cluster, engine_id: str) -> list[psutil.Process]:
    """SIGKILL the engine actor's process; returns its vLLM child processes (they must go too)."""
    return bench_kill_engine(cluster.engines[engine_id])


def reap(children: list[psutil.Process], timeout_s: float = 60) -> list[int]:
    """Wait for a killed engine's vLLM processes to exit by themselves; kill stragglers; returns their pids."""
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        p.kill()
    return [p.pid for p in alive]


def complete(url: str, prompt: list[int], max_tokens: int = 8) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    return {"status": r.status_code, **r.json()}


def assert_no_leaked_blocks(cluster, idle: dict[str, int], timeout_s: float = 10.0) -> None:
    """Every surviving engine's free block count returns to its idle value (nothing held for dead requests)."""
    held, took = blocks_held(cluster.engines, idle, timeout_s)
    assert held and all(n == 0 for n in held.values()), \
        f"blocks leaked (held per engine, None: no answer; after {took:.1f} s): {held}"
    print(f"free blocks back to idle on {sorted(held)} ({took:.2f} s)")


def test_decode_dies_mid_stream(served, idle_free):
    """SIGKILL the decode engine of a greedy stream after its first tokens: the stream goes on - the prompt plus the
    tokens already sent are prefilled again and decoded on the other decode engine - and the client gets one
    uninterrupted answer, token for token the one the cluster gives without the kill. The prefill side holds nothing
    and the coordinator takes the dead engine out of every pair."""
    url, prefill = served.url, served.engines["prefill-0"]
    body = {"model": MODEL, "prompt": [1] + list(range(3, 300)), "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "logprobs": 1}
    want = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    pieces, tokens, finish = [], [], None
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        # the first token may come from the prefill engine: the decode engine takes the request right after it
        busy: list[str] = []
        wait_for(lambda: busy.extend(e for e in ("decode-0", "decode-1")
                                     if ray.get(served.engines[e].num_unfinished()) == 1) or busy, 10)
        victim = busy[0]
        children = kill_engine(served, victim)
        t0 = time.monotonic()
        rest = [line for line in lines if line]
    took = time.monotonic() - t0
    for line in [first] + rest[:-1]:
        event = json.loads(line.removeprefix("data: "))
        assert "error" not in event, event
        choice = event["choices"][0]
        pieces.append(choice["text"])
        tokens += choice["logprobs"]["tokens"]
        finish = choice["finish_reason"] or finish
    print(f"stream finished {took:.2f} s after {victim} was killed, {len(tokens)} tokens")
    assert rest[-1] == "data: [DONE]" and finish == "length"
    assert "".join(pieces) == want["text"] and tokens == want["logprobs"]["tokens"] and len(tokens) == 200
    metrics = httpx.get(f"{url}/metrics").text
    assert float(metric(metrics, "pd_requests_failed_over_total")) >= 1
    assert ray.get(prefill.pending_sends(5.0)) == []
    removed = wait_for(lambda: victim not in ray.get(served.coordinator.ready("decode")), 15)
    print(f"coordinator removed {victim} within {removed:.2f} s of the stream's end")
    assert reap(children) == [], "vLLM processes of the killed engine had to be killed"
    served.engines.pop(victim)
    assert_no_leaked_blocks(served, idle_free)


def test_requests_routed_to_a_dead_decode_are_retried(served, idle_free, gdn_model):
    """Kill a decode engine while it is still registered: requests sent to it fail at their decode step before any
    token, free the prefill blocks, and complete on the other decode engine with the right output."""
    url, prefill = served.url, served.engines["prefill-0"]
    # bring the pool back to two decode engines (a new engine joins: registered, negotiated, then served); at TP 2,
    # so that it has shared memory to leave behind (a TP 1 CPU engine runs its model in its EngineCore: it maps none)
    engine, ref = launch_engine_actor(gdn_model, 2, role="decode", engine_id="decode-9", served_model=MODEL,
                                      name=f"{ENGINE_PREFIX}decode-9", namespace="pd-test-faults")
    ray.get(ref)
    ray.get(engine.register(served.coordinator))
    served.engines["decode-9"] = engine
    idle_free["decode-9"] = ray.get(engine.free_blocks())
    decodes = sorted(ray.get(served.coordinator.ready("decode")))
    assert len(decodes) == 2
    prompts = [[1] + [(7 * i + j) % 900 + 3 for j in range(40 + 30 * i)] for i in range(8)]
    want = [complete(url, p)["choices"][0]["text"] for p in prompts]  # both engines healthy: the reference

    victim = "decode-9"
    left = ray.get(served.engines[victim].leftovers())  # what its processes would leave if killed
    assert left.shm and os.path.isdir(left.tmpdir)
    children = kill_engine(served, victim)
    t_kill = time.monotonic()
    seen: dict[str, list[float]] = {}  # prefill request id -> [first, last] time its blocks were seen held
    done = threading.Event()

    def watch_prefill():
        while not done.is_set():
            now = time.monotonic()
            for rid in ray.get(prefill.pending_sends(0.0)):
                seen.setdefault(rid, [now, now])[1] = now
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_prefill)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: complete(url, p), prompts))
    done.set()
    watcher.join()
    longest = max((b - a for a, b in seen.values()), default=0.0)
    print(f"prefill blocks held at most {longest:.2f} s per request ({len(seen)} requests seen holding)")
    assert longest < 5.0
    assert [g["status"] for g in got] == [200] * len(prompts), [g for g in got if g["status"] != 200]
    assert [g["choices"][0]["text"] for g in got] == want
    held = ray.get(prefill.pending_sends(5.0))
    print(f"after killing {victim}: {len(prompts)} requests completed; prefill holds {held} "
          f"{time.monotonic() - t_kill:.2f} s after the kill")
    assert held == []
    took = wait_for(lambda: victim not in ray.get(served.coordinator.ready("decode")), 10)
    print(f"coordinator removed {victim} {time.monotonic() - t_kill:.2f} s after the kill ({took:.2f} s after the requests)")
    removed = ray.get(served.coordinator.removed_engines())
    assert victim in [r["engine_id"] for r in removed]
    assert httpx.get(f"{url}/health").status_code == 200
    assert reap(children) == []
    # a SIGKILLed engine's shared memory (4 MiB resident per CPU all-reduce segment) and TMPDIR outlived it before
    # the coordinator removed them once the engine was confirmed dead and its processes gone
    try:
        gone = wait_for(lambda: not any(os.path.exists(p) for p in left.shm + (left.tmpdir,)), 60)
    except AssertionError:
        served.engines.pop(victim)  # the later tests serve on without it
        raise AssertionError(f"still there 60 s after: {[p for p in left.shm + (left.tmpdir,) if os.path.exists(p)]}; "
                             f"the coordinator removed {ray.get(served.coordinator.cleaned_up()).get(victim)}") from None
    print(f"{victim}'s {len(left.shm)} shared-memory files and TMPDIR removed {gone:.2f} s after the requests")
    # the coordinator's sweep of the victim's node did it (some files may go with their own process; the sweep also
    # takes whatever else dead engines left there)
    removed = set(ray.get(served.coordinator.cleaned_up())[victim])
    assert left.tmpdir in removed and len(removed & (set(left.shm) | {left.tmpdir})) >= 2, removed
    served.engines.pop(victim)
    assert_no_leaked_blocks(served, idle_free)


def test_an_engine_joins_while_a_dead_decode_engine_is_still_listed(served, idle_free, gdn_model):
    """A decode engine that died a moment ago, before the coordinator noticed, is still registered when a new prefill
    engine joins, and pushing the new pair's plan to it fails. The join goes on without it - the coordinator confirms
    the death and takes the dead engine out of every pair - instead of the new engine being refused."""
    launched = {engine_id: launch_engine_actor(gdn_model, 1, role=engine_id.split("-")[0], engine_id=engine_id,
                                               served_model=MODEL, name=f"{ENGINE_PREFIX}{engine_id}",
                                               namespace="pd-test-faults")
                for engine_id in ("decode-8", "prefill-8")}
    ray.get([ref for _, ref in launched.values()])
    (doomed, _), (joining, _) = launched["decode-8"], launched["prefill-8"]
    ray.get(doomed.register(served.coordinator))
    served.engines["decode-8"] = doomed
    children = kill_engine(served, "decode-8")
    try:
        ray.get(joining.register(served.coordinator))
        engines = ray.get(served.coordinator.describe())["engines"]
        assert engines["prefill-8"]["state"] == "ready" and "decode-8" not in engines
        assert "decode-8" in [r["engine_id"] for r in ray.get(served.coordinator.removed_engines())]
        survivor = next(e for e in served.engines if e.startswith("decode") and e != "decode-8")
        assert ("prefill-8", survivor) in {(p["prefill"], p["decode"]) for p in
                                           ray.get(served.coordinator.describe())["pairs"]}
    finally:  # the later tests expect prefill-0 as the only prefill engine
        ray.get(served.coordinator.deregister("prefill-8"))
        stop_engine_actor(joining)
    assert reap(children) == []
    served.engines.pop("decode-8")
    assert_no_leaked_blocks(served, idle_free)


def test_coordinator_restart_rebuilds_the_registry(served, idle_free):
    """SIGKILL the coordinator: the front end keeps serving on the routes the coordinator last gave it (the pairs'
    plans are installed in their engines) - every request 200 with the same output, none waiting for the restart -
    while Ray restarts it; it re-registers every live engine (re-negotiating their pairs and re-pushing the plans).
    An outage shorter than the routes watch's deadline can pass unnoticed (the watch vouches for routes that were
    current when the coordinator died); a longer one has requests routed on the last routes, counted."""
    from actors.frontend.router import ROUTES_FALLBACK_AFTER_S, WATCH_WAIT_S

    url = served.url
    before = ray.get(served.coordinator.describe())
    prompt = [1] + list(range(3, 150))
    want = complete(url, prompt)["choices"][0]["text"]
    stale0 = float(metric(httpx.get(f"{url}/metrics").text, "pd_requests_on_last_routes_total"))
    os.kill(ray.get(served.coordinator.pid()), signal.SIGKILL)
    t0 = time.monotonic()
    served_meanwhile, slowest = 0, 0.0
    while True:
        t1 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        slowest = max(slowest, time.monotonic() - t1)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        served_meanwhile += 1
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 200, health.text
        try:
            ray.get(served.coordinator.rebuilt_engines(), timeout=0.5)
            break
        except ray.exceptions.GetTimeoutError:
            assert time.monotonic() - t0 < 90, "the coordinator was not back 90 s after it was killed"
    took = time.monotonic() - t0
    stale = float(metric(httpx.get(f"{url}/metrics").text, "pd_requests_on_last_routes_total")) - stale0
    print(f"coordinator killed: back after {took:.1f} s; {served_meanwhile} requests served meanwhile (slowest "
          f"{slowest:.1f} s), {stale:.0f} on the last routes")
    assert served_meanwhile >= 1 and slowest < 10, (served_meanwhile, slowest)  # none waited for the restart
    if took > WATCH_WAIT_S + ROUTES_FALLBACK_AFTER_S + 1:
        assert stale >= 1, "no request was routed on the last routes while the coordinator was down"
    after = ray.get(served.coordinator.describe())
    assert {k: v["state"] for k, v in after["engines"].items()} == {k: v["state"] for k, v in before["engines"].items()}
    assert sorted(map(str, after["pairs"])) == sorted(map(str, before["pairs"]))
    assert sorted(ray.get(served.coordinator.rebuilt_engines())) == sorted(before["engines"])
    assert_no_leaked_blocks(served, idle_free)


def test_with_the_decode_pool_dead_the_prefill_engine_serves_whole_requests(served, idle_free, gdn_model):
    """SIGKILL the last decode engine: the decode pool is empty, and the prefill engine, which would otherwise sit
    idle while every request got a 503, runs requests whole - all 200, the same outputs as through the pair, /health
    200 "degraded", counted in /metrics. A new decode engine joins: pairs serve again and /health says "ok"."""
    url = served.url
    replacement, started = launch_engine_actor(gdn_model, 1, role="decode", engine_id="decode-7", served_model=MODEL,
                                               name=f"{ENGINE_PREFIX}decode-7", namespace="pd-test-faults")
    prompts = [[1] + [(13 * i + j) % 900 + 3 for j in range(50 + 40 * i)] for i in range(6)]
    want = [complete(url, p)["choices"][0]["text"] for p in prompts]  # through the pair
    decodes = [e for e in served.engines if e.startswith("decode")]
    children = [c for e in decodes for c in kill_engine(served, e)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # at once: some race the coordinator's notice
        got = list(pool.map(lambda p: complete(url, p), prompts))
    assert [g["status"] for g in got] == [200] * len(prompts), [g for g in got if g["status"] != 200]
    assert [g["choices"][0]["text"] for g in got] == want
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
    assert health.json()["serving"] == "prefill engines decode"
    metrics = httpx.get(f"{url}/metrics").text
    assert float(metric(metrics, 'pd_requests_colocated_total{role="prefill"}')) >= 1
    assert float(metric(metrics, 'pd_degraded{role="prefill"}')) == 1
    assert reap(children) == []
    for e in decodes:
        served.engines.pop(e)
        idle_free.pop(e, None)

    ray.get(started)
    ray.get(replacement.register(served.coordinator))
    served.engines["decode-7"] = replacement
    idle_free["decode-7"] = ray.get(replacement.free_blocks())
    assert complete(url, prompts[0])["choices"][0]["text"] == want[0]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert float(metric(httpx.get(f"{url}/metrics").text, 'pd_degraded{role="prefill"}')) == 0
    assert_no_leaked_blocks(served, idle_free)


def test_prefill_dies_after_prefill_before_the_read(served, idle_free):
    """The window between a prefill and the decode engine's read, hit exactly: prefill a request, SIGKILL the prefill
    engine, then hand its transfer parameters to a decode engine (what the router does next). The decode request
    ends - completed by recomputing, or failed with an error - within seconds, and the decode engine frees every
    block it took for it."""
    prefill = served.engines["prefill-0"]
    decode_id = sorted(e for e in served.engines if e.startswith("decode"))[0]
    decode = served.engines[decode_id]
    prompt = [1] + list(range(3, 400))
    sampling = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    want, _ = asyncio.run(run_decode(decode, prompt, sampling, None, "window-ref"))  # colocated reference
    params = ray.get(prefill.prefill(prompt, "window-1")).kv_transfer_params
    children = kill_engine(served, "prefill-0")
    t0 = time.monotonic()
    try:  # a hang ends here, with how long it was given, not at the test's time limit
        out, err = asyncio.run(asyncio.wait_for(run_decode(decode, prompt, sampling, params, "window-1"), 120))
    except asyncio.TimeoutError:
        pytest.fail("the decode request had not ended 120 s after its prefill engine died")
    took = time.monotonic() - t0
    print(f"decode after the prefill engine died: {'completed ' + str(len(out)) + ' tokens' if err is None else 'failed: ' + str(err)[:200]} in {took:.2f} s")
    # within seconds: the read of a dead engine fails at once (UCX is refused the connection) - or reads the blocks if
    # its EngineCore has not exited yet - and an 8-token decode, recomputing the 400-token prompt, takes ~1 s here
    assert took < WINDOW_S, f"the decode request took {took:.1f} s to end after its prefill engine died"
    assert err is not None or out == want  # recomputed locally: the right tokens, not garbage
    assert ray.get(decode.num_unfinished()) == 0
    assert reap(children) == []
    served.engines.pop("prefill-0")
    assert_no_leaked_blocks(served, idle_free)


async def run_decode(decode, prompt, sampling, params, rid):
    """A decode request straight on the engine (what the router does after a prefill); (tokens, error or None)."""
    out, err = [], None
    try:
        stream = decode.decode(prompt, dict(sampling), params, rid)
        async for ref in stream:
            out += (await ref)["token_ids"]
    except Exception as e:  # noqa: BLE001 - a clear failure is an allowed outcome
        err = e
    return out, err


def test_with_the_prefill_pool_dead_decode_engines_serve_whole_requests_then_503(served, gdn_model):
    """The only prefill engine is dead (killed by the test before): the decode engine runs requests whole - 200s with
    the output it gives alone, /health 200 "degraded", counted in /metrics. Then the last decode engine dies under a
    stream: new requests get 503 + Retry-After at once (not a hang or a 500) and /health turns 503, while the stream,
    which its client cannot retry, waits for an engine (`routing.failover_wait_s`); once a new one registers it goes
    on there and ends token for token as the decode engine alone gives it."""
    url = served.url
    (decode_id, decode), = [(e, h) for e, h in served.engines.items() if e.startswith("decode")]
    # the engine that will join once nothing serves: it boots meanwhile, and registers only when told
    replacement, started = launch_engine_actor(gdn_model, 1, role="prefill", engine_id="prefill-9", served_model=MODEL,
                                               name=f"{ENGINE_PREFIX}prefill-9", namespace="pd-test-faults")
    prompts = [[1] + [(11 * i + j) % 900 + 3 for j in range(30 + 50 * i)] for i in range(4)]
    want = [ray.get(decode.generate(prompt_token_ids=p, max_tokens=8, ignore_eos=True))["text"] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: complete(url, p), prompts))
    assert [g["status"] for g in got] == [200] * len(prompts), got
    assert [g["choices"][0]["text"] for g in got] == want
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
    assert health.json()["serving"] == "decode engines prefill"
    metrics = httpx.get(f"{url}/metrics").text
    assert float(metric(metrics, 'pd_requests_colocated_total{role="decode"}')) >= len(prompts)
    assert float(metric(metrics, 'pd_degraded{role="decode"}')) == 1

    long_prompt = [1] + list(range(5, 200))
    long_want = ray.get(decode.generate(prompt_token_ids=long_prompt, max_tokens=160, ignore_eos=True))["text"]
    events: list[dict] = []
    ended: list[str] = []

    def stream() -> None:
        body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 160, "ignore_eos": True, "temperature": 0,
                "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line.removeprefix("data: ")))
                    elif line == "data: [DONE]":
                        ended.append("done")
        except Exception as e:  # noqa: BLE001 - reported by the assertions
            ended.append(f"{type(e).__name__}: {e}")

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    wait_for(lambda: len(events) >= 10, 60)
    children = kill_engine(served, decode_id)
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}, timeout=60)
    assert r.status_code == 503 and r.headers.get("retry-after")
    assert r.json()["error"]["code"] == 503 and r.json()["error"]["message"]
    wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, 15)
    print(f"last engine dead: 503 after {time.monotonic() - t0:.2f} s, /health 503")
    assert reap(children) == []
    served.engines.pop(decode_id)
    time.sleep(2)
    assert reader.is_alive() and not ended, f"the stream ended while no engine could take it: {ended}"
    waiting = len(events)
    ray.get(started)
    ray.get(replacement.register(served.coordinator))
    served.engines["prefill-9"] = replacement
    joined = time.monotonic()
    reader.join(timeout=180)
    print(f"the stream waited {joined - t0:.1f} s with {waiting} events sent, then ended {time.monotonic() - joined:.2f} s "
          f"after an engine joined: {ended}")
    assert ended == ["done"], ended
    assert all("error" not in e for e in events), [e for e in events if "error" in e][:1]
    assert "".join(e["choices"][0]["text"] for e in events) == long_want
    metrics = httpx.get(f"{url}/metrics").text
    assert float(metric(metrics, "pd_requests_waited_for_engine_total")) >= 1
    assert float(metric(metrics, 'pd_requests_colocated_total{role="prefill"}')) >= 1


def test_a_stop_right_after_an_engine_is_killed_leaves_nothing_behind(served, gdn_model):
    """The module's last test: a decode engine of a live pair (after the earlier tests only a prefill engine is left
    serving: a decode engine joins it first) takes a little load, is SIGKILLed with requests in flight, and the cluster
    is stopped at once, before anyone has noticed the death. Within a deadline no process of any engine runs, /dev/shm
    holds no engine file it did not hold before the module's cluster started (those of the engines killed by the
    earlier tests included), and no engine TMPDIR remains."""
    assert any(e.startswith("prefill") for e in served.engines), f"no prefill engine left serving: {served.engines}"
    if not any(e.startswith("decode") for e in served.engines):
        joining, started = launch_engine_actor(gdn_model, 1, role="decode", engine_id="decode-8", served_model=MODEL,
                                               name=f"{ENGINE_PREFIX}decode-8", namespace="pd-test-faults")
        served.engines["decode-8"] = joining
        ray.get(started)
        ray.get(joining.register(served.coordinator))
        wait_for(lambda: "decode-8" in {d for ds in ray.get(served.coordinator.routes()).values() for d in ds}, 30)
    pids = {p for e in served.engines.values() for p in ray.get(e.pids(), timeout=30)}
    tmpdirs = {ray.get(e.leftovers(), timeout=30).tmpdir for e in served.engines.values()}
    assert len(tmpdirs) == len(served.engines) and all(map(os.path.isdir, tmpdirs))
    prompt = [1] + list(range(3, 200))

    def complete_one() -> int:
        try:
            return httpx.post(f"{served.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 64, "ignore_eos": True}).status_code
        except httpx.HTTPError:
            return 0

    decodes = [e for e in served.engines if e.startswith("decode")]
    # until a request has gone through a pair (the front end's router sees a new pair within seconds)
    wait_for(lambda: complete_one() == 200 and any(ray.get(served.engines[d].first_served(), timeout=30) is not None
                                                   for d in decodes), 60, poll_s=0.5)
    busy: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        load = [pool.submit(complete_one) for _ in range(3)]
        wait_for(lambda: busy.extend(d for d in decodes if ray.get(served.engines[d].num_unfinished()) > 0) or busy, 30)
        victim = busy[0]
        bench_kill_engine(served.engines[victim])
        stop_cluster(served, shutdown_serve=True, progress=print)
        STOPPED.append(True)  # only once it has stopped: a stop that failed is tried again by the fixture
        concurrent.futures.wait(load, timeout=90)

    def leftovers() -> list[str]:
        procs = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    procs.append(f"process {pid}")
            except psutil.NoSuchProcess:
                pass
        return procs + sorted(shm_files() - SHM_BEFORE) + sorted(t for t in tmpdirs if os.path.exists(t))

    left: list[str] = []
    try:
        took = wait_for(lambda: not left.__setitem__(slice(None), leftovers()) and not left, 60, poll_s=0.5)
    except AssertionError:
        raise AssertionError(f"left behind 60 s after the stop: {left}") from None
    print(f"nothing of the {len(pids)} engine processes, their shared memory and TMPDIRs left {took:.2f} s after the "
          "stop")
