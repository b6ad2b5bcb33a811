"""Process-wide NIXL settings shared by the engines' connector and the transfer benchmark (no vLLM import).

NIXL 1.5.1's Python agent hard-codes a progress-thread delay of 0 us: its progress thread spins a whole core per agent
even when idle, which on small hosts starves the engines themselves (measured: an idle TP 1 worker at 100% CPU with
it, 4% with a 200 us delay). `install_progress_delay` substitutes `PD_NIXL_PROGRESS_DELAY_US` (0 keeps NIXL's own)
for agents created afterwards in this process. The delay is the timeout of the thread's poll on UCX's event fds
(rounded up to whole ms), so the thread still wakes for transfer events; the engines also progress NIXL on every
step (vLLM's connector polls its transfers and notifications). The default is 1 s: with 200 us each agent's thread
woke every 1 ms, preempting a TP worker on the same core, and P TP 1 + D TP 2 on 2 cores measured, with vLLM's bench
client over 2 alternating rounds, 379 against 333 output tokens/s at concurrency 8, TPOT 8.9 against 9.7 ms and TTFT
65.5 against 75.7 ms at concurrency 1 (vLLM's own server with this connector configured: 478 against 350 tokens/s,
its plain server 471). An earlier version of the cluster measured 20000 us worse than 200 (README, Notes).

`install_read_lanes` lets one READ run on several UCX threads, one per core the reading rank may use (below).
"""

from __future__ import annotations

import os
from typing import Any

PROGRESS_DELAY_US = int(os.environ.get("PD_NIXL_PROGRESS_DELAY_US", "1000000"))


def install_progress_delay(delay_us: int = PROGRESS_DELAY_US) -> None:
    if delay_us <= 0:
        return
    import nixl._api as nixl_api

    bind = nixl_api.nixlBind
    base = getattr(bind.nixlAgentConfig, "_pd_base", bind.nixlAgentConfig)

    class AgentConfig(base):  # type: ignore[misc, valid-type]
        _pd_base = base

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "pthrDelay" and value == 0:
                value = delay_us
            super().__setattr__(name, value)

    bind.nixlAgentConfig = AgentConfig


# ---- read lanes -------------------------------------------------------------------------------------------------------
# On one host a NIXL READ of DRAM is UCX's cma transport: a `process_vm_readv` per descriptor, a kernel copy made by
# the UCX worker's thread. One such copy stream ran at 5.3-6.6 GB/s here whatever the descriptor count, against 7-13
# GB/s for a memcpy in one thread; two streams on two cores at 11.7-12.9 GB/s (raw `process_vm_readv` between two
# processes, 34 and 214 MiB). NIXL's UCX backend can run one READ on several threads: with `num_threads` > 0 it keeps
# that many UCX workers, each on a thread of its own, and splits a READ of at least `split_batch_size` descriptors into
# runs of max(n / num_threads, split_batch_size) consecutive descriptors, a run per thread, the READ's notification
# sent when all are done. vLLM creates its agents with num_threads 4 (its default) and NIXL's split_batch_size is
# 1024, more descriptors than a request's READ has here: no READ was ever split. `install_read_lanes` (CPU hosts: the
# connector installs it there only) sets both for UCX agents this process creates from then on: one thread ("lane")
# per core the creating thread may run on - the connector gives it its rank's cores for that moment, so a prefill
# rank's agent gets lanes too and leaves them idle - (PD_NIXL_READ_LANES overrides; at most MAX_READ_LANES), and
# split_batch_size = cluster.core.planner.LANE_MIN_ROWS; `cluster.core.planner.lane_rows` lays each READ out so that
# the runs carry equal bytes. One lane (a rank on one core) leaves the backend's settings as given (vLLM's 4 threads,
# which split only READs of 1024 descriptors or more).
READ_LANES_ENV = "PD_NIXL_READ_LANES"
MAX_READ_LANES = 4  # vLLM's own UCX thread count, kept as the ceiling (each UCX worker takes NIC resources on RDMA hosts)


def read_lanes() -> int:
    """UCX threads one READ runs on, for an agent the calling thread creates now (see above)."""
    raw = os.environ.get(READ_LANES_ENV, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"{READ_LANES_ENV}={raw!r}: expected a whole number of UCX threads per READ (1 = no split)") from None
        if n < 1:
            raise ValueError(f"{READ_LANES_ENV}={raw!r}: expected at least 1 (1 = no split)")
    else:
        n = len(os.sched_getaffinity(0))
    return min(n, MAX_READ_LANES)


def agent_read_lanes(agent: Any) -> int:
    """The lanes `install_read_lanes` gave this agent's UCX backend (1: its settings left as given)."""
    return int(getattr(agent, "_pd_read_lanes", 1))


def install_read_lanes() -> None:
    """Give UCX backends created from now on in this process `read_lanes()` threads and the split size `lane_rows`
    lays READs out for. Idempotent."""
    import nixl._api as nixl_api

    from cluster.core.planner import LANE_MIN_ROWS

    cls = nixl_api.nixl_agent
    if getattr(cls.create_backend, "_pd_lanes", False):
        return
    stock = cls.create_backend

    def create_backend(self: Any, backend: str, initParams: dict[str, str] | None = None) -> None:  # noqa: N803 - NIXL's name
        params = dict(initParams or {})
        lanes = 1
        if backend == "UCX":
            lanes = read_lanes()
            if lanes > 1:
                params["num_threads"] = str(lanes)
                params["split_batch_size"] = str(LANE_MIN_ROWS)
        stock(self, backend, params)
        if backend == "UCX":
            self._pd_read_lanes = lanes

    create_backend._pd_lanes = True  # type: ignore[attr-defined]
    cls.create_backend = create_backend
