"""Prefill and decode pools autoscaling independently under real load on loopback (Ray Serve pools, real engines,
HTTP through the official `openai` client).

One cluster for the module: prefill and decode at TP 1, each pool 1..2 engines (differing TP sizes are the disagg
modules' subject; here a TP 2 decode engine took 142-235 s to load beside the load that grew its pool, a TP 1 engine
36 s: half the processes, each importing vLLM). A prompt-heavy load (long prompts, 2 tokens each) grows the prefill
pool and leaves the decode pool alone; a decode-heavy load (short prompts, long answers) grows the decode pool and
leaves the prefill pool alone; each shrinks back when its load goes. The decode pool shrinks while requests are still
decoding on the engine that leaves. Every response is compared with the colocated engine's answer for the same prompt
(itself checked against the rule the tiny model's weights implement), and every process of every engine that ever ran
is gone at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import ray

from actors.engine.settings import free_port
from cluster.core.config import DeployConfig
from cluster.cli.launch import Cluster, serve, stop_cluster
from tests.pd_helpers import oracle, until

pytestmark = pytest.mark.engine
MODEL = "tiny-hybrid"
DECODE_TP = 1
# request kinds: (number of prompts, prompt length, max_tokens)
KINDS = {"long": (4, 1800, 2), "short": (6, 24, 48), "tail": (4, 24, 300)}


@pytest.fixture(scope="module")
def scaled(ray_local, gdn_model):
    fast = {"upscale_delay_s": 2, "downscale_delay_s": 8, "look_back_s": 2, "drain_timeout_s": 90}
    cfg = DeployConfig.model_validate({
        "model": {"path": str(gdn_model), "name": MODEL},
        # the loads repeat a fixed set of prompts: with prefix caching the prefill engines would answer them from
        # their caches and the prompt-heavy load would not load them (tests/test_prefix_caching.py covers caching)
        # up to 2 + 2 engines on 2 cores: they share them (default_layout/test_own_cores.py owns cores)
        "prefill": {"tp": 1, "min_replicas": 1, "max_replicas": 2, "enable_prefix_caching": False, "share_cores": True,
                    "scaling": {**fast, "target_queued_prompt_tokens": 3000}},
        # decode waits longer to shrink: the countdown starts when test_decode_pool_grows_alone's load stops, and
        # test_decode_scale_down_with_requests_in_flight_loses_none needs its own requests decoding on both engines
        # by then (at 8 s, one run's decision came before any reached the new engine)
        "decode": {"tp": DECODE_TP, "min_replicas": 1, "max_replicas": 2, "enable_prefix_caching": False, "share_cores": True,
                   "scaling": {**fast, "downscale_delay_s": 15, "target_running_requests": 5}},
        "coordinator": {"name": "coordinator-autoscale", "namespace": "pd-test-autoscale"},
        "http": {"port": free_port()},
    })
    cluster = serve(cfg, progress=print)
    scaled = Scaled(cluster, PoolWatch(cluster))
    try:
        scaled.refs = references(cluster)
        yield scaled
    finally:
        scaled.watch.stop()
        stop_cluster(cluster, shutdown_serve=True, progress=print)
    # every process of every engine that ever ran (those that joined and left included) is gone with the cluster
    seen = dict(scaled.watch.pids)
    assert len(seen) >= 2, seen
    pids = [p for ps in seen.values() for p in ps]
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=30)
    alive = [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"engine processes of {sorted(seen)} alive after the cluster stopped: {alive}"


@dataclass
class Scaled:
    """The module's cluster and what its tests keep beside it: the registry's watcher and the reference answers.
    Each test starts from, and leaves, one engine per pool (the pools' minimum): none depends on another's order."""

    cluster: Cluster
    watch: "PoolWatch"
    refs: dict[str, list[tuple[list[int], int, str]]] = field(default_factory=dict)


class PoolWatch:
    """Samples the coordinator's registry every 0.25 s: how many engines each pool had (and when), and the pids of
    every engine that ever registered."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.pids: dict[str, list[int]] = {}
        self.started: dict[str, dict[int, float | None]] = {}  # engine -> pid -> its start time (pids get reused)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from actors.clients.engine_client import EngineClient

        ns = self.cluster.cfg.coordinator.namespace
        while not self._stop.wait(0.25):
            try:
                engines = ray.get(self.cluster.coordinator.describe(), timeout=10)["engines"]
            except Exception:  # noqa: BLE001 - the cluster is going away
                continue
            count = {"prefill": 0, "decode": 0}
            for engine_id, e in engines.items():
                count[e["role"]] += 1
                if engine_id not in self.pids:
                    try:
                        self.pids[engine_id] = ray.get(EngineClient.named(engine_id, ns).pids(), timeout=10)
                        self.started[engine_id] = {p: _started(p) for p in self.pids[engine_id]}
                    except Exception:  # noqa: BLE001 - try again next sample
                        pass
            self.samples.append((time.time(), count))

    def most(self, role: str, since: float) -> int:
        return max((c[role] for t, c in self.samples if t >= since), default=0)

    def now(self, role: str) -> int:
        return self.samples[-1][1][role] if self.samples else 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def references(cluster) -> dict[str, list[tuple[list[int], int, str]]]:
    """Per request kind: (prompt, max_tokens, expected text). The expected text is the colocated engine's; its token
    ids must equal the model's rule."""
    rng = random.Random(11)
    engine = cluster.engines["decode-0"]
    asked = [(kind, [1] + [rng.randrange(3, 1024) for _ in range(length - 1)], max_tokens)
             for kind, (n, length, max_tokens) in KINDS.items() for _ in range(n)]
    # all at once (the engine batches them); each checked against the rule, so batching cannot hide a wrong answer
    outs = ray.get([engine.generate(prompt_token_ids=p, max_tokens=m, ignore_eos=True) for _, p, m in asked])
    refs: dict[str, list[tuple[list[int], int, str]]] = {kind: [] for kind in KINDS}
    for (kind, prompt, max_tokens), out in zip(asked, outs):
        assert out["token_ids"] == oracle(prompt, max_tokens), "the colocated engine disagrees with the model's rule"
        refs[kind].append((prompt, max_tokens, out["text"]))
    return refs


class Load:
    """Closed-loop clients over HTTP; every answer is checked against the reference."""

    def __init__(self, scaled: Scaled):
        self.cluster = scaled.cluster
        self.refs = scaled.refs
        self.client = openai.AsyncOpenAI(base_url=f"{self.cluster.url}/v1", api_key="unused", max_retries=0, timeout=600)
        self.results: list[dict] = []
        self.groups: dict[str, tuple[asyncio.Event, list[asyncio.Task]]] = {}

    def start(self, name: str, kind: str, clients: int) -> None:
        stop = asyncio.Event()
        self.groups[name] = (stop, [asyncio.ensure_future(self._client(kind, stop, i)) for i in range(clients)])

    async def stop(self, name: str) -> None:
        stop, tasks = self.groups.pop(name)
        stop.set()
        await asyncio.gather(*tasks)

    async def _client(self, kind: str, stop: asyncio.Event, seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            prompt, max_tokens, expected = rng.choice(self.refs[kind])
            t0 = time.time()
            try:
                r = await self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                         extra_body={"ignore_eos": True})
                text, error = r.choices[0].text, None
            except Exception as e:  # noqa: BLE001 - recorded and failed on below
                text, error = None, f"{type(e).__name__}: {e}"
            self.results.append({"kind": kind, "start": t0, "end": time.time(), "ok": text == expected,
                                 "error": error, "got": text if text != expected else None})

    def check(self, since: float = 0.0) -> int:
        mine = [r for r in self.results if r["start"] >= since]
        bad = [r for r in mine if not r["ok"]]
        assert not bad, f"{len(bad)} of {len(mine)} requests failed or answered wrong, e.g. {bad[:3]}"
        return len(mine)


def events(cluster) -> dict:
    return ray.get(cluster.coordinator.pool_events())


def served_by(cluster, engine_id: str) -> float | None:
    from actors.clients.engine_client import EngineClient

    try:
        return ray.get(EngineClient.named(engine_id, cluster.cfg.coordinator.namespace).first_served(), timeout=10)
    except Exception:  # noqa: BLE001 - gone
        return None


def scale_up_breakdown(cluster, role: str, since: float) -> dict:
    """From the pool's scale-up decision to the first request the new engine served, and its parts."""
    ev = events(cluster)
    decision = next(d for d in ev["scaling"] if d["role"] == role and d["direction"] == "up" and d["time"] >= since)
    join = next(j for j in ev["joins"] if j["role"] == role and j["replica_started"] >= decision["time"])
    left = [e for e in ev["leaves"] if e["engine_id"] == join["engine_id"]]
    first = left[0].get("first_served") if left else served_by(cluster, join["engine_id"])
    out = {"engine_id": join["engine_id"], "reason": decision["reason"],
           "decision_to_replica_s": join["replica_started"] - decision["time"], **join["phases"],
           "registered_to_first_request_s": (first - join["registered"]) if first else None,
           "decision_to_first_request_s": (first - decision["time"]) if first else None}
    print(f"{role} scale-up: " + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}))
    # the new engine got traffic only once registered, its pairs negotiated and their plans installed
    assert out["registered_to_first_request_s"] is not None and out["registered_to_first_request_s"] > 0, out
    Path("results").mkdir(exist_ok=True)
    with open(f"results/scale-up-{role}.json", "w") as f:
        json.dump(out, f, indent=1)
    return out


def checked_decisions(load: Load, since: float) -> list[dict]:
    """Every request of `load` answered right; the scaling decisions taken since `since`."""
    n = load.check()
    mine = [d for d in events(load.cluster)["scaling"] if d["time"] >= since]
    print(f"{n} requests, all right; decisions: {[(d['role'], d['direction'], d['reason']) for d in mine]}")
    return mine


def joined_engine_served(cluster, role: str, since: float) -> bool:
    joins = [j for j in events(cluster)["joins"] if j["role"] == role and j["replica_started"] >= since]
    return bool(joins) and served_by(cluster, joins[-1]["engine_id"]) is not None


def test_prefill_pool_grows_and_shrinks_alone(scaled):
    """Long prompts: queued prompt tokens grow the prefill pool; the decode pool stays at one engine."""
    t0 = time.time()

    async def run():
        load = Load(scaled)
        load.start("hot", "long", 12)
        load.start("tail", "short", 1)
        await until(lambda: scaled.watch.now("prefill") == 2 and joined_engine_served(scaled.cluster, "prefill", t0), 600,
                    "the prefill pool grows to 2 and its new engine serves")
        await asyncio.sleep(3)
        await load.stop("hot")
        await until(lambda: scaled.watch.now("prefill") == 1 and any(l["role"] == "prefill" for l in events(scaled.cluster)["leaves"]),
                    180, "the prefill pool shrinks back to 1")
        await asyncio.sleep(1)
        await load.stop("tail")
        return load

    mine = checked_decisions(asyncio.run(run()), t0)
    assert [(d["role"], d["direction"]) for d in mine] == [("prefill", "up"), ("prefill", "down")]
    assert "prompt tokens" in mine[0]["reason"]
    assert scaled.watch.most("decode", t0) == 1, "the decode pool grew under a prompt-heavy load"
    scale_up_breakdown(scaled.cluster, "prefill", t0)
    assert_left_cleanly(scaled, "prefill", t0)
    assert_metrics_show(scaled, "prefill", "queued_prompt_tokens")


def test_decode_pool_grows_alone_then_shrinks_with_requests_in_flight(scaled):
    """Short prompts with long answers: running sequences grow the decode pool; the prefill pool stays at one. Then
    long answers keep decoding on both engines while the pool shrinks: the leaving engine finishes its requests (it
    refuses new ones; the router sends them elsewhere), then deregisters and stops."""
    assert scaled.watch.now("decode") == 1, "starts from the pool's minimum"
    t0 = time.time()

    async def grow():
        load = Load(scaled)
        load.start("hot", "short", 14)
        await until(lambda: scaled.watch.now("decode") == 2 and joined_engine_served(scaled.cluster, "decode", t0), 600,
                    "the decode pool grows to 2 and its new engine serves")
        await asyncio.sleep(2)
        await load.stop("hot")
        return load

    mine = checked_decisions(asyncio.run(grow()), t0)
    assert [(d["role"], d["direction"]) for d in mine][:1] == [("decode", "up")] and "sequences decoding" in mine[0]["reason"]
    assert all(d["role"] == "decode" for d in mine)
    assert scaled.watch.most("prefill", t0) == 1, "the prefill pool grew under a decode-heavy load"
    scale_up_breakdown(scaled.cluster, "decode", t0)

    # the decode pool waits longer to shrink (downscale_delay_s 15): these requests are decoding on both engines by then
    t1 = time.time()

    async def shrink():
        load = Load(scaled)
        load.start("tail", "tail", 4)
        await until(lambda: scaled.watch.now("decode") == 1 and any(l["role"] == "decode" and l["started"] >= t1
                                                                   for l in events(scaled.cluster)["leaves"]),
                    240, "the decode pool shrinks back to 1")
        await asyncio.sleep(2)
        await load.stop("tail")
        return load

    load = asyncio.run(shrink())
    n = load.check()
    leave = next(l for l in events(scaled.cluster)["leaves"] if l["role"] == "decode" and l["started"] >= t1)
    print(f"{n} requests, all right; the leaving engine: {leave}")
    assert leave["held_at_start"]["decodes"] >= 1, "no request was in flight on the engine that left"
    assert not leave["timed_out"]
    during = [r for r in load.results if r["start"] <= leave["started"] + leave["drain_s"] and r["end"] >= leave["started"]]
    assert during, "no request overlapped the drain"
    assert_left_cleanly(scaled, "decode", t1)
    assert_metrics_show(scaled, "decode", "running_requests")


def assert_metrics_show(scaled: Scaled, role: str, signal: str) -> None:
    """/metrics: the pool back at one engine, its target one, its load signal, and a decision each way."""
    text = httpx.get(f"{scaled.cluster.url}/metrics", timeout=30).text
    for direction in ("up", "down"):
        assert f'pd_scaling_decisions_total{{direction="{direction}",role="{role}"}}' in text, (role, direction)
    assert f'pd_pool_engines{{role="{role}",state="ready"}} 1.0' in text
    assert f'pd_pool_target_engines{{role="{role}"}} 1.0' in text
    assert f'pd_pool_load{{role="{role}",signal="{signal}"}}' in text
    assert 'direction="down"' in text.split("pd_pool_last_scaling_decision_timestamp_seconds{")[1]


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def assert_left_cleanly(scaled: Scaled, role: str, since: float) -> None:
    """The engine that left: deregistered (no pair names it) and none of its processes alive."""
    leave = next(l for l in events(scaled.cluster)["leaves"] if l["role"] == role and l["started"] >= since)
    desc = ray.get(scaled.cluster.coordinator.describe())
    assert leave["engine_id"] not in desc["engines"]
    assert all(leave["engine_id"] not in (p["prefill"], p["decode"]) for p in desc["pairs"])
    started = scaled.watch.started.get(leave["engine_id"], {})
    assert scaled.watch.pids.get(leave["engine_id"]), "never saw the leaving engine's processes"

    def alive() -> list[int]:
        return [p for p in scaled.watch.pids.get(leave["engine_id"], []) if psutil.pid_exists(p) and
                psutil.Process(p).status() != psutil.STATUS_ZOMBIE and _started(p) == started.get(p)]  # not a reused pid

    deadline = time.monotonic() + 15  # a signalled process may still be exiting on a busy machine; a leak stays
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(), f"processes of {leave['engine_id']} outlived it by 15 s: {alive()}"


def test_a_dead_engine_is_replaced(scaled):
    """SIGKILL the prefill engine's actor process: the coordinator drops it, its replica fails Serve's health check,
    and Serve starts a replica whose new engine joins and serves the right answers."""
    engines = ray.get(scaled.cluster.coordinator.describe())["engines"]
    victim = next(e for e, d in engines.items() if d["role"] == "prefill")
    pids = scaled.watch.pids[victim]
    children = [psutil.Process(p) for p in pids[1:] if psutil.pid_exists(p)]
    os.kill(pids[0], signal.SIGKILL)

    def replaced() -> bool:
        now = ray.get(scaled.cluster.coordinator.describe())["engines"]
        return victim not in now and any(d["role"] == "prefill" and d["state"] == "ready" for d in now.values())

    killed_at = time.time()
    took = asyncio.run(until(replaced, 400, "a new prefill engine replaces the killed one"))
    joins = [j for j in events(scaled.cluster)["joins"] if j["role"] == "prefill" and j["replica_started"] >= killed_at]
    assert joins and joins[0]["engine_id"] != victim, "no new prefill engine joined after the kill"
    prompt, max_tokens, expected = scaled.refs["short"][0]
    client = openai.OpenAI(base_url=f"{scaled.cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "the killed engine's vLLM processes live on"
    new = [e for e, d in ray.get(scaled.cluster.coordinator.describe())["engines"].items() if d["role"] == "prefill"]
    print(f"{victim} killed; {new} serving {took:.0f} s later")

