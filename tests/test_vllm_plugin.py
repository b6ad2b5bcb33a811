"""The vLLM plugin that makes a prefill engine's message-queue readers nap instead of spinning (actors/vllm_plugin.py):
inert without its environment variable; with it, a reader past its short spin sleeps between checks (CPU time far
below wall time), where vLLM's own reader spins with sched_yield for a whole second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, os, tempfile, time, zmq
from actors.vllm_plugin import register
from vllm.distributed.device_communicators import shm_broadcast
stock = shm_broadcast.SpinCondition.wait
register()
patched = shm_broadcast.SpinCondition.wait is not stock
ctx = zmq.Context()
addr = "ipc://" + os.path.join(tempfile.mkdtemp(), "notify")
writer = shm_broadcast.SpinCondition(False, ctx, addr)
reader = shm_broadcast.SpinCondition(True, ctx, addr)
reader.last_read = time.monotonic() - 0.01  # past a 2 ms spin, well inside vLLM's 1 s busy period
cpu0, wall0 = time.process_time(), time.monotonic()
for _ in range(300):
    reader.wait()
print(json.dumps({"patched": patched, "cpu": time.process_time() - cpu0, "wall": time.monotonic() - wall0}))
"""


def run_probe(script: str, **variables: str | None) -> dict:
    """Run `script` in a fresh interpreter with the plugin's variables set as given (None: unset); its last line."""
    env = {k: v for k, v in os.environ.items() if k not in ("PD_SHM_SPIN_S", "PD_CPU_KERNEL_BLOCK")}
    env.update({k: v for k, v in variables.items() if v is not None})
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def probe(env_value: str | None) -> dict:
    return run_probe(PROBE, PD_SHM_SPIN_S=env_value)


def test_inert_without_its_variable():
    assert probe(None)["patched"] is False


def test_a_reader_past_its_spin_naps():
    got = probe("0.002")
    assert got["patched"] is True
    assert got["wall"] >= 300 * 0.0002  # it slept between checks
    assert got["cpu"] < 0.5 * got["wall"], got  # and did not burn the core meanwhile


KERNEL_PROBE = """
import json, os
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from actors.vllm_plugin import register
stock = CPUAttentionBackend.get_supported_kernel_block_sizes()
got = {}
for value in [None, "48", "0", "-32", "x", "64"]:  # unset first, and the one valid value last: it patches vLLM
    os.environ.pop("PD_CPU_KERNEL_BLOCK", None)
    if value is not None:
        os.environ["PD_CPU_KERNEL_BLOCK"] = value
    try:
        register()
        got[str(value)] = {"stock": repr(stock), "sizes": repr(CPUAttentionBackend.get_supported_kernel_block_sizes())}
    except ValueError as e:
        got[str(value)] = {"error": str(e)}
print(json.dumps(got))
"""


def test_kernel_block_variable_sets_the_cpu_attention_kernel_block():
    """PD_CPU_KERNEL_BLOCK (tests only): unset, vLLM's CPU attention keeps its own answer; set, it declares that one
    kernel block size; anything but a positive multiple of 32 is refused naming the variable (one interpreter for
    every value: importing vLLM takes ~20 s here)."""
    got = run_probe(KERNEL_PROBE)
    assert got["None"]["sizes"] == got["None"]["stock"]
    assert got["64"]["sizes"] == "[64]"
    for bad in ("48", "0", "-32", "x"):
        assert "PD_CPU_KERNEL_BLOCK" in got[bad]["error"], bad
