"""The HTTP front end's own parts, without engines.

/health's verdict (`actors.frontend.health.health_report`) against a stand-in coordinator (a mock, for the race a
restarting coordinator makes - failing one question and answering the next - which the live test
tests/test_faults.py::test_coordinator_restart_rebuilds_the_registry meets only by chance): what requests are routed
on decides, never 503 while they are served. The same verdicts from the snapshot the front end keeps (`HealthWatch`):
no coordinator call per /health, refreshed in the background and at once when a request contradicts it.

The layers in front of vLLM's app (`actors.frontend.guards.guarded`) around a stand-in for it, over httpx's ASGI
transport: the API key on every route but /health, admission control (429 + Retry-After past the bound, streams
included), the cap on `n`/`best_of`. The live versions are in tests/default_layout/test_http.py."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client import Gauge

from actors.frontend.server import VLLM_ROUTES, FrontendSettings
from actors.frontend.health import HealthWatch, health_report
from actors.frontend.guards import GENERATION_ROUTES, Admission, guarded
from actors.frontend.router import Router
from cluster.core.metrics import ServiceMetrics, sample_value


class Unavailable(Exception):
    """Stands for Ray's ActorUnavailableError: the coordinator is restarting."""


class _Call:
    def __init__(self, coordinator: "FakeCoordinator", name: str):
        self.coordinator, self.name = coordinator, name

    def remote(self, *args):
        return self.coordinator.answer(self.name, *args)


class FakeCoordinator:
    """Answers `ready(role)` and `routes()` from `ready` and `routes`; the calls named in `down` raise Unavailable."""

    def __init__(self, ready: dict[str, list[str]], routes: dict[str, list[str]]):
        self.ready_engines, self.route_map, self.down, self.asked = ready, routes, set(), []

    def __getattr__(self, name: str) -> _Call:
        return _Call(self, name)

    async def answer(self, name: str, *args):
        self.asked.append(name)
        if name in self.down:
            raise Unavailable(name)
        return self.ready_engines[args[0]] if name == "ready" else self.route_map


PAIRED = ({"prefill": ["prefill-0"], "decode": ["decode-0", "decode-1"]},
          {"prefill-0": ["decode-0", "decode-1"]})


def report(coordinator: FakeCoordinator) -> tuple[int, dict]:
    return asyncio.run(health_report(coordinator, Router(coordinator), "m", timeout_s=1))


def test_a_ready_pair_is_ok():
    assert report(FakeCoordinator(*PAIRED)) == (200, {"status": "ok", "model": "m",
                                                      "ready": {"prefill": 1, "decode": 2}})


def test_a_coordinator_back_between_the_two_questions_is_ok():
    """The first question fails (restarting), the router's answers (back): ok, and not "unreachable" (it answered)."""
    coordinator = FakeCoordinator(*PAIRED)
    coordinator.down = {"ready"}
    code, body = report(coordinator)
    assert (code, body["status"], body["ready"]) == (200, "ok", {"prefill": 1, "decode": 2}), body
    assert "coordinator" not in body
    assert coordinator.asked == ["ready", "routes"]


def test_a_dead_coordinator_with_last_routes_is_ok_and_says_so():
    coordinator = FakeCoordinator(*PAIRED)

    async def go():
        router = Router(coordinator)
        await router.routes()  # the routes a request was given before the coordinator died
        coordinator.down = {"ready", "routes"}
        return await health_report(coordinator, router, "m", timeout_s=1)

    code, body = asyncio.run(go())
    assert (code, body["status"], body["coordinator"]) == (200, "ok", "unreachable: serving on its last routes")


@pytest.mark.parametrize("down", [{"ready"}, {"ready", "routes"}])
def test_no_routes_and_no_answer_is_503(down):
    coordinator = FakeCoordinator(*PAIRED)
    coordinator.down = down
    coordinator.route_map = {"prefill-0": []}  # the router's answer, where it gets one: nothing paired
    assert report(coordinator) == (503, {"status": "unavailable", "model": "m", "error": "Unavailable"})


def test_one_pool_is_degraded_none_is_503():
    code, body = report(FakeCoordinator({"prefill": ["prefill-0"], "decode": []}, {"prefill-0": []}))
    assert (code, body["status"], body["serving"]) == (200, "degraded", "prefill engines decode")
    code, body = report(FakeCoordinator({"prefill": [], "decode": []}, {}))
    assert (code, body["status"]) == (503, "unavailable")


# ---- /health from the front end's snapshot (`HealthWatch`) ---------------------------------------------------------
def watch_of(coordinator: FakeCoordinator, **kw) -> HealthWatch:
    return HealthWatch(coordinator, Router(coordinator), "m", timeout_s=1, **kw)


def without_age(report: tuple[int, dict]) -> tuple[int, dict]:
    code, body = report
    assert 0 <= body["age_s"] < 5, body
    return code, {k: v for k, v in body.items() if k != "age_s"}


@pytest.mark.parametrize("ready, routes, down", [
    (*PAIRED, set()),
    ({"prefill": ["prefill-0"], "decode": []}, {"prefill-0": []}, set()),
    ({"prefill": [], "decode": []}, {}, set()),
    (*PAIRED, {"ready"}),
], ids=["ok", "degraded", "unavailable", "coordinator-back"])
def test_the_snapshot_gives_health_reports_verdict(ready, routes, down):
    """/health from the snapshot says what `health_report` says, plus its age."""
    coordinator = FakeCoordinator(ready, routes)
    coordinator.down = down

    async def go():
        watch = watch_of(coordinator, interval_s=60)
        await watch.start()
        try:
            return await watch.report()
        finally:
            await watch.stop()

    assert without_age(asyncio.run(go())) == report(coordinator)


def test_health_calls_ask_the_coordinator_nothing():
    """A hundred /health answers cost no coordinator call: only the background refresh asks."""
    coordinator = FakeCoordinator(*PAIRED)

    async def go():
        watch = watch_of(coordinator, interval_s=60)
        await watch.start()
        asked = len(coordinator.asked)
        answers = [await watch.report() for _ in range(100)]
        await watch.stop()
        return asked, answers

    asked, answers = asyncio.run(go())
    assert asked == 3 and len(coordinator.asked) == 3  # ready x 2, routes: the first snapshot only
    assert all(without_age(a) == (200, {"status": "ok", "model": "m", "ready": {"prefill": 1, "decode": 2}})
               for a in answers)


def test_the_snapshot_is_refreshed_in_the_background():
    """Engines gone with no request to notice: /health turns 503 within a few refreshes, and says how old it is."""
    coordinator = FakeCoordinator(*PAIRED)

    async def go():
        watch = watch_of(coordinator, interval_s=0.05, min_gap_s=0.01)
        await watch.start()
        first = await watch.report()
        coordinator.ready_engines, coordinator.route_map = {"prefill": [], "decode": []}, {}
        await asyncio.sleep(0.3)
        later = await watch.report()
        await watch.stop()
        return first, later

    first, later = asyncio.run(go())
    assert first[0] == 200
    assert later[0] == 503 and later[1]["status"] == "unavailable" and later[1]["age_s"] < 0.2, later


def test_a_request_that_contradicts_the_snapshot_refreshes_it_before_health_answers():
    """No background refresh in the test's time (every 60 s): a request refused while the snapshot says 200 makes the
    next /health wait for a fresh one (503); a request served while it says 503 makes it 200 again; requests that
    agree with it ask nothing."""
    coordinator = FakeCoordinator(*PAIRED)

    async def go():
        watch = watch_of(coordinator, interval_s=60)
        await watch.start()
        asked = len(coordinator.asked)
        for _ in range(50):
            watch.observe(True)  # served while the snapshot says ok: nothing to ask
        assert (await watch.report())[0] == 200 and len(coordinator.asked) == asked
        coordinator.ready_engines, coordinator.route_map = {"prefill": [], "decode": []}, {}
        watch.observe(False)
        gone = await watch.report()
        coordinator.ready_engines, coordinator.route_map = PAIRED
        watch.observe(True)
        back = await watch.report()
        await watch.stop()
        return gone, back

    gone, back = asyncio.run(go())
    assert gone[0] == 503 and back[0] == 200, (gone, back)


def test_a_storm_of_failures_cannot_become_a_storm_of_coordinator_calls():
    """Every request failing while /health says ok: each contradicts the snapshot, but refreshes stay min_gap_s
    apart (0.05 s: at most ~7 in 0.3 s, 3 coordinator calls each)."""
    coordinator = FakeCoordinator(*PAIRED)

    async def go():
        watch = watch_of(coordinator, interval_s=60, min_gap_s=0.05)
        await watch.start()
        asked = len(coordinator.asked)
        t_end = time.monotonic() + 0.3
        while time.monotonic() < t_end:
            watch.observe(False)
            await asyncio.sleep(0.001)
        await watch.stop()
        return len(coordinator.asked) - asked

    calls = asyncio.run(go())
    assert 3 <= calls <= 3 * 8, calls


# ---- the front end's layers (`guarded`) around a stand-in for vLLM's app: API key, admission control, the n cap ----
KEY = "unit-test-key-0123"


class StandIn:
    """Stands for vLLM's app: answers every request 200 (generation as a 2-event stream when the body asks for one),
    holding generation requests until `gate` opens; counts the requests that reached it and how many at once."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.reached: list[tuple[str, str]] = []
        self.running = self.most_running = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.reached.append((scope["path"], body.decode()))
        stream = False
        if scope["path"] in GENERATION_ROUTES:
            stream = bool(json.loads(body or b"{}").get("stream"))
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            try:
                await self.gate.wait()
            finally:
                self.running -= 1
        kind = b"text/event-stream" if stream else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": b'data: {"x": 1}\n\n' if stream else b"{}",
                    "more_body": stream})
        if stream:
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def front(stand_in: StandIn, **settings) -> tuple[object, ServiceMetrics]:
    metrics = ServiceMetrics()
    base = dict(model_name="m", model_dir="/nowhere", max_model_len=64, coordinator_name="c", namespace="n")
    return guarded(stand_in, FrontendSettings(**{**base, **settings}), metrics), metrics


def layer(app, kind):
    while not isinstance(app, kind):
        app = app.app
    return app


def http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front", timeout=10)


async def until(predicate, timeout_s: float = 5) -> None:
    t_end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < t_end, "condition not reached"
        await asyncio.sleep(0.005)


GEN = {"model": "m", "prompt": "x", "max_tokens": 2}


def test_past_the_bound_requests_get_429_with_retry_after_at_once():
    """2 in flight and 3 waiting at most: of 10 requests sent together (every other one streamed) 5 get 429 +
    Retry-After at once - streams too, as a plain JSON error before any event - and never reach the app; the 5
    admitted run at most 2 at a time, the waiting ones in arrival order, all 200. Counted in /metrics by reason."""
    stand_in = StandIn()
    app, metrics = front(stand_in, max_requests_in_flight=2, max_queued_requests=3, retry_after_s=7)
    admission = layer(app, Admission)

    async def go():
        async with http(app) as c:
            tasks = []
            for i in range(10):  # one after another, so that arrival order is known
                body = {**GEN, "prompt": f"p{i}", "stream": i % 2 == 1}
                tasks.append(asyncio.create_task(c.post("/v1/completions", json=body)))
                await until(lambda: admission.in_flight + admission.queued + sum(t.done() for t in tasks) == i + 1)
            refused = [t for t in tasks if t.done()]
            assert (admission.in_flight, admission.queued, len(refused)) == (2, 3, 5)
            assert float(sample_value(metrics.render().decode(), "pd_requests_queued")) == 3
            stand_in.gate.set()
            return await asyncio.wait_for(asyncio.gather(*tasks), 10)

    answers = asyncio.run(go())
    assert [r.status_code for r in answers] == [200] * 5 + [429] * 5
    for r in answers[5:]:
        assert r.headers["retry-after"] == "7" and r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert (err["code"], err["type"], err["reason"]) == (429, "TooManyRequests", "queue_full"), err
        assert "retry after 7 s" in err["message"]
    assert answers[1].text.startswith("data: ") and answers[3].text.endswith("data: [DONE]\n\n")
    assert [json.loads(b)["prompt"] for _, b in stand_in.reached] == [f"p{i}" for i in range(5)]
    assert stand_in.most_running == 2
    assert (admission.in_flight, admission.queued) == (0, 0)
    text = metrics.render().decode()
    assert float(sample_value(text, 'pd_requests_refused_total{reason="queue_full"}')) == 5
    assert float(sample_value(text, 'pd_requests_total{status="429"}')) == 5
    assert float(sample_value(text, 'pd_requests_total{status="200"}')) == 5
    assert float(sample_value(text, "pd_requests_queued")) == 0


def test_routes_that_do_not_generate_are_not_held_by_the_bound():
    stand_in = StandIn()
    app, _ = front(stand_in, max_requests_in_flight=1, max_queued_requests=0)

    async def go():
        async with http(app) as c:
            held = asyncio.create_task(c.post("/v1/chat/completions", json={"model": "m", "messages": []}))
            await until(lambda: stand_in.running == 1)
            refused = await c.post("/v1/completions", json=GEN)
            others = [await c.get("/v1/models"), await c.post("/tokenize", json={"prompt": "x"}),
                      await c.get("/health"), await c.get("/metrics"), await c.get("/version")]
            stand_in.gate.set()
            return refused, others, await held

    refused, others, held = asyncio.run(go())
    assert refused.status_code == 429
    assert [r.status_code for r in others] == [200] * 5 and held.status_code == 200


def test_a_waiting_request_whose_client_leaves_gives_its_place_back():
    stand_in = StandIn()
    app, _ = front(stand_in, max_requests_in_flight=1, max_queued_requests=1)
    admission = layer(app, Admission)

    async def go():
        async with http(app) as c:
            held = asyncio.create_task(c.post("/v1/completions", json=GEN))
            await until(lambda: admission.in_flight == 1)
            waiting = asyncio.create_task(c.post("/v1/completions", json=GEN))
            await until(lambda: admission.queued == 1)
            waiting.cancel()  # the client went away while it waited
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert admission.queued == 0
            again = asyncio.create_task(c.post("/v1/completions", json=GEN))  # its place in the queue is free
            await until(lambda: admission.queued == 1)
            stand_in.gate.set()
            return await held, await again

    held, again = asyncio.run(go())
    assert (held.status_code, again.status_code) == (200, 200)
    assert (admission.in_flight, admission.queued) == (0, 0)


def test_a_waiting_request_whose_connection_closes_gives_its_place_back():
    """As uvicorn tells it: the request is not cancelled, `receive` answers http.disconnect once the client has gone.
    Its place in the queue is free at once (not when a place in flight frees), the app never sees it, nothing is sent;
    a waiting request whose client stays is admitted with its body intact."""
    stand_in = StandIn()
    app, metrics = front(stand_in, max_requests_in_flight=1, max_queued_requests=1)
    admission = layer(app, Admission)

    def connection(prompt: str):
        sent: list[dict] = []
        closed = asyncio.Event()
        messages = [{"type": "http.request", "body": json.dumps({**GEN, "prompt": prompt}).encode(),
                     "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await closed.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
        return app(scope, receive, send), closed, sent

    async def go():
        held, _, held_sent = connection("held")
        held = asyncio.create_task(held)
        await until(lambda: stand_in.running == 1)
        left, closed, left_sent = connection("left")
        left = asyncio.create_task(left)
        await until(lambda: admission.queued == 1)
        closed.set()  # its client goes away while it waits
        await asyncio.wait_for(left, 5)
        assert (admission.queued, left_sent) == (0, [])
        stays, _, stays_sent = connection("stays")
        stays = asyncio.create_task(stays)
        await until(lambda: admission.queued == 1)
        stand_in.gate.set()
        await asyncio.wait_for(asyncio.gather(held, stays), 5)
        return held_sent, stays_sent

    held_sent, stays_sent = asyncio.run(go())
    assert held_sent[0]["status"] == 200 and stays_sent[0]["status"] == 200
    assert [json.loads(b)["prompt"] for _, b in stand_in.reached] == ["held", "stays"]
    assert (admission.in_flight, admission.queued) == (0, 0)
    assert float(sample_value(metrics.render().decode(), 'pd_requests_total{status="disconnected"}')) == 1


def test_a_place_handed_to_a_request_cancelled_at_that_moment_is_passed_on():
    """The race `_leave` and a cancelled waiter make: the place given to it goes back, none leaks."""
    admission = Admission(None, 1, 1, 2, ServiceMetrics().requests, Gauge("q", "q", registry=None))

    async def go():
        assert await admission._enter()
        waiter = asyncio.create_task(admission._enter())
        await asyncio.sleep(0)
        assert admission.queued == 1
        admission._leave()  # hands the place to the waiter ...
        waiter.cancel()  # ... which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return admission.in_flight, admission.queued

    assert asyncio.run(go()) == (0, 0)


@pytest.mark.parametrize("route, body, field, value", [
    ("/v1/completions", {"n": 129}, "n", 129),
    ("/v1/completions", {"n": "129"}, "n", 129),  # as vLLM's request model reads it (pydantic's lax int)
    ("/v1/completions", {"n": 1000.0}, "n", 1000),
    ("/v1/completions", {"n": 2, "best_of": 200}, "best_of", 200),
    ("/v1/chat/completions", {"n": 129, "messages": []}, "n", 129),
])
def test_n_over_the_cap_is_a_400_naming_field_and_limit_before_anything_is_routed(route, body, field, value):
    stand_in = StandIn()
    stand_in.gate.set()  # (a request let through is answered 200, not held)
    app, metrics = front(stand_in)  # max_n: the schema's default, 128

    async def go():
        async with http(app) as c:
            return await c.post(route, json={**GEN, **body})

    r = asyncio.run(go())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"], err["reason"]) == (400, field, "n_over_limit"), err
    assert err["message"].startswith(f"{field} must be at most 128, got {value}"), err
    assert stand_in.reached == []
    assert float(sample_value(metrics.render().decode(), 'pd_requests_refused_total{reason="n_over_limit"}')) == 1


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"n": 128}), ("/v1/completions", {"n": "many"}), ("/v1/completions", {"n": None}),
    ("/v1/chat/completions", {"n": 3, "best_of": 128}), ("/tokenize", {"n": 1000}),
])
def test_n_within_the_cap_or_not_a_number_reaches_the_app(route, body):
    """At the cap, or not an int at all (vLLM's validation answers that), or not a generation route: passed on."""
    stand_in = StandIn()
    stand_in.gate.set()
    app, _ = front(stand_in)

    async def go():
        async with http(app) as c:
            return await c.post(route, json={**GEN, **body})

    assert asyncio.run(go()).status_code == 200 and len(stand_in.reached) == 1


ROUTES = sorted(VLLM_ROUTES | {"/metrics", "/v1/nowhere", "/"})


def test_every_route_but_health_needs_the_key():
    """With a key set: every route vLLM's app serves here, /metrics and unknown paths are 401 without it, with a wrong
    one or another scheme, and reach the app with it; /health never needs it. Unauthenticated generation requests
    take no place in flight or in the queue."""
    stand_in = StandIn()
    stand_in.gate.set()
    app, metrics = front(stand_in, api_key=KEY, max_requests_in_flight=1, max_queued_requests=0)

    async def go():
        out = {}
        async with http(app) as c:
            for path in ROUTES:
                method = "POST" if path in GENERATION_ROUTES or path in ("/tokenize", "/detokenize") else "GET"
                kw = {"json": GEN} if method == "POST" else {}
                out[path] = [(await c.request(method, path, headers=h, **kw))
                             for h in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {KEY}"},
                                       {"Authorization": f"Bearer {KEY}"})]
            out["/health"] = [await c.get("/health")]
            stand_in.gate.clear()  # the one place in flight taken by a client with the key ...
            held = asyncio.create_task(c.post("/v1/completions", json=GEN, headers={"Authorization": f"Bearer {KEY}"}))
            await until(lambda: stand_in.running == 1)
            flood = await asyncio.gather(*(c.post("/v1/completions", json=GEN) for _ in range(5)))  # ... 401, not 429
            stand_in.gate.set()
            assert (await held).status_code == 200
        return out, flood

    out, flood = asyncio.run(go())
    for path in ROUTES:
        *refused, allowed = out[path]
        for r in refused:
            assert r.status_code == 401, (path, r.status_code)
            assert r.json()["error"]["code"] == 401 and r.headers["www-authenticate"] == "Bearer"
        assert allowed.status_code == 200, path
    assert out["/health"][0].status_code == 200
    assert [r.status_code for r in flood] == [401] * 5
    assert float(sample_value(metrics.render().decode(), 'pd_requests_refused_total{reason="queue_full"}')) == 0
    assert {p for p, _ in stand_in.reached} == set(ROUTES) | {"/health"}


def test_without_a_key_every_route_is_open():
    stand_in = StandIn()
    stand_in.gate.set()
    app, _ = front(stand_in)

    async def go():
        async with http(app) as c:
            return [await c.get(p) for p in ("/v1/models", "/docs", "/openapi.json", "/metrics")]

    assert [r.status_code for r in asyncio.run(go())] == [200] * 4


def test_metrics_state_keeps_the_totals_of_engines_that_left_without_keeping_them():
    """/metrics' counters never go down when an engine leaves, and the front end's map of engines' last totals stays
    as big as the pools: engines that left fold into one sum per role."""
    from types import SimpleNamespace

    from actors.frontend.health import DEPARTED, cluster_state
    from cluster.core.metrics import TransferTotals

    live: dict[str, str] = {}

    class Coordinator:
        describe = SimpleNamespace(remote=lambda: _done({"engines": {e: {"role": r, "state": "ready"}
                                                                     for e, r in live.items()}}))

    class Engine:
        def __init__(self, n: int):
            self.n = n

        async def transfer_totals(self):
            return TransferTotals(bytes=self.n, computed_prompt_tokens=self.n)

    async def engine(engine_id, role):
        return Engine(int(engine_id.split("-")[1]) * 100)

    router = SimpleNamespace(engine=engine, retried=0,
                             choice=SimpleNamespace(decisions={}, views=0, view_seconds=0.0, view_failures=0, unasked=0,
                                                    suspected=0),
                             colocated={}, degraded=None, failed_over=0, waited_for_capacity=0, first_from_prefill=0, stale_routed=0,
                             local_prefill=0)
    seen: dict = {}
    totals = []
    for step in range(50):  # an autoscaled decode pool: engine decode-<step> replaces decode-<step - 1>
        live.clear()
        live.update({"prefill-0": "prefill", f"decode-{step + 1}": "decode"})
        state = asyncio.run(cluster_state(Coordinator(), router, seen))
        totals.append(state["transfers"].bytes)
    assert totals == sorted(totals) and totals[-1] == sum(100 * (i + 1) for i in range(50))
    assert state["computed_prompt_tokens"]["decode"] == totals[-1]
    assert len(seen) <= 4 and DEPARTED + "decode" in seen


async def _done(value):
    return value
