"""How an engine is set up, apart from the actor that hosts it: vLLM's engine arguments for a role
(`vllm_engine_args`, with the project's KV connector: `pd_kv_transfer_config`), the per-engine environment
(`engine_env`, and `launch_env`: what an engine actor and vLLM's processes under it run with), whether a TP 1 CPU
engine runs its model in its EngineCore (`in_process_model`, `in_process_env`), and free ports for each engine's side
channel (`free_port`). Plain functions: the engine actor (`actors.engine.actor`), the benchmarks' vLLM servers and the
tests use them alike."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path
from typing import Any

from cluster.core.cores import shared_bind

CONNECTOR_MODULE = "actors.engine.connector"
DEFAULT_MAX_MODEL_LEN = 2048  # an engine's context when nothing sets one (deploy.yaml's model.max_model_len default)
COMPILE_CACHE_ENV = "PD_COMPILE_CACHE_DIR"  # where every engine's compile caches live (`compile_cache_env`)


def pd_kv_transfer_config(role: str, engine_id: str, device: str = "cpu") -> dict[str, Any]:
    """The KV transfer config of a prefill or decode engine: the project's connector (vLLM's NIXL pull connector
    with the coordinator's plans in its data path), cache memory on `device` (DRAM on CPU hosts, VRAM on GPUs)."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    return {
        "kv_connector": "NixlConnector",  # the name vLLM keys behaviour on (config checks)
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu" if device == "cpu" else "cuda",
        # a prompt state that cannot be read ends the request with finish_reason "error" (the router retries it on
        # another pair) rather than a silent local recompute
        "kv_load_failure_policy": "fail",
        "engine_id": engine_id,
    }


def vllm_engine_args(model_dir: str, tp: int, *, max_model_len: int = DEFAULT_MAX_MODEL_LEN, dtype: str = "bfloat16",
                     kv_transfer_config: dict[str, Any] | None = None, engine_kwargs: dict[str, Any] | None = None,
                     role: str | None = None, engine_id: str = "engine", device: str = "cpu") -> dict[str, Any]:
    """vLLM's engine arguments for one engine: with a role, the project's connector (`pd_kv_transfer_config`) and
    worker extension. vLLM's async scheduling is left at its platform's default: vLLM-CPU turns it off; on GPUs it
    is on, and vLLM 0.32 carries both upstream fixes for hybrid models in P/D under it (connector-loaded attention
    blocks are not zeroed, #48481; freed blocks wait for the in-flight step, #45357). `engine_kwargs` override
    anything here."""
    if role is not None and kv_transfer_config is None:
        kv_transfer_config = pd_kv_transfer_config(role, engine_id, device)
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        tensor_parallel_size=tp,
        dtype=dtype,  # Qwen3-Next on CPU: the GDN kernel asserts "CPU GDN attention requires BF16."
        max_model_len=max_model_len,
        enable_prefix_caching=False,  # off unless asked: the deploy config turns it on (`cluster.cli.placement.prefix_caching`)
        # TP 1 on CPU: the model in the EngineCore process (`in_process_model`); otherwise a process per rank ("ray"
        # fails on CPU and would be auto-picked inside placement groups)
        distributed_executor_backend="uni" if in_process_model(tp, device) else "mp",
        disable_log_stats=True,
        # no torch.compile: on 2 cores a tiny model starts in ~15 s instead of ~45-90 s, and generates
        # fast enough; pass engine_kwargs={"enforce_eager": False} for the compiled path
        enforce_eager=True,
    )
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
        if kv_transfer_config.get("kv_connector_module_path") == CONNECTOR_MODULE:
            kwargs["worker_extension_cls"] = f"{CONNECTOR_MODULE}.PDWorkerExtension"
    kwargs.update(engine_kwargs or {})
    return kwargs


def default_compile_cache_dir() -> Path:
    """The compile caches' directory when nothing names one: per user, under the XDG cache home
    (~/.cache/hybrid-pd/compile), or under the temporary directory where the home is not writable."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    probe = base
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if os.access(probe, os.W_OK):
        return base / "hybrid-pd" / "compile"
    import getpass
    import tempfile

    return Path(tempfile.gettempdir()) / f"hybrid-pd-compile-{getpass.getuser()}"


def compile_cache_env(device: str = "cpu") -> dict[str, str]:
    """Where an engine's compilers keep what they built: one directory per user (PD_COMPILE_CACHE_DIR, else
    `default_compile_cache_dir`), shared by every engine of the node - replacements and autoscaled engines load what
    the first ones compiled - and kept across restarts. torch inductor's cache (by default under the temporary
    directory, which a new machine or a cleaned /tmp empties), vLLM's own (its compiled graphs, VLLM_CACHE_ROOT) and,
    on GPUs, Triton's. Always these, whatever the process inherited: torch sets TORCHINDUCTOR_CACHE_DIR in a
    process's environment as it first uses its cache, and Ray's workers inherit the environment of the process that
    started Ray (a pool's `env` may not name them: `cluster.core.config.COMPILE_CACHE_VARS`)."""
    root = Path(os.environ.get(COMPILE_CACHE_ENV) or default_compile_cache_dir()).expanduser()
    env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "VLLM_CACHE_ROOT": str(root / "vllm")}
    if device != "cpu":
        env["TRITON_CACHE_DIR"] = str(root / "triton")
    return env


_HANDED_OUT: set[int] = set()


FREE_PORT_RANGE = (20000, 32000)  # below Linux's ephemeral range (32768+) and above Ray's worker ports (10002-19999)


def free_port() -> int:
    """A TCP port that is free right now, that this process has not handed out before, and that no other process is
    about to take by chance: it comes from FREE_PORT_RANGE, not from the kernel's ephemeral range, where vLLM's own
    processes pick their ports with bind(0) while our engines start (two users of one side-channel port hang)."""
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(*FREE_PORT_RANGE)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {FREE_PORT_RANGE} after 1000 tries")


def engine_env(tp: int, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for one CPU engine: 1 GiB KV space, no reserved CPU, an explicit thread binding per TP rank over
    this process's cores (`shared_bind`; vLLM's automatic binding asserts on a 1-NUMA-node machine at TP 2; engine
    actors bind again when they start, to their own node's cores), its own NIXL side-channel port, and OpenMP
    threads that sleep instead of spinning when they wait (`PD_OMP_WAIT_POLICY`, default PASSIVE): engines share
    cores, and an idle engine's spinning threads starved a busy one - a TP 1 decode of 160 tokens next to an idle
    TP 1 engine took 52 s spinning, 1.4 s passive; a TP 2 decode alone 3.7 vs 3.2 s."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_OMP_THREADS_BIND": shared_bind(sorted(os.sched_getaffinity(0)), tp),
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        "OMP_WAIT_POLICY": os.environ.get("PD_OMP_WAIT_POLICY", "PASSIVE"),
    }
    env.update(extra_env or {})
    return env


def in_process_model(tp: int, device: str = "cpu", engine_kwargs: dict[str, Any] | None = None) -> bool:
    """Whether an engine runs its model in its EngineCore process (vLLM's "uni" executor) rather than in a worker
    process under it: TP 1 CPU engines, unless `engine_kwargs` name another executor. One process fewer per engine -
    and importing vLLM costs ~15 s of CPU per process on these machines: a TP 1 prefill engine joined `bench serve`'s
    cluster in 30-34 s instead of 53-62 s, and measured the same day against vLLM's server, concurrency 1 TPOT 1.29x
    instead of 1.60x and concurrency 8 output tokens/s 1.08x instead of 0.73x (TTFT 1.70x against 1.63x; README,
    Benchmarks). vLLM-CPU refuses "uni" unless VLLM_ENABLE_V1_MULTIPROCESSING=0, because its mp executor is what
    binds a worker's OpenMP threads; under `AsyncLLM` the EngineCore is a fresh process all the same, so
    `launch_env` gives it the binding vLLM's mp executor gives a worker (`in_process_env`)."""
    backend = (engine_kwargs or {}).get("distributed_executor_backend")
    return device == "cpu" and tp == 1 and backend in (None, "uni")


def in_process_env(cpu_bind: str) -> dict[str, str]:
    """The environment of a TP 1 CPU engine whose EngineCore runs the model: what vLLM's mp executor sets for a
    worker bound to `cpu_bind` (a VLLM_CPU_OMP_THREADS_BIND list such as "0-1" or "0,2,4"), read by PyTorch's
    libgomp, which vLLM-CPU preloads: one OpenMP thread per listed core, each on its core (the EngineCore's main
    thread, the OpenMP master, on the first). An earlier try that bound them with `OMP_PLACES`/`OMP_PROC_BIND`
    instead measured a slower prefill, and a slower decode engine next to it. "auto"/"nobind": no binding."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if cpu_bind in ("auto", "nobind", "") or "|" in cpu_bind:
        return env
    cores: list[int] = []
    for part in cpu_bind.split(","):
        lo, _, hi = part.partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    env["OMP_NUM_THREADS"] = str(len(cores))
    env["GOMP_CPU_AFFINITY"] = " ".join(map(str, cores))
    return env


# The conv-state layout of prefill and decode engines on CPU hosts: vLLM's default (SD, (conv_rows, channels)), which
# its plain OpenAI server runs, rather than the DS layout vLLM-CPU switches to whenever a NIXL connector is configured
# (its stock transfers need DS; the planner reads either). Measured on vLLM's own server with vLLM's bench client
# (512-token prompts, 64 output tokens, 3 alternating rounds): DS costs 1.27x time per output token at concurrency 1
# (11.4 vs 9.0 ms) and 0.65x output tokens/s at concurrency 8 (277 vs 424). In this cluster (every request
# disaggregated, same client, 3 alternating rounds) the two were within the noise: SD 10.8 vs DS 11.7 ms per token,
# 299 vs 328 tokens/s. A pool's `env` may set another; both engines of a pair must agree (refused at registration).
CPU_CONV_STATE_LAYOUT = "SD"


def launch_env(tp: int, extra_env: dict[str, str] | None, role: str | None, device: str = "cpu",
               engine_kwargs: dict[str, Any] | None = None, own_cores: int = 0) -> dict[str, str]:
    """The environment an engine actor (and vLLM's processes under it) runs with: `engine_env` less the OpenMP
    binding, which a CPU engine sets when it starts, from the cores of its node it owns or shares
    (`EngineActor._take_cores`; a TP 1 engine's EngineCore runs the model, bound by `in_process_env`), unless
    `extra_env` names one for an engine that shares cores; on every engine, one gloo device per process (vllm_plugin,
    PD_GLOO_SHARED_DEVICE); on a prefill engine, message-queue readers that nap instead of spinning (vllm_plugin);
    on CPU prefill and decode engines, the SD conv-state layout (`CPU_CONV_STATE_LAYOUT`). `extra_env` wins over
    all of it."""
    extra = dict(extra_env or {})
    env = engine_env(tp)
    del env["VLLM_CPU_OMP_THREADS_BIND"]  # the engine binds when it starts, to its node's cores (`_take_cores`)
    env["PD_GLOO_SHARED_DEVICE"] = os.environ.get("PD_GLOO_SHARED_DEVICE", "1")
    if role == "prefill":
        env["PD_SHM_SPIN_S"] = os.environ.get("PD_SHM_SPIN_S", "0.002")
    if role is not None and device == "cpu":
        env["VLLM_SSM_CONV_STATE_LAYOUT"] = CPU_CONV_STATE_LAYOUT
    if in_process_model(tp, device, engine_kwargs) and "VLLM_CPU_OMP_THREADS_BIND" in extra and not own_cores:
        env.update(in_process_env(extra["VLLM_CPU_OMP_THREADS_BIND"]))  # a binding the pool names itself
    elif in_process_model(tp, device, engine_kwargs):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the rest of `in_process_env` follows the cores at start
    if (engine_kwargs or {}).get("kv_cache_memory_bytes") is not None:
        # an exact cache size as vLLM's own argument: vLLM-CPU's variable (whole GiB) would override it
        del env["VLLM_CPU_KVCACHE_SPACE"]
    env.update(extra)
    return env
