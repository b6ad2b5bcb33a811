"""Hung engines fail over like dead ones: an engine whose vLLM processes are stopped (SIGSTOP: alive, holding its
Ray stream open, vLLM's `errored` flag clear) is found stuck (`cluster.core.progress`: a process stopped), its requests
continue on another pair - token for token - the coordinator takes it out of every pair, and when it continues
(SIGCONT) mid-stream its late output reaches nobody. On the folder's four engines (conftest.py), after
test_cache_routing.py; its tests run in order: each later one starts from the engines the earlier ones left (and says
so)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray

from actors.frontend.router import Router
from tests.pd_helpers import oracle, prompts, until, wait_for
from tests.tp1_engines.shared import STALL_S, UNRESPONSIVE_S, signal_engine

pytestmark = pytest.mark.engine

# the hung-engine tests' routers: an engine is judged stuck within 1 s (its next question) + its threshold (twice its
# slowest step, < 0.3 s here, + STALL_S, the folder's engines' margin) of a SIGSTOP, and a router asks every
# ROUTER_STALL_S of silence, so a request resumes within RESUME_S; with either default (a router's 5 s, an engine's
# 10 s) it would take 5.3 s or more. The coordinator takes out an engine silent for UNRESPONSIVE_S (shared.py).
ROUTER_STALL_S = 0.5
RESUME_S = 4.5


@pytest.fixture(scope="module")
def cl(tp1_engines):
    """The folder's coordinator and engines; whatever a test stopped is continued at the end."""
    try:
        yield tp1_engines.coordinator, tp1_engines.engines
    finally:
        tp1_engines.signal_all(signal.SIGCONT)  # never leave a stopped process behind


def _signal(engine, sig: int) -> None:
    signal_engine(engine, sig, actor_too=False)  # vLLM's processes: the actor still answers


def _removed(coordinator, engine_id: str, since: int = 0) -> list[dict]:
    """The coordinator's removals of `engine_id` (with why), oldest first, past the first `since` of them (an engine
    test_cache_routing.py stopped and restarted under its id has an older one)."""
    return [r for r in ray.get(coordinator.removed_engines()) if r["engine_id"] == engine_id][since:]


def _routes(coordinator) -> dict[str, list[str]]:
    return ray.get(coordinator.routes())


def test_a_hung_decode_engine_fails_over_mid_stream(cl):
    """A greedy stream's decode engine stops after a few tokens: within seconds the stream continues on another
    pair, its tokens exactly the model's; the engine reports itself stuck, the coordinator removes it. The stopped
    engine is continued (SIGCONT) as soon as the stream has failed over, while the stream still runs: the tokens it
    then produces for the request reach nobody - the stream is still the model's, token for token."""
    coordinator, engines = cl
    router = Router(coordinator, stall_s=ROUTER_STALL_S, policy="load")
    prompt = prompts(seed=31, lengths=(300,))[0]
    n = 96
    stopped: list[str] = []
    continued: list[int] = []  # tokens the stream had when the hung engine was continued
    before: list[int] = []  # the hung engine's removals listed before it was stopped

    async def run() -> tuple[list[int], float]:
        out: list[int] = []
        resumed_after = 0.0
        params = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}
        async for item in router.generate(prompt, params):
            if len(out) >= 4 and not stopped:
                d_id = next(d for d in ("decode-a", "decode-b") if router.choice.inflight[d])
                before.append(len(_removed(coordinator, d_id)))
                _signal(engines[d_id], signal.SIGSTOP)
                stopped.append(d_id)
                t_stop = time.monotonic()
            elif stopped and router.failed_over and not resumed_after:  # the first item from the new pair
                resumed_after = time.monotonic() - t_stop
                # once the coordinator has judged it (stopped: stuck), it continues; its late outputs may come now,
                # while this stream still runs: to nobody
                await until(lambda: _removed(coordinator, stopped[0], before[0]), 30, "the hung engine taken out", 0.1)
                _signal(engines[stopped[0]], signal.SIGCONT)
                continued.append(len(out))
            out += item["token_ids"]
        return out, resumed_after

    try:
        out, resumed_after = asyncio.run(run())
        hung = stopped[0]
        print(f"resumed {resumed_after:.2f} s after the decode engine stopped; continued it at token "
              f"{continued[0] if continued else None} of {n}")
        assert out == oracle(prompt, n)  # token for token across the failover, late outputs of the hung engine or not
        assert router.failed_over == 1 and continued and continued[0] < n - 8
        assert resumed_after < RESUME_S, resumed_after
        removed = _removed(coordinator, hung, before[0])
        assert removed and "stuck" in removed[-1]["why"] and "stopped" in removed[-1]["why"], removed
        deadline = time.monotonic() + 30
        while hung in {d for ds in _routes(coordinator).values() for d in ds} and time.monotonic() < deadline:
            time.sleep(0.5)
        assert hung not in {d for ds in _routes(coordinator).values() for d in ds}
    finally:
        for e in stopped:
            _signal(engines[e], signal.SIGCONT)
    again = asyncio.run(_one(router, prompt, n))
    assert again == oracle(prompt, n)


def test_a_hung_prefill_engine_is_retried_elsewhere(cl):
    """One prefill engine stops before a request reaches it: the prefill waits `stall_s`, the engine is found
    stuck and taken out of every pair, and the request is prefilled on the other one, with the model's output."""
    coordinator, engines = cl
    live = [p for p in _routes(coordinator) if p.startswith("prefill")]
    assert sorted(live) == ["prefill-a", "prefill-b"]
    router = Router(coordinator, stall_s=ROUTER_STALL_S, policy="load")
    router.choice.pick = lambda candidates, role: sorted(candidates)[0]  # prefill-a first, whatever the rotation
    before = len(_removed(coordinator, "prefill-a"))  # test_cache_routing.py may have stopped it once
    _signal(engines["prefill-a"], signal.SIGSTOP)
    try:
        prompt = prompts(seed=32, lengths=(200,))[0]
        t0 = time.monotonic()
        out = asyncio.run(_one(router, prompt, 8))
        took = time.monotonic() - t0
        wait_for(lambda: _removed(coordinator, "prefill-a", before), 30, poll_s=0.1)  # judged while still stopped
        removed = _removed(coordinator, "prefill-a", before)
    finally:
        _signal(engines["prefill-a"], signal.SIGCONT)
    print(f"retried elsewhere and served in {took:.2f} s; prefill-a removed: {removed}")
    assert out == oracle(prompt, 8)
    assert router.retried == 1 and took < RESUME_S, took
    assert removed and "stuck" in removed[-1]["why"] and "stopped" in removed[-1]["why"], removed
    assert "prefill-a" not in _routes(coordinator)


async def _one(router: Router, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    async for item in router.generate(prompt, {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}):
        out += item["token_ids"]
    return out


async def _verdict(engine):
    return await engine.verdict()


def test_a_reader_that_stops_reading_its_ray_stream_ends_its_requests(cl):
    """The cross-node output path (a Ray stream) is bounded: a front end that stops reading (wedged, or its host
    gone quiet) holds the engine's stream back after `backlog` messages, and its requests are ended, not decoded on
    into memory for nobody. Without the bound the request runs to its last token."""
    from vllm import SamplingParams

    _, engines = cl
    engine = engines["prefill-b"]  # any engine decodes a request it runs whole; this one no other test stops
    n = 1500
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    prompt = prompts(seed=33, lengths=(64,))[0]

    async def run() -> tuple[list, float]:
        stream = engine.decode_channel("stalled-reader", None, backlog=2)
        await (await stream.__anext__())  # the opening: requests may be submitted
        await engine.submit_decode("stalled-reader", "never-read", prompt, params, None)
        t0 = time.monotonic()
        while (await engine.load()).running_requests and time.monotonic() - t0 < 60:  # nobody reads meanwhile
            await asyncio.sleep(0.2)
        ended_after = time.monotonic() - t0
        items = []

        async def read() -> None:
            async for ref in stream:  # what was held back, then the stream's end
                items.extend(await ref)

        try:
            await asyncio.wait_for(read(), 60)
        except asyncio.TimeoutError:
            raise AssertionError(f"the unread stream did not end ({len(items)} items read)") from None
        return items, ended_after

    items, ended_after = asyncio.run(run())
    tokens = sum(len(out.outputs[0].token_ids) for _, out in items if hasattr(out, "outputs"))
    print(f"request ended {ended_after:.1f} s into an unread stream, after {tokens} tokens; {len(items)} items read")
    assert tokens < n, "the request decoded to its end into an unread stream"
    assert ended_after < 30


def test_an_engine_stuck_as_a_whole_is_taken_out_and_not_trusted_again(cl):
    """The whole engine stops, its actor process too (SIGSTOP): it answers nothing, not even its health, so it
    cannot say it is stuck - and a silent engine is not a busy one for ever. Once it has answered no health question
    for the coordinator's `unresponsive_s` it is taken out of every pair; a request meanwhile is retried elsewhere with
    the model's output; when the engine continues (SIGCONT) it stays out (it serves again only by registering anew,
    and a pool's replica fails its health check once it has been found so: Serve replaces it)."""
    coordinator, engines = cl
    victim = "prefill-b"  # the last prefill engine: the request must be served whole by a decode engine
    assert ray.get(coordinator.ready("prefill")) == [victim], "this test runs after the hung-prefill test took " \
        f"prefill-a out; ready: {ray.get(coordinator.ready('prefill'))}"
    pids = ray.get(engines[victim].pids())  # the actor, then vLLM's processes
    router = Router(coordinator, stall_s=STALL_S, policy="load")
    prompt = prompts(seed=34, lengths=(120,))[0]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        out = asyncio.run(_one(router, prompt, 8))  # its prefill engine answers nothing: served elsewhere
        served_after = time.monotonic() - t0
        t1 = time.monotonic()  # the next request does not try it again (the coordinator has not decided yet)
        again = asyncio.run(_one(router, prompt, 8))
        again_s = time.monotonic() - t1
        listed = victim in ray.get(coordinator.ready("prefill"))  # still listed: the router avoided it by itself
        deadline = t0 + UNRESPONSIVE_S + 45
        while victim in ray.get(coordinator.ready("prefill")) and time.monotonic() < deadline:
            time.sleep(0.5)
        out_after = time.monotonic() - t0
        assert victim not in ray.get(coordinator.ready("prefill")), "the silent engine was never taken out"
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    print(f"a request served {served_after:.1f} s after the whole engine stopped, the next in {again_s:.1f} s (the "
          f"engine {'still' if listed else 'no longer'} listed); "
          f"taken out after {out_after:.1f} s")
    assert out == oracle(prompt, 8) and again == out
    assert listed, "the coordinator had taken the engine out already: the router's own avoidance went unseen"
    assert again_s < STALL_S and router.choice.suspected == 1, (again_s, router.choice.suspects)
    why = [r["why"] for r in ray.get(coordinator.removed_engines()) if r["engine_id"] == victim]
    assert why and why[-1].startswith("unresponsive: no health answer"), why
    deadline = time.monotonic() + 30
    while asyncio.run(_verdict(engines[victim])).state != "healthy" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert asyncio.run(_verdict(engines[victim])).state == "healthy"  # it answers again now
    time.sleep(2 * STALL_S)  # and the coordinator's watch has looked at it again: still out
    assert victim not in ray.get(coordinator.ready("prefill"))
    assert asyncio.run(_one(router, prompt, 8)) == oracle(prompt, 8)
