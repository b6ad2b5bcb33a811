"""How the launcher and what it starts say what they are doing: one timestamped line at a time, flushed."""

from __future__ import annotations

import time


def say(msg: str) -> None:
    print(f"[hybrid-pd {time.strftime('%H:%M:%S')}] {msg}", flush=True)
