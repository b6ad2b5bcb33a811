"""How the router ends a request whose decode engine ends it abnormally. Stand-ins for the coordinator and engines
(speaking `EngineClient`'s calls: prefill, decode_channel, submit_decode, release, abort; outputs are vLLM's own
objects) (a mock, for faults too slow or racy to cause for real here): an engine stopped under a request (vLLM's
finish_reason "abort", what a scale-down past its drain timeout does), a state read that failed ("error"), an engine
gone between the coordinator's answer and the call. Never a short answer reported as a success; a failure before the
first token is retried once on a pair without the engine at fault; a failover that finds no engine waits for one to
join. The real versions: tests/test_disagg_gdn.py (a read racing a prefill engine's departure), tests/test_autoscale.py
(scale-down with requests in flight) and tests/test_faults.py (the last engine killed under a stream, a new one
joining)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import pytest

from actors.clients.engine_client import Prefilled
from actors.frontend.router import EngineFailure, NoCapacity, Router


def _ready(value):
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


class FakeEngine:
    """An `EngineClient`'s prefill and decode-channel calls: `outputs` are what its decode side produces for any
    request, one channel item each. Its prefill (answered on the channel, `submit_prefill`, or as the call's return)
    never samples a first token (no `first`), so every request takes the decode-first path here."""

    def __init__(self, outputs: list[dict]):
        self.outputs, self.released, self.aborted, self.submitted, self.cancelled = outputs, [], [], [], []
        self.channels: dict[str, asyncio.Queue] = {}

    def prefill(self, prompt, rid, *, prompt_logprobs=None, first_token=None, continued=0):
        return _ready(Prefilled({"remote_request_id": rid}))

    def release(self, ids):
        return _ready(self.released.extend(ids))

    def submit_prefill(self, channel_id, rid, prompt, prompt_logprobs=None, first_token=None, continued=0):
        self.channels[channel_id].put_nowait((rid, Prefilled({"remote_request_id": rid})))
        return _ready(None)

    def cancel_prefill(self, rid):
        return _ready(self.cancelled.append(rid))

    def abort(self, rid):
        self.aborted.append(rid)

    def decode_channel(self, channel_id, address=None):
        return self._channel(channel_id, address)

    async def _channel(self, channel_id, address=None):
        assert address is None, "no node id: the router uses the Ray stream"
        queue = self.channels[channel_id] = asyncio.Queue()
        yield _ready([])
        while True:
            yield _ready([await queue.get()])

    def submit_decode(self, channel_id, rid, prompt, params, kv_params, continued=0):
        self.submitted.append((list(prompt), params, kv_params))
        async def produce():  # one output per engine step, a step apart (the caller reads each before the next)
            for out in self.outputs:
                self.channels[channel_id].put_nowait((rid, request_output(rid, **out)))
                await asyncio.sleep(0.02)

        self.producer = asyncio.ensure_future(produce())
        return _ready(None)


def request_output(rid: str, token_ids: list[int], text: str, finish_reason: str | None):
    from vllm.outputs import CompletionOutput, RequestOutput

    c = CompletionOutput(index=0, text=text, token_ids=list(token_ids), cumulative_logprob=None, logprobs=None,
                         finish_reason=finish_reason)
    return RequestOutput(rid, None, [1, 2, 3], None, [c], finished=finish_reason is not None)


class FakeCoordinator:
    def __init__(self, engines: dict[str, FakeEngine | None], pairs: list[tuple[str, str]]):
        self.engines, self.pairs, self.reported = engines, pairs, []
        self.ready = SimpleNamespace(remote=lambda role: _ready(sorted({p if role == "prefill" else d for p, d in self.pairs})))
        self.routes = SimpleNamespace(remote=lambda: _ready(
            {p: [d for q, d in self.pairs if q == p] for p in sorted({p for p, _ in self.pairs})}))
        self.client = SimpleNamespace(remote=lambda e: _ready(self.engines.get(e)))
        self.engine_failed = SimpleNamespace(remote=lambda e: _ready(self.reported.append(e)))


def tokens(*ids, finish=None):
    return {"token_ids": list(ids), "text": "".join(f"<{i}>" for i in ids), "finish_reason": finish}


async def collect(router: Router, **sampling) -> list[dict]:
    return [out async for out in router.generate([1, 2, 3], {"max_tokens": 3, **sampling})]


ABORT = {"token_ids": [], "text": "", "finish_reason": "abort"}


async def question_ended(router: Router, timeout_s: float = 5.0) -> None:
    """Until the routes question the router asks in the background while the coordinator is away has ended
    (answered, failed or past its deadline)."""
    t0 = time.monotonic()
    while router._routes_question is not None and not router._routes_question.done():
        assert time.monotonic() - t0 < timeout_s, "the background routes question did not end"
        await asyncio.sleep(0.01)


def test_an_aborted_request_is_never_a_short_answer_it_continues_elsewhere():
    """The decode engine stops under a request after two of its three tokens: the stream goes on, the prompt plus
    the two tokens sent are run again - here on the prefill engine alone, the decode pool having no other engine -
    for the one token left, and the caller sees one uninterrupted answer."""
    d = FakeEngine([tokens(5), tokens(6), ABORT])
    p = FakeEngine([tokens(7, finish="length")])
    router = Router(FakeCoordinator({"p": p, "d": d}, [("p", "d")]))
    outs = asyncio.run(collect(router, seed=40))
    assert [t for o in outs for t in o["token_ids"]] == [5, 6, 7] and outs[-1]["finish_reason"] == "length"
    (prompt, params, kv_params), = p.submitted
    assert prompt == [1, 2, 3, 5, 6] and kv_params is None  # colocated on the prefill engine (degraded mode)
    assert (params.max_tokens, params.seed) == (1, 42) and router.failed_over == 1 and router.retried == 0


@pytest.mark.parametrize("sampling, why", [
    ({"presence_penalty": 0.5}, "presence/frequency"), ({"frequency_penalty": 0.5}, "presence/frequency"),
    ({"stop": ["zz"]}, "stop strings: the engine holds back text")])
def test_a_continuation_that_would_be_another_request_is_refused(sampling, why):
    """Presence/frequency penalties count generated tokens only (the tokens sent would become prompt); with stop
    strings the engine held back text that may begin one, and it died with the engine: the continuation would not be
    the request the caller asked for. The stream ends with a clear error instead."""
    d = FakeEngine([tokens(5), ABORT])
    router = Router(FakeCoordinator({"p": FakeEngine([tokens(7)]), "d": d}, [("p", "d")]))
    with pytest.raises(EngineFailure, match=f"the engine aborted.*not continued elsewhere: {why}") as e:
        asyncio.run(collect(router, **sampling))
    assert e.value.streamed and router.failed_over == 0


def test_an_error_from_an_engine_serving_whole_requests_is_that_engines_failure():
    """In degraded mode (no pair ready) the prefill engine runs a request whole; if it ends the request with an error
    that is its own failure - not a state read from a prefill engine - and the retry avoids it."""
    alone = FakeEngine([{"token_ids": [], "text": "", "finish_reason": "error"}])
    coordinator = FakeCoordinator({"p": alone}, [])
    coordinator.routes = SimpleNamespace(remote=lambda: _ready({"p": []}))
    coordinator.ready = SimpleNamespace(remote=lambda role: _ready(["p"] if role == "prefill" else []))
    router = Router(coordinator)
    with pytest.raises(NoCapacity, match="no prefill or decode engine is registered and ready$"):
        asyncio.run(collect(router))  # nothing was sent: refused at once (its client can retry), no wait
    assert coordinator.reported == ["p"] and router.retried == 1 and router.waited_for_capacity == 0


class ChangingCoordinator(FakeCoordinator):
    """No prefill engine; the decode engines `decodes` lists (a test changes it), each served by `engines`."""

    def __init__(self, engines: dict[str, FakeEngine], decodes: list[str]):
        super().__init__(engines, [])
        self.decodes = decodes
        self.routes = SimpleNamespace(remote=lambda: _ready({}))
        self.ready = SimpleNamespace(remote=lambda role: _ready(list(self.decodes) if role == "decode" else []))


def test_a_failover_that_finds_no_engine_waits_for_one_to_join():
    """The only engine stops under a stream after one token (the prefill pool is empty): the stream, which its
    client cannot retry, is not failed - it waits for an engine. The pool's replacement registers under the dead
    engine's own id (pools reuse ids): once that id has left the lists and is listed again it is a new engine, and
    the stream goes on there. Meanwhile a new request is refused at once (503: its client can retry)."""
    coordinator = ChangingCoordinator({"d": FakeEngine([tokens(5), ABORT])}, ["d"])
    router = Router(coordinator, failover_wait_s=30)

    async def scenario():
        stream = asyncio.ensure_future(collect(router))
        await asyncio.sleep(0.3)
        assert not stream.done()
        coordinator.decodes[:] = []  # the dead engine is taken out
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(NoCapacity, match="no prefill or decode engine") as refused:
            await collect(router)
        assert asyncio.get_running_loop().time() - t0 < 0.2 and "waited" not in str(refused.value)
        await asyncio.sleep(0.6)
        assert not stream.done()
        coordinator.engines["d"] = FakeEngine([tokens(6, finish="length")])  # its replacement registers
        coordinator.decodes[:] = ["d"]
        return await asyncio.wait_for(stream, 5)

    outs = asyncio.run(scenario())
    assert [t for o in outs for t in o["token_ids"]] == [5, 6] and outs[-1]["finish_reason"] == "length"
    assert router.waited_for_capacity == 1 and router.failed_over == 1
    (prompt, _, _), = coordinator.engines["d"].submitted
    assert prompt == [1, 2, 3, 5]


def test_a_failover_waits_for_an_engine_only_so_long():
    """The engine that failed the stream stays listed (not yet taken out) and nothing joins: after
    `failover_wait_s` the stream ends with the error and how long it waited."""
    coordinator = ChangingCoordinator({"d": FakeEngine([tokens(5), ABORT])}, ["d"])
    router = Router(coordinator, failover_wait_s=0.5)
    with pytest.raises(NoCapacity, match=r"no prefill or decode engine is registered and ready \(waited 0.5 s"):
        asyncio.run(collect(router))
    assert router.waited_for_capacity == 1


def test_streams_waiting_for_an_engine_share_one_poll():
    """Ten streams whose only engine stopped under them wait together: the coordinator is asked for its lists about
    once per poll interval, not once per stream (a burst of failovers would otherwise be a burst of questions)."""
    from actors.frontend.router import CAPACITY_POLL_S

    coordinator = ChangingCoordinator({"d": FakeEngine([tokens(5), ABORT])}, ["d"])
    asked = []
    ready = coordinator.ready.remote
    coordinator.ready = SimpleNamespace(remote=lambda role: asked.append(role) or ready(role))
    router = Router(coordinator, failover_wait_s=30)

    async def scenario():
        streams = [asyncio.ensure_future(collect(router)) for _ in range(10)]
        await asyncio.sleep(0.3)
        coordinator.decodes[:] = []  # the dead engine is taken out; all ten wait
        asked.clear()
        waited = 4 * CAPACITY_POLL_S
        await asyncio.sleep(waited)
        polls = len(asked)
        coordinator.engines["d"] = FakeEngine([tokens(6, finish="length")])
        coordinator.decodes[:] = ["d"]
        outs = await asyncio.wait_for(asyncio.gather(*streams), 5)
        return polls, waited, outs

    polls, waited, outs = asyncio.run(scenario())
    assert all([t for o in out for t in o["token_ids"]] == [5, 6] for out in outs)
    assert router.waited_for_capacity == 10
    assert 1 <= polls <= waited / CAPACITY_POLL_S + 2, polls  # one stream alone would ask as often; ten did not ask 10x


class SilentEngine(FakeEngine):
    """A decode engine alive but stuck: it takes requests and sends nothing; its health goes unanswered."""

    def submit_decode(self, channel_id, rid, prompt, params, kv_params, continued=0):
        self.submitted.append((list(prompt), params, kv_params))
        return _ready(None)

    async def stuck(self, timeout_s):
        from actors.clients.engine_client import Verdict

        return Verdict("slow", f"no answer within {timeout_s:.0f} s")


@pytest.mark.parametrize("policy", ["cache", "load"])
def test_an_engine_found_stuck_is_avoided_by_the_next_requests(policy):
    """A request finds decode engine d1 stuck (no output for the stall time, no health answer twice) and is retried
    on d2; the requests after it go to d2 at once instead of each waiting out the stall on d1 again (the coordinator
    still lists d1: it has not decided yet). With no other engine left a suspect is still used."""
    d1, d2 = SilentEngine([]), FakeEngine([tokens(5, finish="length")])
    coordinator = FakeCoordinator({"p": FakeEngine([]), "d1": d1, "d2": d2}, [("p", "d1"), ("p", "d2")])
    router = Router(coordinator, stall_s=0.2, policy=policy)

    async def run():
        return [await collect(router) for _ in range(4)]

    outs = asyncio.run(run())
    assert all([t for o in out for t in o["token_ids"]] == [5] for out in outs)
    assert (len(d1.submitted), len(d2.submitted), router.retried) == (1, 4, 1)
    assert router.choice.suspected == 1 and router.choice.wary() == {"d1"} and coordinator.reported == ["d1"]
    assert router.choice.wary(now=time.monotonic() + 3600) == set()  # and trusted again after SUSPECT_S


def test_the_shared_poll_is_not_carried_into_another_event_loop():
    """A poll left pending (or cancelled) when its event loop ended is not waited on from the next loop."""
    coordinator = ChangingCoordinator({"d": None}, ["d"])
    router = Router(coordinator)

    async def leave_one_pending():
        router._listing = asyncio.get_running_loop().create_future()
        router._listing_at = time.monotonic()

    asyncio.run(leave_one_pending())
    assert asyncio.run(asyncio.wait_for(router._listed(), 5)) == {"d"}
    router._listing.cancel()
    assert asyncio.run(asyncio.wait_for(router._listed(), 5)) == {"d"}


def test_a_suspect_that_left_the_cluster_is_forgotten():
    """Pools reuse engine ids: once the coordinator no longer lists a suspect, the mark goes, so that a replacement
    registered under its id is trusted; one still listed keeps it."""
    coordinator = FakeCoordinator({}, [("p", "d1"), ("p", "d2")])
    router = Router(coordinator)
    router.choice.suspect("d1", "stuck")
    router.choice.suspect("d2", "stuck")
    coordinator.pairs = [("p", "d2")]  # d1 taken out
    asyncio.run(router.routes())
    assert router.choice.wary() == {"d2"}


def test_with_its_only_decode_engine_stuck_requests_are_served_whole_by_a_prefill_engine():
    """The decode pool's only engine is found stuck: the request that found it is served whole by the prefill
    engine (degraded mode), and so are the next ones, at once, instead of each being sent to the stuck engine and
    waiting out the stall first."""
    d1, p = SilentEngine([]), FakeEngine([tokens(7, finish="length")])
    coordinator = FakeCoordinator({"p": p, "d1": d1}, [("p", "d1")])
    router = Router(coordinator, stall_s=0.2)

    async def run():
        return [await collect(router) for _ in range(3)]

    outs = asyncio.run(run())
    assert all([t for o in out for t in o["token_ids"]] == [7] for out in outs)
    assert (len(d1.submitted), len(p.submitted), router.retried) == (1, 3, 1)
    assert router.colocated["prefill"] == 3 and router.choice.wary() == {"d1"}
    router.choice.suspect("p", "stuck too")  # nothing but suspects left: they are tried (d1 first, as paired)
    assert [t for o in asyncio.run(collect(router)) for t in o["token_ids"]] == [7]
    assert (len(d1.submitted), len(p.submitted)) == (2, 4)


def test_failover_is_bounded():
    """Every engine stops under the request after one token: two continuations, then a clear error."""
    engines = {f"{role}{i}": FakeEngine([tokens(10 + i), ABORT]) for i in range(4) for role in ("p", "d")}
    router = Router(FakeCoordinator(engines, [(f"p{i}", f"d{i}") for i in range(4)]), policy="load")
    router.choice.pick = lambda candidates, role: sorted(candidates)[0]
    with pytest.raises(EngineFailure, match="not continued elsewhere: it failed over too often") as e:
        asyncio.run(collect(router, max_tokens=10))
    assert e.value.streamed and router.failed_over == 2
    assert [len(engines[f"d{i}"].submitted) for i in range(4)] == [1, 1, 1, 0]
    assert engines["d2"].submitted[0][0] == [1, 2, 3, 10, 11]


def test_a_failed_state_read_is_retried_on_a_pair_without_that_prefill_engine():
    bad = FakeEngine([{"token_ids": [], "text": "", "finish_reason": "error"}])
    good = FakeEngine([tokens(7, 8), tokens(9, finish="length")])
    p1, p2 = FakeEngine([]), FakeEngine([])
    coordinator = FakeCoordinator({"p1": p1, "p2": p2, "d1": bad, "d2": good}, [("p1", "d1"), ("p2", "d2")])
    router = Router(coordinator, policy="load")
    router.choice.pick = lambda candidates, role: sorted(candidates)[0]  # p1 first
    outs = asyncio.run(collect(router))
    assert [t for o in outs for t in o["token_ids"]] == [7, 8, 9] and outs[-1]["finish_reason"] == "length"
    assert router.retried == 1 and len(p1.released) == 1  # the failed attempt's blocks on p1 are let go
    assert "p1" in coordinator.reported  # the prefill engine is the one at fault, not the decode engine


def test_an_engine_gone_after_the_coordinator_listed_it_is_retried():
    good = FakeEngine([tokens(4, finish="stop")])
    coordinator = FakeCoordinator({"p1": None, "p2": FakeEngine([]), "d": good}, [("p1", "d"), ("p2", "d")])
    router = Router(coordinator, policy="load")
    router.choice.pick = lambda candidates, role: sorted(candidates)[0]
    assert [o["token_ids"] for o in asyncio.run(collect(router))] == [[4]] and router.retried == 1


def test_while_the_coordinator_is_away_an_engine_that_failed_is_not_looked_up_again():
    """Decode engine d1 fails a request and its client is dropped; then the coordinator stops answering (restarting).
    Its last routes still list d1. The next request is not held for the coordinator's client question (before: a
    10 s wait, then a 503 never retried): it goes to d2, and the ones after it avoid d1 at once."""
    d1, d2 = FakeEngine([ABORT]), FakeEngine([tokens(5, finish="length")])
    coordinator = FakeCoordinator({"p": FakeEngine([]), "d1": d1, "d2": d2}, [("p", "d1"), ("p", "d2")])
    router = Router(coordinator, policy="load")
    router.choice.pick = lambda candidates, role: sorted(candidates)[0]  # d1 whenever it is a candidate

    async def run():
        first = await collect(router)  # d1 fails it; retried on d2
        await asyncio.sleep(0)
        away = SimpleNamespace(remote=lambda *a: asyncio.get_running_loop().create_future())  # never answered
        coordinator.routes = coordinator.client = coordinator.ready = coordinator.engine_failed = away
        later = []
        for _ in range(3):
            t0 = time.monotonic()
            later.append((await collect(router), time.monotonic() - t0))
        return first, later

    first, later = asyncio.run(run())
    assert [t for o in first for t in o["token_ids"]] == [5] and "d1" not in router._engines
    for outs, seconds in later:
        assert [t for o in outs for t in o["token_ids"]] == [5]
        assert seconds < 6, f"a request took {seconds:.1f} s while the coordinator was away"
    assert (len(d1.submitted), len(d2.submitted)) == (1, 4) and router.coordinator_unreachable
    assert router.choice.wary() == {"d1"} and router.stale_routed >= 3


def test_while_the_coordinator_is_away_requests_route_at_once_on_its_last_routes():
    """The coordinator stops answering (restarting): the first request waits ROUTES_FALLBACK_AFTER_S for it, then
    is routed on the last routes; the next ones are routed at once while one question waits in the background (not
    one each). When the coordinator answers it - as Ray delivers the calls queued for a restarting actor - its new
    routes take over."""
    d, d2 = FakeEngine([tokens(5, finish="length")]), FakeEngine([tokens(6, finish="length")])
    coordinator = FakeCoordinator({"p": FakeEngine([]), "d": d, "d2": d2}, [("p", "d")])
    router = Router(coordinator, policy="load")

    async def run():
        await collect(router)
        answering, asked = coordinator.routes, []

        def away():
            asked.append(asyncio.get_running_loop().create_future())
            return asked[-1]

        coordinator.routes = SimpleNamespace(remote=away)
        took = []
        for _ in range(4):
            t0 = time.monotonic()
            assert [t for o in await collect(router) for t in o["token_ids"]] == [5]
            took.append(time.monotonic() - t0)
        coordinator.pairs, coordinator.routes = [("p", "d2")], answering  # back, with another decode engine
        for question in asked:
            if not question.done():
                question.set_result({"p": ["d2"]})
        await question_ended(router)
        return took, len(asked), [t for o in await collect(router) for t in o["token_ids"]]

    took, questions, back = asyncio.run(run())
    assert took[0] >= 0.9 and max(took[1:]) < 0.5, took
    assert questions == 2  # the first request's, then one in the background for the three after it
    assert back == [6] and not router.coordinator_unreachable and router.stale_routed == 4


def test_during_an_outage_only_a_dead_engine_is_avoided_and_only_until_the_coordinator_answers():
    """While the coordinator does not answer: a request-level error on d1 (the engine ends one request with an
    error) costs that request a retry and nothing more - d1 keeps its client and the next requests may use it; a
    dead d2 (its actor gone) is avoided by the next requests. Once the coordinator answers and still lists d2 (a
    replacement registered under its id), d2 is trusted again."""
    from ray.exceptions import ActorDiedError

    class Dead(FakeEngine):
        def submit_decode(self, *args, **kwargs):
            raise ActorDiedError()

    d1 = FakeEngine([{"token_ids": [], "text": "", "finish_reason": "error"}])
    d2, d3 = Dead([]), FakeEngine([tokens(5, finish="length")])
    coordinator = FakeCoordinator({"p": FakeEngine([]), "d1": d1, "d2": d2, "d3": d3},
                                  [("p", "d1"), ("p", "d2"), ("p", "d3")])
    router = Router(coordinator, policy="load")
    order = iter(["d1", "d3", "d2", "d3"])
    router.choice.pick = lambda candidates, role: next(order) if role == "decode" else sorted(candidates)[0]

    async def run():
        await router.routes()
        for d in ("d1", "d2", "d3"):
            await router.engine(d)  # clients known before the outage
        answering = coordinator.routes
        coordinator.routes = SimpleNamespace(remote=lambda: asyncio.get_running_loop().create_future())
        first = await collect(router)  # d1: a request-level error, retried on d3
        wary = router.choice.wary()
        second = await collect(router, seed=1)  # d2: dead, retried on d3
        coordinator.routes = answering
        await question_ended(router)  # the one asked while away ends at its deadline
        await router.routes()  # asks again; this one is answered
        await question_ended(router)
        return first, wary, second, await router.routes()

    first, wary, second, back = asyncio.run(run())
    assert [t for o in first for t in o["token_ids"]] == [5] == [t for o in second for t in o["token_ids"]]
    assert wary == set() and router.choice.suspected == 1 and "d1" in router._engines and "d2" not in router._engines
    assert router.retried == 2 and back == {"p": ["d1", "d2", "d3"]} and not router.coordinator_unreachable
    assert router.choice.wary() == set()  # d2 is listed again: trusted


def test_requests_failing_together_on_one_engine_make_one_report():
    """Six requests whose decode engine ends each with an error while the coordinator is still checking it: one
    report of that engine reaches the coordinator (a burst used to take one coordinator slot per request)."""
    class SlowCoordinator(FakeCoordinator):
        def __init__(self, *a):
            super().__init__(*a)

            async def report(e):
                self.reported.append(e)
                await asyncio.sleep(0.5)

            self.engine_failed = SimpleNamespace(remote=report)

    engines = {"p": FakeEngine([]), "d": FakeEngine([{"token_ids": [], "text": "", "finish_reason": "error"}] * 6),
               "d2": FakeEngine([tokens(4, finish="stop")] * 6)}
    coordinator = SlowCoordinator(engines, [("p", "d"), ("p", "d2")])
    router = Router(coordinator, policy="load")
    router.choice.pick = lambda candidates, role: sorted(candidates)[0]  # d first: every request fails there once

    async def burst():
        return await asyncio.gather(*(collect(router) for _ in range(6)), return_exceptions=True)

    asyncio.run(burst())
    assert coordinator.reported.count("d") == 1 and router.retried == 6


def test_engines_that_left_the_routes_are_forgotten():
    """A router keeps no client (nor ended channel) of an engine the coordinator no longer lists: a long-running
    front end does not grow with every engine that ever came and went."""
    d = FakeEngine([tokens(4, finish="stop")])
    coordinator = FakeCoordinator({"p": FakeEngine([]), "d": d, "d2": FakeEngine([])}, [("p", "d"), ("p", "d2")])
    router = Router(coordinator, policy="load")
    router.choice.pick = lambda candidates, role: sorted(candidates)[0]

    async def run():
        outs = await collect(router)
        assert "d" in router._engines and "d" in router._channels
        router._channels["d"].closed = True  # its stream ended (the engine left)
        coordinator.pairs = [("p", "d2")]
        await router.routes()
        return outs

    assert [o["token_ids"] for o in asyncio.run(run())] == [[4]]
    assert "d" not in router._engines and "d" not in router._channels and "p" in router._engines


def test_the_coordinator_checks_a_burst_of_reports_of_one_engine_once():
    """Reports of one engine arriving while it is being checked share that check: 50 at once ask the engine's
    health once, not 50 times (each a slot of the coordinator's 64 and a call to a possibly dead engine)."""
    from actors.control.coordinator import CoordinatorActor
    from actors.clients.engine_client import Verdict

    cls = CoordinatorActor.__ray_actor_class__
    coordinator = cls.__new__(cls)  # its state only: no Ray actor, no runtime context
    coordinator.clients, coordinator._failure_checks, coordinator._silence = {}, {}, {}
    coordinator.unresponsive_s = 60.0
    asked = []

    class Busy:
        async def verdict(self):
            asked.append(1)
            await asyncio.sleep(0.2)
            return Verdict("healthy", "answering")

    coordinator.clients["decode-0"] = Busy()

    async def burst():
        return await asyncio.gather(*(coordinator.engine_failed("decode-0") for _ in range(50)))

    assert asyncio.run(burst()) == [False] * 50
    assert len(asked) == 1
    assert asyncio.run(coordinator.engine_failed("decode-0")) is False and len(asked) == 2  # a later report asks again


def _registration(engine_id: str, role: str = "prefill"):
    """A real registration of a Qwen3.5-0.8B-shaped engine at TP 1: its Hugging Face config and one rank's layout
    report as a running engine's worker writes it (`actors.engine.report`), here computed offline."""
    from pathlib import Path

    from actors.clients.engine_client import Registration
    from cluster.core.hf_config import load_config, model_shape
    from cluster.core.layout import offline_layout

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3.5-0.8b.json")
    lay = offline_layout(model_shape(config), 1, "bfloat16", "float32", conv_layout="SD")
    report = {"tp": 1, "dtype": lay.dtype, "ssm_dtype": lay.ssm_dtype, "block_size": lay.block_size,
              "kernel_block_size": lay.kernel_block_size, "page_bytes": lay.page_bytes,
              "groups": [{"kind": g.kind, "layers": list(g.layers)} for g in lay.groups],
              "conv_layout": lay.conv_layout, "kv_layout": "HND"}
    bases = list(range(0, lay.num_regions << 30, 1 << 30))  # where each region's memory starts
    return Registration(engine_id, role, "m", config, [{"tp_rank": 0, "layout": report, "region_bases": bases}])


def test_an_engine_the_rebuilt_registry_already_holds_registers_again():
    """A coordinator killed while an engine registers rebuilds its registry from the live engines, that one
    included; the engine's own registration then arrives: it is the same engine, not a second one under a taken id,
    so it is answered with its pairs (it used to be refused, and its pool replica failed and took the engine with it).
    Another engine under that id is still refused - by the registry itself, naming the field."""
    from actors.control.coordinator import CoordinatorActor
    from cluster.core.coordinator import Coordinator, EngineRecord, RegistrationError
    from cluster.core.hf_config import model_shape
    from cluster.core.layout import layout_from_report

    cls = CoordinatorActor.__ray_actor_class__
    coordinator = cls.__new__(cls)
    coordinator.core, coordinator.clients, coordinator.restarted = Coordinator(), {}, False
    coordinator._watcher = SimpleNamespace(done=lambda: False)  # the health watch: running (not started here)
    coordinator._routes_moved, coordinator.leftovers = None, {}
    engine, other = SimpleNamespace(name="prefill-1 actor"), SimpleNamespace(name="another actor")
    registration = _registration("prefill-1")

    def record(reg):
        return EngineRecord(reg.engine_id, reg.role, "m", layout_from_report(reg.layout, model_shape(reg.hf_config)),
                            [dict(reg.ranks[0])])

    # what the rebuild registered: the engine's real record, and a decode engine it pairs with
    coordinator.core.register(record(_registration("decode-0", "decode")))
    coordinator.core.register(record(registration))
    coordinator.core.register(record(_registration("prefill-0")))
    coordinator.clients["prefill-1"] = engine
    answer = asyncio.run(coordinator.register(registration, engine))
    assert answer == {"engine_id": "prefill-1", "pairs": [("prefill-1", "decode-0")]}  # its own pairs only
    with pytest.raises(RegistrationError, match="'prefill-1' is already registered") as refused:
        asyncio.run(coordinator.register(registration, other))
    assert refused.value.field == "engine_id"
    assert coordinator.clients["prefill-1"] is engine  # the refused one took nothing over


def test_an_engine_silent_for_longer_than_the_limit_is_unresponsive():
    """`Silence`: slow or unreachable answers in a row are a busy engine until they have lasted `limit_s`; then the
    engine is unresponsive (gone: taken out, replaced). Any answer ends the silence."""
    from actors.clients.engine_client import Silence, Verdict

    slow, healthy = Verdict("slow", "no answer within 10 s"), Verdict("healthy", "healthy")
    silence = Silence(limit_s=60)
    assert silence.saw(slow, now=100).state == "slow"
    assert silence.saw(Verdict("unreachable", "unreachable"), now=150).state == "unreachable"
    verdict = silence.saw(slow, now=161)
    assert verdict.state == "unresponsive" and verdict.gone and "no health answer for 61 s" in verdict.why
    assert silence.saw(healthy, now=162) is healthy  # it answered: the silence is over
    assert silence.saw(slow, now=200).state == "slow" and not silence.saw(slow, now=259).gone
    assert silence.saw(Verdict("failed", "unhealthy"), now=300).gone  # a verdict of its own, passed on


@pytest.mark.parametrize("answers, stuck", [
    (["healthy"], None), (["slow", "healthy"], None), (["unreachable", "healthy"], None),
    (["slow", "slow"], "slow"), (["unreachable", "slow"], "slow"), (["starting", "starting"], "starting"),
    (["failed"], "failed"), (["dead"], "dead"), (["slow", "dead"], "dead"),
])
def test_the_one_rule_for_an_engine_gone_silent(answers, stuck):
    """`EngineClient.stuck`, what a stalled decode stream and a prefill without an answer both go by: failed or dead
    at once, no healthy answer twice in a row (the second asked at once), else healthy (waited for)."""
    from actors.clients.engine_client import EngineClient, Verdict

    asked = []

    class Scripted(EngineClient):
        async def verdict(self, timeout_s: float = 10.0) -> Verdict:
            asked.append(timeout_s)
            return Verdict(answers[len(asked) - 1], answers[len(asked) - 1])

    got = asyncio.run(Scripted(None, "e").stuck(3.0))
    assert (got.state if got else None) == stuck
    assert asked == [3.0] * len(answers)  # asked exactly as often as the rule needs, each with the timeout given


def test_the_decode_engines_own_prompts_are_counted_until_their_first_output_whatever_ends_them():
    """`transfer.local_prefill_speed`: with prompts queued at the prefill engine, a request goes to its decode engine
    whole (no prefill call, no transfer parameters); the router counts its prompt tokens on that engine until the
    first output. The count is given back when the request ends normally, when the engine fails it before any
    output (the retry runs elsewhere), and when the caller stops reading after the first output."""
    async def first_only(router):
        async with contextlib.aclosing(router.generate([1, 2, 3], {"max_tokens": 3})) as outs:
            async for out in outs:
                return out

    for outputs, run, served_by in (
            ([tokens(5), tokens(6), tokens(7, finish="length")], collect, "d"),
            ([{"token_ids": [], "text": "", "finish_reason": "error"}], collect, "p"),
            ([tokens(5), tokens(6), tokens(7, finish="length")], first_only, "d")):
        d, p = FakeEngine(outputs), FakeEngine([tokens(5, 6, 7, finish="length")])
        router = Router(FakeCoordinator({"p": p, "d": d}, [("p", "d")]), local_prefill_speed=1.0)
        router.choice.pending_tokens["p"] = 10_000  # a queue at the prefill engine: the decode engine is sooner
        seen = []
        original = router.choice.choose

        async def spied(*args, **kwargs):
            choice = await original(*args, **kwargs)
            seen.append(choice.local)
            return choice

        router.choice.choose = spied
        asyncio.run(run(router))
        assert seen[0] is True and d.submitted and d.submitted[0][2] is None  # whole on the decode engine
        assert (p if served_by == "p" else d).submitted, served_by
        assert router.local_prefill >= 1 and sum(router.choice.local_tokens.values()) == 0, router.choice.local_tokens


class WatchedCoordinator(FakeCoordinator):
    """A FakeCoordinator that also answers the routes watch's question as `CoordinatorActor.routes_after` does: at
    once when the routes differ from the router's copy, else when `moved()` is called or after `wait_s`. Counts the
    per-request `routes` questions in `asked` and the watch's in `watched`; `wedged` leaves every later question of
    either kind unanswered."""

    def __init__(self, *a):
        super().__init__(*a)
        self.asked = self.watched = 0
        self.wedged = False
        self._moved: asyncio.Event | None = None
        plain = self.routes.remote

        def routes():
            self.asked += 1
            return asyncio.get_running_loop().create_future() if self.wedged else plain()

        self.routes = SimpleNamespace(remote=routes)
        self.routes_after = SimpleNamespace(remote=self._after)

    def current(self):
        return {p: [d for q, d in self.pairs if q == p] for p in sorted({p for p, _ in self.pairs})}

    def moved(self):
        if self._moved is not None:
            self._moved.set()

    async def _after(self, known, wait_s):
        self.watched += 1
        if self.wedged:
            await asyncio.get_running_loop().create_future()
        deadline = time.monotonic() + wait_s
        while self.current() == known and time.monotonic() < deadline:
            self._moved = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._moved.wait(), deadline - time.monotonic())
            if self.wedged:
                await asyncio.get_running_loop().create_future()
        return self.current()


def test_with_the_routes_watch_requests_do_not_ask_the_coordinator_and_see_its_changes():
    """The front end's router (`watch_routes`): the first request asks the coordinator for the routes; the ones after
    it route on what the watch holds, with no question of their own - and when the routes change (d replaced by d2),
    the watch's question is answered at once and the next request goes to d2."""
    d, d2 = FakeEngine([tokens(5, finish="length")]), FakeEngine([tokens(6, finish="length")])
    coordinator = WatchedCoordinator({"p": FakeEngine([]), "d": d, "d2": d2}, [("p", "d")])
    router = Router(coordinator, policy="load", watch_routes=True)

    async def run():
        before = [t for _ in range(4) for o in await collect(router) for t in o["token_ids"]]
        asked = coordinator.asked
        coordinator.pairs = [("p", "d2")]
        coordinator.moved()
        for _ in range(100):  # the watch's answer arrives within a few loop turns
            if router._routes is not None and router._routes[1] == {"p": ["d2"]}:
                break
            await asyncio.sleep(0.01)
        after = [t for o in await collect(router) for t in o["token_ids"]]
        return before, asked, after

    before, asked, after = asyncio.run(run())
    assert before == [5] * 4 and asked == 1, (before, asked)
    assert after == [6] and coordinator.asked == 1 and router.watch_answers >= 1


def test_a_wedged_coordinator_stops_the_watch_vouching_and_requests_fall_back(monkeypatch):
    """The coordinator stops answering (wedged): the watch's question goes unanswered, and once it is late
    (WATCH_WAIT_S + ROUTES_FALLBACK_AFTER_S) the watch no longer vouches for the routes - a request asks, waits
    ROUTES_FALLBACK_AFTER_S and is routed on the last routes, as without a watch (`stale_routed`). Without the
    coordinator's watch call at all (an older coordinator), requests ask as before."""
    import actors.frontend.router as router_module

    monkeypatch.setattr(router_module, "WATCH_WAIT_S", 0.2)
    monkeypatch.setattr(router_module, "ROUTES_FALLBACK_AFTER_S", 0.2)
    d = FakeEngine([tokens(5, finish="length")] * 3)
    coordinator = WatchedCoordinator({"p": FakeEngine([]), "d": d}, [("p", "d")])
    router = Router(coordinator, policy="load", watch_routes=True)

    async def run():
        await collect(router)
        await asyncio.sleep(0.05)
        vouched = router._watched() is not None
        coordinator.wedged = True
        coordinator.moved()
        await asyncio.sleep(0.5)  # past the watch question's deadline
        unvouched = router._watched() is None
        t0 = time.monotonic()
        outs = await collect(router)
        return vouched, unvouched, time.monotonic() - t0, outs

    vouched, unvouched, took, outs = asyncio.run(run())
    assert vouched and unvouched, (vouched, unvouched)
    assert [t for o in outs for t in o["token_ids"]] == [5] and took >= 0.15
    assert router.coordinator_unreachable and router.stale_routed == 1

    plain = FakeCoordinator({"p": FakeEngine([]), "d": FakeEngine([tokens(5, finish="length")] * 2)}, [("p", "d")])
    router = Router(plain, policy="load", watch_routes=True)

    async def twice():
        return [t for _ in range(2) for o in await collect(router) for t in o["token_ids"]]

    assert asyncio.run(twice()) == [5, 5] and router._watched() is None


def test_the_coordinator_answers_the_watch_when_the_routes_change():
    """`CoordinatorActor.routes_after`: at once when the caller's routes are not the current ones; held while they
    are, until they change - an engine's state set, an engine drained (scale-down), an engine deregistered - or until
    `wait_s` has passed."""
    from actors.control.coordinator import CoordinatorActor
    from cluster.core.coordinator import Coordinator

    cls = CoordinatorActor.__ray_actor_class__
    coordinator = cls.__new__(cls)
    coordinator.core, coordinator.restarted, coordinator._routes_moved = Coordinator(), False, None
    coordinator.clients, coordinator._silence, coordinator.leftovers = {}, {}, {}
    core = coordinator.core
    for engine_id, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"),
                            ("decode-2", "decode")):
        core.engines[engine_id] = SimpleNamespace(engine_id=engine_id, role=role, state="ready")
        if role == "decode":
            core.pairs[("prefill-0", engine_id)] = object()
    now = {"prefill-0": ["decode-0", "decode-1", "decode-2"]}

    async def woken_by(change, known):
        waiting = asyncio.ensure_future(coordinator.routes_after(known, 5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        t0 = time.monotonic()
        await change()
        return await waiting, time.monotonic() - t0

    async def run():
        stale = await coordinator.routes_after({}, 5.0)
        t0 = time.monotonic()
        same = await coordinator.routes_after(now, 0.2)
        held = time.monotonic() - t0
        async def set_state():
            coordinator.set_state("decode-0", "draining")

        changes = [await woken_by(set_state, now)]
        changes.append(await woken_by(lambda: coordinator.drain("decode-1"), changes[-1][0]))
        changes.append(await woken_by(lambda: coordinator._deregister("decode-2"), changes[-1][0]))
        return stale, same, held, changes

    stale, same, held, changes = asyncio.run(run())
    assert stale == now and same == now and held >= 0.19
    assert [routes for routes, _ in changes] == [{"prefill-0": ["decode-1", "decode-2"]}, {"prefill-0": ["decode-2"]},
                                                 {"prefill-0": []}]
    assert all(woke < 0.5 for _, woke in changes), changes


def test_the_prefill_answer_comes_on_the_channel_and_a_client_that_leaves_cancels_it():
    """The router's prefill (`prefill_over_channel`, the default): submitted with `submit_prefill`, answered on the
    channel from that engine - the Ray call's return (`prefill`) is not used. A client that leaves while the prompt
    is in prefill has it cancelled on the engine (`cancel_prefill`), which also frees the blocks if it had answered."""

    class ChannelOnly(FakeEngine):
        hold = False

        def prefill(self, *a, **k):
            raise AssertionError("the prefill's answer was asked as the call's return")

        def submit_prefill(self, channel_id, rid, *a, **k):
            if self.hold:
                return _ready(None)  # in prefill until cancelled
            return super().submit_prefill(channel_id, rid, *a, **k)

    p, d = ChannelOnly([]), FakeEngine([tokens(5, finish="length")])
    router = Router(FakeCoordinator({"p": p, "d": d}, [("p", "d")]), policy="load")

    async def run():
        served = [t for o in await collect(router) for t in o["token_ids"]]
        p.hold = True
        left = asyncio.ensure_future(collect(router))
        for _ in range(100):
            if router.choice.inflight["p"]:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        left.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await left
        for _ in range(100):
            if p.cancelled:
                break
            await asyncio.sleep(0.01)
        return served

    assert asyncio.run(run()) == [5]
    assert len(p.cancelled) == 1 and router.choice.inflight["p"] == 0
    assert not router._channels["p"].inboxes  # nothing left waiting on the prefill engine's channel


def test_a_prefill_channel_that_breaks_with_its_engine_alive_has_the_prefill_stopped_and_the_request_retried():
    """The channel from a live prefill engine breaks while a prefill waits on it (its socket, an overflow): the
    answer may have been lost with blocks held for it, so the prefill is cancelled on the engine (which frees them if
    it had answered), and the request is retried on another pair."""

    class Breaks(FakeEngine):
        def submit_prefill(self, channel_id, rid, *a, **k):
            self.channels[channel_id].put_nowait(BROKEN)
            return _ready(None)

        async def _channel(self, channel_id, address=None):
            queue = self.channels[channel_id] = asyncio.Queue()
            yield _ready([])
            item = await queue.get()
            if item is BROKEN:
                raise RuntimeError("the decode socket from p broke")
            yield _ready([item])

    BROKEN = object()
    p, p2, d = Breaks([]), FakeEngine([]), FakeEngine([tokens(5, finish="length")])
    router = Router(FakeCoordinator({"p": p, "p2": p2, "d": d}, [("p", "d"), ("p2", "d")]), policy="load")
    router.choice.pick = lambda candidates, role: sorted(candidates)[0]

    async def run():
        outs = [t for o in await collect(router) for t in o["token_ids"]]
        for _ in range(100):
            if p.cancelled:
                break
            await asyncio.sleep(0.01)
        return outs

    assert asyncio.run(run()) == [5] and router.retried == 1 and len(p.cancelled) == 1
