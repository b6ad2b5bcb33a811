"""Start and serve the cluster a deployment file describes, until stopped.

    python -m cluster run deploy.yaml    # what `make run` and `ray job submit ... -- python -m cluster.cli.launch` run

Builds the tiny model if the file names a builtin one, joins the Ray cluster (RAY_ADDRESS, as `ray job submit` sets
it) or starts a local one, starts the coordinator and the prefill and decode pools as Ray Serve deployments (one
replica = one engine; a pool with min_replicas < max_replicas autoscales on its own signal, see
actors/control/autoscale.py), waits for their engines to load and register (progress every 10 s; the coordinator
negotiates every pair), starts the HTTP front end (vLLM's OpenAI server over the cluster), checks it with one
completion, prints the URL and a curl line, and serves until Ctrl-C / SIGTERM (`ray job stop`), printing scaling
decisions and engines joining or leaving; then shuts down the front end, the pools (each engine drains first) and the
coordinator.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cluster.cli.frontends import start_http, stop_frontends, watch_frontends
from cluster.cli.local_ray import start_ray
from cluster.cli.output import say
from cluster.cli.placement import check_chat, check_cores, check_placement, device_options, prefix_caching
from cluster.core.config import DeployConfig, DeployError, load_deploy

if TYPE_CHECKING:
    from actors.clients.coordinator_client import CoordinatorClient
    from actors.clients.engine_client import EngineClient

SERVE_CONTROL_LOOP_S = os.environ.get("PD_SERVE_CONTROL_LOOP_S", "0.5")  # Serve's controller loop period (Ray: 0.1)


@dataclass
class Cluster:
    cfg: DeployConfig
    model_dir: Path
    coordinator: "CoordinatorClient"  # actors.clients.coordinator_client
    engines: dict[str, EngineClient] = field(default_factory=dict)  # engine id -> client (pools: as of the last refresh)
    timings: dict[str, float] = field(default_factory=dict)
    url: str | None = None
    pool_apps: list[str] = field(default_factory=list)  # Serve applications of the pools ("serve" mode)
    frontends: list[Any] = field(default_factory=list)  # the HTTP front ends' actors, by replica index (start_http)
    frontend_nodes: list[str] = field(default_factory=list)  # the Ray node id of each front end, by replica index
    urls: list[str] = field(default_factory=list)  # each node's front-end URL (http.location every_node: several)

    def refresh_engines(self) -> dict[str, EngineClient]:
        """The engines registered with the coordinator now (pools grow and shrink): {engine id: client}."""
        import ray

        from actors.clients.engine_client import EngineClient

        found = {}
        for engine_id in ray.get(self.coordinator.describe())["engines"]:
            try:
                found[engine_id] = EngineClient.named(engine_id, self.cfg.coordinator.namespace)
            except ValueError:  # left between the two calls
                pass
        self.engines = found
        return found


def start_cluster(cfg: DeployConfig, progress: Callable[[str], None] = say, *, pools: str = "serve") -> Cluster:
    """Coordinator and engines, started and registered (Ray must be initialised).

    pools="serve" (what `cluster.cli.launch` runs): each pool is a Ray Serve deployment whose replicas own one engine
    each, sized between min_replicas and max_replicas by the pool's autoscaling policy; Serve also replaces a replica
    whose engine died. Serve runs without its HTTP proxy: the front end (`start_http`) serves HTTP.
    pools="actors": min_replicas engines per pool as plain actors owned by the caller: fixed size, nothing replaces
    a dead engine (tests that kill engines on purpose use it).
    Raises with everything stopped when an engine fails to start or is refused by the coordinator."""
    if pools not in ("serve", "actors"):
        raise ValueError(f"pools must be 'serve' or 'actors', got {pools!r}")
    return (_start_pools if pools == "serve" else _start_actors)(cfg, progress)


def _start_coordinator(cfg: DeployConfig, progress: Callable[[str], None]) -> Cluster:
    from actors.control.coordinator import start_coordinator
    from cluster.cli.real_model import builtin_model

    check_chat(cfg)  # refused before anything starts
    model_dir = Path(cfg.model.path).resolve() if cfg.model.path else builtin_model(cfg.model.builtin)
    progress(f"model {cfg.model.name}: {model_dir}")
    caching = {role: prefix_caching(cfg, role, model_dir) for role in ("prefill", "decode")}  # refused before a start
    progress("prefix caching: " + ", ".join(f"{role} {'on' if on else 'off'}" for role, on in caching.items()))
    # restarted by Ray if it dies; it then rebuilds its registry from the live engines (named, same namespace).
    # It prefers the launcher's node (with the HTTP front end: on a multi-node cluster, not on a node that a pool
    # grows onto and loses), and restarts elsewhere if that node is gone.
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    coordinator = start_coordinator(name=cfg.coordinator.name, namespace=cfg.coordinator.namespace,
                                          get_if_exists=True, max_restarts=-1, scheduling_strategy=here)
    return Cluster(cfg, model_dir, coordinator)


def engine_spec(cfg: DeployConfig, role: str, model_dir: str | Path):
    """How every engine of pool `role` starts under `cfg` (the one place the deploy config becomes engine options)."""
    from actors.engine.actor import EngineSpec

    return EngineSpec(
        role=role, model_dir=str(model_dir), tp=getattr(cfg, role).tp, served_model=cfg.model.name,
        max_model_len=cfg.model.max_model_len, dtype=cfg.model.dtype, device=cfg.device,
        start_timeout_s=cfg.coordinator.engine_start_timeout_s, device_options=device_options(cfg, role, model_dir),
    )


def pool_spec(cluster: Cluster, role: str):
    """What each replica of a pool needs to start and register its engine."""
    from actors.control.pool import PoolSpec

    cfg = cluster.cfg
    pool = getattr(cfg, role)
    return PoolSpec(
        engine=engine_spec(cfg, role, cluster.model_dir), coordinator=cfg.coordinator.name,
        namespace=cfg.coordinator.namespace, drain_timeout_s=pool.scaling.drain_timeout_s,
        labels=dict(pool.placement.labels),  # the replicas run next to their engines
    )


def _start_pools(cfg: DeployConfig, progress: Callable[[str], None]) -> Cluster:
    import concurrent.futures

    import ray
    from ray import serve

    from actors.control.pool import pool_app_name, pool_deployment

    t0 = time.monotonic()
    from actors.host.cores import free_cpus_per_node

    check_placement(cfg, ray.nodes())
    for note in check_cores(cfg, ray.nodes(), free_cpus_per_node()):
        progress(note)
    cluster = _start_coordinator(cfg, progress)
    # the pools take no HTTP: the front end (actors.frontend.server) serves it. Serve's controller wakes every 0.1 s by
    # default (5% of a core here, idle); every 0.5 s is ample for two pools scaled on seconds-long windows
    serve.start(proxy_location="Disabled", controller_options={
        "runtime_env": {"env_vars": {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": SERVE_CONTROL_LOOP_S}}})
    # Serve applications outlive a driver that was killed: pools of an earlier run would keep engines that this
    # run's coordinator does not know
    ours = {pool_app_name(cfg.coordinator.namespace, role) for role in ("prefill", "decode")}
    stale = sorted(ours & set(serve.status().applications))
    if stale:
        progress(f"removing the pools of an earlier run: {', '.join(stale)}")
        _stop_pools(cluster, progress, stale)
    # serve.run blocks until a pool's first engines are up: one thread per pool, so that both load at once and this
    # thread reports progress (and is free to stop everything on Ctrl-C)
    pool_exec = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pd-pool-deploy")
    try:
        running = {}
        for role in ("prefill", "decode"):
            pool = getattr(cfg, role)
            app = pool_app_name(cfg.coordinator.namespace, role)
            cluster.pool_apps.append(app)
            dep = pool_deployment(role, pool_spec(cluster, role), pool.min_replicas, pool.max_replicas,
                                  pool.scaling.model_dump())
            size = f"{pool.min_replicas}..{pool.max_replicas} (autoscaled)" if pool.autoscaling else str(pool.min_replicas)
            progress(f"starting the {role} pool: {size} engine(s) of TP {pool.tp} ...")
            running[pool_exec.submit(serve.run, dep, name=app, route_prefix=None)] = role
        pending = set(running)
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=10)
            for fut in done:
                fut.result()  # a pool that failed to deploy raises here
                progress(f"{running[fut]} pool up")
            if pending:
                engines = ray.get(cluster.coordinator.describe())["engines"]
                ready = ", ".join(sorted(engines)) or "none"
                doing = engine_phases(cfg.coordinator.namespace, skip=set(engines))
                progress(f"  starting engines ({time.monotonic() - t0:.0f} s): {doing or 'actors starting'}; "
                         f"registered so far: {ready}")
        cluster.refresh_engines()
        for info in ray.get(cluster.coordinator.pool_events())["joins"]:
            progress(f"{info['engine_id']} (TP {info['tp']}{_cores(info)}) joined in {info['total_s']:.0f} s "
                     f"({_phases(info, 0)})")
        pairs = ray.get(cluster.coordinator.describe())["pairs"]
        progress("negotiated pairs: " + ", ".join(f"{p['prefill']}->{p['decode']}" for p in pairs))
        cluster.timings["engines_s"] = cluster.timings["registered_s"] = time.monotonic() - t0
    except BaseException:
        _stop_pools(cluster, progress)
        cluster.coordinator.kill()
        raise
    finally:
        pool_exec.shutdown(wait=False, cancel_futures=True)
    return cluster


def engine_phases(namespace: str, *, skip: set[str] = frozenset(), only: set[str] | None = None) -> str:
    """What each starting engine of `namespace` is doing ("prefill-0 warming up (logprobs), decode-0 loading vLLM"),
    asked of the engines themselves; engines in `skip` (registered already) left out, only those in `only` if given."""
    import ray

    from actors.clients.engine_client import ENGINE_PREFIX, EngineClient

    ids = sorted(a["name"][len(ENGINE_PREFIX):] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == namespace and a["name"].startswith(ENGINE_PREFIX))
    ids = [e for e in ids if e not in skip and (only is None or e in only)]
    refs = {}
    for engine_id in ids:
        try:
            refs[engine_id] = EngineClient.named(engine_id, namespace).phase()
        except ValueError:  # gone meanwhile
            pass
    said = []
    for engine_id, ref in refs.items():
        try:
            said.append(f"{engine_id} {ray.get(ref, timeout=2)}")
        except Exception:  # noqa: BLE001 - an actor still starting answers nothing yet
            said.append(f"{engine_id} starting its actor")
    return ", ".join(said)


def _cores(join: dict[str, Any]) -> str:
    """", cores 0-1" for an engine that owns cores, "" for one that shares its node's."""
    from cluster.core.cores import format_cores

    return f", cores {format_cores(join['cores'])}" if join.get("cores") else ""


def _phases(join: dict[str, Any], digits: int) -> str:
    """A join's phase times: "actor start 1 s, engine load 39 s, registration 0 s"."""
    return ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.{digits}f} s" for k, v in join["phases"].items())


def _start_actors(cfg: DeployConfig, progress: Callable[[str], None]) -> Cluster:
    import ray

    from actors.engine.actor import stop_engine_actors

    t0 = time.monotonic()
    from actors.host.cores import free_cpus_per_node

    check_placement(cfg, ray.nodes())
    for note in check_cores(cfg, ray.nodes(), free_cpus_per_node()):
        progress(note)
    cluster = _start_coordinator(cfg, progress)
    coordinator = cluster.coordinator


    launched = []
    try:
        for role, pool in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            spec = engine_spec(cfg, role, cluster.model_dir)
            for i in range(pool.min_replicas):
                engine_id = f"{role}-{i}"
                engine, ref = spec.launch(engine_id, cfg.coordinator.namespace)
                cluster.engines[engine_id] = engine
                launched.append((engine_id, pool.tp, ref))
                progress(f"starting {role} engine {engine_id} (TP {pool.tp}) ...")
        pending = {ref: (engine_id, tp) for engine_id, tp, ref in launched}
        while pending:
            done, _ = ray.wait(list(pending), timeout=10)
            for ref in done:
                engine_id, tp = pending.pop(ref)
                took = ray.get(ref)
                cores = ray.get(cluster.engines[engine_id].cores())
                warm = ray.get(cluster.engines[engine_id].start_report())["warm_up_s"] or 0.0
                progress(f"{engine_id} (TP {tp}{_cores({'cores': cores})}) started in {took:.0f} s "
                         f"(vLLM {took - warm:.0f} s, warm-up {warm:.0f} s)")
            if pending and not done:
                loading = {e for e, _ in pending.values()}
                doing = engine_phases(cfg.coordinator.namespace, only=loading) or ", ".join(sorted(loading))
                progress(f"  still starting ({time.monotonic() - t0:.0f} s): {doing}")
        cluster.timings["engines_s"] = time.monotonic() - t0
        for engine_id in sorted(cluster.engines, key=lambda e: not e.startswith("prefill")):
            result = ray.get(cluster.engines[engine_id].register(coordinator))
            pairs = ", ".join(f"{p}->{d}" for p, d in result["pairs"]) or "none yet"
            progress(f"registered {engine_id}; negotiated pairs: {pairs}")
        cluster.timings["registered_s"] = time.monotonic() - t0
    except BaseException:
        stop_engine_actors(list(cluster.engines.values()))
        coordinator.kill()
        raise
    return cluster


def engine_launch(cfg: DeployConfig, role: str, model_dir: str, engine_id: str) -> dict[str, Any]:
    """What an engine of pool `role` is started with under `cfg` - its environment, GPUs and vLLM engine arguments -
    as the pools and `_start_actors` start it (for checks and `plan`-style inspection; starts nothing)."""
    from actors.engine.settings import launch_env, vllm_engine_args

    spec = engine_spec(cfg, role, model_dir)
    opts = spec.device_options
    return {
        "env": launch_env(spec.tp, opts.get("extra_env"), role, spec.device, opts.get("engine_kwargs"),
                          opts.get("own_cores", 0)),
        "num_gpus": opts.get("num_gpus", 0),
        "own_cores": opts.get("own_cores", 0),
        "reserve_cores": opts.get("reserve_cores", False),
        "borrow_cores": opts.get("borrow_cores", False),
        "label_selector": opts.get("label_selector", {}),
        "resources": opts.get("resources", {}),
        "vllm_args": vllm_engine_args(spec.model_dir, spec.tp, max_model_len=spec.max_model_len, dtype=spec.dtype,
                                      engine_kwargs=opts.get("engine_kwargs"), role=role, engine_id=engine_id,
                                      device=spec.device),
    }


def serve(cfg: DeployConfig, progress: Callable[[str], None] = say, *, pools: str = "serve",
          shutdown_serve: bool = True) -> Cluster:
    """One validated deploy config in, the running service out (the shape of Ray Serve LLM's app builders): the
    coordinator, both pools (`start_cluster`; `pools` as there) and the HTTP front end (`start_http`); the returned
    `Cluster` has its `url`. If a part fails to start, what did start is stopped (with Serve itself when
    `shutdown_serve`, as in `stop_cluster`) before the error is raised. End it with `stop_cluster`."""
    cluster = start_cluster(cfg, progress, pools=pools)
    try:
        start_http(cluster, progress)
    except BaseException:
        stop_cluster(cluster, shutdown_serve=shutdown_serve, progress=progress)
        raise
    return cluster


def _stop_pools(cluster: Cluster, progress: Callable[[str], None], apps: list[str] | None = None) -> None:
    """Delete the pools' Serve applications (both at once): every replica drains its engine, deregisters and stops
    it (each checks that none of its engine's processes survives)."""
    import concurrent.futures

    from ray import serve

    def delete(app: str) -> None:
        try:
            serve.delete(app)
        except Exception as e:  # noqa: BLE001 - keep shutting the rest down
            progress(f"could not remove {app}: {e}")

    apps = cluster.pool_apps if apps is None else apps
    with concurrent.futures.ThreadPoolExecutor(max(1, len(apps))) as pool:
        list(pool.map(delete, apps))


def stop_cluster(cluster: Cluster, *, shutdown_serve: bool = False, progress: Callable[[str], None] = say) -> None:
    """Stop the HTTP front end, the engines (checking no process survives) and the coordinator."""
    import ray
    from ray import serve

    from actors.engine.actor import stop_engine_actors
    from actors.engine.procs import sweep_nodes

    stop_frontends(cluster, progress)
    try:  # an engine that died just before the stop: its files go now, not with the coordinator's clean-up
        ray.get(cluster.coordinator.clean_up_dead(), timeout=120)
    except Exception as e:  # noqa: BLE001 - keep stopping
        progress(f"could not clean up after dead engines: {e}")
    progress("stopping engines ...")
    if cluster.pool_apps:
        _stop_pools(cluster, progress)
    else:
        stop_engine_actors(list(cluster.engines.values()))
    # what no engine's own stop could remove (an engine whose pool replica was killed, or that was still starting),
    # once every engine actor of the deployment is gone (a live actor's files are not touched)
    _wait_engines_gone(cluster.cfg.coordinator.namespace)
    swept = sweep_nodes()
    if swept:
        progress(f"removed what stopped engines left: {len(swept)} files and directories")
    if shutdown_serve:
        try:
            serve.shutdown()
        except Exception as e:  # noqa: BLE001
            progress(f"could not shut Serve down: {e}")
    cluster.coordinator.kill()


def _wait_engines_gone(namespace: str, timeout_s: float = 60.0) -> None:
    """Until no engine actor of `namespace` lives (Ray lists named actors until they are dead), at most `timeout_s`."""
    import ray

    from actors.clients.engine_client import ENGINE_PREFIX

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not any(a["namespace"] == namespace and a["name"].startswith(ENGINE_PREFIX)
                       for a in ray.util.list_named_actors(all_namespaces=True)):
                return
        except Exception:  # noqa: BLE001 - Ray itself going: nothing more to wait for
            return
        time.sleep(0.5)


def watch_pools(cluster: Cluster, stop: Any, progress: Callable[[str], None] = say, interval_s: float = 2.0) -> None:
    """Print each scaling decision (with its reason) and each engine joining or leaving, until `stop` is set."""
    import ray

    stamp = {"scaling": "time", "joins": "registered", "leaves": "started"}  # each event's wall time
    seen = {kind: time.time() for kind in stamp}  # print what happens from now on (by time: the lists are bounded)
    while not stop.wait(interval_s):
        try:
            events = ray.get(cluster.coordinator.pool_events(), timeout=10)
        except Exception:  # noqa: BLE001 - a restarting coordinator: try again next time
            continue
        for kind, items in events.items():
            fresh = [e for e in items if e[stamp[kind]] > seen[kind]]
            for e in fresh:
                if kind == "scaling":
                    progress(f"autoscaler: {e['role']} pool {e['before']} -> {e['after']} ({e['reason']})")
                elif kind == "joins":
                    progress(f"{e['engine_id']} (TP {e['tp']}{_cores(e)}) joined the {e['role']} pool in "
                             f"{e['total_s']:.1f} s ({_phases(e, 1)})")
                else:
                    progress(f"{e['engine_id']} left the {e['role']} pool (drained in {e['drain_s']:.1f} s)")
            seen[kind] = max([seen[kind], *(e[stamp[kind]] for e in fresh)])


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
    # once: a second Ctrl-C (or a SIGINT and a SIGTERM together) must not break off the clean-up the first started
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
    start_ray(cfg.coordinator.namespace, address)
    # after ray.init, which installs its own SIGTERM handler (a bare sys.exit)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    say(f"Ray: {'joined ' + address if address else 'local instance'}")
    cluster = None
    try:
        # `serve`'s two steps by hand: once the cluster exists, its clean-up below runs with the signals ignored
        cluster = start_cluster(cfg)
        start_http(cluster)
        check = self_check(cluster, api_key)
        say(f"self-check: 16 tokens streamed, first after {check['ttft_ms']:.0f} ms, all after {check['total_ms']:.0f} ms")
        say(f"ready in {time.monotonic() - t0:.0f} s: {cluster.url}/v1/completions  (model {cfg.model.name})")
        print(f"\n  {curl_line(cluster)}\n", flush=True)
        say("serving; Ctrl-C (or `ray job stop`) shuts everything down")
        stop_watch = threading.Event()
        threading.Thread(target=watch_pools, args=(cluster, stop_watch), daemon=True).start()
        threading.Thread(target=watch_frontends, args=(cluster, stop_watch), daemon=True).start()
        try:
            while True:
                time.sleep(3600)
        finally:
            stop_watch.set()
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
