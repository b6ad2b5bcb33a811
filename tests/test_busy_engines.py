"""Busy is not stuck, live: an engine whose EngineCore compiles inside a step - a logprobs request on an empty compile
cache with the warm-up turned off, so that vLLM compiles its logprob rank count there, ~10 s of a core - does not
answer between steps for several times its threshold, yet burns CPU: it stays healthy (busy), and the request
completes on it. The same engine SIGSTOPped is judged stuck as fast as before the rule (its threshold and a probe)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import ray

from actors.engine.actor import launch_engine_actor, stop_engine_actors
from tests.pd_helpers import wait_for

pytestmark = pytest.mark.engine
STALL_S = 1.0  # the engine's margin (PD_ENGINE_STALL_S): its threshold is 2 x its slowest answer + 1 s


@pytest.fixture(scope="module")
def engine(ray_local, gdn_model, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cold-compile-cache")
    client, started = launch_engine_actor(
        gdn_model, 1, role="decode", engine_id="decode-busy",
        extra_env={"PD_ENGINE_WARMUP": "0", "PD_COMPILE_CACHE_DIR": str(cache), "PD_ENGINE_STALL_S": str(STALL_S)})
    try:
        ray.get(started)
        yield client
    finally:
        for pid in ray.get(client.pids())[1:]:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop_engine_actors([client])


def _verdict(client):
    return asyncio.run(client.verdict())


def test_an_engine_compiling_inside_a_step_is_busy_not_stuck(engine):
    seen: list[tuple[float, str, str]] = []
    done = threading.Event()

    def watch() -> None:
        t0 = time.monotonic()
        while not done.is_set():
            v = _verdict(engine)
            seen.append((time.monotonic() - t0, v.state, v.why))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    out = ray.get(engine.generate(prompt_token_ids=[1, 5, 9, 14], max_tokens=4, logprobs=2), timeout=300)
    took = time.monotonic() - t0
    done.set()
    watcher.join()
    busy = [why for _, state, why in seen if "busy" in why]
    print(f"logprobs request on a cold cache took {took:.1f} s; verdicts: "
          f"{sorted({state for _, state, _ in seen})}; busy e.g. {busy[:1]}")
    assert len(out["logprobs"]) == 4
    assert took > 4 * STALL_S + 3, f"no long compile happened ({took:.1f} s): this test would show nothing"
    assert {state for _, state, _ in seen} == {"healthy"}, [s for s in seen if s[1] != "healthy"][:3]
    assert busy, "the engine was never found busy while it compiled"


def test_a_stopped_engine_is_still_found_stuck_within_its_threshold(engine):
    assert _verdict(engine).state == "healthy"
    pids = ray.get(engine.pids())[1:]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        took = wait_for(lambda: _verdict(engine).state == "failed", 60, poll_s=0.2)
        why = _verdict(engine).why
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    print(f"found stuck {took:.1f} s after SIGSTOP: {why}")
    assert "stuck" in why and "stopped" in why
    # threshold = 2 x slowest answer (idle answers: milliseconds) + STALL_S; plus up to a probe interval to ask
    assert took < 2 * STALL_S + 3, took
    wait_for(lambda: _verdict(engine).state == "healthy", 30, poll_s=0.2)  # it continues: stepping again
