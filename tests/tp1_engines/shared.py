"""The engines this folder's modules share (`Engines`, started by conftest.py's `tp1_engines` fixture) and the
settings they are started with."""

from __future__ import annotations

import os
import signal

import ray

BLOCKS = 192  # each engine's block pool (vLLM's num_gpu_blocks_override): small, so that eviction comes soon
ENGINE_KWARGS = {"enable_prefix_caching": True, "num_gpu_blocks_override": BLOCKS}
# the engines' margin past twice their slowest step before they call themselves stuck (PD_ENGINE_STALL_S, default
# 10 s): a hung engine is found within about a second
STALL_S = 1.0
# the coordinator's patience with an engine that answers no health question (default 60 s): longer than a request
# takes to be served elsewhere, so that a router is seen avoiding the engine while the coordinator still lists it
UNRESPONSIVE_S = 15.0
PREFILLS, DECODES = ("prefill-a", "prefill-b"), ("decode-a", "decode-b")


def signal_engine(engine, sig: int, actor_too: bool = True) -> None:
    """`sig` to an engine's processes: its actor and every process vLLM started under it (`actor_too=False`: vLLM's
    only); nothing for an engine already stopped."""
    try:
        pids = ray.get(engine.pids(), timeout=30)  # the actor first
    except Exception:  # noqa: BLE001 - stopped already
        return
    for pid in pids if actor_too else pids[1:]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Engines:
    """The coordinator and the engines by id; `launch` starts (or restarts, under the same id) and registers more."""

    def __init__(self, model_dir: str):
        from actors.control.coordinator import start_coordinator

        self.model_dir = model_dir
        self.coordinator = start_coordinator(name="coordinator-tp1-engines", unresponsive_s=UNRESPONSIVE_S)
        self.engines: dict = {}
        try:
            self.launch(*PREFILLS, *DECODES)
        except BaseException:
            self.stop()
            raise

    def launch(self, *engine_ids: str) -> None:
        from actors.engine.actor import launch_engine_actor

        launched = {e: launch_engine_actor(self.model_dir, 1, role=e.split("-")[0], engine_id=e,
                                           engine_kwargs=ENGINE_KWARGS, extra_env={"PD_ENGINE_STALL_S": str(STALL_S)})
                    for e in engine_ids}
        self.engines.update({e: h for e, (h, _) in launched.items()})
        ray.get([ref for _, ref in launched.values()])
        for e in sorted(engine_ids, key=lambda e: not e.startswith("prefill")):
            ray.get(self.engines[e].register(self.coordinator))

    def signal_all(self, sig: int) -> None:
        """`sig` to every process of every engine (a test that stopped one must never leave it stopped)."""
        for h in self.engines.values():
            signal_engine(h, sig)

    def stop(self) -> None:
        from actors.engine.actor import stop_engine_actors

        self.signal_all(signal.SIGCONT)
        stop_engine_actors(list(self.engines.values()))
        self.coordinator.kill()
