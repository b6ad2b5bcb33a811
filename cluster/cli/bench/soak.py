"""`python -m cluster bench soak`: the deployment's cluster under mixed streaming traffic for `--minutes`, with a fault
every `--fault-every` seconds, and a check at the end that nothing was lost or left behind.

The cluster is the deploy file's (`--deploy`), started as `cluster.cli.launch.serve` starts it - the pools as Ray Serve
deployments, so a killed engine is replaced by its pool - with `--frontends` HTTP front ends sharing the port
(`http.replicas`; 2 by default, so that one front end's death does not stop the service), in a namespace of its own.
`--clients` streaming clients (`cluster.cli.bench.loadgen`'s request and outcome classes; they honour Retry-After of
503s and 429s) send prompts of 16-1200 tokens asking for 4, 16, 64 or 192 tokens each (`ignore_eos`), one request after
another. Faults, from `--faults`, round-robin or at random (`--order`, `--seed`):

  kill-prefill      SIGKILL a prefill engine (its actor and vLLM's processes); its pool starts another
  kill-decode       the same for a decode engine
  stop-engine       SIGSTOP every process of an engine (prefill and decode by turns) for 20 s, then SIGCONT
  kill-coordinator  SIGKILL the coordinator's process; Ray restarts it and it rebuilds its registry
  kill-frontend     SIGKILL one HTTP front end (by turns); Ray restarts it, the others serve meanwhile
  burst             500 connections at once, each a small non-streamed completion: 200 / 429 / 503 / other
  n-too-large       one request with n=1000: a 400 naming the limit (`http.max_n`), reason n_over_limit

One progress line per fault (what was done), and one when what followed is over (the engine noticed dead and
replaced, the front end or coordinator serving again, the engine back or replaced after SIGCONT).

At the end (load over, faults' aftermath settled for up to `--settle` s): requests sent, completed, failed
(accepted and not completed + malformed + 4xx/5xx other than a clean 503 or a 429 - 0 expected; burst answers other
than 200/429/503 and a wrong n-too-large answer count too), 429s and 503s apart, and requests lost with a killed
front end apart: a request that ended in a transport error or a cut stream, and was in flight at a front-end kill
(started before it, ended at most `FRONTEND_LOSS_WINDOW_S` after it) or started at most that long after it - the
client cannot tell which front end a connection reached (they share the port), so this is by time window. Then
per-process resident memory (engines with vLLM's processes, front ends, the coordinator) at the start and the end;
/dev/shm files (`actors.engine.procs.SHM_PREFIXES`) at the start, at the end, owned by no live engine, and after the
cluster stopped; blocks each live engine still holds once the load is over, against its idle free block count
(an engine that joined during the soak is compared with its pool's idle count at the start: same model, TP and
cache size); the decode engines' NIXL agents of prefill engines that are gone; the faulted engines' processes,
/dev/shm files and TMPDIR still there. Exit status 1 when anything failed, was left behind or did not recover.
results/bench_soak.json.

Kept in one module past the usual size: `Soak` is one thing, a running soak's state (faults, their aftermath, the
requests), which `soak_cluster` drives; its bookkeeping is `cluster.cli.bench.soak_accounting`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from cluster.cli.bench.soak_accounting import (BURST_REQUESTS, BURST_TIMEOUT_S, FAULTS, FRONTEND_LOSS_WINDOW_S,
                                              N_TOO_LARGE, OUTPUT_TOKENS, POLL_S, PROMPT_TOKENS, RECOVERY_TIMEOUT_S,
                                              STOP_S, Request, burst_counts, check_n_too_large, fault_schedule,
                                              idle_baselines, orphans, parse_faults, problems, shm_files, shm_of, tally)
from cluster.cli.local_ray import start_ray



def say(msg: str) -> None:
    print(f"[bench soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--deploy", default="deploy.yaml", help="the deployment whose cluster is soaked")
    p.add_argument("--minutes", type=float, default=20.0, help="minutes of traffic")
    p.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults (the first after that long)")
    p.add_argument("--faults", type=parse_faults, default=list(FAULTS), help=f"from {', '.join(FAULTS)} (default all)")
    p.add_argument("--order", choices=("round-robin", "random"), default="round-robin")
    p.add_argument("--seed", type=int, default=0, help="for --order random, the victims and the traffic")
    p.add_argument("--frontends", type=int, default=2, help="HTTP front ends sharing the port (http.replicas)")
    p.add_argument("--clients", type=int, default=8, help="streaming clients")
    p.add_argument("--port", type=int, help="HTTP port (default: the deployment's)")
    p.add_argument("--settle", type=float, default=240.0,
                   help="seconds to wait after the load for faults' aftermath (engines replaced) before the checks")
    p.add_argument("--out-dir", default="results")



# ---- the traffic ---------------------------------------------------------------------------------------------------
async def traffic(url: str, model: str, clients: int, duration_s: float, requests: list[Request], *,
                  api_key: str | None = None, seed: int = 0, retry_after_s: float = 2.0) -> Any:
    """`clients` loops of streamed completions (`cluster.cli.bench.loadgen`'s request and classes), mixed prompt and
    output lengths, until `duration_s` is over; each request is appended to `requests`. Returns the loadgen result with
    every request's latencies."""
    from cluster.cli.bench.loadgen import run_load

    def answered(one: Any, wait: float | None) -> float | None:
        start, end, kind = one.timeline[0]
        reason = one.errors[0] if one.errors else None
        if kind == "refused_4xx" and reason and reason.startswith("refused_4xx: HTTP 429"):
            kind, wait = "refused_429", retry_after_s  # admission control said "not now" (loadgen counts it a 4xx)
        requests.append(Request(start, end, kind, reason))
        return wait

    return await run_load(url, model, clients, duration_s, max_tokens=tuple(OUTPUT_TOKENS),
                          prompt_tokens=tuple(PROMPT_TOKENS), api_key=api_key, seed=seed, on_answer=answered)


async def burst(url: str, model: str, n: int = BURST_REQUESTS, api_key: str | None = None,
                timeout_s: float = BURST_TIMEOUT_S) -> tuple[list[int | str], float]:
    """`n` small non-streamed completions on `n` connections opened at once: each answer's HTTP status (a 200 whose
    body is not a whole completion is "malformed"; a transport error its name), and the seconds it all took."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    body = {"model": model, "prompt": [1, 5, 9, 13, 17, 21, 25, 29], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}

    async def one(client: httpx.AsyncClient) -> int | str:
        try:
            r = await client.post(f"{url}/v1/completions", json=body)
        except Exception as e:  # noqa: BLE001 - a transport failure of one request
            return type(e).__name__
        if r.status_code == 200:
            try:
                ok = r.json()["usage"]["completion_tokens"] == body["max_tokens"] and len(r.json()["choices"]) == 1
            except (ValueError, KeyError, TypeError):
                ok = False
            return 200 if ok else "malformed"
        if r.status_code in (429, 503) and "retry-after" not in r.headers:
            return f"{r.status_code} without Retry-After"
        return r.status_code

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, headers=headers) as client:
        answers = await asyncio.gather(*(one(client) for _ in range(n)))
    return list(answers), time.perf_counter() - t0



def _rss(pids: list[int]) -> int | None:
    import psutil

    total, found = 0, False
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
            found = True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total if found else None


class Skipped(Exception):
    """A fault that finds nothing to fault now (its pool's only engine is still being replaced)."""


@dataclass
class Fault:
    """One fault of the soak and what followed it."""

    index: int
    kind: str
    at_s: float  # after the load started
    target: str = ""
    done: str = ""
    followed: str = ""
    awaits: str = ""  # what its aftermath waits for (empty: nothing)
    recovered_s: float | None = None  # from the fault until its aftermath was over
    problem: str | None = None
    t: float = 0.0  # time.perf_counter() of the fault
    check: Callable[[], str | None] | None = field(default=None, repr=False)  # the aftermath: a message once over

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("check", "t")}


class Soak:
    """The faults, their aftermath and the bookkeeping around one running cluster (`soak_cluster` drives it)."""

    def __init__(self, cluster: Any, args: argparse.Namespace, t0: float, progress: Callable[[str], None] = say):
        import ray

        self.ray = ray
        self.cluster, self.args, self.t0, self.progress = cluster, args, t0, progress
        self.cfg = cluster.cfg
        self.rng = random.Random(args.seed + 1)
        self.faults: list[Fault] = []
        self.frontend_kills: list[float] = []
        self.stop = threading.Event()  # ends the watch
        self.no_more_faults = threading.Event()  # the load is over: a fault still due is not done
        self.lock = threading.Lock()
        self.turn = {"stop-engine": 0, "kill-frontend": 0}
        self.faulted: dict[str, Any] = {}  # engine id -> its Leftovers, taken before the fault
        self.faulted_shm: dict[str, set[str]] = {}  # engine id -> the /dev/shm files its processes held then
        self.agent_names: dict[str, dict[str, list[str]]] = {}  # gone prefill id -> {decode id: its agents there}
        self.seen_prefills: set[str] = set()
        self.stopped: set[int] = set()  # pids SIGSTOPped and not yet SIGCONTed
        self.seen_idle: dict[str, int] = {}
        self.known: set[str] | None = None  # the engines registered at the last look
        self.burst_rows: list[dict[str, Any]] = []
        self.requests: list[Request] = []

    # -- the cluster now
    def engines(self) -> dict[str, Any]:
        with self.lock:
            found = self.cluster.refresh_engines()
        self.seen_prefills |= {e for e in found if e.startswith("prefill")}
        return found

    def ready(self, role: str) -> list[str]:
        return self.ray.get(self.cluster.coordinator.ready(role), timeout=5)

    def processes(self) -> dict[str, list[int]]:
        """Process label -> its pids: every engine (actor and vLLM's processes), front end and the coordinator."""
        ray = self.ray
        out: dict[str, list[int]] = {}
        for engine_id, engine in sorted(self.engines().items()):
            with contextlib.suppress(Exception):
                out[f"engine {engine_id}"] = ray.get(engine.pids(), timeout=10)
        for i, frontend in enumerate(self.cluster.frontends):
            with contextlib.suppress(Exception):
                out[f"frontend {i}"] = [ray.get(frontend.info.remote(), timeout=10)["pid"]]
        with contextlib.suppress(Exception):
            out["coordinator"] = [ray.get(self.cluster.coordinator.pid(), timeout=10)]
        return out

    def rss_mib(self) -> dict[str, float | None]:
        return {label: (round(r / 2**20, 1) if (r := _rss(pids)) is not None else None)
                for label, pids in self.processes().items()}

    def nixl_agents(self, prefills: list[str]) -> dict[str, dict[str, list[str]]]:
        """prefill id -> {decode id: names of that prefill engine's NIXL agents the decode engine has loaded}."""
        out: dict[str, dict[str, list[str]]] = {}
        for decode_id, decode in self.engines().items():
            if not decode_id.startswith("decode"):
                continue
            for prefill_id in prefills:
                try:
                    ranks = self.ray.get(decode.remote_agents(prefill_id), timeout=10)
                except Exception:  # noqa: BLE001 - a dead or stopped decode engine
                    continue
                names = [name for rank in ranks for name in rank]
                if names:
                    out.setdefault(prefill_id, {})[decode_id] = names
        return out

    def sample_idle(self) -> None:
        """An engine that joined during the soak: its free block count whenever it holds nothing (its baseline); and
        a progress line for each engine that joined or left the coordinator's registry since the last look."""
        engines = self.engines()
        if self.known is not None:
            for engine_id in sorted(set(engines) - self.known):
                self.progress(f"  +{self.rel():.0f} s {engine_id} registered")
            for engine_id in sorted(self.known - set(engines)):
                self.progress(f"  +{self.rel():.0f} s {engine_id} left the registry")
        self.known = set(engines)
        for engine_id, engine in engines.items():
            try:
                if self.ray.get(engine.busy(), timeout=5).idle:
                    free = self.ray.get(engine.free_blocks(), timeout=5)
                    self.seen_idle[engine_id] = max(self.seen_idle.get(engine_id, 0), free)
            except Exception:  # noqa: BLE001 - joining, dead or stopped
                pass

    def rel(self, t: float | None = None) -> float:
        return (time.perf_counter() if t is None else t) - self.t0

    # -- the faults
    def run_faults(self, schedule: list[tuple[float, str]]) -> None:
        for i, (at, kind) in enumerate(schedule, 1):
            if self.no_more_faults.wait(max(0.0, self.t0 + at - time.perf_counter())):
                return
            f = Fault(i, kind, round(self.rel(), 1))
            f.t = time.perf_counter()
            try:
                getattr(self, "_" + kind.replace("-", "_"))(f)
            except Skipped as e:  # e.g. the pool's engine is still being replaced: noted, not a failure
                f.done = f"skipped: {e}"
            except Exception as e:  # noqa: BLE001 - a fault that could not be done is reported, the soak goes on
                f.problem = f"could not be done: {type(e).__name__}: {e}"
            with self.lock:
                self.faults.append(f)
            sent = len(self.requests)
            done = sum(r.outcome == "complete" for r in self.requests)
            self.progress(f"+{f.at_s:.0f} s fault {i}/{len(schedule)} {kind}: {f.target} {f.done or f.problem} "
                          f"(traffic so far: {sent} sent, {done} completed)")

    def watch(self) -> None:
        """Until stopped: each pending fault's aftermath checked, and idle counts of new engines sampled. A look
        that fails (the coordinator restarting: one of the faults) is tried again at the next poll - the watch must
        outlive every fault it watches."""
        last_sample = 0.0
        failing: str | None = None
        while not self.stop.wait(POLL_S):
            try:
                self.check_pending()
                if time.monotonic() - last_sample > 5:
                    self.sample_idle()
                    last_sample = time.monotonic()
                failing = None
            except Exception as e:  # noqa: BLE001 - said once per spell, then looked at again
                if failing is None:
                    self.progress(f"  +{self.rel():.0f} s the watch could not look ({type(e).__name__}: {e}); "
                                  "looking again")
                failing = type(e).__name__

    def short_pools(self) -> list[str]:
        """Pools with fewer ready engines than their min_replicas now: "prefill 0 of 1"."""
        out = []
        for role in ("prefill", "decode"):
            try:
                n = len(self.ready(role))
            except Exception:  # noqa: BLE001 - a restarting coordinator
                n = 0
            if n < getattr(self.cfg, role).min_replicas:
                out.append(f"{role} {n} of {getattr(self.cfg, role).min_replicas}")
        return out

    def pending(self) -> list[Fault]:
        with self.lock:
            return [f for f in self.faults if f.check is not None]

    def check_pending(self) -> None:
        for f in self.pending():
            try:
                msg = f.check()
            except Exception:  # noqa: BLE001 - asked while a part restarts
                msg = None
            if msg is not None:
                f.recovered_s = round(time.perf_counter() - f.t, 1)
                f.followed, f.check = msg, None
                self.progress(f"  fault {f.index} {f.kind} {f.target}: {msg}")
            elif time.perf_counter() - f.t > RECOVERY_TIMEOUT_S:
                f.followed, f.check = f"{f.awaits} not seen in {RECOVERY_TIMEOUT_S:.0f} s", None
                self.progress(f"  fault {f.index} {f.kind} {f.target}: {f.followed}")

    def _victim(self, role: str | None) -> tuple[str, Any]:
        engines = self.engines()
        ready = set(self.ready("prefill")) | set(self.ready("decode"))
        pick = sorted(e for e in engines if (role is None or e.startswith(role)) and e in ready)
        if not pick:
            raise Skipped(f"no ready {role or ''} engine to fault".replace("  ", " "))
        return pick[0] if role is None else self.rng.choice(pick), engines

    def _before_engine_fault(self, engine_id: str, engine: Any) -> None:
        self.faulted[engine_id] = self.ray.get(engine.leftovers(), timeout=30)
        self.faulted_shm[engine_id] = shm_of(self.ray.get(engine.pids(), timeout=30))
        if engine_id.startswith("prefill"):
            self.agent_names[engine_id] = self.nixl_agents([engine_id]).get(engine_id, {})

    def _engine_aftermath(self, f: Fault, engine_id: str, before: set[str], resumed: Callable[[], bool] | None = None
                          ) -> Callable[[], str | None]:
        """The aftermath of a fault on `engine_id`: noticed (it left the ready engines), then a new engine of its pool
        ready (or, `resumed`, it is ready again itself)."""
        role = engine_id.rsplit("-", 1)[0]
        state: dict[str, float] = {}

        def check() -> str | None:
            ready = self.ready(role)
            if engine_id not in ready and "noticed" not in state:
                state["noticed"] = time.perf_counter() - f.t
            noticed = (f"noticed after {state['noticed']:.1f} s, " if "noticed" in state else "never left the ready "
                       "engines, ")
            fresh = sorted(set(ready) - before - {engine_id})
            if resumed is None and "noticed" in state:  # a killed engine never comes back: its id may (pools reuse it)
                fresh = sorted(set(ready) - (before - {engine_id}))
            if fresh and len(ready) >= len(before):
                return f"{noticed}replaced by {fresh[0]} after {time.perf_counter() - f.t:.1f} s"
            if resumed is not None and resumed() and engine_id in ready:
                return f"{noticed}serving again after {time.perf_counter() - f.t:.1f} s"
            return None
        return check

    def _kill_engine(self, f: Fault, role: str) -> None:
        from cluster.cli.bench.faults import kill_engine

        engine_id, engines = self._victim(role)
        before = set(self.ready(role))
        self._before_engine_fault(engine_id, engines[engine_id])
        f.t = time.perf_counter()
        kill_engine(engines[engine_id])
        f.target, f.done, f.awaits = engine_id, "SIGKILLed", "its replacement"
        f.check = self._engine_aftermath(f, engine_id, before)

    def _kill_prefill(self, f: Fault) -> None:
        self._kill_engine(f, "prefill")

    def _kill_decode(self, f: Fault) -> None:
        self._kill_engine(f, "decode")

    def _stop_engine(self, f: Fault) -> None:
        role = ("prefill", "decode")[self.turn["stop-engine"] % 2]
        self.turn["stop-engine"] += 1
        engine_id, engines = self._victim(role)
        before = set(self.ready(role))
        pids = self.ray.get(engines[engine_id].pids(), timeout=30)
        self._before_engine_fault(engine_id, engines[engine_id])
        f.t = time.perf_counter()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                self.stopped.add(pid)
        cont_at = f.t + STOP_S

        def cont() -> None:
            for pid in pids:
                self.stopped.discard(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

        timer = threading.Timer(STOP_S, cont)
        timer.daemon = True
        timer.start()
        f.target, f.done = engine_id, f"{len(pids)} processes SIGSTOPped for {STOP_S:.0f} s"
        f.awaits = "the engine serving again or replaced"
        f.check = self._engine_aftermath(f, engine_id, before, resumed=lambda: time.perf_counter() >= cont_at)

    def _kill_coordinator(self, f: Fault) -> None:
        ray = self.ray
        coordinator = self.cluster.coordinator
        old = ray.get(coordinator.pid(), timeout=30)
        f.t = time.perf_counter()
        os.kill(old, signal.SIGKILL)
        f.target, f.done, f.awaits = f"coordinator (pid {old})", "SIGKILLed", "the restarted coordinator answering"

        def check() -> str | None:
            pid = ray.get(coordinator.pid(), timeout=2)
            if pid == old:
                return None
            rebuilt = ray.get(coordinator.rebuilt_engines(), timeout=10)
            return (f"restarted (pid {pid}), registry rebuilt with {len(rebuilt)} engine(s), after "
                    f"{time.perf_counter() - f.t:.1f} s")
        f.check = check

    def _kill_frontend(self, f: Fault) -> None:
        import httpx

        ray = self.ray
        replica = self.turn["kill-frontend"] % len(self.cluster.frontends)
        self.turn["kill-frontend"] += 1
        frontend = self.cluster.frontends[replica]
        info = ray.get(frontend.info.remote(), timeout=30)
        f.t = time.perf_counter()
        os.kill(info["pid"], signal.SIGKILL)
        self.frontend_kills.append(f.t)
        f.target = f"frontend {replica} (pid {info['pid']})"
        f.awaits = "the restarted front end serving"
        answered = None
        while time.perf_counter() - f.t < 30:  # the service itself: the other front ends answer
            try:
                if httpx.get(f"{self.cluster.url}/health", timeout=2).status_code == 200:
                    answered = time.perf_counter() - f.t
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        f.done = "SIGKILLed; " + (f"the service answered /health after {answered:.2f} s" if answered is not None
                                   else "the service did not answer /health for 30 s")
        if answered is None:
            f.problem = "the service did not answer /health for 30 s after a front end died"

        def check() -> str | None:
            now = ray.get(frontend.info.remote(), timeout=2)
            if now["pid"] == info["pid"] or not now["serving"]:
                return None
            return (f"restarted (restart {now['restarts']}, pid {now['pid']}), serving again after "
                    f"{time.perf_counter() - f.t:.1f} s")
        f.check = check

    def _burst(self, f: Fault) -> None:
        answers, took = asyncio.run(burst(self.cluster.url, self.cfg.model.name, BURST_REQUESTS,
                                          self.cfg.http.resolved_api_key()))
        counts = burst_counts(answers)
        others = sorted({str(a) for a in answers if a not in (200, 429, 503)})
        self.burst_rows.append({"fault": f.index, **counts, "seconds": round(took, 1), "other_answers": others})
        f.target = f"{BURST_REQUESTS} connections"
        f.done = (f"in {took:.1f} s: 200 x {counts['200']}, 429 x {counts['429']}, 503 x {counts['503']}, other x "
                  f"{counts['other']}" + (f" ({', '.join(others[:5])})" if others else ""))
        if counts["other"]:
            f.problem = f"{counts['other']} answer(s) other than 200/429/503: {', '.join(others[:5])}"

    def _n_too_large(self, f: Fault) -> None:
        import httpx

        key = self.cfg.http.resolved_api_key()
        r = httpx.post(f"{self.cluster.url}/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {key}"} if key else {},
                       json={"model": self.cfg.model.name, "prompt": "one too many", "max_tokens": 1, "n": N_TOO_LARGE})
        try:
            body = r.json()
        except ValueError:
            body = r.text
        f.target = f"n={N_TOO_LARGE}"
        wrong = check_n_too_large(r.status_code, body, self.cfg.http.max_n)
        f.done = f"HTTP {r.status_code}: {body['error'].get('message') if not wrong else wrong}"
        f.problem = wrong

    def resume_stopped(self) -> None:
        for pid in list(self.stopped):
            self.stopped.discard(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def soak_config(base: Any, frontends: int, port: int | None = None) -> Any:
    """The deployment as soaked: `frontends` HTTP front ends (http.replicas), `port` if given, and a coordinator and
    namespace of its own (`<namespace>-soak`: a SIGKILLed engine's actor name may stay taken a while)."""
    data = base.model_dump()
    data["http"]["replicas"] = frontends
    if port is not None:
        data["http"]["port"] = port
    data["coordinator"].update(name=f"{base.coordinator.name}-soak", namespace=f"{base.coordinator.namespace}-soak")
    return type(base).model_validate(data)


def run_soak(cfg: Any, args: argparse.Namespace, progress: Callable[[str], None] = say) -> dict[str, Any]:
    """Start `cfg`'s cluster (Ray must be initialised), soak it as `args` says, stop it; the report."""
    from cluster.cli.launch import serve

    fault_schedule(args.faults, args.fault_every, args.minutes * 60, args.order, args.seed)  # refused before starting
    shm_before = shm_files()
    progress(f"{cfg.prefill.min_replicas}..{cfg.prefill.max_replicas} prefill x TP {cfg.prefill.tp}, "
             f"{cfg.decode.min_replicas}..{cfg.decode.max_replicas} decode x TP {cfg.decode.tp}, "
             f"{cfg.http.replicas} front ends")
    t_start = time.perf_counter()
    cluster = serve(cfg, progress=lambda m: progress(f"  {m}"), pools="serve")
    progress(f"cluster up in {time.perf_counter() - t_start:.0f} s at {cluster.url}")
    return soak_cluster(cluster, args, shm_before, progress)


def soak_cluster(cluster: Any, args: argparse.Namespace, shm_before: set[str],
                 progress: Callable[[str], None] = say) -> dict[str, Any]:
    """Soak a running cluster (its pools Serve's, so that a killed engine is replaced) as `args` says, then stop it;
    the report. `shm_before`: the engine files in /dev/shm before the cluster started (those after its stop that
    were not there then are reported)."""
    from actors.engine.procs import still_running
    from cluster.cli.bench.faults import blocks_held, free_blocks
    from cluster.cli.launch import stop_cluster
    from cluster.cli.bench.loadgen import percentile_ms

    cfg = cluster.cfg
    duration = args.minutes * 60
    soak = None
    threads: list[threading.Thread] = []
    try:  # whatever happens from here on, the cluster is stopped (the finally below)
        schedule = fault_schedule(args.faults, args.fault_every, duration, args.order, args.seed)
        progress(f"{args.clients} clients for {args.minutes:g} min, {len(schedule)} faults ({args.order}): "
                 f"{', '.join(k for _, k in schedule)}")
        soak = Soak(cluster, args, time.perf_counter(), progress)
        engines = soak.engines()
        idle = free_blocks(engines)
        start = {"engines": sorted(engines), "rss_mib": soak.rss_mib(), "shm": sorted(shm_files()),
                 "idle_free_blocks": idle}
        soak.t0 = time.perf_counter()
        threads = [threading.Thread(target=soak.run_faults, args=(schedule,), daemon=True, name="soak-faults"),
                   threading.Thread(target=soak.watch, daemon=True, name="soak-watch")]
        for t in threads:
            t.start()
        res = asyncio.run(traffic(cluster.url, cfg.model.name, args.clients, duration, soak.requests,
                                  api_key=cfg.http.resolved_api_key(), seed=args.seed,
                                  retry_after_s=cfg.http.retry_after_s))
        progress(f"load over after {soak.rel():.0f} s: {len(soak.requests)} requests; settling (up to {args.settle:.0f} s)")
        soak.no_more_faults.set()
        threads[0].join(BURST_TIMEOUT_S)  # a fault in progress (a burst) finishes
        soak.stop.set()
        threads[1].join(10)
        soak.resume_stopped()
        deadline = time.perf_counter() + args.settle
        while (soak.pending() or soak.short_pools()) and time.perf_counter() < deadline:
            soak.check_pending()
            time.sleep(POLL_S)
        short = soak.short_pools()  # each pool back to its min_replicas ready engines
        for f in soak.pending():
            f.followed, f.check = f"{f.awaits} not seen by the end of the settle time", None
            progress(f"  fault {f.index} {f.kind} {f.target}: {f.followed}")
        # what is left: blocks held by live engines, files and processes of faulted engines, unowned /dev/shm, NIXL
        soak.sample_idle()
        live = soak.engines()
        baselines = idle_baselines(idle, sorted(live), soak.seen_idle)
        held, _ = blocks_held(live, baselines, 60)
        owned: set[str] = set()
        for engine in live.values():
            with contextlib.suppress(Exception):
                owned |= set(soak.ray.get(engine.leftovers(), timeout=30).shm)
        gone = {e: lo for e, lo in soak.faulted.items() if e not in live}
        waited = time.monotonic() + 30
        while True:
            files = sorted({p for e, lo in gone.items() for p in (*lo.shm, lo.tmpdir, *soak.faulted_shm.get(e, ()))
                            if os.path.exists(p)})
            alive = [p.pid for lo in gone.values() for p in still_running(lo.procs)]
            if not (files or alive) or time.monotonic() > waited:
                break
            time.sleep(0.5)
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shm_end = shm_files()
        unowned = orphans(shm_end - owned - shm_before)
        gone_prefills = sorted(p for p in soak.seen_prefills if p not in live)
        still = soak.nixl_agents(gone_prefills)
        known = 0
        for prefill_id, per_decode in soak.agent_names.items():
            if prefill_id in live:
                continue
            for decode_id, names in per_decode.items():
                with contextlib.suppress(Exception):
                    known += sum(sum(r) for r in soak.ray.get(live[decode_id].nixl_knows(names), timeout=10))
        live_prefills = sorted(p for p in live if p.startswith("prefill"))
        end = {"engines": sorted(live), "rss_mib": soak.rss_mib(), "shm": sorted(shm_end),
               "nixl_agents_loaded": sum(len(n) for d in soak.nixl_agents(live_prefills).values() for n in d.values())}
        left = {"pools_short": short, "blocks_held": held, "idle_baselines": baselines,
                "shm_unowned": unowned, "shm_new_held": len(shm_end - shm_before - set(unowned)),
                "faulted_engine_files": files, "stragglers": alive,
                "nixl_agents_of_gone_prefills": sum(len(n) for d in still.values() for n in d.values()) + known}
    finally:
        if threading.current_thread() is threading.main_thread():  # a second Ctrl-C must not break off the clean-up
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        if soak is not None:
            soak.no_more_faults.set()
            soak.stop.set()
            soak.resume_stopped()
        stop_cluster(cluster, shutdown_serve=True, progress=lambda m: progress(f"  {m}"))
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 30
    while (after := orphans(shm_files() - shm_before)) and time.monotonic() < deadline:
        time.sleep(1)
    left["shm_after_stop"] = after
    counts = tally(soak.requests, soak.frontend_kills)
    report = {
        "config": {"deploy": args.deploy, "minutes": args.minutes, "fault_every_s": args.fault_every,
                   "faults": args.faults, "order": args.order, "seed": args.seed, "frontends": cfg.http.replicas,
                   "clients": args.clients, "prompt_tokens": list(PROMPT_TOKENS), "output_tokens": list(OUTPUT_TOKENS),
                   "frontend_loss_window_s": FRONTEND_LOSS_WINDOW_S},
        "traffic": {**counts, "ttft_p50_ms": percentile_ms(res.ttft_s, 50), "ttft_p99_ms": percentile_ms(res.ttft_s, 99),
                    "itl_p50_ms": percentile_ms(res.itl_s, 50), "itl_p99_ms": percentile_ms(res.itl_s, 99),
                    "output_tokens_per_s": round(res.tokens / res.wall_s, 1) if res.wall_s else 0.0,
                    "first_errors": [r.reason for r in soak.requests
                                     if r.outcome not in ("complete", "refused_503", "refused_429")][:5]},
        "faults": [f.row() for f in soak.faults], "bursts": soak.burst_rows,
        "start": start, "end": end, "left_behind": left,
    }
    # bursts' other answers and a wrong n-too-large answer are failed requests too
    report["traffic"]["failed_probes"] = (sum(b["other"] for b in soak.burst_rows)
                                          + sum(1 for f in soak.faults if f.kind == "n-too-large" and f.problem))
    report["traffic"]["failed"] += report["traffic"]["failed_probes"]
    report["problems"] = problems(report)
    return report


def print_report(report: dict[str, Any]) -> None:
    from cluster.cli.bench.results import table

    print("\nfaults:")
    table(report["faults"], ["index", "at_s", "kind", "target", "done", "followed", "recovered_s"])
    t = report["traffic"]
    print("\ntraffic:")
    table([t], ["sent", "completed", "failed", "refused_429", "refused_503", "lost_with_frontend", "failed_midstream",
                 "malformed", "unexpected_4xx", "failed_probes", "ttft_p99_ms", "itl_p99_ms", "output_tokens_per_s"])
    print("\nresident memory (MiB; engines with vLLM's processes):")
    labels = sorted(set(report["start"]["rss_mib"]) | set(report["end"]["rss_mib"]))
    table([{"process": k, "start": report["start"]["rss_mib"].get(k, "-"), "end": report["end"]["rss_mib"].get(k, "-")}
            for k in labels], ["process", "start", "end"])
    left = report["left_behind"]
    print("\nleft behind:")
    print(f"  /dev/shm files: {len(report['start']['shm'])} at the start, {len(report['end']['shm'])} at the end "
          f"({left['shm_new_held']} new ones held by live processes); new and held by no process: "
          f"{len(left['shm_unowned'])} at the end {left['shm_unowned'] or ''}, {len(left['shm_after_stop'])} after the "
          f"cluster stopped {left['shm_after_stop'] or ''}")
    print(f"  pools short of min_replicas ready engines at the end: {left['pools_short'] or 'none'}")
    print(f"  blocks held once the load was over: {left['blocks_held']} (idle baselines {left['idle_baselines']})")
    print(f"  NIXL agents: {report['end'].get('nixl_agents_loaded', 'n/a')} loaded at the end, "
          f"{left['nixl_agents_of_gone_prefills']} of gone prefill engines")
    print(f"  faulted engines' files still there: {len(left['faulted_engine_files'])}; processes: {len(left['stragglers'])}")
    print("\nverdict: " + ("PASS" if not report["problems"] else "FAIL - " + "; ".join(report["problems"])))


def main(args: argparse.Namespace) -> int:
    import ray

    from cluster.core.config import load_deploy

    cfg = soak_config(load_deploy(args.deploy), args.frontends, args.port)
    started = not ray.is_initialized()
    if started:
        start_ray(cfg.coordinator.namespace)
    try:
        report = run_soak(cfg, args)
    except KeyboardInterrupt:
        say("interrupted: the cluster was stopped")
        return 130
    finally:
        if started:
            ray.shutdown()
    print_report(report)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_soak.json"
    path.write_text(json.dumps({"benchmark": "soak", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **report}, indent=2,
                               default=str))
    print(f"wrote {path}")
    return 0 if not report["problems"] else 1
