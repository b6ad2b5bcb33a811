"""Start and serve the cluster a deployment file describes, until stopped.

    python -m cluster.launch deploy.yaml          # what `make run` and `ray job submit ... -- python -m cluster.launch` run

Builds the tiny model if the file names a builtin one, joins the Ray cluster (RAY_ADDRESS, as `ray job submit` sets
it) or starts a local one, starts the coordinator and the prefill and decode engines (progress every 10 s while they
load), registers them (the coordinator negotiates every pair), starts the HTTP ingress (Ray Serve), checks it with
one completion, prints the URL and a curl line, and serves until Ctrl-C / SIGTERM (`ray job stop`), then shuts down
the ingress, the engines and the coordinator.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cluster.config import DeployConfig, DeployError, load_deploy


def say(msg: str) -> None:
    print(f"[hybrid-pd {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Cluster:
    cfg: DeployConfig
    model_dir: Path
    coordinator: Any
    engines: dict[str, Any] = field(default_factory=dict)  # engine id -> handle
    timings: dict[str, float] = field(default_factory=dict)
    url: str | None = None


def start_cluster(cfg: DeployConfig, progress: Callable[[str], None] = say) -> Cluster:
    """Coordinator and engines, started and registered (Ray must be initialised). Raises with the engines stopped
    when one fails to start or is refused by the coordinator."""
    import ray

    from actors.coordinator import ENGINE_PREFIX, CoordinatorActor
    from actors.engine import launch_engine_actor, stop_engine_actors
    from cluster.models import ensure_model

    t0 = time.monotonic()
    model_dir = Path(cfg.model.path).resolve() if cfg.model.path else ensure_model(cfg.model.builtin)
    progress(f"model {cfg.model.name}: {model_dir}")
    # restarted by Ray if it dies; it then rebuilds its registry from the live engines (named, same namespace)
    coordinator = CoordinatorActor.options(
        name=cfg.coordinator.name, namespace=cfg.coordinator.namespace, get_if_exists=True, max_restarts=-1
    ).remote(namespace=cfg.coordinator.namespace)
    cluster = Cluster(cfg, model_dir, coordinator)
    launched = []
    try:
        for role, pool in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            for i in range(max(pool.min_replicas, 1)):
                engine_id = f"{role}-{i}"
                handle, ref = launch_engine_actor(
                    model_dir, pool.tp, role=role, engine_id=engine_id, served_model=cfg.model.name,
                    max_model_len=cfg.model.max_model_len, dtype=cfg.model.dtype, device=cfg.device,
                    start_timeout_s=cfg.coordinator.engine_start_timeout_s, **_device_options(cfg, pool),
                    name=f"{ENGINE_PREFIX}{engine_id}", namespace=cfg.coordinator.namespace,
                )
                cluster.engines[engine_id] = handle
                launched.append((engine_id, pool.tp, ref))
                progress(f"starting {role} engine {engine_id} (TP {pool.tp}) ...")
        pending = {ref: (engine_id, tp) for engine_id, tp, ref in launched}
        while pending:
            done, _ = ray.wait(list(pending), timeout=10)
            for ref in done:
                engine_id, tp = pending.pop(ref)
                progress(f"{engine_id} (TP {tp}) loaded in {ray.get(ref):.0f} s")
            if pending and not done:
                progress(f"  still loading: {', '.join(e for e, _ in pending.values())} ({time.monotonic() - t0:.0f} s)")
        cluster.timings["engines_s"] = time.monotonic() - t0
        for engine_id in sorted(cluster.engines, key=lambda e: not e.startswith("prefill")):
            result = ray.get(cluster.engines[engine_id].register.remote(coordinator))
            pairs = ", ".join(f"{p}->{d}" for p, d in result["pairs"]) or "none yet"
            progress(f"registered {engine_id}; negotiated pairs: {pairs}")
        cluster.timings["registered_s"] = time.monotonic() - t0
    except BaseException:
        stop_engine_actors(list(cluster.engines.values()))
        ray.kill(coordinator, no_restart=True)
        raise
    return cluster


def _device_options(cfg: DeployConfig, pool) -> dict[str, Any]:
    """CPU: the KV/state cache size in DRAM. CUDA: one GPU per TP rank and vLLM's share of its memory."""
    if cfg.device == "cuda":
        return {"num_gpus": pool.tp, "engine_kwargs": {"gpu_memory_utilization": pool.gpu_memory_utilization}}
    return {"extra_env": {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(pool.kv_cache_gib)))}}


def ingress_settings(cluster: Cluster):
    from actors.ingress import IngressSettings

    cfg = cluster.cfg
    return IngressSettings(
        model_name=cfg.model.name, model_dir=str(cluster.model_dir), max_model_len=cfg.model.max_model_len,
        coordinator_name=cfg.coordinator.name, namespace=cfg.coordinator.namespace,
        api_key=cfg.http.resolved_api_key(), max_body_bytes=cfg.http.max_body_bytes, retry_after_s=cfg.http.retry_after_s,
    )


def start_http(cluster: Cluster, progress: Callable[[str], None] = say) -> str:
    """Start Ray Serve's proxy on the configured host/port and deploy the ingress; returns the base URL."""
    from ray import serve

    from actors.ingress import APP_NAME, ingress_app

    http = cluster.cfg.http
    t0 = time.monotonic()
    cluster.url = f"http://{http.host}:{http.port}"  # set first: a stop during serve.run still removes the app
    serve.start(http_options={"host": http.host, "port": http.port})
    serve.run(ingress_app(ingress_settings(cluster)), name=APP_NAME, route_prefix="/", blocking=False)
    cluster.timings["http_s"] = time.monotonic() - t0
    progress(f"HTTP ingress up in {cluster.timings['http_s']:.0f} s")
    return cluster.url


def stop_cluster(cluster: Cluster, *, shutdown_serve: bool = False, progress: Callable[[str], None] = say) -> None:
    """Remove the ingress, stop the engines (checking no process survives) and the coordinator."""
    import ray
    from ray import serve

    from actors.engine import stop_engine_actors
    from actors.ingress import APP_NAME

    if cluster.url is not None:
        try:
            serve.shutdown() if shutdown_serve else serve.delete(APP_NAME)
        except Exception as e:  # noqa: BLE001 - keep shutting the rest down
            progress(f"could not remove the ingress: {e}")
    progress("stopping engines ...")
    stop_engine_actors(list(cluster.engines.values()))
    ray.kill(cluster.coordinator, no_restart=True)


def self_check(cluster: Cluster, api_key: str | None) -> dict[str, Any]:
    """One streamed completion through the HTTP endpoint: time to first token and total, in ms."""
    body = json.dumps({"model": cluster.cfg.model.name, "prompt": "the prefill engine hands its state to the decode engine",
                       "max_tokens": 16, "temperature": 0, "stream": True}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(f"{cluster.url}/v1/completions", data=body, headers=headers)
    t0 = time.perf_counter()
    first, text = None, ""
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                first = first or time.perf_counter() - t0
                text += json.loads(line[6:])["choices"][0]["text"]
    return {"ttft_ms": (first or 0) * 1e3, "total_ms": (time.perf_counter() - t0) * 1e3, "text": text}


def curl_line(cluster: Cluster) -> str:
    auth = ""
    if cluster.cfg.http.api_key or cluster.cfg.http.api_key_env:
        var = cluster.cfg.http.api_key_env or "PD_API_KEY"
        auth = f" -H \"Authorization: Bearer ${var}\""
    body = json.dumps({"model": cluster.cfg.model.name, "prompt": "the decode engine", "max_tokens": 24, "stream": True})
    return f"curl -N {cluster.url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


class _Stop(Exception):
    pass


def _on_signal(signum, _frame) -> None:
    raise _Stop(signal.Signals(signum).name)


def main(argv: list[str]) -> int:
    path = argv[0] if argv else "deploy.yaml"
    try:
        cfg = load_deploy(path)
        api_key = cfg.http.resolved_api_key()
    except DeployError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    t0 = time.monotonic()
    address = os.environ.get("RAY_ADDRESS")
    local = {} if address else {"num_cpus": 2, "include_dashboard": False}
    ray.init(address=address, namespace=cfg.coordinator.namespace, log_to_driver=False, **local)
    # after ray.init, which installs its own SIGTERM handler (a bare sys.exit)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    say(f"Ray: {'joined ' + address if address else 'local instance'}")
    cluster = None
    try:
        cluster = start_cluster(cfg)
        start_http(cluster)
        check = self_check(cluster, api_key)
        say(f"self-check: 16 tokens streamed, first after {check['ttft_ms']:.0f} ms, all after {check['total_ms']:.0f} ms")
        say(f"ready in {time.monotonic() - t0:.0f} s: {cluster.url}/v1/completions  (model {cfg.model.name})")
        print(f"\n  {curl_line(cluster)}\n", flush=True)
        say("serving; Ctrl-C (or `ray job stop`) shuts everything down")
        while True:
            time.sleep(3600)
    except (_Stop, KeyboardInterrupt) as e:
        say(f"stopping ({e or 'interrupted'}) ...")
    except Exception as e:
        say(f"failed: {type(e).__name__}: {e}")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if cluster is not None:
            stop_cluster(cluster, shutdown_serve=not address)
        ray.shutdown()
        say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
