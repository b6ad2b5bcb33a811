"""Shared pieces of the disaggregated-serving tests: start engines with roles, register them, run requests."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import ray

from actors.coordinator import CoordinatorActor
from actors.engine import launch_engine_actor, stop_engine_actors
from cluster.router import Router

MAX_TOKENS = 12


def oracle(prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    """The greedy continuation the tiny GDN model's weights implement (`cluster.models.expected_next_token`)."""
    from cluster.models import expected_next_token

    ids = list(prompt)
    for _ in range(n):
        ids.append(expected_next_token(ids))
    return ids[len(prompt):]


def prompts(seed: int = 5, lengths=(3, 60, 200, 700)) -> list[list[int]]:
    """Token prompts from shorter than one block to several blocks (blocks are 128-384 tokens on CPU)."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 1024) for _ in range(n)] for n in lengths]


class PDCluster:
    """A coordinator and engines started together; `engines[(role, tp)]` -> handle."""

    def __init__(self, model_dir, layout: list[tuple[str, int]], namespace: str,
                 engine_kwargs: dict[str, Any] | None = None,
                 per_engine: dict[tuple[str, int], dict[str, Any]] | None = None,
                 extra_env: dict[str, str] | None = None):
        """`engine_kwargs` go to every engine, `per_engine[(role, tp)]` to one (on top); `extra_env` to every engine's
        processes."""
        self.coordinator = CoordinatorActor.options(name=f"coordinator-{namespace}").remote()
        launched = {
            (role, tp): launch_engine_actor(model_dir, tp, role=role, engine_id=f"{role}-tp{tp}", extra_env=extra_env,
                                            engine_kwargs={**(engine_kwargs or {}), **(per_engine or {}).get((role, tp), {})})
            for role, tp in layout
        }
        self.engines = {k: h for k, (h, _) in launched.items()}
        try:
            self.startup_s = dict(zip(launched, ray.get([ref for _, ref in launched.values()])))
            for key in sorted(self.engines, key=lambda k: k[0] != "prefill"):  # prefill first, then decode
                ray.get(self.engines[key].register.remote(self.coordinator))
        except BaseException:
            self.stop()
            raise
        # the router as deployed (the prefill engine samples the first token where it can) and one that leaves every
        # first token to the decode engine (vLLM's hybrid default: the prefill side stops one token short)
        self.routers = {"prefill": Router(self.coordinator), "decode": Router(self.coordinator, first_token_from_prefill=False)}
        self.router = self.routers["prefill"]

    def engine_id(self, role: str, tp: int) -> str:
        return f"{role}-tp{tp}"

    def stop(self) -> tuple[list[int], list[int]]:
        """Stop everything; returns the engines' pids and side-channel ports (empty when already stopped)."""
        pids, ports = [], []
        for h in self.engines.values():
            try:
                pids += ray.get(h.pids.remote(), timeout=30)
                ports.append(ray.get(h.side_channel_port.remote(), timeout=30))
            except Exception:  # noqa: BLE001 - already stopped
                pass
        stop_engine_actors(list(self.engines.values()))
        ray.kill(self.coordinator, no_restart=True)
        return pids, ports


async def run_pair(router: Router, prefill_id: str, decode_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """One greedy request through a given approved pair."""
    out: list[int] = []
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    async for item in router.generate(prompt, sampling, pair=(prefill_id, decode_id)):
        out += item["token_ids"]
    return out


async def colocated(engine: Any, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """The same request run whole by one engine (no transfer)."""
    return await decode_stream(engine, prompt, None, max_tokens)


async def decode_stream(engine: Any, prompt: list[int], params: dict[str, Any] | None, max_tokens: int = MAX_TOKENS) -> list[int]:
    """A greedy request on a decode engine, straight (no router): with a prefill's transfer parameters the engine
    reads the state from that prefill engine; with None it runs the whole request itself."""
    out: list[int] = []
    stream = engine.decode.options(num_returns="streaming").remote(
        prompt, {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}, params, f"direct-{random.random()}"
    )
    async for ref in stream:
        out += (await ref)["token_ids"]
    return out


def wait_for(predicate, timeout_s: float, poll_s: float = 0.1) -> float:
    """Poll `predicate` until it is true; returns the seconds it took, AssertionError after `timeout_s`."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not true after {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - t0


def gather(coros) -> list:
    """Run coroutines concurrently to completion from synchronous test code."""

    async def main():
        return await asyncio.gather(*coros)

    return asyncio.run(main())
