"""What the serving benchmarks (`bench serve`, `bench goodput`, `bench prefix-routing`) measure, each started and
stopped one way: the cluster as `make run` starts it (`local_cluster`), vLLM's own OpenAI server (`vllm_server`) and
vLLM's stock P/D - a prefill and a decode server with its NixlConnector behind the minimal proxy
(`cluster.cli.bench.stock_pd_proxy`) - (`stock_pd`). Each is a context manager that yields once the target answers
and leaves nothing running behind it. vLLM's servers get the cluster's per-engine environment (`engine_env`: on
2-core hosts explicit OpenMP binding, passive waiting, 1 GiB of KV cache), so that both sides run alike."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[3]
Say = Callable[[str], None]


def _say(message: str) -> None:
    print(message, flush=True)


@contextlib.contextmanager
def local_cluster(cfg: Any, label: str = "cluster", say: Say = _say) -> Iterator[Any]:
    """The deploy config's cluster (`cluster.cli.launch.serve`, as `make run` starts it) on a local Ray instance of
    its own (2 CPUs, the config's namespace); yields the `Cluster`. Stopped with Serve afterwards - a failure to stop
    is said, not raised, so that what was measured stands."""
    import ray

    from cluster.cli.launch import serve, stop_cluster
    from cluster.cli.local_ray import start_ray

    start_ray(cfg.coordinator.namespace)
    cluster = None
    try:
        t0 = time.monotonic()
        cluster = serve(cfg, progress=lambda m: say(f"  {label}: {m}"))
        say(f"  {label}: cluster up in {time.monotonic() - t0:.0f} s at {cluster.url}")
        yield cluster
    finally:
        try:
            if cluster is not None:
                stop_cluster(cluster, shutdown_serve=True, progress=lambda m: None)
        except Exception as e:  # noqa: BLE001 - the measured figures stand; the failure to stop is reported
            say(f"  {label}: could not stop cleanly: {e}")
        ray.shutdown()


@contextlib.contextmanager
def vllm_server(model_dir: str, name: str, tp: int, logs: Path, prefix_caching: bool = False,
                label: str | None = None, say: Say = _say) -> Iterator[str]:
    """vLLM's own OpenAI server for the model, colocated at TP `tp`, served as `name`; yields its URL. Its output goes
    to logs/<label>.log (label: vllm-tp<tp>)."""
    from actors.engine.settings import free_port

    label = label or f"vllm-tp{tp}"
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", logs / f"{label}.log"
    procs = [server_process(model_dir, name, tp, port, log, prefix_caching=prefix_caching)]
    try:
        say(f"  {label}: server up in {wait_http(url, procs):.0f} s (log {log})")
        yield url
    finally:
        stop_processes(procs)


@contextlib.contextmanager
def stock_pd(model_dir: str, name: str, p_tp: int, d_tp: int, logs: Path, prefix_caching: bool = False,
             say: Say = _say) -> Iterator[str]:
    """vLLM's stock P/D: a prefill server (kv_producer) at TP `p_tp` and a decode server (kv_consumer) at TP `d_tp`
    with vLLM's NixlConnector, behind `cluster.cli.bench.stock_pd_proxy`; yields the proxy's URL."""
    from actors.engine.settings import free_port

    p_port, d_port, proxy_port = free_port(), free_port(), free_port()
    procs = [server_process(model_dir, name, p_tp, p_port, logs / "stock-prefill.log", "kv_producer",
                            prefix_caching=prefix_caching),
             server_process(model_dir, name, d_tp, d_port, logs / "stock-decode.log", "kv_consumer",
                            prefix_caching=prefix_caching)]
    try:
        took = max(wait_http(f"http://127.0.0.1:{p}", procs) for p in (p_port, d_port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "cluster.cli.bench.stock_pd_proxy", "--prefill", f"http://127.0.0.1:{p_port}",
             "--decode", f"http://127.0.0.1:{d_port}", "--port", str(proxy_port)], cwd=REPO,
            stdout=(logs / "stock-proxy.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True))
        wait_http(f"http://127.0.0.1:{proxy_port}", procs, 60)
        say(f"  stock-pd: prefill TP {p_tp} + decode TP {d_tp} servers up in {took:.0f} s")
        yield f"http://127.0.0.1:{proxy_port}"
    finally:
        stop_processes(procs)


def server_env(tp: int, side_port: int) -> dict[str, str]:
    """A vLLM server's environment: the cluster's per-engine one, and its own NIXL side-channel port."""
    from actors.engine.settings import engine_env

    return {**os.environ, **engine_env(tp), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port)}


def server_process(model_dir: str, name: str, tp: int, port: int, log: Path, kv_role: str | None = None,
                   side_port: int | None = None, prefix_caching: bool = False) -> subprocess.Popen:
    """`vllm.entrypoints.openai.api_server` in a process group of its own (eager, bfloat16, 2048 tokens, the
    prefix-caching setting given; with `kv_role`, vLLM's NixlConnector on CPU buffers)."""
    from actors.engine.settings import free_port

    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
            name, "-tp", str(tp), "--distributed-executor-backend", "mp", "--dtype", "bfloat16", "--max-model-len",
            "2048", "--enforce-eager", "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    if kv_role:
        argv += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role,
                                                     "kv_buffer_device": "cpu"})]
    return subprocess.Popen(argv, env=server_env(tp, side_port or free_port()), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_http(url: str, procs: list[subprocess.Popen], timeout_s: float = 600) -> float:
    """Seconds until `url`/v1/models answers; an error if one of `procs` exits first or it takes over `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a server exited while starting (see its log)")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(2)
    raise TimeoutError(f"{url} did not come up in {timeout_s:.0f} s")


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each process group, SIGKILL what has not exited after 60 s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
