"""Shared pieces of the disaggregated-serving tests: start engines with roles, register them, run requests."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import psutil
import ray

from actors.control.coordinator import start_coordinator
from actors.engine.actor import launch_engine_actor, stop_engine_actors
from actors.frontend.router import Router

MAX_TOKENS = 12


def oracle(prompt: list[int], n: int = MAX_TOKENS, kind: str = "gdn") -> list[int]:
    """The greedy continuation the tiny hybrid model's weights implement (`cluster.cli.tiny_circuit.expected_next_token`)."""
    from cluster.cli.tiny_circuit import expected_next_token

    ids = list(prompt)
    for _ in range(n):
        ids.append(expected_next_token(ids, kind=kind))
    return ids[len(prompt):]


def prompts(seed: int = 5, lengths=(3, 60, 200, 700)) -> list[list[int]]:
    """Token prompts from shorter than one block to several blocks (blocks are 128-384 tokens on CPU)."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 1024) for _ in range(n)] for n in lengths]


class PDCluster:
    """A coordinator and engines started together; `engines[(role, tp)]` -> its `EngineClient`."""

    def __init__(self, model_dir, layout: list[tuple[str, int]], namespace: str,
                 engine_kwargs: dict[str, Any] | None = None,
                 per_engine: dict[tuple[str, int], dict[str, Any]] | None = None,
                 extra_env: dict[str, str] | None = None):
        """`engine_kwargs` go to every engine, `per_engine[(role, tp)]` to one (on top); `extra_env` to every engine's
        processes."""
        self.coordinator = start_coordinator(name=f"coordinator-{namespace}")
        launched = {
            (role, tp): launch_engine_actor(model_dir, tp, role=role, engine_id=f"{role}-tp{tp}", extra_env=extra_env,
                                            engine_kwargs={**(engine_kwargs or {}), **(per_engine or {}).get((role, tp), {})})
            for role, tp in layout
        }
        self.engines = {k: h for k, (h, _) in launched.items()}
        try:
            self.startup_s = dict(zip(launched, ray.get([ref for _, ref in launched.values()])))
            for key in sorted(self.engines, key=lambda k: k[0] != "prefill"):  # prefill first, then decode
                ray.get(self.engines[key].register(self.coordinator))
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
                pids += ray.get(h.pids(), timeout=30)
                ports.append(ray.get(h.side_channel_port(), timeout=30))
            except Exception:  # noqa: BLE001 - already stopped
                pass
        stop_engine_actors(list(self.engines.values()))
        self.coordinator.kill()
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
    stream = engine.decode(
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


async def until(predicate, timeout_s: float, what: str, poll_s: float = 0.5) -> float:
    """`wait_for` inside an event loop: `predicate` runs in a thread (it may block), the loop keeps serving."""
    t0 = time.monotonic()
    while not await asyncio.to_thread(predicate):
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not after {timeout_s:.0f} s")
        await asyncio.sleep(poll_s)
    return time.monotonic() - t0


def processes_under(marker: str) -> list[psutil.Process]:
    """A test cluster's daemons (their command lines name `marker`, e.g. its Ray temp dir) and everything below them."""
    roots = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                roots.append(p)
        except psutil.Error:
            pass
    found = {p.pid: p for p in roots}
    for p in roots:
        try:
            found.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            pass
    return [p for p in found.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def end_processes_under(marker: str) -> None:
    """Terminate `processes_under(marker)`, then kill what is left and wait for it to be gone: a SIGKILLed gcs_server
    can still read as running for a moment (CI saw one), and a daemon may start a child while its parent shuts down -
    so take a few rounds before anything counts as a leak."""
    for _ in range(3):
        procs = processes_under(marker)
        if not procs:
            break
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=10)


def metric(text: str, name: str) -> str:
    """The value of `name` (with its labels, when it has any: 'pd_degraded{role="prefill"}') in a /metrics page."""
    from cluster.core.metrics import sample_value

    value = sample_value(text, name)
    assert value is not None, f"{name} not in /metrics"
    return value


def gather(coros) -> list:
    """Run coroutines concurrently to completion from synchronous test code."""

    async def main():
        return await asyncio.gather(*coros)

    return asyncio.run(main())


def _run_time_layout(registration: Any):
    """(model shape, the engine's run-time layout, its state places [(group, region, layer)], its attention places
    [(group, region)]) from a registration."""
    from cluster.core.hf_config import model_shape
    from cluster.core.layout import layout_from_report

    shape = model_shape(registration.hf_config)
    lay = layout_from_report(registration.ranks[0]["layout"], shape)
    places = [(g, region, layer) for g, group in enumerate(lay.groups) if group.kind == "state"
              for region, layer in enumerate(group.layers)]
    attention = [(g, region) for g, group in enumerate(lay.groups) if group.kind == "attention"
                 for region in range(len(group.layers))]
    return shape, lay, places, attention


def _every_state_layer(lay, places, ranges: list[tuple[int, int]], dtype: str) -> list[list[dict]]:
    return [[{"group": g, "region": region, "dtype": dtype, "ranges": ranges} for g, region, _ in places]] * lay.tp


def _attention_and_control(lay, places, attention) -> dict[str, list[list[dict]]]:
    """Attention K and V of every attention layer, and (where the state pages have some) the control: noise in
    state page padding, bytes the model never reads."""
    out: dict[str, list[list[dict]]] = {}
    half = lay.kv_head_bytes // 2  # a KV head's K rows, then its V rows, in each kernel page
    for name, start in (("attention K", 0), ("attention V", half)):
        ranges = [(k * lay.kernel_page_bytes + h * lay.kv_head_bytes + start, half)
                  for k in range(lay.physical_blocks_per_logical) for h in range(lay.kv_heads_local)]
        out[name] = [[{"group": g, "region": region, "dtype": lay.dtype, "ranges": ranges}
                      for g, region in attention]] * lay.tp
    padding = lay.page_bytes - lay.min_state_page_bytes
    if padding >= 4:
        out[CONTROL] = _every_state_layer(lay, places, [(lay.min_state_page_bytes, padding // 4 * 4)], "float32")
    return out


def byte_classes(registration: Any, probes: dict[str, list[int]]) -> dict[str, tuple[list[int], list[list[dict]]]]:
    """Every byte class a decode engine reads for a hybrid request, as (probe prompt, noise specs per rank) for
    `EngineClient.corrupt_next_read`: each conv sub-projection (GDN Q, K, V; Mamba2 x, B, C) and each conv row in every
    state layer, each recurrent head of each state layer (on the rank that holds it), attention K and V. Offsets come
    from the engine's run-time layout (`cluster.core.layout`). `probes`: the model's probe prompts
    (`cluster.cli.tiny_circuit.probe_prompts`: "self" for the conv and attention classes, "layer L head H" for recurrent
    head H of the L-th state layer)."""
    shape, lay, places, attention = _run_time_layout(registration)
    state, tp = shape.state, lay.tp
    out: dict[str, tuple[list[int], list[list[dict]]]] = {}
    for i, proj in enumerate(state.conv_projs):  # in the engine's conv layout: DS or SD (cluster.core.layout)
        ranges = lay.conv_ranges(i, 0, proj.local_units(tp))
        out[f"conv {proj.name}"] = (probes["self"], _every_state_layer(lay, places, ranges, lay.dtype))
    for r in range(lay.conv_rows):
        out[f"conv row {r}"] = (probes["self"], _every_state_layer(lay, places, lay.conv_row_ranges(r), lay.dtype))
    head_bytes = state.ssm.unit_elems * lay.ssm_elem_bytes
    for i, (g, region, layer) in enumerate(sorted(places, key=lambda p: p[2])):
        for head in range(state.ssm.units):
            specs: list[list[dict]] = [[] for _ in range(tp)]
            for rank in range(tp):
                held = state.ssm.held_units(tp, rank)
                if head in held:
                    at = lay.ssm_offset + held.index(head) * head_bytes
                    specs[rank].append({"group": g, "region": region, "dtype": lay.ssm_dtype, "ranges": [(at, head_bytes)]})
            out[f"recurrent layer {layer} head {head}"] = (probes[f"layer {i} head {head}"], specs)
    for name, specs in _attention_and_control(lay, places, attention).items():
        out[name] = (probes["self"], specs)
    return out


def whole_byte_classes(registration: Any) -> dict[str, list[list[dict]]]:
    """The byte classes of a hybrid request's transfer, each whole across every layer (noise specs per rank for
    `EngineClient.corrupt_next_read`): conv state, recurrent state, attention K, attention V, and the control (state
    page padding) where there is one - for models without probe prompts (the real-size builds)."""
    _, lay, places, attention = _run_time_layout(registration)
    return {"conv": _every_state_layer(lay, places, [(0, lay.conv_state_bytes)], lay.dtype),
            "recurrent": _every_state_layer(lay, places, [(lay.ssm_offset, lay.ssm_state_bytes)], lay.ssm_dtype),
            **_attention_and_control(lay, places, attention)}


CONTROL = "control: state page padding"


def unseen_byte_classes(pd: PDCluster, prefill_id: str, decode_key: tuple[str, int], kind: str,
                        max_tokens: int = 4) -> dict[str, list[int]]:
    """Run each byte class's probe prompt from `prefill_id` to the decode engine `decode_key` (the decode engine
    samples the first token, so it reads the state after all but the last prompt token) with that class overwritten
    by noise right after the read lands. Returns the classes whose output stayed as without the noise (empty: every
    class is seen). Each probe's clean output is checked against the model's rule first, and noise in bytes the model
    never reads (the state pages' padding, where there is some) must leave the output as it was."""
    from cluster.cli.tiny_circuit import probe_prompts

    decode = pd.engines[decode_key]
    router = pd.routers["decode"]
    classes = byte_classes(ray.get(decode.registration()), probe_prompts(kind))
    clean = {}
    unseen = {}
    for i, (name, (prompt, specs)) in enumerate(classes.items()):
        key = tuple(prompt)
        if key not in clean:
            clean[key] = gather([run_pair(router, prefill_id, pd.engine_id(*decode_key), prompt, max_tokens)])[0]
            assert clean[key] == oracle(prompt, max_tokens, kind), f"probe for {name}: the pair disagrees with the rule"
        ray.get(decode.corrupt_next_read(specs, i))
        out = gather([run_pair(router, prefill_id, pd.engine_id(*decode_key), prompt, max_tokens)])[0]
        if name == CONTROL:
            assert out == clean[key], "noise in bytes the model never reads changed the output: the hook is off target"
        elif out == clean[key]:
            unseen[name] = out
    return unseen
