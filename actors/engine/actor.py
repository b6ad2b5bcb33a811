"""A vLLM engine (CPU build) inside a Ray actor.

`EngineActor` hosts one `AsyncLLM` for a model directory at a tensor-parallel size. vLLM starts its own processes
as plain subprocesses of the actor (an EngineCore, and above TP 1 or on GPUs one worker per TP rank; a TP 1 CPU
engine runs its model in its EngineCore, see `actors.engine.settings.in_process_model`), so the actor itself takes
`num_cpus=0` - unless it owns cores (`own_cores`, "cores as devices"): then it takes that many CPUs from Ray and binds
its processes to cores of its node that no other engine holds (`actors.host.cores`).
The per-engine environment (`actors.engine.settings`: `launch_env`, vLLM's arguments too) travels in the actor's
`runtime_env`; vLLM's processes inherit it, and a private TMPDIR that the actor creates. Engines run eagerly by default
(no torch.compile): startup ~15-30 s on 2 cores instead of ~45-90 s. `kv_transfer_config` and `engine_kwargs` pass
straight to vLLM's engine arguments. An engine with a role warms up before `start` returns (`actors.engine.warmup`; its
compile caches are kept across engines and restarts: `actors.engine.settings.compile_cache_env`), and says what it is
doing meanwhile (`phase`).

The actor is made of components, one per concern and module, each the one owner of its state, built by the actor's
constructor with what it needs of the others: `EngineServing` (`serving`: prefill, decode, decode channels),
`EnginePairs` (`pairs`: registration, pair plans, transfer records, the engine's `TransferTotals`), `EngineVerify`
(`verify`: transfer.verify), `EngineLoad` (`load`: load counters and draining) and `EngineProcesses` (`procs`:
processes and clean-up), next to the prefix record (`prefix`), the progress watch (`progress`) and the connector's
ranks (`connector_ranks`), all modules of `actors.engine`. The vLLM engine itself is reached through one accessor
(`procs.LiveEngine`). Ray exposes only the methods of the actor class: each remote method the
actor does not answer itself (start-up, health, routing views) is one line that hands the call to its component.
Nobody calls the actor directly: everything talks to it through `actors.clients.engine_client.EngineClient`, which
`launch_engine_actor` returns.

Typical use:

    client, started = launch_engine_actor(ensure_model("gdn"), tp=2)
    ray.get(started)                   # the startup seconds
    out = ray.get(client.generate(prompt_token_ids=[1, 5, 9], max_tokens=8))
    stop_engine_actor(client)          # engine shutdown, ray.kill, and a check that every process is gone

Kept in one module past the usual size: `EngineActor` is the actor Ray exposes, start-up and health its own; every
other remote method hands its call to a component module (`serving`, `pairs`, `verify`, `load`, `procs`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray

from actors.host.core_lending import CoreLender, borrow_env
from actors.host.cores import (HostCores, bind_this_thread, lease_cores, lock_dir, node_cores, normal_priority,
                          start_host_cores, thread_affinities, unbind_thread)
from actors.engine.connector_ranks import ConnectorRanks
from actors.clients.engine_client import (CHANNEL_BACKLOG, ENGINE_PREFIX, Busy, EngineClient, Health, Leftovers, Load,
                                  Prefilled, Registration)
from actors.engine.load import EngineLoad
from actors.engine.pairs import EnginePairs
from actors.engine.prefix import EnginePrefixes
from actors.engine.progress import ProgressWatch, stall_rule
from actors.engine.procs import EngineProcesses, LiveEngine, end_processes, sweep_dead_engines, sweep_nodes
from actors.engine.serving import EngineServing, _ranked
from actors.engine.settings import (DEFAULT_MAX_MODEL_LEN, compile_cache_env, in_process_env, in_process_model,
                                    launch_env, vllm_engine_args)
from actors.engine.verify import EngineVerify
from actors.engine.warmup import WarmupReport, warm_up
from cluster.core.metrics import TransferTotals
from cluster.core.cores import format_cores, omp_bind, shared_bind
from cluster.core.prefix import EngineView, PrefixRoots

DEFAULT_START_TIMEOUT_S = 300.0
WARMUP_TIMEOUT_S = 120.0  # the least time a warm-up gets, whatever is left of the start timeout
START_SWEEP_WAIT_S = 5.0  # at start, how long a dead engine's processes get to exit before they are killed
log = logging.getLogger("pd.engine")


@ray.remote(num_cpus=0)
class EngineActor:
    """One vLLM `AsyncLLM` on CPU. Call `start()` once, then `generate()`; `shutdown()` before `ray.kill`. Start-up,
    health and the routers' views are answered here; every other method hands the call to the component of its
    concern (see the module docstring), where it is documented."""

    def __init__(
        self,
        model_dir: str,
        tp: int = 1,
        *,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        dtype: str = "bfloat16",
        kv_transfer_config: dict[str, Any] | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        role: str | None = None,
        engine_id: str | None = None,
        served_model: str = "tiny-hybrid",
        device: str = "cpu",
        own_cores: int = 0,
        reserve_cores: bool = False,
        borrow_cores: bool = False,
    ) -> None:
        self.model_dir = str(model_dir)
        self.tp = tp
        self.device = device
        self.own_cores = own_cores  # cores this engine takes for itself at start (0: it shares the node's cores)
        self.lease = None  # actors.host.cores.CoreLease once taken
        # the cluster's own processes keep off its cores (actors.host.cores.HostCores)
        self.reserve_cores = reserve_cores
        self.host_cores: HostCores | None = None  # this actor's own threads: off the reserved cores, once started
        self.borrow_cores = borrow_cores  # its steps also run on idle engines' cores (actors.host.core_lending)
        self.lender: CoreLender | None = None  # its cores' busy bytes, once it owns cores
        self.spawn_cores: tuple[int, ...] = ()  # where its vLLM processes start, when not its own cores (borrowing)
        self.role, self.served_model = role, served_model
        self.engine_id = engine_id or f"{role or 'engine'}-{uuid.uuid4().hex[:8]}"
        self.kwargs = vllm_engine_args(self.model_dir, tp, max_model_len=max_model_len, dtype=dtype,
                                       kv_transfer_config=kv_transfer_config, engine_kwargs=engine_kwargs, role=role,
                                       engine_id=self.engine_id, device=device)
        # compile caches kept across engines and restarts, in this actor's environment before vLLM's processes start
        os.environ.update(compile_cache_env(device))
        self.live = LiveEngine()  # the vLLM engine: set by `start`, taken by `shutdown`
        self.ranks = ConnectorRanks(self.engine_id, self.live)  # its connector's workers, one per TP rank
        self.startup_s: float | None = None
        self.load_s: float | None = None  # of `startup_s`: vLLM's engine built ...
        self.warmup: WarmupReport | None = None  # ... and warmed up (engines with a role)
        self._phase = "not started"  # what `start` is doing now (`phase`)
        self._stopping = False  # `shutdown` was called: a start under way gives up
        self.procs = EngineProcesses(self.live)
        self.meter = EngineLoad(self.engine_id, self.live)
        self.pairs = EnginePairs(self.engine_id, role, served_model, self.model_dir, self.ranks, self.live,
                                 draining=lambda: self.meter.draining, leftovers=self.procs.leftovers)
        self.verifier = EngineVerify(self.engine_id, tp, self.ranks, self.live, self.pairs.totals,
                                     self.pairs.prefill_checksums)
        self.prefixes = EnginePrefixes(self.pairs.totals)  # what of a prompt this engine can resume (routing.policy cache)
        self.serving = EngineServing(self.engine_id, self.live, self.ranks, self.prefixes, self.meter, self.verifier,
                                     self.pairs.totals)
        self.progress: ProgressWatch | None = None  # whether its EngineCore steps (engines with a role, once started)

    async def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> float:
        """Build the engine (in a thread, so the actor keeps answering) and return the startup seconds.
        On timeout the half-built engine's processes keep running until `stop_engine_actor` kills them."""
        if self.live() is not None:
            return self.startup_s
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**self.kwargs)
        t0 = time.monotonic()
        normal_priority(f"engine {self.engine_id}")  # before vLLM's processes start: they inherit it
        # what engines that died on this node left (a launcher killed before it could clean up, a pool replica that
        # died with its loading engine): gone before this one adds its own
        try:
            swept = await asyncio.to_thread(sweep_dead_engines, os.path.dirname(self.procs.tmpdir), START_SWEEP_WAIT_S)
            if swept:
                log.warning("engine %s: removed what dead engines left on this node: %s", self.engine_id, swept)
        except Exception as e:  # noqa: BLE001 - a clean-up of others' leftovers never fails this engine's start
            log.warning("engine %s: could not sweep this node for dead engines' files: %s", self.engine_id, e)
        actor_cores = os.sched_getaffinity(0)
        cores = self._take_cores()
        if self.kwargs.get("kv_cache_memory_bytes") is not None and os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None):
            # vLLM-CPU's variable (inherited from whoever started Ray) would override the exact size asked for
            log.warning("engine %s: VLLM_CPU_KVCACHE_SPACE ignored: the pool's kv_cache_gib sets the cache size",
                        self.engine_id)

        def build() -> Any:
            if not cores:
                return AsyncLLM.from_engine_args(args)
            # vLLM's processes start from this thread: they (and every thread of theirs) inherit its cores. The
            # threads it starts in this actor (vLLM's client side: output handling, sockets) go back to the
            # actor's cores afterwards, like the rest of the control plane
            before = set(thread_affinities(os.getpid()))
            # a borrowing engine's process starts on the cores it may borrow too: libgomp spins only when it may
            # run its threads on as many cores as it has threads, and pins its own threads (the main one to the
            # engine's first core) as it starts
            bind_this_thread(self.spawn_cores or cores)
            try:
                return AsyncLLM.from_engine_args(args)
            finally:
                for tid in set(thread_affinities(os.getpid())) - before:
                    unbind_thread(tid, actor_cores)

        self._phase = "loading vLLM"
        builder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pd-engine-build")
        try:
            self.live.set(await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(builder, build), timeout_s))
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"vLLM engine for {self.model_dir} (TP {self.tp}) did not start within {timeout_s:.0f} s; a common "
                "cause is two engines sharing VLLM_NIXL_SIDE_CHANNEL_PORT"
            ) from None
        finally:
            builder.shutdown(wait=False)  # its one thread is bound to the engine's cores: used for nothing else
        if self._stopping:  # stopped while vLLM was being built: nobody will shut this engine down but us
            await asyncio.to_thread(self.live.take().shutdown)
            raise RuntimeError(f"engine {self.engine_id} was stopped while it started")
        self.procs.note_shm()  # workers map theirs at start; they may die first
        self.load_s = time.monotonic() - t0
        # this actor's threads are the engine's host side (vLLM's client: outputs, detokenizing, the decode channel):
        # off the cores engines reserve, this one's included; vLLM's own processes keep the cores they started on
        self.host_cores = start_host_cores(f"engine {self.engine_id} (actor)")
        if self.role is not None:
            # every request feature that compiles or builds something on first use, before any user request
            # (`actors.engine.warmup`); the progress watch starts before its long prompt, to learn a real long step
            self.progress = ProgressWatch(self.engine_id, self.meter.free_blocks, stall_rule(self.device))
            with self.meter.direct_request():
                await self._warm_up(max(WARMUP_TIMEOUT_S, timeout_s - (time.monotonic() - t0)))
            # the warm-up's prompts leave nothing in the prefix cache: the prefix record starts from an empty cache
            if not await self.live.required().reset_prefix_cache():
                log.warning("engine %s: vLLM kept its prefix cache after the warm-up", self.engine_id)
            self._phase = "registering"
            total_blocks = await self.meter.count_pool()
            groups = (await self.ranks.registration())[0]["layout"]["groups"]
            self.prefixes.start(self.live.required().vllm_config, total_blocks, [g["kind"] for g in groups])
        if self.lender is not None:  # its cores are lent while it has nothing in flight (actors.host.core_lending)
            self.meter.lender = self.lender
            self.lender.ready(self.meter.in_flight)
        self.startup_s = time.monotonic() - t0
        self._phase = "started"
        return self.startup_s

    async def _warm_up(self, budget_s: float) -> None:
        """`actors.engine.warmup.warm_up` within `budget_s`, the progress watch started before its long prompt; with
        PD_ENGINE_WARMUP=0 (`engines.warm_up: false`) one short greedy request only, then the watch."""
        if os.environ.get("PD_ENGINE_WARMUP", "1") == "0":
            await self.generate(prompt_token_ids=[1, 2, 3, 4], max_tokens=2)
            self.progress.start()
            return
        try:
            self.warmup = await asyncio.wait_for(
                warm_up(self.live.required(), phase=self._warming, before_long_prompt=self.progress.start), budget_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine {self.engine_id} did not finish its warm-up ({self._phase}) within "
                               f"{budget_s:.0f} s (what its start timeout left, at least {WARMUP_TIMEOUT_S:.0f} s)"
                               ) from None
        log.info("engine %s warmed up in %s", self.engine_id, self.warmup)

    def _warming(self, what: str) -> None:
        self._phase = f"warming up ({what})"

    def phase(self) -> str:
        """What the engine is doing while it starts: "loading vLLM", "warming up (logprobs)", "started", ..."""
        return self._phase

    def start_report(self) -> dict[str, Any]:
        """How the start went: seconds to build vLLM's engine (`load_s`), the warm-up's phases and total (None for an
        engine without a role), and the whole start (`startup_s`)."""
        w = self.warmup
        return {"load_s": self.load_s, "startup_s": self.startup_s,
                "warm_up_s": None if w is None else w.total_s,
                "warm_up_phases": None if w is None else dict(w.phases),
                "long_prompt_tokens": None if w is None else w.long_prompt_tokens}

    def _take_cores(self) -> tuple[int, ...]:
        """Cores as devices: take `own_cores` free cores of this node (`actors.host.cores.lease_cores`, refused with the
        cores' holders named) and bind vLLM's OpenMP threads to them, one contiguous share per TP rank; the engine's
        processes inherit the cores from the thread that starts them (`start`). An engine that shares its node's
        cores binds its ranks over all of them (`shared_bind`), unless its pool's env names a binding; it returns ()."""
        if self.device != "cpu":  # GPU engines own their GPUs (Ray's num_gpus)
            return ()
        if not self.own_cores and "VLLM_CPU_OMP_THREADS_BIND" in os.environ:  # the pool's env names a binding
            return ()
        cores: tuple[int, ...] = ()
        node = self.procs.node_id()
        if self.own_cores:
            if self.lease is None:
                who = f"{self.role} pool" if self.role else ""
                self.lease = lease_cores(self.own_cores, self.engine_id, node, who=who,
                                         reserved=self.reserve_cores)
            cores = self.lease.cores
            bind = omp_bind(cores, self.tp)
            log.info("engine %s owns cores %s (OpenMP binding %s)", self.engine_id, format_cores(cores), bind)
            if self.lender is None:
                self.lender = CoreLender(lock_dir(node), cores)
        else:
            bind = shared_bind(node_cores(), self.tp)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        if in_process_model(self.tp, self.device, self.kwargs):
            os.environ.update(in_process_env(bind))
            others = tuple(c for c in node_cores() if c not in cores)
            if self.borrow_cores and cores and others:
                os.environ.update(borrow_env(lock_dir(node), cores, others))
                # its OpenMP threads spin a moment between parallel regions instead of sleeping (GOMP_SPINCOUNT):
                # two threads that sleep between a step's hundreds of small regions ran slower than one
                os.environ.pop("OMP_WAIT_POLICY", None)
                self.spawn_cores = cores + others
        elif self.borrow_cores:
            log.warning("engine %s: borrow_idle_cores needs an in-process TP 1 engine; this one runs on its own "
                        "cores only", self.engine_id)
        return cores

    def cores(self) -> tuple[int, ...]:
        """The cores this engine owns; () when it shares its node's cores."""
        return self.lease.cores if self.lease is not None else ()

    async def borrowed(self) -> dict[str, Any] | None:
        """Core lending (`actors.host.core_lending`): the steps this engine ran and those that also ran on idle engines'
        cores; None where it does not borrow."""
        return (await self.ranks.borrowed())[0]

    async def shutdown(self, timeout_s: float = 30.0) -> list[str]:
        """`EngineProcesses.shutdown`, then the engine's cores are free for the next engine."""
        if self.progress is not None:
            self.progress.stop()
        if self.lender is not None:
            self.meter.lender = None
            self.lender.close()
        self._stopping = True  # a start still building vLLM's engine shuts it down as soon as it is built
        try:
            return await self.procs.shutdown(timeout_s, building=self._phase == "loading vLLM")
        finally:
            if self.lease is not None:
                self.lease.release()

    async def generate(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        logprobs: int | None = None,
        ignore_eos: bool = False,
        extra_args: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One request to completion. Returns token_ids, text, finish_reason, kv_transfer_params and, when asked,
        logprobs: per generated token a list of (token_id, logprob) pairs, best first."""
        from vllm import SamplingParams

        engine = self.live.required()
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompt or prompt_token_ids")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            logprobs=logprobs,
            ignore_eos=ignore_eos,
            extra_args=extra_args,
        )
        request = {"prompt": prompt} if prompt is not None else {"prompt_token_ids": list(prompt_token_ids)}
        final = None
        with self.meter.direct_request():  # in flight for core lending; not the routers' load
            async for output in engine.generate(request, params, request_id=uuid.uuid4().hex):
                final = output
        completion = final.outputs[0]
        result: dict[str, Any] = {
            "token_ids": list(completion.token_ids),
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "prompt_token_ids": list(final.prompt_token_ids or []),
            "kv_transfer_params": final.kv_transfer_params,
        }
        if logprobs is not None:
            result["logprobs"] = [_ranked(step) for step in completion.logprobs or []]
        return result

    async def health(self) -> Health:
        """Whether the engine is started, vLLM has not failed it, and its EngineCore is not stuck (`ProgressWatch`: a
        hung engine is unhealthy too, a busy one is not); `EngineClient.verdict` turns this into the verdict everyone
        acts on."""
        engine = self.live()
        if engine is None:
            return Health(started=False, healthy=False)
        try:
            await engine.check_health()
            healthy = not engine.errored
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            healthy = False
        judged = self.progress.judge() if self.progress is not None else None
        if healthy and judged is not None and judged.state == "stuck":
            return Health(started=True, healthy=False, why=judged.why)
        # a busy engine (burning CPU in a long step or a compile) is healthy: the why says so
        return Health(started=True, healthy=healthy, why=judged.why if healthy and judged is not None else "")

    def resumable(self, prompt_token_ids: list[int]) -> EngineView:
        """What of this prompt the engine can resume (its prefix record, `actors.engine.prefix`), and its load: the
        prompt tokens it is prefilling past their hits, for every front end, and the requests it decodes. Answered
        from the actor's memory, at once, whatever the engine is computing."""
        return EngineView(self.engine_id, self.prefixes.predict(prompt_token_ids), self.meter.queued_tokens,
                          self.meter.decodes)

    def prefix_roots(self, known: tuple[int, int] | None = None) -> PrefixRoots | None:
        """The first-block hashes of the prompts this engine may resume something of (`actors.engine.prefix`), for
        the routers to ask it only about those; None while they are those of version `known`."""
        return self.prefixes.roots(known)

    def prefix_record(self) -> dict[str, Any]:
        """The prefix record's size: block size, capacity (the block pool), blocks of tokens held and the pool blocks
        they take, blocks it dropped for capacity; {} while the engine caches no prefixes."""
        r = self.prefixes.record
        return {} if r is None else {"block_size": r.block_size, "capacity": r.capacity, "blocks": len(r),
                                      "used": r.used, "evicted": r.evicted, "stateful": r.stateful}

    def side_channel_port(self) -> int:
        """The port vLLM's NIXL side-channel listener of this engine binds (on VLLM_NIXL_SIDE_CHANNEL_HOST,
        localhost by default)."""
        return int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"])

    # ---- serving (`EngineServing`) ---------------------------------------------------------------------------------
    async def prefill(self, prompt_token_ids: list[int], request_id: str, prompt_logprobs: int | None = None,
                      first_token: Any = None, continued: int = 0) -> Prefilled:
        return await self.serving.prefill(prompt_token_ids, request_id, prompt_logprobs, first_token, continued)

    async def decode(self, prompt_token_ids: list[int], sampling: dict[str, Any], kv_transfer_params: dict[str, Any] | None,
                     request_id: str):
        async with contextlib.aclosing(self.serving.decode(prompt_token_ids, sampling, kv_transfer_params,
                                                           request_id)) as items:
            async for item in items:
                yield item

    async def decode_channel(self, channel_id: str, address: str | None = None, backlog: int = CHANNEL_BACKLOG):
        async with contextlib.aclosing(self.serving.decode_channel(channel_id, address, backlog)) as batches:
            async for batch in batches:
                yield batch

    async def submit_decode(self, channel_id: str, request_id: str, prompt_token_ids: list[int], params: Any,
                            kv_transfer_params: dict[str, Any] | None, continued: int = 0) -> None:
        return await self.serving.submit_decode(channel_id, request_id, prompt_token_ids, params, kv_transfer_params,
                                                continued)

    async def submit_prefill(self, channel_id: str, request_id: str, prompt_token_ids: list[int],
                             prompt_logprobs: int | None = None, first_token: Any = None, continued: int = 0) -> None:
        return await self.serving.submit_prefill(channel_id, request_id, prompt_token_ids, prompt_logprobs,
                                                 first_token, continued)

    async def cancel_prefill(self, request_id: str) -> None:
        return await self.serving.cancel_prefill(request_id)

    async def abort(self, request_id: str) -> None:
        return await self.serving.abort(request_id)

    async def release(self, remote_request_ids: list[str]) -> list[str]:
        return await self.serving.release(remote_request_ids)

    async def pending_sends(self, wait_s: float = 5.0) -> list[str]:
        return await self.serving.pending_sends(wait_s)

    # ---- pairs and transfer records (`EnginePairs`) ----------------------------------------------------------------
    async def registration(self) -> Registration:
        return await self.pairs.registration()

    async def register(self, coordinator: Any, registration: Registration | None = None) -> dict[str, Any]:
        return await self.pairs.register(coordinator, registration)

    async def install_pair(self, prefill_engine_id: str, payload: str) -> list[list[int]]:
        return await self.pairs.install_pair(prefill_engine_id, payload)

    async def install_pairs(self, plans: list[tuple[str, str]]) -> None:
        return await self.pairs.install_pairs(plans)

    async def remote_agents(self, prefill_engine_id: str) -> list[dict[str, bool]]:
        return await self.pairs.remote_agents(prefill_engine_id)

    async def set_handshake_delay(self, seconds: float) -> None:
        return await self.pairs.set_handshake_delay(seconds)

    async def delayed_handshakes(self) -> list[int]:
        return await self.pairs.delayed_handshakes()

    async def stale_handshakes(self) -> list[int]:
        return await self.pairs.stale_handshakes()

    async def nixl_knows(self, agent_names: list[str]) -> list[list[bool]]:
        return await self.pairs.nixl_knows(agent_names)

    async def remove_pair(self, prefill_engine_id: str) -> None:
        return await self.pairs.remove_pair(prefill_engine_id)

    async def transfer_stats(self) -> list[dict[str, Any]]:
        return await self.pairs.transfer_stats()

    async def transfer_totals(self) -> TransferTotals:
        return await self.pairs.transfer_totals()

    # ---- transfer.verify (`EngineVerify`) --------------------------------------------------------------------------
    async def set_verify(self, fraction: float) -> None:
        return await self.verifier.set_verify(fraction)

    async def plant_corruption(self, count: int = 1, rank: int = 0) -> None:
        return await self.verifier.plant_corruption(count, rank)

    async def corrupt_next_read(self, specs_by_rank: list[list[dict[str, Any]]], seed: int = 0) -> None:
        return await self.verifier.corrupt_next_read(specs_by_rank, seed)

    def verify_timings(self) -> list[float]:
        return self.verifier.verify_timings()

    async def checksums(self, items: list[tuple[int, int, list[int], list[int]]]) -> dict[int, int]:
        return await self.verifier.checksums(items)

    # ---- load and draining (`EngineLoad`) --------------------------------------------------------------------------
    async def load(self) -> Load:
        return await self.meter.load()

    def set_draining(self) -> None:
        return self.meter.set_draining()

    async def busy(self) -> Busy:
        return await self.meter.busy()

    def first_served(self) -> float | None:
        return self.meter.first_served()

    async def free_blocks(self) -> int:
        return await self.meter.free_blocks()

    def num_unfinished(self) -> int:
        return self.meter.num_unfinished()

    # ---- processes (`EngineProcesses`) -----------------------------------------------------------------------------
    def leftovers(self) -> Leftovers:
        return self.procs.leftovers()

    def node_id(self) -> str:
        return self.procs.node_id()

    def pids(self) -> list[int]:
        return self.procs.pids()

    def rss_bytes(self) -> int:
        return self.procs.rss_bytes()


@dataclass(frozen=True)
class EngineSpec:
    """How every engine of one pool starts: built once from the deploy config (`cluster.cli.launch.engine_spec`), used
    by the pools' replicas and by plain-actor clusters alike. `device_options`: what `_device_options` derives per
    pool (vLLM engine kwargs, extra environment, GPUs, placement)."""

    role: str
    model_dir: str
    tp: int
    served_model: str
    max_model_len: int
    dtype: str
    device: str
    start_timeout_s: float
    device_options: dict[str, Any]

    def launch(self, engine_id: str, namespace: str) -> tuple[EngineClient, Any]:
        """Start engine `engine_id` as the named actor the coordinator finds it by; returns (its client, ref to its
        startup seconds)."""
        return launch_engine_actor(
            self.model_dir, self.tp, role=self.role, engine_id=engine_id, served_model=self.served_model,
            max_model_len=self.max_model_len, dtype=self.dtype, device=self.device,
            start_timeout_s=self.start_timeout_s, name=f"{ENGINE_PREFIX}{engine_id}", namespace=namespace,
            **self.device_options,
        )


def launch_engine_actor(
    model_dir: str | Path,
    tp: int = 1,
    name: str | None = None,
    extra_env: dict[str, str] | None = None,
    *,
    kv_transfer_config: dict[str, Any] | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    num_gpus: int = 0,
    namespace: str | None = None,
    label_selector: dict[str, str] | None = None,
    resources: dict[str, float] | None = None,
    own_cores: int = 0,
    reserve_cores: bool = False,
    borrow_cores: bool = False,
    **actor_kwargs: Any,
) -> tuple[EngineClient, Any]:
    """Create an `EngineActor` and begin its start; returns (its `EngineClient`, ref to the startup seconds).
    Lets a caller start several engines at once. `actor_kwargs` go to the actor (role, engine_id, served_model,
    max_model_len, dtype, device). On CUDA hosts pass `num_gpus=tp`: Ray then sets the actor's CUDA_VISIBLE_DEVICES,
    which vLLM's worker processes inherit. `label_selector` / `resources`: the Ray nodes it may run on (a pool's
    `placement`). `own_cores`: CPU hosts, cores as devices - the engine takes that many free cores of its node for
    itself (`actors.host.cores`), and Ray counts them as the actor's CPUs, so that it places the engine only on a node
    with that many CPUs free; 0: it shares the node's cores with everything else. `reserve_cores`: the cluster's own
    processes keep off the cores it takes (`actors.host.cores.HostCores`). `borrow_cores`: a TP 1 engine's steps also
    run on its node's idle engines' cores (`actors.host.core_lending`)."""
    env = launch_env(tp, extra_env, actor_kwargs.get("role"), actor_kwargs.get("device", "cpu"), engine_kwargs,
                     own_cores)
    options: dict[str, Any] = {"runtime_env": {"env_vars": env}}
    if num_gpus:
        options["num_gpus"] = num_gpus
    if own_cores:
        options["num_cpus"] = own_cores
        actor_kwargs["own_cores"] = own_cores
        actor_kwargs["reserve_cores"] = reserve_cores
        actor_kwargs["borrow_cores"] = borrow_cores
    if label_selector:
        options["label_selector"] = label_selector
    if resources:
        options["resources"] = resources
    if name is not None:
        options["name"] = name
    if namespace is not None:
        options["namespace"] = namespace
    handle = EngineActor.options(**options).remote(
        str(Path(model_dir).resolve()), tp, kv_transfer_config=kv_transfer_config, engine_kwargs=engine_kwargs, **actor_kwargs
    )
    client = EngineClient(handle, actor_kwargs.get("engine_id"))
    return client, client.start(start_timeout_s)


def stop_engine_actor(engine: EngineClient, timeout_s: float = 60.0) -> list[str]:
    """Shut the engine down, kill the actor, and check that none of its processes survive (stragglers are
    killed); then sweep its node (`actors.engine.procs.sweep_dead_engines`) for what the shutdown could not see.
    Returns the files removed; raises RuntimeError naming any pid still alive."""
    return stop_engine_actors([engine], timeout_s)


def stop_engine_actors(engines: list[EngineClient], timeout_s: float = 60.0) -> list[str]:
    """`stop_engine_actor` for several engines at once (their shutdowns run in parallel)."""
    pids: list[int] = []
    here = ray.get_runtime_context().get_node_id()
    nodes: list[str] | None = []  # where to sweep afterwards (None: every node - an engine's node is unknown)
    for engine in engines:
        try:
            where = ray.get(engine.node_id(), timeout=timeout_s)
            if nodes is not None:
                nodes.append(where)
            if where == here:  # pids of another node mean other processes here (its own shutdown checks them there)
                pids += ray.get(engine.pids(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a dead actor cannot report its pids, nor its node
            nodes = None
    removed: list[str] = []
    for engine, ref in [(e, e.shutdown()) for e in engines]:
        try:
            removed += ray.get(ref, timeout=timeout_s)
        except Exception:  # noqa: BLE001 - kill regardless
            pass
        engine.kill()
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    alive = end_processes(procs, timeout_s)
    if alive:
        raise RuntimeError(f"engine processes still alive after stop: {[p.pid for p in alive]}")
    # what a shutdown could not see: processes an engine started while it was being stopped (stopped while loading),
    # or everything of an engine that died first - its actor's process may still be ending (killed a moment ago, by
    # `engine.kill` or before): the sweep waits for it
    return removed + sweep_nodes(nodes, dead_actors=tuple(e.actor_id for e in engines))
