"""A vLLM engine (CPU build) inside a Ray actor.

`EngineActor` hosts one `AsyncLLM` for a model directory at a tensor-parallel size. vLLM starts its own processes
(EngineCore, one worker per TP rank) as plain subprocesses of the actor, so the actor itself takes `num_cpus=0`.
The per-engine environment (`engine_env`) travels in the actor's `runtime_env`; vLLM's processes inherit it, and a
private TMPDIR that the actor creates. Engines run eagerly by default (no torch.compile): startup ~15-30 s on
2 cores instead of ~45-90 s. `kv_transfer_config` and `engine_kwargs` pass straight to vLLM's engine arguments.

Typical use:

    handle, started = launch_engine_actor(ensure_model("gdn"), tp=2)
    ray.get(started)                   # the startup seconds
    out = ray.get(handle.generate.remote(prompt_token_ids=[1, 5, 9], max_tokens=8))
    stop_engine_actor(handle)          # engine shutdown, ray.kill, and a check that every process is gone
"""

from __future__ import annotations

import asyncio
import dataclasses
import getpass
import json
import logging
import os
import pickle
import random
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray
import zmq

from actors.engine_health import Busy, Health
from cluster.core.metrics import TransferTotals
from cluster.core.verify import TRANSFER_VERIFY_FAILED, VERIFY_ENV, VERIFY_TIMEOUT_S, sampled, verify_fraction
from cluster.core.wire import FIRST_TOKEN

CPU_BIND = {1: "0-1", 2: "0|1", 4: "0|1|0|1"}  # VLLM_CPU_OMP_THREADS_BIND per TP size on the 2-core machines
# /dev/shm files an engine's processes create and leak when a worker is killed (SIGTERMed NIXL workers):
# CPU all-reduce segments, message-queue segments, multiprocessing semaphores
SHM_PREFIXES = ("vllm_dist_", "psm_", "sem.mp-")
TMPDIR_PREFIX = "hpd-engine-"  # each engine's private TMPDIR (vLLM's vllm_dist_* file stores land there)
DEFAULT_START_TIMEOUT_S = 300.0
UNREAD_STATS_KEPT = 4096  # per-request transfer records kept until someone reads them (the totals keep counting)
CONNECTOR_MODULE = "actors.connector"
SOCKET_BACKLOG = 10_000  # decode-channel messages a front end may leave unread before its channel is ended
VERIFY_POLL_S = 0.002  # transfer.verify: how often the actor collects landed reads while some are expected
VERIFY_FAILED_KEPT = 1000  # verify failures remembered for the requests they end
log = logging.getLogger("pd.engine")


class EngineDraining(RuntimeError):
    """The engine is leaving its pool: it finishes what it holds but takes no new request (the router retries on
    another pair)."""


def pd_kv_transfer_config(role: str, engine_id: str, device: str = "cpu") -> dict[str, Any]:
    """The KV transfer config of a prefill or decode engine: the project's connector (vLLM's NIXL pull connector
    with the coordinator's plans in its data path), cache memory on `device` (DRAM on CPU hosts, VRAM on GPUs)."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    return {
        "kv_connector": "NixlConnector",  # the name vLLM keys behaviour on (DS conv layout, config checks)
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu" if device == "cpu" else "cuda",
        # a prompt state that cannot be read ends the request with finish_reason "error" (the router retries it on
        # another pair) rather than a silent local recompute
        "kv_load_failure_policy": "fail",
        "engine_id": engine_id,
    }


def vllm_engine_args(model_dir: str, tp: int, *, max_model_len: int = 2048, dtype: str = "bfloat16",
                     kv_transfer_config: dict[str, Any] | None = None, engine_kwargs: dict[str, Any] | None = None,
                     role: str | None = None, engine_id: str = "engine", device: str = "cpu") -> dict[str, Any]:
    """vLLM's engine arguments for one engine: with a role, the project's connector (`pd_kv_transfer_config`) and
    worker extension. vLLM's async scheduling is left at its platform's default: vLLM-CPU turns it off; on GPUs it
    is on, and vLLM 0.32 carries both upstream fixes for hybrid models in P/D under it (connector-loaded attention
    blocks are not zeroed, #48481; freed blocks wait for the in-flight step, #45357). `engine_kwargs` override
    anything here."""
    if role is not None and kv_transfer_config is None:
        kv_transfer_config = pd_kv_transfer_config(role, engine_id, device)
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        tensor_parallel_size=tp,
        dtype=dtype,  # Qwen3-Next on CPU: the GDN kernel asserts "CPU GDN attention requires BF16."
        max_model_len=max_model_len,
        enable_prefix_caching=False,  # off unless asked: the deploy config turns it on (`cluster.launch.prefix_caching`)
        # a process per rank; vLLM-CPU would turn "uni" into "mp" anyway (its OpenMP set-up needs a fresh process),
        # and "ray" fails on CPU and would be auto-picked inside placement groups
        distributed_executor_backend="mp",
        disable_log_stats=True,
        # no torch.compile: on 2 cores a tiny model starts in ~15 s instead of ~45-90 s, and generates
        # fast enough; pass engine_kwargs={"enforce_eager": False} for the compiled path
        enforce_eager=True,
    )
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
        if kv_transfer_config.get("kv_connector_module_path") == CONNECTOR_MODULE:
            kwargs["worker_extension_cls"] = f"{CONNECTOR_MODULE}.PDWorkerExtension"
    kwargs.update(engine_kwargs or {})
    return kwargs


_HANDED_OUT: set[int] = set()


FREE_PORT_RANGE = (20000, 32000)  # below Linux's ephemeral range (32768+) and above Ray's worker ports (10002-19999)


def free_port() -> int:
    """A TCP port that is free right now, that this process has not handed out before, and that no other process is
    about to take by chance: it comes from FREE_PORT_RANGE, not from the kernel's ephemeral range, where vLLM's own
    processes pick their ports with bind(0) while our engines start (two users of one side-channel port hang)."""
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(*FREE_PORT_RANGE)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {FREE_PORT_RANGE} after 1000 tries")


def engine_env(tp: int, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for one CPU engine: 1 GiB KV space, no reserved CPU, an explicit thread binding per TP rank
    (vLLM's automatic binding asserts on a 1-NUMA-node machine at TP 2), its own NIXL side-channel port, and OpenMP
    threads that sleep instead of spinning when they wait (`PD_OMP_WAIT_POLICY`, default PASSIVE): engines share
    cores, and an idle engine's spinning threads starved a busy one - a TP 1 decode of 160 tokens next to an idle
    TP 1 engine took 52 s spinning, 1.4 s passive; a TP 2 decode alone 3.7 vs 3.2 s."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_OMP_THREADS_BIND": CPU_BIND.get(tp, "nobind"),
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        "OMP_WAIT_POLICY": os.environ.get("PD_OMP_WAIT_POLICY", "PASSIVE"),
    }
    env.update(extra_env or {})
    return env


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _process_tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _is_resource_tracker(p: psutil.Process) -> bool:
    try:
        return any("resource_tracker" in part for part in p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _shm_paths(procs: list[psutil.Process]) -> set[str]:
    """Shared-memory files that `procs` have mapped or open and that an engine creates."""
    paths: set[str] = set()
    for p in procs:
        try:
            candidates = [m.path for m in p.memory_maps(grouped=True)] + [f.path for f in p.open_files()]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for path in candidates:
            if path.startswith("/dev/shm/") and os.path.basename(path).startswith(SHM_PREFIXES):
                paths.add(path)
    return paths


def _ranked(step: dict[int, Any]) -> list[tuple[int, float]]:
    """One position's logprobs as (token id, logprob) pairs, best first."""
    return sorted(((tok, lp.logprob) for tok, lp in step.items()), key=lambda x: -x[1])


class WorkerCallError(RuntimeError):
    """A connector method failed on a TP rank of the engine (the message names the method, rank and error)."""


@dataclass(frozen=True)
class DecodeError:
    """A decode request that failed inside the engine (as a channel item): the exception's type name and message."""

    kind: str
    message: str


class _Outbox:
    """One decode channel's pending outputs; `take` waits for at least one and returns all."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Any]] = []
        self.ready = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()

    def put(self, item: tuple[str, Any]) -> None:
        self.items.append(item)
        self.ready.set()

    async def take(self) -> list[tuple[str, Any]]:
        await self.ready.wait()
        await asyncio.sleep(0)  # let the other requests of this engine step add theirs
        items, self.items = self.items, []
        self.ready.clear()
        return items


def _push_socket(address: str) -> "zmq.Socket":
    """The engine's end of a decode channel's local socket (sends never block: see SOCKET_BACKLOG)."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SOCKET_BACKLOG)
    sock.connect(address)
    return sock


@ray.remote(num_cpus=0)
class EngineActor:
    """One vLLM `AsyncLLM` on CPU. Call `start()` once, then `generate()`; `shutdown()` before `ray.kill`."""

    def __init__(
        self,
        model_dir: str,
        tp: int = 1,
        *,
        max_model_len: int = 2048,
        dtype: str = "bfloat16",
        kv_transfer_config: dict[str, Any] | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        role: str | None = None,
        engine_id: str | None = None,
        served_model: str = "tiny-hybrid",
        device: str = "cpu",
    ) -> None:
        self.model_dir = str(model_dir)
        self.tp = tp
        self.role, self.served_model = role, served_model
        self.engine_id = engine_id or f"{role or 'engine'}-{uuid.uuid4().hex[:8]}"
        self.kwargs = vllm_engine_args(self.model_dir, tp, max_model_len=max_model_len, dtype=dtype,
                                       kv_transfer_config=kv_transfer_config, engine_kwargs=engine_kwargs, role=role,
                                       engine_id=self.engine_id, device=device)
        self.engine = None
        self.startup_s: float | None = None
        self._unread: list[dict[str, Any]] = []
        # running totals for /metrics: a decode engine's reads, verify outcomes, and every engine's prompt tokens found
        # in its own prefix cache (a prefill engine's prefills, a decode engine's reads and colocated requests)
        self._totals = TransferTotals()
        # transfer.verify (cluster/core/verify.py): the fraction of requests verified; requests submitted for
        # verification and not finished (by prefill-side request id); landed reads by request and decode rank until
        # every rank's are in; verify failures by prefill-side request id (what ended them)
        self.verify = verify_fraction(os.environ.get(VERIFY_ENV))
        self._verify_expected: set[str] = set()
        self._verify_parts: dict[str, dict[int, dict[str, Any]]] = {}
        self._verify_seen: dict[str, float] = {}
        self._verify_failed: dict[str, str] = {}
        self._verify_task: asyncio.Task | None = None
        self._verify_grace_until = 0.0
        self._verify_ms: list[float] = []
        self._coordinator: Any = None
        self._me = psutil.Process()
        self._shm: set[str] = set()
        # load, for the pool's autoscaling signal and for draining
        self.draining = False
        self._prefill_tokens = 0  # prompt tokens of prefills admitted and not finished
        self._prefills = 0
        self._decodes = 0
        self._total_blocks = 0  # the block pool's size (all free right after start)
        self._usage = 0.0  # fraction of blocks in use, refreshed in the background (EngineCore may be mid-step)
        self._usage_task: asyncio.Task | None = None
        self._usage_error: str | None = None  # why the last cache-usage refresh failed (None: it worked)
        # wall time this engine first served a request: a prefill engine's first prefill done, a decode engine's first
        # tokens out (engine warm-up excluded)
        self.first_served_at: float | None = None
        self._channels: dict[str, _Outbox] = {}  # open decode channels (one per front end)
        # a private TMPDIR, inherited by vLLM's processes (file stores, IPC sockets) and removed at shutdown;
        # torch.compile's cache stays in the shared default place
        os.environ.setdefault(
            "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
        )
        self.tmpdir = tempfile.mkdtemp(prefix=TMPDIR_PREFIX)
        os.environ["TMPDIR"] = self.tmpdir
        tempfile.tempdir = None  # make tempfile re-read TMPDIR

    async def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> float:
        """Build the engine (in a thread, so the actor keeps answering) and return the startup seconds.
        On timeout the half-built engine's processes keep running until `stop_engine_actor` kills them."""
        if self.engine is not None:
            return self.startup_s
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**self.kwargs)
        t0 = time.monotonic()
        try:
            self.engine = await asyncio.wait_for(asyncio.to_thread(AsyncLLM.from_engine_args, args), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"vLLM engine for {self.model_dir} (TP {self.tp}) did not start within {timeout_s:.0f} s; a common "
                "cause is two engines sharing VLLM_NIXL_SIDE_CHANNEL_PORT"
            ) from None
        self._shm = _shm_paths(_process_tree(self._me))  # workers map theirs at start; they may die first
        if self.role is not None:
            # a fresh engine's first forward pass is several seconds slower; pay it here, not in a user's TTFT
            await self.generate(prompt_token_ids=[1, 2, 3, 4], max_tokens=2)
            self._total_blocks = await self.free_blocks()
        self.startup_s = time.monotonic() - t0
        return self.startup_s

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

        if self.engine is None:
            raise RuntimeError("engine not started: call start() first")
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
        async for output in self.engine.generate(request, params, request_id=uuid.uuid4().hex):
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

    # ---- prefill/decode ------------------------------------------------------------------------------------------
    async def registration(self) -> dict[str, Any]:
        """What the coordinator needs: every rank's NIXL agent metadata, region bases and run-time layout, and what
        this engine would leave on its node if it were killed (`leftovers`)."""
        self._require_engine()
        ranks = await self._pd_call("pd_registration")
        hf_config = json.loads((Path(self.model_dir) / "config.json").read_text())
        return {"engine_id": self.engine_id, "role": self.role, "model": self.served_model, "hf_config": hf_config,
                "ranks": sorted(ranks, key=lambda r: r["tp_rank"]), "draining": self.draining,
                "leftovers": self.leftovers()}

    def leftovers(self) -> dict[str, Any]:
        """What this engine's processes leave behind when they are killed (a graceful `shutdown` removes it all): its
        shared-memory files, its private TMPDIR, and the processes themselves as (pid, start time) - what
        `clean_leftovers` needs, on this engine's node, once the engine is known dead."""
        tree = _process_tree(self._me)
        self._shm |= _shm_paths(tree)
        procs = []
        for p in tree:
            try:
                procs.append((p.pid, p.create_time()))
            except psutil.NoSuchProcess:
                pass
        return {"node_id": self.node_id(), "shm": sorted(self._shm), "tmpdir": self.tmpdir, "procs": procs}

    async def _pd_call(self, method: str, *args: Any) -> list[Any]:
        """A connector method on every TP rank (`PDWorkerExtension.pd_call`); the ranks' values, in rank order, or
        WorkerCallError naming the first rank that failed."""
        answers = await self.engine.collective_rpc("pd_call", args=(method, *args))
        for rank, answer in enumerate(answers):
            if "error" in answer:
                raise WorkerCallError(f"{method} failed on TP rank {rank} of engine {self.engine_id}: {answer['error']}")
        return [answer["ok"] for answer in answers]

    async def register(self, coordinator: Any, registration: dict[str, Any] | None = None) -> dict[str, Any]:
        """Register with the coordinator (which pushes negotiated plans to decode engines). `registration` lets a
        caller pass an edited registration (tests of what the coordinator does with wrong values)."""
        self._coordinator = coordinator  # transfer.verify asks it for prefill engines' handles
        return await coordinator.register.remote(registration or await self.registration(), self._self_handle())

    async def install_pair(self, prefill_engine_id: str, payload: str) -> list[list[int]]:
        """Give every decode worker the negotiated plan for one prefill engine."""
        self._require_engine()
        return await self._pd_call("pd_install_pair", prefill_engine_id, payload)

    async def install_pairs(self, plans: list[tuple[str, str]]) -> None:
        """`install_pair` for several prefill engines at once: [(prefill engine id, payload)]."""
        for prefill_engine_id, payload in plans:
            await self.install_pair(prefill_engine_id, payload)

    async def remote_agents(self, prefill_engine_id: str) -> list[dict[str, bool]]:
        """Per decode rank, the prefill engine's NIXL agents it has loaded (name -> NIXL still holds it)."""
        self._require_engine()
        return await self._pd_call("pd_remote_agents", prefill_engine_id)

    async def set_handshake_delay(self, seconds: float) -> None:
        """Test hook: every decode rank's NIXL handshakes take `seconds` longer."""
        self._require_engine()
        await self._pd_call("pd_set_handshake_delay", seconds)

    async def stale_handshakes(self) -> list[int]:
        """Per decode rank, handshakes whose agents were dropped because their pair was re-negotiated meanwhile."""
        self._require_engine()
        return await self._pd_call("pd_stale_handshakes")

    async def nixl_knows(self, agent_names: list[str]) -> list[list[bool]]:
        """Per decode rank, whether NIXL still holds each named remote agent."""
        self._require_engine()
        return await self._pd_call("pd_nixl_knows", list(agent_names))

    async def remove_pair(self, prefill_engine_id: str) -> None:
        if self.engine is not None:
            await self._pd_call("pd_remove_pair", prefill_engine_id)

    async def _collect_stats(self) -> None:
        """Move the workers' new per-request transfer records here, adding them to the running totals."""
        fresh = [s for rank in await self._pd_call("pd_stats") for s in rank]
        self._unread = (self._unread + fresh)[-UNREAD_STATS_KEPT:]
        for s in fresh:
            if not s.get("ok", True):  # a failed read moved nothing useful
                continue
            self._totals.transfers += bool(s["bytes"])  # a full local prefix hit reads nothing
            self._totals.bytes += s["bytes"]
            self._totals.descriptors += s["descriptors"]
            self._totals.seconds += s["ms"] / 1e3
            if s["decode_rank"] == 0:  # every rank of a read reports the same local hit
                self._totals.cached_prompt_tokens += s.get("cached_tokens", 0)

    async def transfer_stats(self) -> list[dict[str, Any]]:
        """Per request and decode rank: bytes, descriptors, milliseconds of the NIXL reads (drained on read)."""
        self._require_engine()
        await self._collect_stats()
        out, self._unread = self._unread, []
        return out

    async def transfer_totals(self) -> TransferTotals:
        """Running totals since start (see `TransferTotals`). Not drained: what /metrics exports as counters."""
        self._require_engine()
        await self._collect_stats()
        return dataclasses.replace(self._totals)

    # ---- transfer.verify: every byte range read checked against the prefill side's before the request runs ---------
    async def set_verify(self, fraction: float) -> None:
        """Verify this fraction of the requests from now on (0: off, 1: all)."""
        self._require_engine()
        fraction = verify_fraction(fraction)
        await self._pd_call("pd_set_verify", fraction)  # the workers first: they hold a sampled read for the actor
        self.verify = fraction
        if fraction:  # requests submitted before the change may be read after it: watch the workers a while
            self._verify_grace_until = time.monotonic() + VERIFY_TIMEOUT_S
            self._expect_verify(None)

    async def plant_corruption(self, count: int = 1, rank: int = 0) -> None:
        """Test hook: flip a byte of each of the next `count` verified reads on decode rank `rank` right after it
        lands (what transfer.verify must catch)."""
        self._require_engine()
        await self._pd_call("pd_plant_corruption", count, rank)

    async def corrupt_next_read(self, specs_by_rank: list[list[dict[str, Any]]], seed: int = 0) -> None:
        """Test hook: overwrite byte ranges of the next read that lands on each rank with noise before its request
        runs (`PlannedPullWorker.pd_corrupt_next_read`; `specs_by_rank[r]` for rank r)."""
        self._require_engine()
        await self._pd_call("pd_corrupt_next_read", specs_by_rank, seed)

    def verify_timings(self) -> list[float]:
        """Milliseconds from a verified request's first landed read to its verdict, oldest first (drained on read)."""
        out, self._verify_ms = self._verify_ms, []
        return out

    def _expect_verify_of(self, kv_transfer_params: dict[str, Any]) -> str | None:
        """A request about to read its state: if transfer.verify samples it, expect its verification and return its
        prefill-side id (else None)."""
        remote_id = kv_transfer_params.get("remote_request_id", "")
        if not sampled(remote_id, self.verify):
            return None
        self._expect_verify(remote_id)
        return remote_id

    def _expect_verify(self, remote_request_id: str | None) -> None:
        if remote_request_id is not None:
            self._verify_expected.add(remote_request_id)
        if self._verify_task is None or self._verify_task.done():
            self._verify_task = asyncio.get_running_loop().create_task(self._verify_loop())

    async def _verify_loop(self) -> None:
        """Collect landed verified reads from every rank, check each request once all its ranks' reads are in, and
        send the verdicts; runs while requests are expected or the workers hold any. A failure here leaves the
        workers' own timeout (VERIFY_TIMEOUT_S) to fail the requests: never a pass without a check."""
        try:
            while True:
                polls = await self._pd_call("pd_verify_poll")
                now = time.monotonic()
                for rank, poll in enumerate(polls):
                    for entry in poll["ready"]:
                        self._verify_parts.setdefault(entry["req_id"], {})[rank] = entry
                        self._verify_seen.setdefault(entry["req_id"], now)
                for req_id in [r for r in self._verify_parts if now - self._verify_seen[r] > VERIFY_TIMEOUT_S]:
                    del self._verify_parts[req_id]  # a rank's read failed: the request fails without a verdict
                    self._verify_seen.pop(req_id, None)
                complete = {r: parts for r, parts in self._verify_parts.items() if len(parts) == self.tp}
                if complete:
                    for req_id in complete:
                        del self._verify_parts[req_id]
                    await self._pd_call("pd_verify_done", await self._verdicts(complete))
                    continue
                if not (self._verify_expected or self._verify_parts or any(p["pending"] for p in polls)
                        or time.monotonic() < self._verify_grace_until):
                    return
                await asyncio.sleep(VERIFY_POLL_S)
        except Exception as e:  # noqa: BLE001 - the workers fail what they hold once its verdict is overdue
            log.error("transfer verify loop of %s stopped: %s: %s", self.engine_id, type(e).__name__, e)

    async def _verdicts(self, complete: dict[str, dict[int, dict[str, Any]]]) -> dict[str, bool]:
        """Compare each request's CRCs with its prefill engine's over the same ranges; log and count mismatches."""
        by_prefill: dict[str, list[str]] = {}
        for req_id, parts in complete.items():
            by_prefill.setdefault(parts[0]["prefill_engine"], []).append(req_id)
        verdicts: dict[str, bool] = {}
        for prefill_id, req_ids in by_prefill.items():
            items, expect = [], []
            for req_id in req_ids:
                for d_rank, part in sorted(complete[req_id].items()):
                    for p_rank, region, offsets, lengths, crc in part["checks"]:
                        items.append((p_rank, region, offsets, lengths))
                        expect.append((req_id, d_rank, p_rank, region, sum(lengths), crc))
            unverifiable = None
            try:
                got = await self._prefill_checksums(prefill_id, items)
            except Exception as e:  # noqa: BLE001 - unverifiable is not verified
                got, unverifiable = {}, f"no checksums from prefill engine {prefill_id} ({type(e).__name__}: {e})"
                log.error("transfer verify: %s", unverifiable)
            bad: dict[str, list[str]] = {}
            for i, (req_id, d_rank, p_rank, region, nbytes, crc) in enumerate(expect):
                if unverifiable is not None:
                    bad[req_id] = [f"could not be checked: {unverifiable}"]
                elif got.get(i) != crc:
                    bad.setdefault(req_id, []).append(
                        f"region {region} (decode rank {d_rank} from prefill rank {p_rank}, {nbytes} bytes) differs "
                        "from the prefill side")
            now = time.monotonic()
            for req_id in req_ids:
                remote_id = complete[req_id][0]["remote_request_id"]
                verdicts[req_id] = req_id not in bad
                self._verify_expected.discard(remote_id)
                ms = (now - self._verify_seen.pop(req_id, now)) * 1e3
                self._verify_ms = (self._verify_ms + [ms])[-UNREAD_STATS_KEPT:]
                self._totals.verify_seconds += ms / 1e3
                if req_id in bad:
                    what = "; ".join(bad[req_id])
                    log.error("transfer verify failed: request %s, pair %s -> %s: %s", remote_id, prefill_id,
                              self.engine_id, what)
                    self._totals.verify_failures += 1
                    self._verify_failed[remote_id] = f"pair {prefill_id} -> {self.engine_id}: {what}"
                    while len(self._verify_failed) > VERIFY_FAILED_KEPT:
                        del self._verify_failed[next(iter(self._verify_failed))]
                else:
                    self._totals.verified += 1
        return verdicts

    async def _prefill_checksums(self, prefill_id: str, items: list[tuple[int, int, list[int], list[int]]]) -> dict[int, int]:
        if self._coordinator is None:
            raise RuntimeError("this engine has not registered with a coordinator")
        handle = await asyncio.wait_for(self._coordinator.handle.remote(prefill_id), 10)
        if handle is None:
            raise RuntimeError(f"prefill engine {prefill_id} has left")
        return await asyncio.wait_for(handle.checksums.remote(items), 10)

    async def checksums(self, items: list[tuple[int, int, list[int], list[int]]]) -> dict[int, int]:
        """Prefill side: CRC-32 of each item's byte ranges [(prefill rank, region, offsets, lengths)] in this engine's
        cache, by item index (transfer.verify)."""
        self._require_engine()
        out: dict[int, int] = {}
        for rank in await self._pd_call("pd_checksums", items):
            out.update(rank)
        return out

    async def free_blocks(self) -> int:
        """Free blocks in the engine's KV/state block pool (its scheduler's count; needs the project's connector)."""
        self._require_engine()
        return int(await self.engine.engine_core.call_utility_async("pd_free_blocks"))

    def num_unfinished(self) -> int:
        """Requests this engine's front end still tracks (running, waiting, or waiting for remote state)."""
        return self.engine.get_num_unfinished_requests() if self.engine is not None else 0

    async def prefill(self, prompt_token_ids: list[int], request_id: str) -> dict[str, Any]:
        """Run the prompt with remote decode requested; returns the transfer parameters for the decode engine."""
        return (await self.prefill_request(prompt_token_ids, request_id))["kv_transfer_params"]

    async def prefill_request(self, prompt_token_ids: list[int], request_id: str,
                              prompt_logprobs: int | None = None, first_token: Any = None,
                              continued: int = 0) -> dict[str, Any]:
        """Run the prompt with remote decode requested. Returns {"kv_transfer_params": for the decode engine,
        "prompt_logprobs": vLLM's prompt logprobs when asked for, "first": None or the first output}.

        By default vLLM's prefill side stops one token short for hybrid models (the decode side recomputes the last
        prompt token and samples the first output token). With `first_token` - the request's own vLLM
        SamplingParams - the whole prompt is prefilled and its first output token sampled here, with those
        parameters; "first" is that token's RequestOutput (text, logprobs, finish reason) and the transfer
        parameters describe the state after the whole prompt: the decode engine continues from prompt + that token.
        `continued`: the prompt's last tokens are output the client already has (a failover's continuation); the
        first token's text continues theirs (`_continuation_detokenizer`).

        Prompt logprobs need the logits of the whole prompt, which the transfer request does not return (vLLM's
        prefill side refuses them with remote decode), so they come from a second, local request over the same
        prompt run alongside."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._require_engine()
        self._refuse_if_draining()
        transfer = {"do_remote_decode": True, "do_remote_prefill": False}
        if first_token is None:
            params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": transfer})
        else:
            params = first_token.clone()
            params.n, params.max_tokens, params.min_tokens = 1, 1, min(1, params.min_tokens or 0)
            params.prompt_logprobs, params.output_kind = None, RequestOutputKind.FINAL_ONLY
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": {**transfer, FIRST_TOKEN: True}}
        self._prefills += 1
        self._prefill_tokens += len(prompt_token_ids)
        try:
            runs = [self._last_output(prompt_token_ids, params, request_id)]
            if prompt_logprobs is not None:
                scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs)
                runs.append(self._last_output(prompt_token_ids, scoring, f"{request_id}-prompt-logprobs"))
            final, *scored = await asyncio.gather(*runs, return_exceptions=True)
        finally:
            self._prefills -= 1
            self._prefill_tokens -= len(prompt_token_ids)
        if isinstance(final, BaseException):
            raise final
        if final is None or not final.kv_transfer_params:
            raise RuntimeError(f"prefill of {request_id} returned no transfer parameters")
        if scored and isinstance(scored[0], BaseException):  # nobody will read the prefilled state: free it now
            await self.release([final.kv_transfer_params["remote_request_id"]])
            raise scored[0]
        self.first_served_at = self.first_served_at or time.time()
        self._totals.cached_prompt_tokens += final.num_cached_tokens or 0
        kv_transfer_params = dict(final.kv_transfer_params)
        first = None
        if first_token is not None:
            first, final.kv_transfer_params = final, None
            detokenizer = self._continuation_detokenizer(prompt_token_ids, continued, params)
            if detokenizer is not None and first.outputs:
                first.outputs[0].text = "".join(detokenizer.decode_next(t) for t in first.outputs[0].token_ids)
        return {"kv_transfer_params": kv_transfer_params, "prompt_logprobs": scored[0].prompt_logprobs if scored else None,
                "first": first}

    async def _last_output(self, prompt_token_ids: list[int], params: Any, request_id: str) -> Any:
        final = None
        async for output in self.engine.generate({"prompt_token_ids": list(prompt_token_ids)}, params, request_id=request_id):
            final = output
        return final

    async def decode(self, prompt_token_ids: list[int], sampling: dict[str, Any], kv_transfer_params: dict[str, Any] | None, request_id: str):
        """Stream a request's new tokens: {"token_ids", "text", "finish_reason"} per step. With
        `kv_transfer_params` the prompt's state is pulled from the prefill engine they name; without, the engine runs
        the whole request itself (colocated)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._require_engine()
        self._refuse_if_draining()
        extra = dict(sampling.pop("extra_args", None) or {})
        if kv_transfer_params is not None:
            extra["kv_transfer_params"] = kv_transfer_params
            self._expect_verify_of(kv_transfer_params)
        params = SamplingParams(**sampling, extra_args=extra or None, output_kind=RequestOutputKind.DELTA)
        self._decodes += 1
        verified = (kv_transfer_params or {}).get("remote_request_id")
        colocated = kv_transfer_params is None
        try:
            async for output in self.engine.generate({"prompt_token_ids": list(prompt_token_ids)}, params, request_id=request_id):
                if colocated:  # its prefix-cache hit (a read's is counted with the read)
                    self._totals.cached_prompt_tokens += output.num_cached_tokens or 0
                    colocated = False
                c = output.outputs[0]
                item: dict[str, Any] = {"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason}
                if c.logprobs:
                    item["logprobs"] = [_ranked(step) for step in c.logprobs]
                if output.prompt_logprobs:
                    item["prompt_logprobs"] = [_ranked(step) if step else None for step in output.prompt_logprobs]
                self.first_served_at = self.first_served_at or time.time()
                yield item
        finally:
            self._decodes -= 1
            self._verify_expected.discard(verified)

    # ---- decode channels: a front end's outputs from this engine, batched --------------------------------------
    async def decode_channel(self, channel_id: str, address: str | None = None):
        """A front end's one stream of decode outputs from this engine (call with num_returns="streaming"): each
        message is a batch [(request id, vLLM RequestOutput | DecodeError)] of everything produced for that front
        end's requests since the last one - typically one engine step for all of them, so a message is paid once per
        step, not once per token and request. With `address` (a ZeroMQ ipc:// address the front end bound on this
        node) the messages go there, pickled, and the stream yields only its opening item, staying open as the
        channel's lifeline; without, they are the stream's items. Requests join with `submit_decode`. When the
        channel ends here (the engine stops, Ray cancels the stream, or the front end stops reading the socket), its
        requests still running are aborted; the front end aborts the requests it gives up on one by one (`abort`)."""
        self._require_engine()
        channel = self._channels[channel_id] = _Outbox()
        sock = None
        try:
            if address is not None:
                sock = _push_socket(address)
                sock.send(pickle.dumps([]), zmq.NOBLOCK)  # hello: the front end opens the channel once it arrives
            yield []  # open: requests may be submitted from now on
            while True:
                items = await channel.take()
                if sock is None:
                    yield items
                    continue
                try:
                    sock.send(pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)
                except zmq.Again:  # SOCKET_BACKLOG messages unread: the front end is gone or wedged
                    log.warning("decode channel %s: the front end stopped reading; ending its requests", channel_id)
                    return
        finally:
            if self._channels.get(channel_id) is channel:
                del self._channels[channel_id]
            for task in list(channel.tasks):
                task.cancel()  # their generate() aborts the request in the engine
            if sock is not None:
                sock.close(linger=0)

    async def submit_decode(self, channel_id: str, request_id: str, prompt_token_ids: list[int], params: Any,
                            kv_transfer_params: dict[str, Any] | None, continued: int = 0) -> None:
        """Start one request whose outputs go to channel `channel_id` (opened by `decode_channel`). `params` is a
        vLLM SamplingParams (its output_kind chooses deltas or one final output). With `kv_transfer_params` the
        prompt's state is read from the prefill engine they name; without, this engine runs the whole request.
        `continued`: the prompt's last tokens are output tokens the client already has (a first token sampled by the
        prefill engine, or the tokens before a failover); the text of the first new tokens is then detokenized as
        the continuation of those (`_continuation_detokenizer`)."""
        self._require_engine()
        self._refuse_if_draining()
        channel = self._channels.get(channel_id)
        if channel is None:
            raise RuntimeError(f"decode channel {channel_id} is not open on engine {self.engine_id}")
        remote_id = None
        if kv_transfer_params is not None:
            params = params.clone()
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": kv_transfer_params}
            # the prompt's state is read, not computed here: no prompt logprobs (the prefill engine gives them), and
            # never a request that skips reading it (vLLM's EngineCore dies on the missing blocks)
            params.prompt_logprobs = None
            params.skip_reading_prefix_cache = False
            remote_id = self._expect_verify_of(kv_transfer_params)
        self._decodes += 1
        task = asyncio.get_running_loop().create_task(
            self._pump(channel, request_id, prompt_token_ids, params, remote_id, continued, kv_transfer_params is None))
        channel.tasks.add(task)
        task.add_done_callback(channel.tasks.discard)
        task.add_done_callback(self._pump_done)

    def _pump_done(self, _: asyncio.Task) -> None:  # also when cancelled before it ran
        self._decodes -= 1

    async def _pump(self, channel: "_Outbox", request_id: str, prompt_token_ids: list[int], params: Any,
                    verified: str | None = None, continued: int = 0, colocated: bool = False) -> None:
        """Run one request, putting its outputs on its channel. `verified`: the prefill-side id of a request under
        transfer.verify; if its check failed, its error output becomes a DecodeError saying so. `colocated`: the
        engine runs the whole prompt (its prefix-cache hit is counted here; a read's is counted with the read)."""
        detokenizer = self._continuation_detokenizer(prompt_token_ids, continued, params)
        try:
            async for output in self.engine.generate({"prompt_token_ids": list(prompt_token_ids)}, params,
                                                     request_id=request_id):
                self.first_served_at = self.first_served_at or time.time()
                if colocated:
                    self._totals.cached_prompt_tokens += output.num_cached_tokens or 0
                    colocated = False
                if detokenizer is not None and output.outputs:  # deltas (a continuation always streams them)
                    c = output.outputs[0]
                    c.text = "".join(detokenizer.decode_next(token) for token in c.token_ids)
                if verified in self._verify_failed and output.outputs and output.outputs[0].finish_reason == "error":
                    channel.put((request_id, DecodeError(TRANSFER_VERIFY_FAILED, self._verify_failed.pop(verified))))
                    return
                channel.put((request_id, output))
        except asyncio.CancelledError:  # the engine is stopping or the channel closed: never a silent end
            channel.put((request_id, DecodeError("Cancelled", "the decode engine stopped the request")))
        except Exception as e:  # noqa: BLE001 - the request fails, the engine and channel carry on
            channel.put((request_id, DecodeError(type(e).__name__, str(e)[:500])))
        finally:
            if verified is not None:
                self._verify_expected.discard(verified)

    def _continuation_detokenizer(self, prompt_token_ids: list[int], continued: int, params: Any) -> Any:
        """A detokenizer for a request whose prompt ends with `continued` output tokens the client already has: vLLM's
        own (`FastIncrementalDetokenizer`), primed with the prompt the client sent and stepped through those tokens,
        so that the new tokens' text continues theirs. vLLM primes a request's detokenizer with its whole prompt, and
        one that ends inside a character (a sent token holding the first bytes of a UTF-8 sequence) is primed
        wrongly: its next text is the whole prompt's. None (vLLM's text stands) for slow tokenizers, requests
        without text, or when priming fails."""
        if not continued:  # every decode request asks: most are not continuations
            return None
        from types import SimpleNamespace

        from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer, uses_fast_detokenizer

        tokenizer = self.engine.tokenizer
        if tokenizer is None or not uses_fast_detokenizer(tokenizer) or params.detokenize is False:
            return None
        request = SimpleNamespace(request_id="continued", sampling_params=params,
                                  prompt_token_ids=list(prompt_token_ids[:-continued]))
        try:
            detokenizer = FastIncrementalDetokenizer(tokenizer, request)
            for token in prompt_token_ids[-continued:]:
                detokenizer.decode_next(token)
        except Exception as e:  # noqa: BLE001 - vLLM's own text stands
            log.warning("could not prime the continuation's detokenizer: %s", e)
            return None
        return detokenizer

    # ---- load and draining (the pool's autoscaling signal; scale-down) -------------------------------------------
    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise EngineDraining(f"engine {self.engine_id} is draining (leaving its pool) and takes no new requests")

    async def load(self) -> dict[str, float]:
        """This engine's load, answered at once (the autoscaler must not read a busy engine as an idle one): prompt
        tokens queued or in prefill, sequences being decoded, and the fraction of its KV/state blocks in use (as of
        the last background refresh: the scheduler answers between steps)."""
        if self.engine is not None and self._total_blocks and (self._usage_task is None or self._usage_task.done()):
            self._usage_task = asyncio.ensure_future(self._refresh_usage())
        load = {"queued_prompt_tokens": float(self._prefill_tokens), "running_requests": float(self._decodes)}
        if self._usage_error is None:  # unreadable is left out, not reported as an empty cache
            load["cache_usage"] = self._usage
        return load

    async def _refresh_usage(self) -> None:
        try:
            self._usage = max(0.0, 1.0 - await asyncio.wait_for(self.free_blocks(), 30) / self._total_blocks)
        except Exception as e:  # noqa: BLE001 - reported, and the signal is withheld until it reads again
            error = f"{type(e).__name__}: {e}"
            if error != self._usage_error:
                log.warning("engine %s cannot read its cache usage (%s): its load reports leave cache_usage out "
                            "(its pool will not shrink on it) until it can", self.engine_id, error)
            self._usage_error = error
            return
        if self._usage_error is not None:
            log.warning("engine %s reads its cache usage again", self.engine_id)
        self._usage_error = None

    def set_draining(self) -> None:
        """Refuse new prefill/decode requests from now on (what is in flight carries on)."""
        self.draining = True

    async def busy(self) -> Busy:
        """What keeps a draining engine from leaving (see `Busy`)."""
        held: tuple[str, ...] = ()
        if self.engine is not None:
            held = tuple(await self.engine.engine_core.call_utility_async("pd_held_requests"))
        return Busy(prefills=self._prefills, decodes=self._decodes, unfinished=self.num_unfinished(), held=held)

    def first_served(self) -> float | None:
        return self.first_served_at

    async def abort(self, request_id: str) -> None:
        if self.engine is not None:
            await self.engine.abort(request_id)

    async def release(self, remote_request_ids: list[str]) -> list[str]:
        """Prefill side: free the blocks held for requests no decode engine will read (their decode side failed)."""
        self._require_engine()
        freed = await self._pd_call("pd_release", list(remote_request_ids))
        return sorted({r for rank in freed for r in rank})

    async def pending_sends(self, wait_s: float = 5.0) -> list[str]:
        """Prefill side: requests whose blocks are still held for a decode engine, after waiting up to `wait_s` for
        the list to drain."""
        self._require_engine()
        deadline = time.monotonic() + wait_s
        while True:
            held = sorted({r for rank in await self._pd_call("pd_pending_sends") for r in rank})
            if not held or time.monotonic() >= deadline:
                return held
            await asyncio.sleep(0.1)

    def side_channel_port(self) -> int:
        """The port vLLM's NIXL side-channel listener of this engine binds (on VLLM_NIXL_SIDE_CHANNEL_HOST,
        localhost by default)."""
        return int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"])

    def _require_engine(self) -> None:
        if self.engine is None:
            raise RuntimeError("engine not started: call start() first")

    def _self_handle(self) -> Any:
        return ray.get_runtime_context().current_actor

    async def health(self) -> Health:
        """Whether the engine is started and its EngineCore answers (`actors.engine_health.engine_health` turns this
        into the verdict everyone acts on)."""
        if self.engine is None:
            return Health(started=False, healthy=False)
        try:
            await self.engine.check_health()
            healthy = not self.engine.errored
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            healthy = False
        return Health(started=True, healthy=healthy)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pids(self) -> list[int]:
        """The actor's pid followed by every process vLLM started under it (EngineCore, workers, helpers)."""
        return [p.pid for p in _process_tree(self._me)]

    def rss_bytes(self) -> int:
        """Resident memory of the actor plus all its descendants (shared pages counted per process)."""
        total = 0
        for p in _process_tree(self._me):
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    async def shutdown(self, timeout_s: float = 30.0) -> list[str]:
        """Shut the engine down, wait for its processes, and remove the shared-memory files they left behind.
        Returns the removed paths. The caller should `ray.kill` the actor afterwards."""
        children = _process_tree(self._me)[1:]
        shm = self._shm | _shm_paths(_process_tree(self._me))
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await asyncio.to_thread(engine.shutdown, timeout_s)
        # multiprocessing's resource tracker lives as long as the actor; it goes with ray.kill
        engine_procs = [p for p in children if not _is_resource_tracker(p)]
        _, alive = await asyncio.to_thread(psutil.wait_procs, engine_procs, timeout_s)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        shm_removed, tmp_files = _remove_leftovers(shm, self.tmpdir)
        return shm_removed + tmp_files


LEFTOVER_WAIT_S = 60.0  # how long a dead engine's vLLM processes get to exit before its files are left alone


@ray.remote(num_cpus=0)
def clean_leftovers(leftovers: dict[str, Any]) -> list[str]:
    """On a dead engine's node (run it there): once none of its processes runs any more (vLLM's exit by themselves
    when the engine actor is gone; up to LEFTOVER_WAIT_S), remove the shared-memory files and the TMPDIR they left -
    4 MiB of resident /dev/shm per CPU all-reduce segment, otherwise until reboot. Returns the removed paths; removes
    nothing while any of the processes still runs."""

    def running() -> bool:
        for pid, started in leftovers["procs"]:
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - started) < 1e-3 and _running(p):
                    return True
            except psutil.NoSuchProcess:
                continue
        return False

    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while running():
        if time.monotonic() > deadline:
            log.warning("a dead engine's processes still run after %.0f s: its files stay", LEFTOVER_WAIT_S)
            return []
        time.sleep(0.5)
    tmpdir = leftovers.get("tmpdir") or ""
    had_tmpdir = os.path.isdir(tmpdir)
    removed, _ = _remove_leftovers(leftovers["shm"], tmpdir)
    return removed + ([tmpdir] if had_tmpdir and not os.path.exists(tmpdir) else [])


def _remove_leftovers(shm: Any, tmpdir: str) -> tuple[list[str], list[str]]:
    """Unlink an engine's shared-memory files and remove its private TMPDIR - only paths an engine creates
    (SHM_PREFIXES under /dev/shm, a TMPDIR_PREFIX directory). Returns (the files unlinked, the files TMPDIR held)."""
    removed = []
    for path in sorted(shm):
        if os.path.dirname(path) == "/dev/shm" and os.path.basename(path).startswith(SHM_PREFIXES):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    tmp_files: list[str] = []
    if os.path.basename(tmpdir).startswith(TMPDIR_PREFIX):
        for root, _, files in os.walk(tmpdir):
            tmp_files += [os.path.join(root, f) for f in files]
        shutil.rmtree(tmpdir, ignore_errors=True)
    return removed, tmp_files


def launch_env(tp: int, extra_env: dict[str, str] | None, role: str | None) -> dict[str, str]:
    """The environment an engine actor (and vLLM's processes under it) runs with: `engine_env`, and on a prefill
    engine, which takes a step per request, message-queue readers that nap instead of spinning (vllm_plugin)."""
    env = engine_env(tp, extra_env)
    if role == "prefill":
        env.setdefault("PD_SHM_SPIN_S", os.environ.get("PD_SHM_SPIN_S", "0.002"))
    return env


ENGINE_PREFIX = "pd-engine-"  # engines are named actors "pd-engine-<engine id>" in the coordinator's namespace


@dataclass(frozen=True)
class EngineSpec:
    """How every engine of one pool starts: built once from the deploy config (`cluster.launch.engine_spec`), used by
    the pools' replicas and by plain-actor clusters alike. `device_options`: what `_device_options` derives per
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

    def launch(self, engine_id: str, namespace: str):
        """Start engine `engine_id` as the named actor the coordinator finds it by; returns (handle, ref to its
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
    **actor_kwargs: Any,
):
    """Create an `EngineActor` and begin its start; returns (handle, ref to the startup seconds).
    Lets a caller start several engines at once. `actor_kwargs` go to the actor (role, engine_id, served_model,
    max_model_len, dtype, device). On CUDA hosts pass `num_gpus=tp`: Ray then sets the actor's CUDA_VISIBLE_DEVICES,
    which vLLM's worker processes inherit. `label_selector` / `resources`: the Ray nodes it may run on (a pool's
    `placement`)."""
    env = launch_env(tp, extra_env, actor_kwargs.get("role"))
    options: dict[str, Any] = {"runtime_env": {"env_vars": env}}
    if num_gpus:
        options["num_gpus"] = num_gpus
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
    return handle, handle.start.remote(start_timeout_s)


def stop_engine_actor(handle, timeout_s: float = 60.0) -> list[str]:
    """Shut the engine down, kill the actor, and check that none of its processes survive (stragglers are
    killed). Returns the shared-memory files removed; raises RuntimeError naming any pid still alive."""
    return stop_engine_actors([handle], timeout_s)


def stop_engine_actors(handles: list, timeout_s: float = 60.0) -> list[str]:
    """`stop_engine_actor` for several engines at once (their shutdowns run in parallel)."""
    pids: list[int] = []
    here = ray.get_runtime_context().get_node_id()
    for handle in handles:
        try:
            where = ray.get(handle.node_id.remote(), timeout=timeout_s)
            if where == here:  # pids of another node mean other processes here (its own shutdown checks them there)
                pids += ray.get(handle.pids.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a dead actor cannot report its pids
            pass
    removed: list[str] = []
    for handle, ref in [(h, h.shutdown.remote()) for h in handles]:
        try:
            removed += ray.get(ref, timeout=timeout_s)
        except Exception:  # noqa: BLE001 - kill regardless
            pass
        ray.kill(handle, no_restart=True)
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=10)
    alive = [p for p in alive if _running(p)]  # a killed process whose parent has not reaped it yet is gone
    if alive:
        raise RuntimeError(f"engine processes still alive after stop: {[p.pid for p in alive]}")
    return removed
