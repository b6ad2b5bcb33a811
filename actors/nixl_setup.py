"""Process-wide NIXL settings shared by the engines' connector and the transfer benchmark (no vLLM import).

NIXL 1.5.1's Python agent hard-codes a progress-thread delay of 0 us: its progress thread spins a whole core per agent
even when idle, which on small hosts starves the engines themselves (measured: an idle TP 1 worker at 100% CPU with
it, 4% with a 200 us delay). `install_progress_delay` substitutes `PD_NIXL_PROGRESS_DELAY_US` (default 200; 0 keeps
NIXL's own) for agents created afterwards in this process.
"""

from __future__ import annotations

import os
from typing import Any

PROGRESS_DELAY_US = int(os.environ.get("PD_NIXL_PROGRESS_DELAY_US", "200"))


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
