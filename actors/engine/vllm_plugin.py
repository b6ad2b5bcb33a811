"""A vLLM general plugin (entry point `vllm.general_plugins`), which vLLM loads in every process it starts. It changes
nothing unless the process's environment asks for it, so a plain `vllm serve` from the same virtual environment (the
benchmark baseline) runs stock.

PD_SHM_SPIN_S: after each message, vLLM's shared-memory message-queue readers (a worker waiting for its EngineCore's
next step, an EngineCore waiting for its workers' results) look for the next one in a loop of sched_yield calls for
1 s before they sleep on a socket. Right for an engine that steps continuously; wrong for a prefill engine that
shares cores with a decode engine: after every prefill its worker spun for a second, and under steady load (a
prefill every second or so) it never stopped, taking a core from the decode engine's TP workers (measured on 2
cores: the idle prefill worker at 20-25% of a core at one request at a time). With PD_SHM_SPIN_S set, a reader spins
only that long after a message and then naps 200 us between checks for the rest of vLLM's busy period, then sleeps on
the socket as before. The reader still checks the same flag between naps, so the message protocol is untouched
(shortening vLLM's busy period instead, so that readers sleep on the socket sooner, lost wake-ups and stalled steps
for 5 s here). `actors.engine.actor.launch_engine_actor` sets it for prefill engines (at TP 1 on CPU there is no such
queue: the EngineCore runs the model itself, `actors.engine.settings.in_process_model`).

PD_CPU_KERNEL_BLOCK (tests only): vLLM's CPU attention accepts any multiple of 32 as its kernel block, so vLLM gives a
CPU engine one kernel block per logical block (`physical_blocks_per_logical` 1). With this variable set to a multiple
of 32, the CPU attention declares that size as the only kernel block it supports, and vLLM splits every logical block
into `block_size / PD_CPU_KERNEL_BLOCK` kernel blocks - the layout CUDA engines run (FlashAttention's 16-token kernel
blocks under larger logical blocks), which the CPU kernel computes like any other. tests/test_block_geometry.py runs
prefill and decode engines with different logical blocks under it.

PD_GLOO_SHARED_DEVICE=1: every gloo process group of the process uses one gloo device, so one `gloo_tcp_loop` thread
instead of one per group. Gloo's TCP loop thread wakes every 10 ms even when idle, and vLLM-CPU builds ~15 gloo
groups per engine process (a device group and a CPU group per parallel group): each engine process woke ~1500 times
a second doing nothing, and on 2 cores every wake-up takes a core from a decode TP worker in the middle of a step.
Gloo devices are made to be shared (each group is its own context and pairs on it). PyTorch's own
`ProcessGroupGloo(store, rank, size, timeout)` makes a device per group (one per GLOO_SOCKET_IFNAME interface when
that is set); the plugin's subclass makes those once per process and passes them to every group through the options
overload, with PyTorch's defaults otherwise (2 threads per device, the timeout given).
`actors.engine.settings.launch_env` sets it for every engine.
"""

from __future__ import annotations

import os
import time
from typing import Any

NAP_S = 0.0002


def register() -> None:
    _kernel_block()
    _nap()
    _gloo_shared_device()


def _kernel_block() -> None:
    value = os.environ.get("PD_CPU_KERNEL_BLOCK")
    if value is None:
        return
    size = int(value) if value.isdigit() else 0
    if size <= 0 or size % 32:
        raise ValueError(f"PD_CPU_KERNEL_BLOCK: the CPU attention's kernel blocks are multiples of 32 tokens, got {value!r}")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    def kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return [size]

    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(kernel_block_sizes)


def _nap() -> None:
    value = os.environ.get("PD_SHM_SPIN_S")
    if value is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    spin = shm_broadcast.SpinCondition
    if getattr(spin, "_pd_spin_s", None) is not None:  # vLLM may load plugins more than once per process
        return
    spin_s = float(value)
    stock_wait = spin.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        idle = time.monotonic() - self.last_read
        if spin_s < idle <= self.busy_loop_s:
            time.sleep(NAP_S)
            return
        stock_wait(self, timeout_ms)

    spin.wait = wait
    spin._pd_spin_s = spin_s


def _gloo_shared_device() -> None:
    value = os.environ.get("PD_GLOO_SHARED_DEVICE")
    if value in (None, "", "0"):
        return
    if value != "1":
        raise ValueError(f"PD_GLOO_SHARED_DEVICE: 1 (one gloo device per process) or 0/unset, got {value!r}")
    import datetime

    from torch.distributed import distributed_c10d as c10d

    stock = c10d.ProcessGroupGloo
    if getattr(stock, "_pd_shared_device", False):  # vLLM may load plugins more than once per process
        return
    devices: list[Any] = []

    class SharedDeviceGloo(stock):  # type: ignore[misc, valid-type]
        _pd_shared_device = True

        def __init__(self, store: Any, rank: int, size: int, timeout: Any = datetime.timedelta(minutes=30)) -> None:
            if not devices:
                ifnames = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
                devices.extend([stock.create_device(interface=i) for i in ifnames] if ifnames
                               else [stock.create_default_device()])
            options = stock._Options()
            options._devices = list(devices)
            options._timeout = timeout
            options._threads = 2 * len(devices)
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo
