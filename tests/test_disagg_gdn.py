"""Disaggregated prefill/decode on the tiny GDN hybrid: real vLLM engines in Ray actors, real NIXL reads planned by the
coordinator, outputs equal to a colocated engine token for token, at (P, D) TP = (1, 1), (1, 2), (2, 1), (2, 2)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import re
import socket
import time

import psutil
import pytest
import ray

from cluster.core.coordinator import RegistrationError
from cluster.cli.tiny_model import ensure_model
from tests.pd_helpers import MAX_TOKENS, PDCluster, colocated, decode_stream, gather, oracle, prompts, run_pair, until, wait_for

pytestmark = pytest.mark.engine

PAIRS = [(1, 1), (1, 2), (2, 1), (2, 2)]


@pytest.fixture(scope="module")
def pd(ray_local, gdn_model):
    cluster = PDCluster(gdn_model, [("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)], "gdn")
    print(f"engine startup seconds: {cluster.startup_s}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def reference(pd):
    """Colocated runs: the whole request on one engine (decode TP 1, no transfer), and the rule the weights implement."""
    ref = gather(colocated(pd.engines[("decode", 1)], p) for p in prompts())
    for p, r in zip(prompts(), ref):
        assert r == oracle(p), "the colocated engine itself disagrees with the model's rule"
    return ref


def test_every_pair_was_negotiated(pd):
    # every engine keeps its conv state in vLLM's default SD layout (actors.engine.settings.CPU_CONV_STATE_LAYOUT), so
    # the reads and the byte-class test below move SD bytes (tests/test_disagg_mamba2.py runs DS)
    layouts = {key: {r["layout"]["conv_layout"] for r in ray.get(e.registration()).ranks} for key, e in pd.engines.items()}
    assert layouts == {key: {"SD"} for key in pd.engines}
    desc = ray.get(pd.coordinator.describe())
    pairs = {(p["prefill"], p["decode"]): p["tp_ratio"] for p in desc["pairs"]}
    assert pairs == {(f"prefill-tp{p}", f"decode-tp{d}"): (d // p if d >= p else -(p // d)) for p, d in PAIRS}


def test_compute_threads_keep_their_cores(pd):
    """vLLM's NIXL worker pins the thread that builds it - the worker's main thread, its OpenMP master, which runs
    the model - to the machine's last core; every TP rank then computed on that one core (2-3x the time per token).
    The connector puts it back: each rank's main thread stays on the first core of its VLLM_CPU_OMP_THREADS_BIND
    list, so the ranks of a TP 2 engine compute on different cores. A TP 1 engine computes in its EngineCore, bound
    as vLLM binds a worker (`actors.engine.settings.in_process_env`)."""
    from actors.engine.settings import in_process_model
    from cluster.core.cores import shared_bind

    for (role, tp), engine in pd.engines.items():
        cores: dict[int, set[int]] = {}
        compute = r"VLLM::EngineCore()" if in_process_model(tp) else r"VLLM::Worker(?:_TP(\d+))?"
        for pid in ray.get(engine.pids()):
            try:
                title = " ".join(psutil.Process(pid).cmdline())
                m = re.match(compute, title)
                if m:
                    cores[int(m.group(1) or 0)] = set(psutil.Process(pid).cpu_affinity())
            except psutil.NoSuchProcess:
                continue
        expected = {rank: {int(re.split(r"[-,]", spec)[0])} for rank, spec in enumerate(shared_bind(sorted(os.sched_getaffinity(0)), tp).split("|"))}
        assert cores == expected, f"{role} TP {tp}: worker main threads on cores {cores}, bound to {expected}"


def test_each_engine_process_runs_one_gloo_loop_thread(pd):
    """vLLM-CPU builds ~15 gloo process groups in each process that runs the model, and stock PyTorch gives each its
    own TCP loop thread, waking every 10 ms; the vLLM plugin (PD_GLOO_SHARED_DEVICE, set by launch_env) gives them
    one device per process, so one loop thread, in the EngineCore of a TP 1 engine and in every worker of a TP 2 one.
    The other tests of this module run on those shared devices (TP 2 all-reduces among them)."""
    from actors.engine.settings import in_process_model

    for (role, tp), engine in pd.engines.items():
        loops: dict[str, int] = {}
        for pid in ray.get(engine.pids()):
            try:
                title = psutil.Process(pid).cmdline()[0]
                names = [open(f"/proc/{pid}/task/{t}/comm").read().strip() for t in os.listdir(f"/proc/{pid}/task")]
            except (OSError, IndexError, psutil.NoSuchProcess):
                continue
            if names.count("gloo_tcp_loop"):
                loops[f"{title} ({pid})"] = names.count("gloo_tcp_loop")
        assert len(loops) == (1 if in_process_model(tp) else tp), f"{role} TP {tp}: {loops}"
        assert set(loops.values()) == {1}, f"{role} TP {tp}: gloo loop threads per process {loops}"


@pytest.mark.parametrize("p_tp, d_tp", PAIRS)
def test_disaggregated_equals_colocated(pd, reference, p_tp, d_tp):
    """Prompts of 4 to 701 tokens (under one block to several), all in flight at once."""
    outs = gather(run_pair(pd.router, f"prefill-tp{p_tp}", f"decode-tp{d_tp}", p) for p in prompts())
    for prompt, out, ref in zip(prompts(), outs, reference):
        assert out == ref, f"{len(prompt)}-token prompt, P TP {p_tp} -> D TP {d_tp}"


@pytest.mark.parametrize("first", ["prefill", "decode"])
@pytest.mark.parametrize("p_tp, d_tp", PAIRS)
def test_prompts_on_block_boundaries(pd, p_tp, d_tp, first):
    """This model's logical block on CPU is 128 tokens. With the first token from the prefill engine the whole prompt
    is transferred; with it from the decode engine all but the last prompt token. Either way, prompts whose
    transferred tokens are one short of a block, exactly one block and exactly two - the cases where an off-by-one
    in the block mapping reads a stale or a missing block - equal the model's rule, and the decode engine read
    exactly that many tokens."""
    decode = pd.engines[("decode", d_tp)]
    block = ray.get(decode.registration()).ranks[0]["layout"]["block_size"]
    assert block == 128
    whole = first == "prefill"  # prompts() adds a BOS: a length n gives n + 1 tokens
    cases = prompts(seed=41, lengths=[n - whole for n in (block - 1, block, 2 * block)])
    ray.get(decode.transfer_stats())  # drain earlier requests
    outs = gather(run_pair(pd.routers[first], f"prefill-tp{p_tp}", f"decode-tp{d_tp}", p) for p in cases)
    for prompt, out in zip(cases, outs):
        assert out == oracle(prompt), f"{len(prompt)}-token prompt, P TP {p_tp} -> D TP {d_tp}, first token: {first}"
    read = sorted({s["tokens"] for s in ray.get(decode.transfer_stats())})
    assert read == [block - 1, block, 2 * block], read


def test_decode_outputs_take_the_local_socket_and_the_ray_stream_alike(pd, reference):
    """On one node a router receives decode outputs on a local ZeroMQ socket, and the channel's Ray stream carries
    only its opening (it stays open as the lifeline that breaks when the engine dies); a router told to use the Ray
    stream receives them as its items. Same outputs either way. A channel's socket file goes with its event loop."""
    import os

    from actors.engine.decode_channel import _socket_dir
    from actors.frontend.router import Router

    by_ray = Router(pd.coordinator, decode_transport="ray")
    for router in (pd.router, by_ray):
        outs = gather(run_pair(router, "prefill-tp1", "decode-tp2", p) for p in prompts())
        assert outs == reference, f"decode transport {router.decode_transport}"
    local, remote = pd.router._channels["decode-tp2"], by_ray._channels["decode-tp2"]
    assert local.transport == "zmq" and local.received["ray"] == 1 and local.received["zmq"] >= MAX_TOKENS
    assert remote.transport == "ray" and remote.received["zmq"] == 0 and remote.received["ray"] > MAX_TOKENS
    assert local.closed and not [f for f in os.listdir(_socket_dir()) if f.endswith(".sock")]
    with pytest.raises(ValueError, match="decode_transport"):
        Router(pd.coordinator, decode_transport="tcp")


def test_first_token_from_the_prefill_engine(pd, reference):
    """A streamed greedy request gets its first token from the prefill engine, sampled with the request's own
    parameters (logprobs included); the decode engine reads the state of the whole prompt and continues from that
    token, with outputs and logprobs equal to a request whose first token the decode engine samples. A request the
    first token ends (max_tokens 1, a stop token) never reaches the decode engine, and the prefill engine lets go of
    the state it held for it. Seeded random sampling and stop strings leave the first token to the decode engine."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    decode, prefill = pd.engines[("decode", 2)], pd.engines[("prefill", 1)]
    prompt = prompts(seed=3, lengths=(200,))[0]

    async def once(router, **kw):
        params = SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **kw},
                                output_kind=RequestOutputKind.DELTA)
        outs = []
        async for o in router.stream(prompt, params, pair=("prefill-tp1", "decode-tp2")):
            outs.append(o)
        c = [o.outputs[0] for o in outs]
        return ([t for x in c for t in x.token_ids], [lp for x in c for lp in (x.logprobs or [])], c[-1].finish_reason,
                {tuple(o.prompt_token_ids) for o in outs})

    def read_tokens():
        return sorted({s["tokens"] for s in ray.get(decode.transfer_stats())})

    read_tokens()  # drain earlier requests
    got, want = asyncio.run(once(pd.router, logprobs=3)), asyncio.run(once(pd.routers["decode"], logprobs=3))
    assert got[0] == want[0] == oracle(prompt) and got[2] == want[2] == "length"
    assert [sorted(lp) for lp in got[1]] == [sorted(lp) for lp in want[1]] and len(got[1]) == MAX_TOKENS
    assert got[3] == want[3] == {tuple(prompt)}
    assert read_tokens() == [len(prompt) - 1, len(prompt)]  # the decode-first request, then the whole prompt

    first = oracle(prompt)[0]
    for kw, reason in (({"max_tokens": 1}, "length"), ({"stop_token_ids": [first], "ignore_eos": False}, "stop")):
        assert asyncio.run(once(pd.router, **kw))[::2] == ([first], reason), kw
    assert read_tokens() == [] and ray.get(prefill.pending_sends(wait_s=10)) == []

    seeded = {"temperature": 0.8, "seed": 7}
    assert asyncio.run(once(pd.router, **seeded))[0] == asyncio.run(once(pd.routers["decode"], **seeded))[0]
    asyncio.run(once(pd.router, stop=["never in the output"]))
    assert read_tokens() == [len(prompt) - 1]  # both left the first token to the decode engine


def test_text_continues_a_first_token_that_ends_inside_a_character(pd, gdn_model):
    """The text clients read, not only the token ids. For this prompt the model's first token is the first byte of a
    UTF-8 sequence (no text yet), and vLLM primes a request's detokenizer with its prompt: a decode engine given
    prompt + that token would send the whole prompt as the next token's text. The decode engine detokenizes the
    continuation as the engine that sampled the first token would have - the same text as a colocated engine, with
    the first token from either engine, and on a continuation after a failover (prompt + sent tokens)."""
    import random

    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    tokenizer = AutoTokenizer.from_pretrained(gdn_model)
    text_prompt = tokenizer("where does the state go?")["input_ids"]

    def lead_byte_prompt() -> list[int]:
        """The text prompt + random tokens, the first whose first output token (by the model's rule) is a lone
        UTF-8 lead byte."""
        for seed in range(5000):
            rng = random.Random(seed)
            prompt = text_prompt + [rng.randrange(3, 1024) for _ in range(8)]
            if tokenizer.decode([oracle(prompt, 1)[0]]) == "\ufffd":
                return prompt
        raise AssertionError("no prompt found whose first token is half a character")

    prompt = lead_byte_prompt()
    first = oracle(prompt, 1)[0]
    assert tokenizer.decode([first]) == "\ufffd"  # a byte that only starts a character: the case under test

    async def colocated_text():
        items = pd.engines[("decode", 1)].decode(
            prompt, {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}, None, "colocated-text")
        return "".join([(await ref)["text"] async for ref in items])

    async def text(router, continued=0):
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        if continued:  # what a failover sends: prompt + the tokens sent, the rest of the request
            from actors.frontend.request import Request

            req = Request(prompt, params, "cont", ("prefill-tp1", "decode-tp2"), sent=oracle(prompt, continued))
            outs = router._once(req.attempt())
            return "".join([o.outputs[0].text async for o in outs])
        return "".join([o.outputs[0].text async for o in router.stream(prompt, params, pair=("prefill-tp1", "decode-tp2"))])

    want = asyncio.run(colocated_text())
    assert want and "<|" not in want
    for first_from in ("prefill", "decode"):
        assert asyncio.run(text(pd.routers[first_from])) == want, first_from
        # the first token's own text is empty (half a character): what follows it carries all of the text
        assert asyncio.run(text(pd.routers[first_from], continued=1)) == want, f"continued, {first_from}"


def test_transfer_statistics(pd, reference):
    """Per request and decode rank: bytes, descriptors and milliseconds, from the decode engine."""
    decode = pd.engines[("decode", 2)]
    ray.get(decode.transfer_stats())  # drain earlier requests
    prompt = prompts(lengths=(300,))[0]
    asyncio.run(run_pair(pd.routers["decode"], "prefill-tp1", "decode-tp2", prompt))
    stats = ray.get(decode.transfer_stats())
    assert sorted(s["decode_rank"] for s in stats) == [0, 1]
    for s in stats:
        assert s["ok"] and s["tokens"] == len(prompt) - 1 and s["remote_ranks"] == [0]
        assert s["bytes"] > 0 and s["descriptors"] >= 1 and s["ms"] > 0
    # both decode ranks read the same amount: half of each head-sharded region
    assert stats[0]["bytes"] == stats[1]["bytes"]
    assert len({s["request_id"] for s in stats}) == 1


def test_reads_run_on_one_ucx_thread_per_core_of_the_rank(pd, reference):
    """Read lanes (actors/engine/nixl_setup.py): a decode rank's READ runs on one UCX thread per core its rank computes
    on (at most MAX_READ_LANES; here the engines share the node's cores: TP 1 binds to all of them, TP 2 one apiece),
    laid out in equal shares (`lane_rows`: a multiple of the lanes, at least LANE_MIN_ROWS per lane), and the output is
    still the model's."""
    from actors.engine.nixl_setup import MAX_READ_LANES
    from cluster.core.cores import rank_cores, shared_bind
    from cluster.core.planner import LANE_ALIGN, LANE_MIN_BYTES, LANE_MIN_ROWS, LANE_PIECES

    prompt = prompts(seed=9, lengths=(1500,))[0]  # ~2 MB of state and KV: past LANE_MIN_BYTES at decode TP 1
    split = 0
    for d_tp in (1, 2):
        decode = pd.engines[("decode", d_tp)]
        ray.get(decode.transfer_stats())  # drain earlier requests
        assert asyncio.run(run_pair(pd.routers["decode"], "prefill-tp1", f"decode-tp{d_tp}", prompt)) == oracle(prompt)
        stats = ray.get(decode.transfer_stats())
        assert sorted(s["decode_rank"] for s in stats) == list(range(d_tp))
        bind = shared_bind(sorted(os.sched_getaffinity(0)), d_tp)
        for s in stats:
            lanes = min(len(rank_cores(bind, s["decode_rank"])), MAX_READ_LANES)
            assert s["ok"] and s["lanes"] == lanes, (d_tp, s)
            if lanes > 1 and s["bytes"] >= LANE_MIN_BYTES:
                assert s["descriptors"] % lanes == 0 and s["descriptors"] >= lanes * LANE_MIN_ROWS, s
                # each of NIXL's runs (one per UCX thread) carries an equal share, within one piece
                for runs in s["lane_bytes"]:
                    assert len(runs) == lanes and max(runs) - min(runs) <= sum(runs) / (lanes * LANE_PIECES) + LANE_ALIGN, s
                split += 1
    if len(os.sched_getaffinity(0)) > 1:
        assert split, "no READ was laid out for lanes: the decode TP 1 engine binds to every core here"


def test_the_data_path_reads_by_the_negotiated_layout(pd, reference):
    """Not decoration: re-register the TP 1 prefill engine with a wrong layout. Its kernel block halved
    (physical_blocks_per_logical 2 instead of 1) is refused outright - CPU attention pages cannot be remapped between
    kernel block sizes. Its page size doubled is a layout the coordinator can plan with: the decode side then reads
    by that plan, and its answers are no longer right (wrong tokens, or reads the prefill side's memory refuses);
    restoring the true registration restores them."""
    from actors.frontend.router import EngineFailure

    engine = pd.engines[("prefill", 1)]
    reg = ray.get(engine.registration())
    long_prompts = prompts(seed=9, lengths=(300, 500))
    expected = [oracle(p) for p in long_prompts]

    async def answers():
        out = []
        for p in long_prompts:
            try:
                out.append(await run_pair(pd.router, "prefill-tp1", "decode-tp2", p))
            except EngineFailure as e:
                out.append(str(e))
        return out

    try:
        ray.get(pd.coordinator.deregister("prefill-tp1"))
        halved = copy.deepcopy(reg)
        for rank in halved.ranks:
            rank["layout"]["kernel_block_size"] //= 2
        with pytest.raises(RegistrationError, match=r"kernel_block_size: prefill has 64, decode has 128; vLLM's CPU"):
            ray.get(engine.register(pd.coordinator, halved))
        doubled = copy.deepcopy(reg)
        for rank in doubled.ranks:
            rank["layout"]["page_bytes"] *= 2
        ray.get(engine.register(pd.coordinator, doubled))
        wrong = asyncio.run(answers())
        assert all(w != e for w, e in zip(wrong, expected)), wrong
    finally:
        ray.get(pd.coordinator.deregister("prefill-tp1"))
        ray.get(engine.register(pd.coordinator, reg))
    assert asyncio.run(answers()) == expected


def test_incompatible_dtype_refused_naming_the_field(pd):
    """A decode engine whose cache dtype differs: refused when paired with the first prefill engine, and a prefill
    engine in another dtype is refused by its own pool."""
    reg = dataclasses.replace(ray.get(pd.engines[("decode", 2)].registration()), engine_id="decode-fp16")
    for rank in reg.ranks:
        rank["layout"]["dtype"] = "float16"
    with pytest.raises(RegistrationError, match=r"dtype: decode-fp16 \(decode\) is incompatible with prefill-tp\d \(prefill\): dtype: prefill has 'bfloat16', decode has 'float16'"):
        ray.get(pd.coordinator.register(reg, pd.engines[("decode", 2)]))
    reg = dataclasses.replace(reg, engine_id="prefill-fp16", role="prefill")
    with pytest.raises(RegistrationError, match=r"dtype: prefill-fp16 has 'float16', prefill-tp\d of the same prefill pool has 'bfloat16'"):
        ray.get(pd.coordinator.register(reg, pd.engines[("decode", 2)]))
    assert not {"decode-fp16", "prefill-fp16"} & set(ray.get(pd.coordinator.describe())["engines"])


def test_engine_in_another_conv_layout_refused(pd):
    """A decode engine that reports its conv state DS, where the prefill pool runs SD: refused at registration,
    naming the field and both layouts (a read planned across layouts would scramble the conv state)."""
    reg = dataclasses.replace(ray.get(pd.engines[("decode", 2)].registration()), engine_id="decode-ds")
    for rank in reg.ranks:
        assert rank["layout"]["conv_layout"] == "SD"
        rank["layout"]["conv_layout"] = "DS"
    with pytest.raises(RegistrationError, match=r"conv_layout: decode-ds \(decode\) is incompatible with prefill-tp\d "
                                                r"\(prefill\): conv_layout: prefill has 'SD', decode has 'DS'"):
        ray.get(pd.coordinator.register(reg, pd.engines[("decode", 2)]))
    assert "decode-ds" not in ray.get(pd.coordinator.describe())["engines"]


def test_engine_of_another_model_refused(pd, ray_local):
    """A real engine serving the asymmetric GDN model (twice the value heads) asks to join as a prefill engine."""
    from actors.engine.actor import launch_engine_actor, stop_engine_actor

    other, started = launch_engine_actor(ensure_model("gdn-asym"), 1, role="prefill", engine_id="prefill-asym")
    try:
        ray.get(started)
        with pytest.raises(RegistrationError, match=r"model\.state\.conv_projs: prefill-asym .*Proj\(name='v', units=8.*Proj\(name='v', units=4"):
            ray.get(other.register(pd.coordinator))
    finally:
        stop_engine_actor(other)
    assert "prefill-asym" not in ray.get(pd.coordinator.describe())["engines"]


def test_a_decode_engine_with_another_block_size_is_refused(pd):
    """A real decode engine started with 256-token blocks (the prefill engines run 128): vLLM's CPU attention pages
    are not token-major inside a block, so its reads would have landed garbage - a live gdn-asym P TP 1 (384) ->
    D TP 4 (256) pair answered wrong tokens for every prompt with a hit, silently, before the coordinator checked it.
    Refused at registration, naming the field and both values."""
    from actors.engine.actor import launch_engine_actor, stop_engine_actor

    other, started = launch_engine_actor(ensure_model("gdn"), 1, role="decode", engine_id="decode-bs256",
                                         engine_kwargs={"block_size": 256})
    try:
        ray.get(started)
        with pytest.raises(RegistrationError, match=r"kernel_block_size: decode-bs256 \(decode\) is incompatible with "
                                                    r"prefill-tp\d \(prefill\): kernel_block_size: prefill has 128, "
                                                    r"decode has 256; vLLM's CPU attention stores V transposed"):
            ray.get(other.register(pd.coordinator))
    finally:
        stop_engine_actor(other)
    assert "decode-bs256" not in ray.get(pd.coordinator.describe())["engines"]


def test_failed_decode_frees_prefill_blocks(pd):
    """A decode-side failure (here: sampling parameters the decode engine rejects - more logprobs than it allows)
    ends the request with a clear error, and the prefill engine's blocks held for it are released at once."""
    from actors.frontend.router import EngineFailure

    prefill = pd.engines[("prefill", 1)]

    async def bad():
        async for _ in pd.routers["decode"].generate(prompts()[1], {"max_tokens": 4, "logprobs": 10**4},
                                                     pair=("prefill-tp1", "decode-tp1")):
            pass

    with pytest.raises(EngineFailure, match="decode failed on engine decode-tp1: .*logprobs"):
        asyncio.run(bad())
    assert ray.get(prefill.pending_sends()) == []


def test_failed_prefill_is_a_clear_error(pd):
    """A prompt the prefill engine rejects (longer than its context) fails the request before any decode work."""
    from actors.frontend.router import EngineFailure

    async def too_long():
        async for _ in pd.router.generate([1] * 5000, {"max_tokens": 4}, pair=("prefill-tp2", "decode-tp1")):
            pass

    with pytest.raises(EngineFailure, match=r"prefill failed on engine prefill-tp2: .*(longer than|maximum|max_model_len)"):
        asyncio.run(too_long())
    assert ray.get(pd.engines[("prefill", 2)].pending_sends(wait_s=0)) == []
    assert ray.get(pd.engines[("prefill", 2)].health()).healthy


def test_a_prefill_engine_is_busy_until_its_prefilled_state_is_read(pd):
    """What a draining prefill engine waits for: after its prefill returned, the engine still holds the request's
    state for the decode engine (its scheduler keeps it); once the decode engine has read it, nothing is held."""
    prefill, decode = pd.engines[("prefill", 1)], pd.engines[("decode", 1)]
    assert ray.get(prefill.busy()).idle
    prompt = prompts()[2]
    params = ray.get(prefill.prefill(prompt, "held-1")).kv_transfer_params
    held = ray.get(prefill.busy())
    assert len(held.held) == 1 and held.prefills == 0 and not held.idle, held  # the prefill is done, its state is not read yet
    assert asyncio.run(decode_stream(decode, prompt, params)) == oracle(prompt)
    wait_for(lambda: ray.get(prefill.busy()).held == (), 10)


class _LeavesAfterPrefill:
    """A prefill engine's client that, right after its first prefill returns, has the coordinator deregister the
    engine (what a scale-down does): the decode engines forget its agents before the router asks one to read."""

    def __init__(self, engine, engine_id: str, coordinator, departed: list[str]):
        self._e, self._id, self._coordinator, self._departed = engine, engine_id, coordinator, departed

    def prefill(self, *args, **kwargs):
        return self._prefill(*args, **kwargs)

    async def _prefill(self, *args, **kwargs):
        prefilled = await self._e.prefill(*args, **kwargs)
        if not self._departed:
            self._departed.append(self._id)
            await self._coordinator.deregister(self._id)
        return prefilled

    def __getattr__(self, name):  # release, ...: the real engine
        return getattr(self._e, name)


def test_a_backlogged_prefill_engine_leaves_the_prompt_to_the_decode_engine(pd):
    """Conditional disaggregation (`transfer.local_prefill_queue`): with a queue of one, a request routed while its
    prefill engine still computes another's prompt is prefilled by its decode engine itself - no transfer - and both
    answers are the model's. Without the limit, the same two requests are both disaggregated."""
    from actors.frontend.router import Router

    decode = pd.engines[("decode", 1)]

    async def both(router, two):
        return await asyncio.gather(*(run_router(router, p) for p in two))

    for limit, local, seed in ((1, 1, 11), (None, 0, 12)):  # new prompts each time: nothing found in a prefix cache
        two = prompts(seed=seed, lengths=(300, 280))
        router = Router(pd.coordinator, local_prefill_queue=limit, policy="load")
        router.choice.pick = lambda candidates, role: sorted(candidates)[0]  # one pair: prefill-tp1 -> decode-tp1
        assert asyncio.run(run_router(router, prompts()[0])) == oracle(prompts()[0])  # routes and engines cached
        assert router.local_prefill == 0  # nothing queued: disaggregated
        ray.get(decode.transfer_stats())  # drain
        assert asyncio.run(both(router, two)) == [oracle(p) for p in two], f"local_prefill_queue {limit}"
        read = ray.get(decode.transfer_stats())
        assert router.local_prefill == local and len(read) == 2 - local, (limit, router.local_prefill, read)
    with pytest.raises(ValueError, match="local_prefill_queue"):
        Router(pd.coordinator, local_prefill_queue=-1)


def test_the_decode_engine_prefills_the_prompts_it_finishes_sooner(pd):
    """`transfer.local_prefill_speed`: three prompts (280, 300, 290 tokens) routed together. The first goes to the
    idle prefill engine. At speed 1 the second finishes sooner on the decode engine (300 against 280 + 300 tokens)
    and is prefilled there; the third would finish no sooner there, behind it (300 + 290 against 280 + 290), and is
    disaggregated. At speed 0.5 the second stays with the prefill engine (600 against 580) and the third goes to the
    decode engine (580 against 870). The decode engine reads only the disaggregated ones; all answers are the
    model's; the router's count of the decode engine's own prompts is back to zero."""
    from actors.frontend.router import Router

    decode = pd.engines[("decode", 1)]
    for speed, expected, seed in ((1.0, [False, True, False], 16), (0.5, [False, False, True], 17)):
        three = prompts(seed=seed, lengths=(279, 299, 289))  # new prompts each time: nothing in a prefix cache
        router = Router(pd.coordinator, local_prefill_speed=speed, policy="load")
        router.choice.pick = lambda candidates, role: sorted(candidates)[0]  # one pair: prefill-tp1 -> decode-tp1
        assert asyncio.run(run_router(router, prompts()[0])) == oracle(prompts()[0])  # routes and engines cached
        assert router.local_prefill == 0  # nothing queued: disaggregated
        ray.get(decode.transfer_stats())  # drain
        routed: dict[int, bool] = {}
        choose = router.choice.choose
        order = [len(p) for p in three]  # the rule's outcome depends on the order they are routed in: keep it

        async def spied(prompt, *args, **kwargs):
            while order[len(routed)] != len(prompt):  # under load the requests' earlier awaits may end out of order
                await asyncio.sleep(0.001)
            choice = await choose(prompt, *args, **kwargs)  # the caller counts it before it awaits anything
            routed[len(prompt)] = choice.local
            return choice

        router.choice.choose = spied

        async def together():
            return await asyncio.gather(*(run_router(router, p) for p in three))

        assert asyncio.run(together()) == [oracle(p) for p in three], f"local_prefill_speed {speed}"
        assert [routed[len(p)] for p in three] == expected, (speed, routed)
        read = ray.get(decode.transfer_stats())
        assert router.local_prefill == 1 and len(read) == 2, (speed, router.local_prefill, read)
        assert sum(router.choice.local_tokens.values()) == 0
    with pytest.raises(ValueError, match="local_prefill_speed"):
        Router(pd.coordinator, local_prefill_speed=0)


def test_an_idle_decode_engine_prefills_the_next_request_itself(pd):
    """`transfer.local_prefill_when_idle`: a request routed while its decode engine has none of the router's requests
    in flight and none in prefill headed for it is prefilled there (no transfer); of two routed together, the second
    finds the engine busy with the first and is disaggregated; a third, routed once the first is done while the
    second is still in prefill, is disaggregated too. All answers are the model's."""
    from actors.frontend.router import Router

    decode = pd.engines[("decode", 1)]
    # prefill answers as the Ray call's return: `_HeldPrefill` below holds one back there
    router = Router(pd.coordinator, local_prefill_when_idle=True, policy="load", prefill_over_channel=False)
    router.choice.pick = lambda candidates, role: sorted(candidates)[0]  # one pair: prefill-tp1 -> decode-tp1
    one, *two = prompts(seed=14, lengths=(290, 300, 280))  # new prompts: nothing found in a prefix cache
    ray.get(decode.transfer_stats())  # drain
    assert asyncio.run(run_router(router, one)) == oracle(one)
    assert router.local_prefill == 1 and ray.get(decode.transfer_stats()) == []

    async def both():
        return await asyncio.gather(*(run_router(router, p) for p in two))

    assert asyncio.run(both()) == [oracle(p) for p in two]
    read = ray.get(decode.transfer_stats())
    assert router.local_prefill == 2 and len(read) == 1, (router.local_prefill, read)

    # a decode engine with nothing in flight but a prompt in prefill headed for it is not idle: the request routed
    # then is disaggregated too (the prefill engine's answer is held back until it has been routed)
    *two, late = prompts(seed=15, lengths=(290, 300, 280))
    held = asyncio.Event()
    router._engines["prefill-tp1"] = _HeldPrefill(pd.engines[("prefill", 1)], held)

    async def three():
        first = [asyncio.create_task(run_router(router, p)) for p in two]  # one local, one held in its prefill
        await until(lambda: router.choice.inflight["decode-tp1"] == 0 and router.choice.heading["decode-tp1"] == 1 and
                    router.local_prefill == 3, 60, "the local request to end while the other is held", poll_s=0.1)
        third = asyncio.create_task(run_router(router, late))
        await until(lambda: router.choice.heading["decode-tp1"] == 2 or router.local_prefill == 4, 60,
                    "the third to be routed", poll_s=0.1)
        held.set()
        return await asyncio.gather(*first, third)

    assert asyncio.run(three()) == [oracle(p) for p in (*two, late)]
    read = ray.get(decode.transfer_stats())
    assert router.local_prefill == 3 and len(read) == 2, (router.local_prefill, read)
    assert sum(router.choice.heading.values()) == 0 and sum(router.choice.inflight.values()) == 0


class _HeldPrefill:
    """A prefill engine's client whose prefills return only once `held` is set."""

    def __init__(self, engine, held: asyncio.Event):
        self._e, self._held = engine, held

    def prefill(self, *args, **kwargs):
        return self._prefill(*args, **kwargs)

    async def _prefill(self, *args, **kwargs):
        prefilled = await self._e.prefill(*args, **kwargs)
        await self._held.wait()
        return prefilled

    def __getattr__(self, name):
        return getattr(self._e, name)


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_a_read_racing_a_prefill_departure_is_retried_on_another_pair(pd, first):
    """The race of a scale-down, caused for real at its worst moment: the prefill engine leaves between its prefill
    and the decode engine's read. The read fails cleanly (vLLM ends the request with finish_reason "error", never a
    short answer), the prefill side's blocks are freed, and the router retries once on a pair without that engine -
    or, when the prefill engine already sent the first token, continues after it on such a pair: the right
    tokens."""
    from actors.frontend.router import Router

    # the prefill's answer as the Ray call's return, where the client wrapper below sees it (on the front end's path it
    # comes on the channel; the race with the read is the same)
    router = Router(pd.coordinator, first_token_from_prefill=first == "prefill", prefill_over_channel=False)
    departed: list[str] = []
    for tp in (1, 2):
        engine_id = f"prefill-tp{tp}"
        router._engines[engine_id] = _LeavesAfterPrefill(pd.engines[("prefill", tp)], engine_id, pd.coordinator, departed)
    prompt = prompts()[2]
    try:
        out = asyncio.run(run_router(router, prompt))
        assert out == oracle(prompt) and len(departed) == 1
        assert (router.retried, router.failed_over) == ((1, 0) if first == "decode" else (0, 1))
        gone = pd.engines[("prefill", int(departed[0][-1]))]
        assert ray.get(gone.pending_sends(wait_s=5)) == []  # nothing held for the read that failed
        assert departed[0] not in ray.get(pd.coordinator.describe())["engines"]
    finally:
        for engine_id in departed:  # back in the cluster for the next tests
            ray.get(pd.engines[("prefill", int(engine_id[-1]))].register(pd.coordinator))


async def run_router(router, prompt, max_tokens: int = 12) -> list[int]:
    out: list[int] = []
    async for item in router.generate(prompt, {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}):
        out += item["token_ids"]
    return out


def test_a_plan_for_another_decode_layout_is_refused_at_install(pd, reference):
    """A decode worker takes only a plan computed for the layout it runs: reads planned for another page size, or
    for another physical_blocks_per_logical (a kernel block half the logical block), would land in other requests'
    blocks. The refusal names the field; the engine's real pairs keep working."""
    import json

    payload = ray.get(pd.coordinator.pair_payload("prefill-tp1", "decode-tp2"))
    decode = pd.engines[("decode", 2)]
    for field, wrong in (("page_bytes", lambda v: v * 2), ("kernel_block_size", lambda v: v // 2)):
        data = json.loads(payload)
        data["pair"]["decode"][field] = wrong(data["pair"]["decode"][field])
        with pytest.raises(ray.exceptions.RayTaskError, match=rf"decode\.{field} is .*this engine runs"):
            ray.get(decode.install_pair("prefill-elsewhere", json.dumps(data)))
    assert gather(run_pair(pd.router, "prefill-tp1", "decode-tp2", p) for p in prompts()) == reference


def test_a_renegotiated_pair_lets_go_of_its_nixl_agents(pd, reference):
    """The plan of a pair installed again (a coordinator that restarted re-negotiates every pair) makes the decode
    workers drop the prefill engine's NIXL agents from NIXL itself, not only from vLLM's table (one leaked agent per
    re-negotiation before); the next read loads them again."""
    decode = pd.engines[("decode", 2)]
    assert gather(run_pair(pd.router, "prefill-tp1", "decode-tp2", p) for p in prompts()[:1]) == reference[:1]
    loaded = ray.get(decode.remote_agents("prefill-tp1"))
    names = sorted({name for rank in loaded for name in rank})
    assert names and all(held for rank in loaded for held in rank.values()), loaded
    ray.get(decode.install_pair("prefill-tp1", ray.get(pd.coordinator.pair_payload("prefill-tp1", "decode-tp2"))))
    assert ray.get(decode.remote_agents("prefill-tp1")) == [{}, {}]
    assert ray.get(decode.nixl_knows(names)) == [[False] * len(names)] * 2
    assert gather(run_pair(pd.router, "prefill-tp1", "decode-tp2", p) for p in prompts()) == reference
    assert ray.get(decode.nixl_knows(names)) == [[True] * len(names)] * 2


def test_a_pair_renegotiated_during_its_handshake_drops_that_handshakes_agents(pd, reference):
    """The pair's plan is installed again (a coordinator restart re-negotiates every pair) while a read's NIXL handshake
    under the old plan is still running (slowed down here to 3 s so that it is): the handshake's agents, which vLLM
    installs when it completes, are dropped again - the plan they were made for is gone - and the read handshakes
    anew under the current plan. pd_install_pair now changes the plan under vLLM's handshake lock."""
    decode = pd.engines[("decode", 2)]
    payload = ray.get(pd.coordinator.pair_payload("prefill-tp1", "decode-tp2"))
    ray.get(decode.install_pair("prefill-tp1", payload))  # no agents loaded: the next read handshakes
    before = ray.get(decode.stale_handshakes())
    delayed = ray.get(decode.delayed_handshakes())
    ray.get(decode.set_handshake_delay(3.0))

    async def renegotiated_mid_handshake():
        read = asyncio.ensure_future(run_pair(pd.router, "prefill-tp1", "decode-tp2", prompts()[2]))
        t0 = time.monotonic()  # until the read's handshake is under way on every rank (inside its 3 s delay)
        while min(a - b for a, b in zip(await decode.delayed_handshakes(), delayed)) < 1:
            assert time.monotonic() - t0 < 60 and not read.done(), "the read's handshake did not start"
            await asyncio.sleep(0.05)
        await decode.install_pair("prefill-tp1", payload)
        return await read

    try:
        assert asyncio.run(renegotiated_mid_handshake()) == reference[2]
    finally:
        ray.get(decode.set_handshake_delay(0.0))
    assert [a - b for a, b in zip(ray.get(decode.stale_handshakes()), before)] == [1, 1]
    assert gather(run_pair(pd.router, "prefill-tp1", "decode-tp2", p) for p in prompts()) == reference


def test_a_read_that_cannot_be_assembled_fails_its_request_not_the_engine(pd, reference):
    """An exception while the decode worker turns a plan into descriptors (here a plan whose prefill ranks list no
    region addresses) happens inside vLLM's engine step, which does not guard it: it used to end the EngineCore.
    It fails that one request (cleanly, with nothing streamed), and the engine serves the next one."""
    import json

    from actors.frontend.router import EngineFailure

    decode = pd.engines[("decode", 2)]
    good = ray.get(pd.coordinator.pair_payload("prefill-tp1", "decode-tp2"))
    broken = json.loads(good)
    for rank in broken["prefill_ranks"]:
        rank["region_bases"] = []
    ray.get(decode.install_pair("prefill-tp1", json.dumps(broken)))
    try:
        with pytest.raises(EngineFailure, match="transfer failed") as failed:
            asyncio.run(run_pair(pd.router, "prefill-tp1", "decode-tp2", prompts()[2]))
        assert not failed.value.streamed
        assert ray.get(pd.engines[("prefill", 1)].pending_sends(wait_s=10)) == []
    finally:
        ray.get(decode.install_pair("prefill-tp1", good))
    assert ray.get(decode.health()).healthy
    assert gather(run_pair(pd.router, "prefill-tp1", "decode-tp2", p) for p in prompts()) == reference


def test_transfer_verify_checks_every_read_and_fails_closed(pd, reference):
    """transfer.verify on the TP 2 decode engine reading from the TP 1 prefill engine (each decode rank reads half of
    every head-sharded region). All: every request's reads are checked, region by region, against the prefill
    side's bytes before it runs a step, and outputs are unchanged. A byte flipped on purpose on decode rank 1 right
    after its read lands: the request fails before any token, naming the pair and the region, and frees the prefill
    side's blocks; with the router's retry the client gets the right output. With the first token from the prefill
    engine (already sent when the read lands) the request continues on a pair after that token instead, and the
    client still gets the right output. Sampled: exactly the requests the sample names are checked."""
    from actors.frontend.router import EngineFailure
    from cluster.core.verify import sampled

    decode, prefill = pd.engines[("decode", 2)], pd.engines[("prefill", 1)]

    async def once(prompt, retries, router=pd.routers["decode"]):
        out = []
        async for o in router.stream(prompt, _greedy(), pair=("prefill-tp1", "decode-tp2"), retries=retries):
            out += o.outputs[0].token_ids
        return out

    ray.get(decode.set_verify("all"))
    try:
        ray.get(decode.transfer_stats())
        before = ray.get(decode.transfer_totals())
        assert gather(run_pair(pd.router, "prefill-tp1", "decode-tp2", p) for p in prompts()) == reference
        totals = ray.get(decode.transfer_totals())
        assert totals.verified - before.verified == len(prompts())
        assert totals.verify_failures == before.verify_failures
        stats = ray.get(decode.transfer_stats())
        assert len(stats) == 2 * len(prompts()) and all(s["verify"] and s["ok"] for s in stats)
        assert len(ray.get(decode.verify_timings())) == len(prompts())

        ray.get(decode.plant_corruption(1, 1))
        with pytest.raises(EngineFailure, match=r"verify failed on engine prefill-tp1: transfer verify: pair "
                                                r"prefill-tp1 -> decode-tp2: region \d+ \(decode rank 1 from prefill rank 0") as failed:
            asyncio.run(once(prompts()[2], retries=0))
        assert not failed.value.streamed
        assert ray.get(prefill.pending_sends(wait_s=10)) == []
        retried = pd.routers["decode"].retried
        ray.get(decode.plant_corruption(1, 1))
        assert asyncio.run(once(prompts()[2], retries=1)) == reference[2]
        assert pd.routers["decode"].retried == retried + 1
        failed_over = pd.router.failed_over
        ray.get(decode.plant_corruption(1, 1))
        assert asyncio.run(once(prompts()[2], retries=0, router=pd.router)) == reference[2]
        assert pd.router.failed_over == failed_over + 1
        after = ray.get(decode.transfer_totals())
        assert after.verify_failures - totals.verify_failures == 3
        assert after.verified - totals.verified == 2
        assert ray.get(prefill.pending_sends(wait_s=10)) == []

        ray.get(decode.set_verify(0.5))
        ray.get(decode.transfer_stats())
        many = prompts(seed=13, lengths=[40] * 16)
        assert gather(run_pair(pd.router, "prefill-tp1", "decode-tp2", p) for p in many) == [oracle(p) for p in many]
        stats = ray.get(decode.transfer_stats())
        assert len(stats) == 2 * len(many)
        assert all(s["verify"] == sampled(s["request_id"], 0.5) for s in stats)
        assert 0 < sum(s["verify"] for s in stats) < len(stats)
    finally:
        ray.get(decode.set_verify("off"))
        ray.get(decode.plant_corruption(0, 1))
    assert ray.get(decode.health()).healthy


def _greedy():
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


@pytest.mark.parametrize("d_tp", [1, 2])
def test_the_output_sees_every_byte_class_that_moves(pd, d_tp):
    """On a live decode engine, each byte class of the state it read (conv Q, K and V channels and each conv row in
    every GDN layer, each recurrent head of each layer, attention K and V) overwritten with noise right after the read
    lands, one class at a time, on probe prompts that need it (`cluster.cli.tiny_circuit.probe_prompts`): the output
    changes every time. So "disaggregated == colocated" here speaks for every byte that moves."""
    from tests.pd_helpers import unseen_byte_classes

    assert unseen_byte_classes(pd, "prefill-tp1", ("decode", d_tp), "gdn") == {}


def test_colocated_text_prompts_agree_across_tp_with_sharp_logprobs(pd):
    """A text prompt run whole on decode TP 1 and TP 2 (the tokenizer's BOS first): the same tokens and text, and at
    every step a clear winner (the sharp tiny model)."""
    prompt = "The prefill engine hands its cache blocks to the decode engine, and the decode engine"
    outs = ray.get([pd.engines[("decode", tp)].generate(prompt=prompt, max_tokens=8, logprobs=2) for tp in (1, 2)])
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and outs[0]["text"] == outs[1]["text"] and outs[0]["text"]
    assert outs[0]["prompt_token_ids"][0] == 1
    for step in outs[0]["logprobs"]:
        (_, top_lp), (_, second_lp) = step[0], step[1]
        assert top_lp > -0.01 and top_lp - second_lp > 4


def test_memory_and_processes_are_reported(pd):
    for (role, tp), engine in pd.engines.items():
        pids, rss = ray.get(engine.pids()), ray.get(engine.rss_bytes())
        print(f"{role} TP {tp}: {len(pids)} processes, RSS {rss / 2**30:.2f} GiB")
        assert len(pids) >= 2 + tp  # actor, EngineCore, one worker per rank
        assert 2**30 < rss < 16 * 2**30


def test_shutdown_leaves_no_engine_processes_or_ports(pd):
    pids, ports = pd.stop()
    assert len(pids) >= 4 * 3 and len(ports) == 4
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    for port in ports:  # every side-channel listener is gone: its port binds again
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))

