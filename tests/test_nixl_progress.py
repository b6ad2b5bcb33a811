"""NIXL's progress-thread delay (actors/engine/nixl_setup.py): the substitution reaches the agent's config, and a READ
from an agent that makes no NIXL call of its own - only its progress thread can serve it, as for a prefill engine
between steps - completes promptly at the project's default delay (1 s), with every byte and notification delivered. The
same READ from an agent without a progress thread stalls: the check sees the passive side's progress."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NBYTES, DESCS, READS = 16 << 20, 64, 8
STALL_S = 3.0  # a READ not done by then is stalled (a prompt one takes milliseconds; the default poll is 1 s)


def test_delay_reaches_the_agent_config() -> None:
    probe = (
        "import json\n"
        "from actors.engine.nixl_setup import PROGRESS_DELAY_US, install_progress_delay\n"
        "import nixl._api as api\n"
        "install_progress_delay()\n"
        "c = api.nixlBind.nixlAgentConfig(); c.pthrDelay = 0\n"
        "d = api.nixlBind.nixlAgentConfig(); d.pthrDelay = 7\n"
        "print(json.dumps([PROGRESS_DELAY_US, c.pthrDelay, d.pthrDelay]))\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "PD_NIXL_PROGRESS_DELAY_US"})
    assert r.returncode == 0, r.stderr[-2000:]
    default, substituted, explicit = json.loads(r.stdout.strip().splitlines()[-1])
    assert default == 1_000_000 and substituted == 1_000_000  # the default; NIXL's hard-coded 0 is replaced
    assert explicit == 7  # a delay someone set on purpose is left alone


def _agent(name: str, prog_thread: bool):
    from actors.engine.nixl_setup import install_progress_delay

    install_progress_delay()  # as actors/engine/connector.py does before vLLM creates its agents
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=prog_thread, backends=["UCX"]))


def _pattern():
    import torch

    return torch.arange(NBYTES // 4, dtype=torch.int32).view(torch.uint8)


def _descs(agent, buf):
    """`buf` as DESCS equal DRAM descriptors (many descriptors per READ, as the planner posts them)."""
    step = NBYTES // DESCS
    return agent.get_xfer_descs([(buf.data_ptr() + i * step, step, 0) for i in range(DESCS)], "DRAM")


def _target(prog_thread: bool, to_initiator, from_initiator, results) -> None:
    src = _pattern()
    agent = _agent("target", prog_thread)
    agent.register_memory(src)
    descs = _descs(agent, src)
    to_initiator.put((agent.get_agent_metadata(), agent.get_serialized_descs(descs)))
    from_initiator.get()  # no NIXL call until the initiator is done: only the progress thread serves it
    results.put(sorted(m.decode() for msgs in agent.get_new_notifs().values() for m in msgs))


def _initiator(to_initiator, from_initiator, results) -> None:
    import torch

    meta, serialized = to_initiator.get()
    expected = _pattern()
    dst = torch.zeros(NBYTES, dtype=torch.uint8)
    agent = _agent("initiator", True)
    agent.register_memory(dst)
    remote_name = agent.add_remote_agent(meta)
    remote = agent.deserialize_descs(serialized)
    local = _descs(agent, dst)
    latencies: list[float | None] = []
    equal = []
    for i in range(READS):
        dst.zero_()
        handle = agent.initialize_xfer("READ", local, remote, remote_name, f"read-{i}".encode())
        t0 = time.monotonic()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR") and time.monotonic() - t0 < STALL_S:
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            latencies.append(None)
            break
        latencies.append(time.monotonic() - t0)
        equal.append(bool(torch.equal(dst, expected)))
        agent.release_xfer_handle(handle)
    results.put({"latencies": latencies, "equal": equal})
    from_initiator.put("done")


def _run(prog_thread: bool) -> tuple[dict, list[str] | None]:
    ctx = mp.get_context("spawn")
    to_initiator, from_initiator, results, notifs = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    target = ctx.Process(target=_target, args=(prog_thread, to_initiator, from_initiator, notifs), daemon=True)
    initiator = ctx.Process(target=_initiator, args=(to_initiator, from_initiator, results), daemon=True)
    target.start()
    initiator.start()
    try:
        reads = results.get(timeout=180)
        try:
            delivered = notifs.get(timeout=30)
        except Exception:  # noqa: BLE001 - a stalled target may never answer
            delivered = None
        return reads, delivered
    finally:
        for p in (initiator, target):
            p.join(5)
            if p.is_alive():
                p.kill()


def test_idle_agent_serves_reads_at_the_default_delay() -> None:
    reads, delivered = _run(prog_thread=True)
    latencies = reads["latencies"]
    assert None not in latencies and len(latencies) == READS, f"a READ stalled: {latencies}"
    assert all(reads["equal"]) and len(reads["equal"]) == READS
    assert delivered == sorted(f"read-{i}" for i in range(READS))
    # a READ waiting on the 1 s poll would take ~1 s; served on UCX's events it takes milliseconds
    assert statistics.median(latencies) < 0.5, latencies


def test_without_a_progress_thread_the_same_read_stalls() -> None:
    """The oracle above sees the passive side's progress: take its progress thread away and the READ does not finish."""
    reads, _ = _run(prog_thread=False)
    assert reads["latencies"][-1] is None, f"every READ completed without the target's progress thread: {reads}"
