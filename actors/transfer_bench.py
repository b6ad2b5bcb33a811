"""The two sides of the transfer benchmark (`python -m cluster bench transfer`): Ray actors that hold one engine's cache
memory per TP rank, laid out as `cluster.core.layout` lays out a real model, each rank with its own NIXL agent.

The prefill side fills its regions with noise; the decode side reads a request's full hybrid state (conv + recurrent
state of every GDN layer, KV of every attention layer) with NIXL READs built from the planner's byte ranges, one
transfer per (decode rank, prefill rank), exactly as the engines' connector posts them. `verify` compares checksums of
every read range on both sides; `memcpy` measures a single-process copy of the same number of bytes (the ceiling).
"""

from __future__ import annotations

import time
import uuid
import zlib

import numpy as np
import ray

from actors.nixl_setup import install_progress_delay
from cluster.core.layout import EngineLayout


@ray.remote(num_cpus=0)
class TransferSide:
    def __init__(self, layout: EngineLayout, num_pages: int, fill: bool):
        from nixl._api import nixl_agent, nixl_agent_config

        install_progress_delay()
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
        """Per remote rank: (local, remote) Nx3 (address, length, device) arrays of one decode rank's reads."""
        local_bases = [m.ctypes.data for m in self.regions[rank]]
        per_remote: dict[int, tuple[list, list]] = {}
        for rr in reads:
            rows = rr.rows
            for region in rr.regions:
                for remote_rank in np.unique(rows[:, 0]):
                    sel = rows[rows[:, 0] == remote_rank]
                    n = len(sel)
                    loc = np.stack([local_bases[region] + sel[:, 2], sel[:, 3], np.zeros(n, np.int64)], axis=1)
                    rem = np.stack([self.remote_bases[int(remote_rank)][region] + sel[:, 1], sel[:, 3], np.zeros(n, np.int64)], axis=1)
                    acc = per_remote.setdefault(int(remote_rank), ([], []))
                    acc[0].append(loc)
                    acc[1].append(rem)
        return {r: (np.concatenate(l), np.concatenate(m)) for r, (l, m) in per_remote.items()}

    def read(self, plan) -> dict[str, float]:
        """Post every decode rank's reads of `plan` (a RequestPlan) at once and wait for all of them. Returns seconds:
        `post_s` from the first descriptor build to all transfers complete (what a request pays), `wire_s` from the
        first `transfer()` call to completion."""
        t0 = time.perf_counter()
        handles = []
        for rank, agent in enumerate(self.agents):
            for remote_rank, (loc, rem) in self._descs(rank, plan.reads[rank]).items():
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
        while pending:
            still = []
            for agent, h in pending:
                state = agent.check_xfer_state(h)
                if state == "ERR":
                    raise RuntimeError("NIXL transfer failed")
                if state != "DONE":
                    still.append((agent, h))
            pending = still
        t2 = time.perf_counter()
        for agent, h in handles:
            agent.release_xfer_handle(h)
        return {"post_s": t2 - t0, "wire_s": t2 - t1, "transfers": len(handles)}

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

    def memcpy(self, nbytes: int, reps: int = 3) -> float:
        """Best seconds of one contiguous copy of `nbytes` in this process (the transfer's ceiling)."""
        src = np.ones(nbytes, np.uint8)
        dst = np.empty(nbytes, np.uint8)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t0)
        return best

