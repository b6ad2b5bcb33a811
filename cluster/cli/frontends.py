"""The HTTP front ends of a running cluster: their settings from the deployment (`frontend_settings`, `chat_flags`),
starting them (`start_http`: `http.replicas` processes sharing the port, on the launching node or on every node),
the URL to reach them (`reachable_url`), watching Ray restart one (`watch_frontends`) and stopping them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cluster.cli.output import say
from cluster.core.config import DeployConfig

if TYPE_CHECKING:
    from cluster.cli.launch import Cluster


def frontend_settings(cluster: Cluster):
    from actors.frontend.server import FrontendSettings

    cfg = cluster.cfg
    return FrontendSettings(
        model_name=cfg.model.name, model_dir=str(cluster.model_dir), max_model_len=cfg.model.max_model_len,
        dtype=cfg.model.dtype, coordinator_name=cfg.coordinator.name, namespace=cfg.coordinator.namespace,
        host=cfg.http.host, port=cfg.http.port, api_key=cfg.http.resolved_api_key(),
        max_body_bytes=cfg.http.max_body_bytes, retry_after_s=cfg.http.retry_after_s,
        first_token_from_prefill=cfg.transfer.first_token_from_prefill,
        local_prefill_queue=cfg.transfer.local_prefill_queue,
        local_prefill_when_idle=cfg.transfer.local_prefill_when_idle,
        local_prefill_speed=cfg.transfer.local_prefill_speed, routing_policy=cfg.routing.policy,
        stall_timeout_s=cfg.routing.stall_timeout_s,
        failover_wait_s=cfg.routing.failover_wait_s,
        max_requests_in_flight=cfg.http.max_requests_in_flight, max_queued_requests=cfg.http.max_queued_requests,
        max_n=cfg.http.max_n, replicas=cfg.http.replicas, chat_flags=chat_flags(cfg),
    )


def chat_flags(cfg: DeployConfig) -> tuple[str, ...]:
    """`chat` as `vllm serve` arguments for the front ends, a chat template file given as its text: the front ends
    are Ray actors (on every node with http.location every_node) that may not see the launcher's files."""
    flags = cfg.chat.vllm_flags()
    template = cfg.chat.chat_template
    if template and Path(template).is_file():
        flags[flags.index("--chat-template") + 1] = Path(template).read_text()
    return tuple(flags)


def start_http(cluster: Cluster, progress: Callable[[str], None] = say) -> str:
    """Start the HTTP front ends (vLLM's OpenAI server over the cluster, `actors.frontend.server`): `http.replicas`
    processes on this node (`http.location` head) or on every node alive now (every_node), all on http.host:http.port of
    their node; returns the base URL of this node's (`Cluster.urls` has every node's). Ray restarts one that dies, on
    its node, and it serves again by itself (`watch_frontends` says so)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from actors.frontend.server import FRONTEND_ACTOR, HTTPFrontend, bind_host, listening_socket

    cfg = cluster.cfg
    t0 = time.monotonic()
    try:  # a port held by anything else (another deployment's replicas too) is refused here, not joined
        listening_socket(bind_host(cfg.http.host), cfg.http.port, shared=False).close()
    except OSError as e:
        raise RuntimeError(f"http.port: cannot listen on {bind_host(cfg.http.host)}:{cfg.http.port}: {e} (is the port "
                           "taken?)") from None
    here = ray.get_runtime_context().get_node_id()
    nodes = [here]
    if cfg.http.location == "every_node":
        nodes += sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    settings = frontend_settings(cluster)
    for node in nodes:
        for _ in range(cfg.http.replicas):
            replica = len(cluster.frontends)
            cluster.frontends.append(HTTPFrontend.options(
                name=f"{FRONTEND_ACTOR}-{cfg.coordinator.name}-{replica}", namespace=cfg.coordinator.namespace,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(settings, replica))
            cluster.frontend_nodes.append(node)
    try:
        ray.get([f.start.remote() for f in cluster.frontends], timeout=300)
        infos = ray.get([f.info.remote() for f in cluster.frontends], timeout=60)
    except BaseException:
        stop_frontends(cluster, progress)
        raise
    cluster.urls = list(dict.fromkeys(reachable_url(i["url"], i["node_ip"]) for i in infos))
    cluster.url = cluster.urls[0]
    cluster.timings["http_s"] = time.monotonic() - t0
    n = len(cluster.frontends)
    where = f" on each of {len(nodes)} nodes" if len(nodes) > 1 else ""
    shared = f" ({cfg.http.replicas} processes sharing the port{where})" if cfg.http.replicas > 1 else where
    progress(f"HTTP front end{'s' if n > 1 else ''}{shared} (vLLM's OpenAI server over the cluster) up in "
             f"{cluster.timings['http_s']:.0f} s: {', '.join(cluster.urls)}")
    return cluster.url


def reachable_url(url: str, node_ip: str) -> str:
    """A front end's URL as a client elsewhere would use it: an unspecified bind address (0.0.0.0, ::) becomes the
    address of the front end's node."""
    for unspecified in ("//0.0.0.0:", "//[::]:"):
        if unspecified in url:
            host = f"[{node_ip}]" if ":" in node_ip else node_ip
            return url.replace(unspecified, f"//{host}:")
    return url


def stop_frontends(cluster: Cluster, progress: Callable[[str], None]) -> None:
    import ray

    frontends, cluster.frontends = cluster.frontends, []
    nodes, cluster.frontend_nodes = cluster.frontend_nodes, []
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    # one on a node that is gone cannot answer (nor be restarted): only killed, so that Ray forgets it
    stops = {f: f.stop.remote() for i, f in enumerate(frontends) if i >= len(nodes) or nodes[i] in alive}
    for frontend in frontends:
        if frontend in stops:
            try:
                ray.get(stops[frontend], timeout=60)
            except Exception as e:  # noqa: BLE001 - keep shutting the rest down
                progress(f"could not stop an HTTP front end cleanly: {e}")
        ray.kill(frontend, no_restart=True)


def watch_frontends(cluster: Cluster, stop: Any, progress: Callable[[str], None] = say,
                    interval_s: float = 2.0) -> None:
    """Say when a front end dies and when it serves again (Ray restarts it), or that it went with its node, until
    `stop` is set."""
    import ray

    known: dict[int, dict[str, Any]] = {}  # replica -> its last info
    down_since: dict[int, float] = {}
    gone: set[int] = set()  # replicas whose node died: nothing will restart them
    while not stop.wait(interval_s):
        for replica, frontend in enumerate(list(cluster.frontends)):
            if replica in gone:
                continue
            try:
                info = ray.get(frontend.info.remote(), timeout=max(interval_s, 5.0))
            except Exception as e:  # noqa: BLE001 - dead, or restarting
                node = cluster.frontend_nodes[replica] if replica < len(cluster.frontend_nodes) else None
                if node is not None and node not in {n["NodeID"] for n in ray.nodes() if n["Alive"]}:
                    gone.add(replica)
                    down_since.pop(replica, None)
                    progress(f"HTTP front end {replica} went with its node {node[:12]}; the other nodes' front ends "
                             "serve")
                elif replica not in down_since:
                    down_since[replica] = time.monotonic()
                    progress(f"HTTP front end {replica} is down ({type(e).__name__}); Ray is restarting it")
                continue
            last = known.get(replica)
            if last is not None and info["pid"] != last["pid"] and replica not in down_since:
                down_since[replica] = time.monotonic()  # died and came back between two looks
                progress(f"HTTP front end {replica} died (pid {last['pid']}); Ray restarted it")
            if info["error"] and (last is None or last["error"] != info["error"]):
                progress(f"HTTP front end {replica} cannot serve: {info['error']}")
            if info["serving"] and replica in down_since:
                took = time.monotonic() - down_since.pop(replica)
                progress(f"HTTP front end {replica} restarted (pid {last['pid'] if last else '?'} -> {info['pid']}, "
                         f"restart {info['restarts']}): serving again at {info['url']} after {took:.0f} s")
            if info["serving"] or last is None:
                known[replica] = info
