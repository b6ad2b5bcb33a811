"""The two sides of the transfer benchmark (`python -m cluster bench transfer`): Ray actors that hold one engine's cache
memory per TP rank, laid out as `cluster.core.layout` lays out a real model, each rank with its own NIXL agent.

The prefill side fills its regions with noise; the decode side reads a request's full hybrid state (conv + recurrent
state of every GDN layer, KV of every attention layer) with NIXL READs built from the planner's byte ranges, one
transfer per (decode rank, prefill rank), exactly as the engines' connector posts them. `verify` compares checksums of
every read range on both sides; `memcpy` measures a single-process copy of the same number of bytes (the ceiling), in
one thread and in as many threads as a READ has lanes (UCX threads: `actors.engine.nixl_setup.install_read_lanes`, one
per core this actor may run on, as a decode rank gets one per core it owns).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import zlib

import numpy as np
import ray

from actors.engine.nixl_setup import agent_read_lanes, install_progress_delay, install_read_lanes
from cluster.core.layout import EngineLayout
from cluster.core.planner import address_rows, lane_rows


@ray.remote(num_cpus=0)
class TransferSide:
    def __init__(self, layout: EngineLayout, num_pages: int, fill: bool):
        from nixl._api import nixl_agent, nixl_agent_config

        install_progress_delay()
        install_read_lanes()
        # one cma call per descriptor, as in the engines' workers (actors.engine.connector.CMA_SEG_SIZE, which sets it
        # there: that module imports vLLM, which this actor does not need)
        os.environ.setdefault("UCX_CMA_SEG_SIZE", "1G")
        self.layout = layout
        self.agents, self.regions, self.names = [], [], []
        rng = np.random.default_rng(1234)
        for rank in range(layout.tp):
            name = f"bench-{uuid.uuid4().hex[:8]}-r{rank}"
            agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
            regions = []
            for _ in range(layout.num_regions):
                mem = np.empty(num_pages * layout.page_bytes, np.uint8)
                if fill:
                    mem[:] = rng.integers(0, 256, len(mem), dtype=np.uint8)
                else:
                    mem[:] = 0
                regions.append(mem)
            agent.register_memory([(m.ctypes.data, m.nbytes, 0, "") for m in regions], "DRAM")
            self.agents.append(agent)
            self.regions.append(regions)
            self.names.append(name)
        self.remote: list[str] = []
        self.remote_bases: list[list[int]] = []
        self.lanes = agent_read_lanes(self.agents[0])

    def metadata(self) -> list[tuple[bytes, list[int]]]:
        """Per rank: NIXL agent metadata and the base address of every region."""
        return [(a.get_agent_metadata(), [m.ctypes.data for m in regs]) for a, regs in zip(self.agents, self.regions)]

    def connect(self, remote: list[tuple[bytes, list[int]]]) -> None:
        """Decode side: load the prefill ranks' agents into every local agent."""
        self.remote_bases = [bases for _, bases in remote]
        self.remote = []
        for agent in self.agents:
            names = [agent.add_remote_agent(meta) for meta, _ in remote]
        self.remote = [n.decode() if isinstance(n, bytes) else n for n in names]

    def _descs(self, rank: int, reads) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per remote rank: (local, remote) Nx3 (address, length, device) arrays of one decode rank's reads, built as
        the connector builds them (`PlannedPullWorker._pd_rows`, then `lane_rows` for the agent's lanes): a planner row
        pattern at a time over all its regions and remote ranks with whole-array operations."""
        local_bases = np.array([m.ctypes.data for m in self.regions[rank]], np.int64)
        remote_bases = np.array(self.remote_bases, np.int64)  # (remote rank, region)
        out = {}
        for r, part in address_rows(reads, remote_bases, local_bases).items():
            part = lane_rows(part, self.lanes)
            zeros = np.zeros(len(part), np.int64)
            out[r] = (np.stack([part[:, 1], part[:, 2], zeros], axis=1), np.stack([part[:, 0], part[:, 2], zeros], axis=1))
        return out

    def read(self, plan) -> dict[str, float]:
        """Post every decode rank's reads of `plan` (a RequestPlan) at once and wait for all of them. Returns seconds:
        `post_s` from the first descriptor build to all transfers complete (what a request pays), `wire_s` from the
        first `transfer()` call to completion."""
        t0 = time.perf_counter()
        handles, posted = [], 0
        for rank, agent in enumerate(self.agents):
            for remote_rank, (loc, rem) in self._descs(rank, plan.reads[rank]).items():
                posted += len(loc)
                local = agent.get_xfer_descs(loc, "DRAM")
                remote = agent.get_xfer_descs(rem, "DRAM")
                handles.append((agent, agent.initialize_xfer("READ", local, remote, self.remote[remote_rank])))
        t1 = time.perf_counter()
        pending = []
        for agent, h in handles:
            state = agent.transfer(h)
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed to post")
            pending.append((agent, h))
        while pending:  # yielding between checks: a busy poll takes a core from the READ's own UCX threads (lanes)
            still = []
            for agent, h in pending:
                state = agent.check_xfer_state(h)
                if state == "ERR":
                    raise RuntimeError("NIXL transfer failed")
                if state != "DONE":
                    still.append((agent, h))
            pending = still
            if pending:
                os.sched_yield()
        t2 = time.perf_counter()
        for agent, h in handles:
            agent.release_xfer_handle(h)
        return {"post_s": t2 - t0, "wire_s": t2 - t1, "transfers": len(handles), "posted": posted, "lanes": self.lanes}

    def checksums(self, plan, side: str) -> list[int]:
        """CRC of every read range, on the prefill (`side="remote"`) or decode (`side="local"`) memory."""
        out = []
        for rank in range(len(plan.reads)):
            for rr in plan.reads[rank]:
                for region in rr.regions:
                    for remote_rank, ro, lo, size in rr.rows.tolist():
                        mem = self.regions[remote_rank if side == "remote" else rank][region]
                        off = ro if side == "remote" else lo
                        out.append(zlib.crc32(memoryview(mem[off:off + size])))
        return out

    def clear(self) -> None:
        for regs in self.regions:
            for m in regs:
                m[:] = 0

    def memcpy(self, nbytes: int, threads: int = 1, reps: int = 3) -> float:
        """`memcpy_seconds` in this actor's process."""
        return memcpy_seconds(nbytes, threads, reps)


def memcpy_seconds(nbytes: int, threads: int = 1, reps: int = 3) -> float:
    """Best seconds of one contiguous copy of `nbytes` in this process (the transfer's ceiling), by `threads`
    threads each copying an equal slice (numpy releases the GIL while it copies)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty(nbytes, np.uint8)
    cuts = [nbytes * i // threads for i in range(threads + 1)]

    def part(i: int) -> None:
        np.copyto(dst[cuts[i]:cuts[i + 1]], src[cuts[i]:cuts[i + 1]])

    best = float("inf")
    for _ in range(reps):
        start = threading.Barrier(threads)  # the clock starts when every thread is ready to copy

        def worker(i: int) -> None:
            start.wait()
            part(i)

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(1, threads)]
        for w in workers:
            w.start()
        start.wait()
        t0 = time.perf_counter()
        part(0)
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return best
