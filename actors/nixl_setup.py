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
