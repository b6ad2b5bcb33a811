"""`python -m cluster bench faults`: one engine (or the coordinator) SIGKILLed under streaming load, per scenario:

  decode-of-two   two decode engines, one killed: its streams continue on the other pair (failover)
  only-decode     the only decode engine killed: the prefill engine serves requests whole (degraded mode)
  prefill-of-two  two prefill engines, one killed: requests retry on the other
  coordinator     the coordinator killed (Ray restarts it): the front end serves on the routes it last gave

Each scenario starts the deployment's cluster (pools as plain actors, so that nothing replaces the dead engine and
the figures show the failure handling alone), runs `--clients` streaming clients (`cluster.cli.bench.loadgen`: they honour
Retry-After) for `--warmup` seconds, kills the victim, keeps the load on for `--after` seconds, then reports:
every outcome class (failed = accepted and not completed + malformed + 4xx; 503s counted apart, and those after the
death was noticed), how long the coordinator took to notice (or, for the coordinator, its restart to answer), p50/p99
TTFT and ITL before the kill and in the fault window (first tokens and token gaps arriving from the kill until
10 s after it was noticed), blocks the survivors still hold once
the load is over (0 = none leaked), and the dead engine's /dev/shm files and TMPDIR still there after its
clean-up. Results: results/bench_faults.json and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from cluster.cli.local_ray import start_ray

SCENARIOS = {  # name: (what is killed, prefill engines, decode engines)
    "decode-of-two": ("decode-0", 1, 2),
    "only-decode": ("decode-0", 1, 1),
    "prefill-of-two": ("prefill-0", 2, 1),
    "coordinator": ("coordinator", 1, 1),
}
FAULT_WINDOW_AFTER_NOTICED_S = 10.0
NOTICE_TIMEOUT_S = 60.0


def say(msg: str) -> None:
    print(f"[bench faults {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--deploy", default="deploy.yaml", help="the deployment whose model, TPs and settings are used")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"from {', '.join(SCENARIOS)}")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--warmup", type=float, default=15.0, help="seconds of load before the kill")
    p.add_argument("--after", type=float, default=30.0, help="seconds of load after the kill")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--decode-tp", type=int, help="decode engines' TP size (default: the deployment's)")
    p.add_argument("--out-dir", default="results")


def kill_engine(engine: Any) -> list[Any]:
    """SIGKILL the engine actor's process (on this node); returns its vLLM processes, which exit by themselves (the
    caller waits for them, or kills stragglers). Also what tests/test_faults.py kills engines with."""
    import psutil
    import ray

    pids = ray.get(engine.pids(), timeout=30)
    children = [psutil.Process(p) for p in pids[1:] if psutil.pid_exists(p)]
    os.kill(pids[0], signal.SIGKILL)
    return children


def free_blocks(engines: dict[str, Any]) -> dict[str, int]:
    """Each engine's free KV/state block count ({engine id: client}; an engine that does not answer is left out)."""
    import ray

    out = {}
    for engine_id, engine in engines.items():
        try:
            out[engine_id] = ray.get(engine.free_blocks(), timeout=10)
        except Exception:  # noqa: BLE001 - the dead one
            pass
    return out


def blocks_held(engines: dict[str, Any], idle: dict[str, int],
                timeout_s: float) -> tuple[dict[str, int | None], float]:
    """Wait up to `timeout_s` until every engine of `idle` still in `engines` is back to its idle free block count
    (nothing held for requests that are over). Returns the blocks each still holds (None: it did not answer; all 0:
    nothing leaked) and the seconds it waited. Also what tests/test_faults.py checks after each fault."""
    t0 = time.monotonic()
    while True:
        survivors = [e for e in engines if e in idle]
        free = free_blocks({e: engines[e] for e in survivors})
        held = {e: idle[e] - free[e] if e in free else None for e in survivors}
        if all(n == 0 for n in held.values()) or time.monotonic() - t0 > timeout_s:
            return held, time.monotonic() - t0
        time.sleep(0.2)


def _noticed(cluster: Any, victim: str, t_kill: float, old_pid: int | None = None) -> float | None:
    """Seconds from the kill until the coordinator no longer lists the victim as ready (for the coordinator itself:
    until its restarted process - another pid than `old_pid` - answers with its registry rebuilt); None if not
    within NOTICE_TIMEOUT_S."""
    import ray

    role = victim.split("-")[0]
    while time.perf_counter() - t_kill < NOTICE_TIMEOUT_S:
        try:
            if victim == "coordinator":
                if ray.get(cluster.coordinator.pid(), timeout=2) != old_pid:
                    ray.get(cluster.coordinator.rebuilt_engines(), timeout=10)
                    return time.perf_counter() - t_kill
            elif victim not in ray.get(cluster.coordinator.ready(role), timeout=2):
                return time.perf_counter() - t_kill
        except Exception:  # noqa: BLE001 - a restarting coordinator
            pass
        time.sleep(0.05)
    return None


def run_scenario(name: str, base: Any, args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import psutil
    import ray

    from cluster.cli.launch import serve, stop_cluster
    from cluster.cli.bench.loadgen import LoadResult, run_load

    victim, n_prefill, n_decode = SCENARIOS[name]
    data = base.model_dump()
    data["prefill"].update(min_replicas=n_prefill, max_replicas=n_prefill)
    data["decode"].update(min_replicas=n_decode, max_replicas=n_decode, **({"tp": args.decode_tp} if args.decode_tp else {}))
    if n_prefill * data["prefill"]["tp"] + n_decode * data["decode"]["tp"] > len(os.sched_getaffinity(0)):
        # more ranks than cores (three engines on 2 cores): what is measured here is failover, not speed
        data["prefill"]["share_cores"] = data["decode"]["share_cores"] = True
    # a namespace per scenario: a SIGKILLed engine's actor name may stay taken for a while
    data["coordinator"].update(name=f"coordinator-faults-{name}", namespace=f"{base.coordinator.namespace}-faults-{name}")
    cfg = type(base).model_validate(data)
    say(f"{name}: prefill {n_prefill} x TP {cfg.prefill.tp}, decode {n_decode} x TP {cfg.decode.tp}; "
        f"{args.clients} clients, {victim} killed after {args.warmup:.0f} s")
    cluster = serve(cfg, progress=lambda m: say(f"  {m}"), pools="actors")
    url = cluster.url
    try:
        idle = free_blocks(cluster.engines)
        holder: dict[str, LoadResult] = {}
        load = threading.Thread(target=lambda: holder.setdefault("res", asyncio.run(run_load(
            url, cfg.model.name, args.clients, args.warmup + args.after, args.max_tokens, api_key=cfg.http.resolved_api_key()))))
        load.start()
        time.sleep(args.warmup)
        leftovers = None
        children: list[Any] = []
        old_pid = None
        if victim == "coordinator":
            old_pid = ray.get(cluster.coordinator.pid(), timeout=30)
            t_kill = time.perf_counter()
            os.kill(old_pid, signal.SIGKILL)  # Ray restarts it (max_restarts=-1)
        else:
            engine = cluster.engines[victim]
            leftovers = ray.get(engine.leftovers(), timeout=30)
            t_kill = time.perf_counter()
            children = kill_engine(engine)
        say(f"  {victim} killed")
        noticed = _noticed(cluster, victim, t_kill, old_pid)
        say(f"  noticed after {noticed:.2f} s" if noticed is not None else f"  not noticed in {NOTICE_TIMEOUT_S:.0f} s")
        load.join()
        res = holder["res"]
        if victim != "coordinator":
            cluster.engines.pop(victim)
        _, alive = psutil.wait_procs(children, timeout=30)
        stragglers = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        for p in stragglers:
            p.kill()
        # survivors return to their idle free block count once the load is over (nothing held for dead requests)
        held, _ = blocks_held(cluster.engines, idle, 30)
        left: list[str] = []
        if leftovers is not None:
            deadline = time.monotonic() + 30
            while True:
                left = [f for f in leftovers.shm + (leftovers.tmpdir,) if os.path.exists(f)]
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        stop_cluster(cluster, shutdown_serve=True, progress=lambda m: say(f"  {m}"))
    return summarize(name, victim, res, t_kill, noticed, held, left, len(stragglers), metrics, args)


def summarize(name: str, victim: str, res: Any, t_kill: float, noticed: float | None, held: dict[str, int | None],
              left: list[str], stragglers: int, metrics: str, args: argparse.Namespace) -> dict[str, Any]:
    """One scenario's row: outcomes, 503s after the death was noticed, latencies before and in the fault window."""
    from cluster.cli.bench.loadgen import percentile_ms
    from cluster.core.metrics import sample_value

    end = t_kill + (noticed if noticed is not None else NOTICE_TIMEOUT_S) + FAULT_WINDOW_AFTER_NOTICED_S
    t_noticed = t_kill + (noticed if noticed is not None else float("inf"))

    def window(values: list[float], at: list[float], lo: float, hi: float) -> list[float]:
        return [v for v, t in zip(values, at) if lo <= t < hi]

    first_token_at = [t + ttft for t, ttft in zip(res.ttft_at, res.ttft_s)]  # by when the first token came
    before_ttft, during_ttft = window(res.ttft_s, first_token_at, 0, t_kill), window(res.ttft_s, first_token_at, t_kill, end)
    before_itl, during_itl = window(res.itl_s, res.itl_at, 0, t_kill), window(res.itl_s, res.itl_at, t_kill, end)
    o = res.outcomes
    row = {
        "scenario": name, "killed": victim, "clients": args.clients, "requests": res.requests, "complete": o["complete"],
        # every request that neither completed nor was cleanly refused with a 503 (failed mid-stream, malformed, 4xx)
        "failed": o["failed_midstream"] + o["malformed"] + o["refused_4xx"],
        "lost": res.lost, "malformed": o["malformed"], "refused_4xx": o["refused_4xx"], "refused_503": o["refused_503"],
        "refused_503_after_noticed": sum(1 for s, _, k in res.timeline if k == "refused_503" and s >= t_noticed),
        "noticed_s": round(noticed, 2) if noticed is not None else None,
        "ttft_p50_ms_before": percentile_ms(before_ttft, 50), "ttft_p99_ms_before": percentile_ms(before_ttft, 99),
        "ttft_p50_ms_fault": percentile_ms(during_ttft, 50), "ttft_p99_ms_fault": percentile_ms(during_ttft, 99),
        "itl_p50_ms_before": percentile_ms(before_itl, 50), "itl_p99_ms_before": percentile_ms(before_itl, 99),
        "itl_p50_ms_fault": percentile_ms(during_itl, 50), "itl_p99_ms_fault": percentile_ms(during_itl, 99),
        # None: a surviving engine did not answer (not a pass)
        "blocks_held_after": None if None in held.values() else sum(held.values()), "shm_left": len(left), "stragglers_killed": stragglers,
        "first_errors": res.errors[:3],
    }
    for metric, key in (("pd_requests_failed_over_total", "failed_over"), ("pd_requests_retried_total", "retried"),
                        ('pd_requests_colocated_total{role="prefill"}', "colocated_on_prefill"),
                        ("pd_requests_on_last_routes_total", "on_last_routes")):
        value = sample_value(metrics, metric)
        row[key] = float(value) if value is not None else None
    return row


def main(args: argparse.Namespace) -> int:
    import ray

    from cluster.cli.bench.results import table, write_results
    from cluster.core.config import load_deploy

    base = load_deploy(args.deploy)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"error: unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
        return 2
    start_ray(base.coordinator.namespace)
    rows = []
    try:
        for name in names:
            rows.append(run_scenario(name, base, args))
            say(f"{name}: {rows[-1]}")
    finally:
        ray.shutdown()
    table(rows, ["scenario", "requests", "complete", "failed", "refused_503", "refused_503_after_noticed", "noticed_s",
                  "ttft_p99_ms_before", "ttft_p99_ms_fault", "itl_p99_ms_before", "itl_p99_ms_fault",
                  "blocks_held_after", "shm_left", "failed_over", "retried", "colocated_on_prefill", "on_last_routes"])
    write_results("faults", rows, Path(args.out_dir))
    return 0 if all(r["failed"] == 0 and r["blocks_held_after"] == 0 and r["shm_left"] == 0 for r in rows) else 1
