"""`bench soak`'s bookkeeping, pure or nearly (no cluster): the fault list and its schedule, each request's outcome
class (a request broken by a front end's kill apart from a failed one), burst and n-too-large answers, the idle
baselines of engines that joined during the soak, the verdict (`problems`), and which /dev/shm files are orphans
(by inode: held by no live process)."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import time
from dataclasses import dataclass
from typing import Any

FAULTS = ("kill-prefill", "kill-decode", "stop-engine", "kill-coordinator", "kill-frontend", "burst", "n-too-large")
STOP_S = 20.0  # how long stop-engine keeps an engine SIGSTOPped
BURST_REQUESTS = 500
BURST_TIMEOUT_S = 300.0
N_TOO_LARGE = 1000
FRONTEND_LOSS_WINDOW_S = 5.0  # a transport error this long after a front-end kill is laid to the kill
RECOVERY_TIMEOUT_S = 300.0  # a fault's aftermath not over by then is reported as not recovered
PROMPT_TOKENS = (16, 1200)
OUTPUT_TOKENS = (4, 16, 64, 192)
POLL_S = 0.5


# ---- pure bookkeeping ----------------------------------------------------------------------------------------------
def parse_faults(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown fault(s) {unknown or text!r}; choose from {', '.join(FAULTS)}")
    return list(dict.fromkeys(names))


def fault_schedule(faults: list[str], every_s: float, duration_s: float, order: str = "round-robin",
                   seed: int = 0) -> list[tuple[float, str]]:
    """(seconds after the load started, fault) for every fault of the soak: one each `every_s`, the first after
    `every_s`, none at or after `duration_s`; round-robin through `faults`, or drawn at random (seeded)."""
    if every_s <= 0:
        raise ValueError("the fault interval must be positive")
    rng = random.Random(seed)
    out = []
    k = 1
    while k * every_s < duration_s:
        kind = faults[(k - 1) % len(faults)] if order == "round-robin" else rng.choice(faults)
        out.append((k * every_s, kind))
        k += 1
    return out


@dataclass
class Request:
    """One request of the traffic: when it started and ended (time.perf_counter()), its outcome (`cluster.cli.bench.loadgen`'s
    classes, with a 429 split off as refused_429) and why, when it did not complete."""

    start: float
    end: float
    outcome: str
    reason: str | None = None


def _transport_errors() -> tuple[str, ...]:
    import httpx

    seen, todo = set(), [httpx.TransportError]
    while todo:
        cls = todo.pop()
        seen.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return tuple(sorted(seen))


def broken_connection(reason: str | None) -> bool:
    """Whether a malformed request's reason is what a front end dying under it gives: a transport error, or a stream
    that ended without its `[DONE]`."""
    if not reason or not reason.startswith("malformed: "):
        return False
    what = reason[len("malformed: "):]
    return what.startswith("done=False") or what.split(":", 1)[0] in _transport_errors()


def lost_with_frontend(req: Request, kills: list[float], window_s: float = FRONTEND_LOSS_WINDOW_S) -> bool:
    """A request broken by a front-end kill: its connection broke (`broken_connection`), and it was in flight at a
    kill (started before, ended within `window_s` after) or started within `window_s` after one."""
    if req.outcome != "malformed" or not broken_connection(req.reason):
        return False
    return any((req.start <= t <= req.end <= t + window_s) or (t <= req.start <= t + window_s) for t in kills)


def tally(requests: list[Request], frontend_kills: list[float], window_s: float = FRONTEND_LOSS_WINDOW_S) -> dict[str, int]:
    """The traffic's outcome counts. failed = every request that neither completed, nor was cleanly refused (503 with
    Retry-After, 429), nor was lost with a killed front end (`lost_with_frontend`)."""
    out = {"sent": len(requests), "completed": 0, "failed": 0, "refused_429": 0, "refused_503": 0,
           "lost_with_frontend": 0, "failed_midstream": 0, "malformed": 0, "unexpected_4xx": 0}
    for r in requests:
        if r.outcome == "complete":
            out["completed"] += 1
        elif r.outcome in ("refused_429", "refused_503"):
            out[r.outcome] += 1
        elif lost_with_frontend(r, frontend_kills, window_s):
            out["lost_with_frontend"] += 1
        else:
            out["failed"] += 1
            out[{"refused_4xx": "unexpected_4xx"}.get(r.outcome, r.outcome)] += 1
    return out


def burst_counts(answers: list[int | str]) -> dict[str, int]:
    """A burst's answers (HTTP status of a well-formed answer, else why not) counted as 200 / 429 / 503 / other."""
    out = {"200": 0, "429": 0, "503": 0, "other": 0}
    for a in answers:
        out[str(a) if a in (200, 429, 503) else "other"] += 1
    return out


def check_n_too_large(status: int, body: Any, max_n: int) -> str | None:
    """None when an n-too-large request got what it should: a 400 whose error names the limit (reason, or code,
    n_over_limit; `max_n` in the message); else what was wrong."""
    err = body.get("error") if isinstance(body, dict) else None
    if status != 400 or not isinstance(err, dict):
        return f"HTTP {status}: {str(body)[:200]}"
    if "n_over_limit" not in (err.get("reason"), err.get("code")):
        return f"400 without reason n_over_limit: {str(err)[:200]}"
    if str(max_n) not in str(err.get("message", "")):
        return f"400 whose message does not name the limit {max_n}: {err.get('message')!r}"
    return None


def idle_baselines(start_idle: dict[str, int], live: list[str], seen_idle: dict[str, int]) -> dict[str, int]:
    """Each live engine's idle free block count: its own at the start; for an engine that joined later, the largest
    idle count of its pool's engines at the start (same model, TP and cache size), or its own largest count seen
    while it held no request if that is larger."""
    role_idle: dict[str, int] = {}
    for engine_id, free in start_idle.items():
        role = engine_id.rsplit("-", 1)[0]
        role_idle[role] = max(role_idle.get(role, 0), free)
    out = {}
    for engine_id in live:
        if engine_id in start_idle:
            out[engine_id] = start_idle[engine_id]
        else:
            base = max(role_idle.get(engine_id.rsplit("-", 1)[0], 0), seen_idle.get(engine_id, 0))
            if base:
                out[engine_id] = base
    return out


def problems(report: dict[str, Any]) -> list[str]:
    """What makes the soak fail: failed requests, anything left behind, a fault whose aftermath did not end."""
    out = []
    t = report["traffic"]
    if t["failed"]:
        out.append(f"{t['failed']} request(s) failed")
    for f in report["faults"]:
        if f.get("problem"):
            out.append(f"fault {f['index']} {f['kind']}: {f['problem']}")
        elif f.get("recovered_s") is None and f.get("awaits"):
            out.append(f"fault {f['index']} {f['kind']}: {f['awaits']} not seen in time")
    left = report["left_behind"]
    if left.get("pools_short"):
        out.append("pools without their min_replicas ready engines at the end (ready of min): "
                   + ", ".join(left["pools_short"]))
    held = left["blocks_held"]
    if any(v is None for v in held.values()):
        out.append("an engine did not answer for its free blocks: " + ", ".join(e for e, v in held.items() if v is None))
    elif any(held.values()):
        out.append("blocks still held after the load: " + ", ".join(f"{e} {v}" for e, v in held.items() if v))
    for key, what in (("shm_unowned", "/dev/shm files made during the soak that no process holds"),
                      ("shm_after_stop", "/dev/shm files made during the soak that no process holds after it stopped"),
                      ("faulted_engine_files", "files of faulted engines still there"),
                      ("stragglers", "processes of faulted engines still running (killed now)")):
        if left.get(key):
            out.append(f"{what}: {left[key]}")
    if left.get("nixl_agents_of_gone_prefills"):
        out.append(f"NIXL agents of gone prefill engines still held: {left['nixl_agents_of_gone_prefills']}")
    return out


# ---- what the processes hold ---------------------------------------------------------------------------------------
def shm_files() -> set[str]:
    from actors.engine.procs import SHM_PREFIXES

    try:
        return {f"/dev/shm/{f}" for f in os.listdir("/dev/shm") if f.startswith(SHM_PREFIXES)}
    except FileNotFoundError:
        return set()


def _by_inode(paths: set[str]) -> dict[int, str]:
    out = {}
    for path in paths:
        with contextlib.suppress(OSError):
            out[os.stat(path).st_ino] = path
    return out


def shm_held(paths: set[str]) -> set[str]:
    """Those of `paths` (/dev/shm files) that some live process - anyone's - has mapped or open
    (`actors.engine.procs.shm_inodes`). A file nobody holds is an orphan."""
    from actors.engine.procs import shm_inodes

    held = shm_inodes([p for p in os.listdir("/proc") if p.isdigit()])
    return {path for ino, path in _by_inode(paths).items() if ino in held}


def shm_of(pids: list[int]) -> set[str]:
    """The `shm_files` that the processes `pids` hold (an engine's, before it is faulted: semaphores included, which
    its own `leftovers` cannot see by name)."""
    from actors.engine.procs import shm_inodes

    held = shm_inodes(pids)
    return {path for ino, path in _by_inode(shm_files()).items() if ino in held}


def orphans(new: set[str]) -> dict[str, str]:
    """Of `new` /dev/shm files, those no live process holds (`shm_held`): path -> when it was last written (to tell
    which part of the soak left it)."""
    held = shm_held(new)
    out = {}
    for path in sorted(new - held):
        with contextlib.suppress(OSError):
            out[path] = time.strftime("%H:%M:%S", time.localtime(os.stat(path).st_mtime))
    return out
