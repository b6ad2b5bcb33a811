"""The HTTP front door: vLLM's own OpenAI server with the whole cluster behind it as one engine.

vLLM's frontend does everything a client sees - its FastAPI app, protocol models, chat templates, sampling-parameter
conversion, logprob and SSE formatting, /tokenize and /detokenize - and calls vLLM's `EngineClient` protocol for
generation (not the project's `actors.clients.engine_client.EngineClient`, which the router uses to reach each engine).
`ClusterEngineClient` is that engine client: each request goes through the router to a prefill engine and a decode
engine (`actors.frontend.router`), and the decode engine's own vLLM `RequestOutput`s come back (batched per engine step
over one channel per decode engine: a local socket on this node, a Ray stream across nodes) to vLLM's formatting. The
project's own code here is only what P/D serving adds: `n > 1` fanned out over pairs, prompt logprobs from the prefill
engine, router failures as 503s (with Retry-After, and before the first byte of a stream), and the layers in front of
vLLM's app (`guarded`): the API key on every route but /health, admission control (a bound on generation requests in
flight and queued, 429 + Retry-After past it), the body limit and the cap on `n`; `/health` (answered from a snapshot
kept in the background, `HealthWatch`) and `/metrics` for the cluster.

`HTTPFrontend` is the Ray actor that runs it with uvicorn on `http.host:http.port` (pinned to the node that started
it), so that a token crosses one process hop - decode engine to front end - on its way to the client.

Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models, /version, /health,
/metrics (Prometheus), /openapi.json, /docs, /redoc. vLLM's other routes (responses, messages, pooling, elastic EP,
RL, dev endpoints) are not served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, AsyncGenerator

import ray
from fastapi.responses import JSONResponse, Response

from actors.clients.coordinator_client import CoordinatorClient
from actors.frontend.health import HealthWatch, cluster_state
from actors.frontend.guards import guarded
from actors.frontend.router import EngineFailure, NoCapacity, Router
from cluster.core.config import HttpConfig
from cluster.core.metrics import ServiceMetrics, TransferTotals

log = logging.getLogger("pd.frontend")
FRONTEND_ACTOR = "pd-http-frontend"
# vLLM routes served as they are (everything else vLLM's app registers is dropped); /health and /metrics are ours
VLLM_ROUTES = {
    "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models", "/version",
    "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
}
_HTTP_DEFAULTS = HttpConfig()  # FrontendSettings' defaults are the deploy schema's


@dataclass(frozen=True)
class FrontendSettings:
    """What the front end needs to know; built from `deploy.yaml` by `cluster.cli.launch`."""

    model_name: str
    model_dir: str
    max_model_len: int
    coordinator_name: str
    namespace: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "bfloat16"
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = _HTTP_DEFAULTS.max_body_bytes
    retry_after_s: int = _HTTP_DEFAULTS.retry_after_s
    max_requests_in_flight: int = _HTTP_DEFAULTS.max_requests_in_flight
    max_queued_requests: int = _HTTP_DEFAULTS.max_queued_requests
    max_n: int = _HTTP_DEFAULTS.max_n
    first_token_from_prefill: bool = True
    local_prefill_queue: int | None = None
    local_prefill_when_idle: bool = False
    local_prefill_speed: float | None = None
    routing_policy: str = "cache"
    stall_timeout_s: float = 5.0
    failover_wait_s: float = 90.0
    replicas: int = 1  # front ends of this deployment on the port (they share it)
    chat_flags: tuple[str, ...] = ()  # vLLM's chat options as `vllm serve` takes them (`deploy.yaml` chat)


def vllm_args(settings: FrontendSettings):
    """The arguments vLLM's own `vllm serve` would get for this model (its parser, its defaults). Not the API key:
    vLLM's middleware guards only /v1/; the front end's own (`ApiKey`) guards every route but /health."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", settings.model_dir, "--served-model-name", settings.model_name,
            "--max-model-len", str(settings.max_model_len), "--dtype", settings.dtype,
            "--host", settings.host, "--port", str(settings.port), "--disable-log-stats", "--enforce-eager",
            *settings.chat_flags]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


def _service_unavailable():
    from vllm.exceptions import GracefulHTTPError

    class ServiceUnavailable(GracefulHTTPError):
        """No engine or pair can take the request now, or its engine failed before anything was sent: a 503 the
        client may retry (the front end adds Retry-After)."""

        def __init__(self, message: str):
            super().__init__(message, HTTPStatus.SERVICE_UNAVAILABLE)

    return ServiceUnavailable


class ClusterEngineClient:
    """vLLM's `EngineClient` over the cluster: generation goes through the router (prefill engine, then a decode
    engine approved for it); rendering and validation use vLLM's own renderer and input processor with the model's
    config, exactly as in vLLM's server. Built by `cluster_engine_client` (which makes it a subclass of vLLM's
    abstract class)."""

    def __init__(self, vllm_config: Any, router: Router, metrics: ServiceMetrics):
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self.router, self.metrics = router, metrics
        self.health: HealthWatch | None = None  # told each request's outcome (a change refreshes /health at once)
        self._unavailable = _service_unavailable()

    # ---- generation -----------------------------------------------------------------------------------------------
    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, **_: Any) -> AsyncGenerator[Any, None]:
        """One request (n >= 1) through the cluster; yields vLLM RequestOutputs as vLLM's AsyncLLM would."""
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        if not (isinstance(prompt, dict) and prompt.get("prompt_token_ids") is not None):
            raise VLLMValidationError("only token and text prompts are served (no embeddings, multi-modal or "
                                      "streamed inputs)")
        # vLLM's own checks of the request against the model (token ids in range, logprob limits, stop and bad
        # words, structured output): a client error here is a 400, before any engine is involved
        self.input_processor.process_inputs(request_id, prompt, sampling_params, supported_tasks=("generate",))
        ids = list(prompt["prompt_token_ids"])
        m = self.metrics
        m.prompt_tokens.inc(len(ids) * sampling_params.n)
        m.inflight.inc()
        t0 = last = time.perf_counter()
        first = True
        timed = sampling_params.output_kind == RequestOutputKind.DELTA  # one final output has no token timings
        try:
            async for out in self._fan_out(ids, sampling_params, request_id):
                now = time.perf_counter()
                n = sum(len(c.token_ids) for c in out.outputs)
                if n and first and timed:
                    m.ttft.observe(now - t0)
                    first = False
                elif n and timed:
                    for _ in range(n):
                        m.itl.observe((now - last) / n)
                last = now if n else last
                m.completion_tokens.inc(n)
                yield out
            m.e2e.observe(time.perf_counter() - t0)
        except (asyncio.CancelledError, GeneratorExit):
            m.disconnects.inc()
            raise
        finally:
            m.inflight.dec()

    async def _fan_out(self, ids: list[int], params: Any, request_id: str) -> AsyncGenerator[Any, None]:
        """n > 1: n requests of n = 1 on pairs of their own (each child's seed is seed + index, as vLLM does), their
        outputs indexed and merged; deltas as they come, or one final output with all n choices."""
        from vllm.sampling_params import RequestOutputKind
        from vllm.utils.async_utils import merge_async_iterators

        if params.n == 1:
            async for out in self._one(ids, params, request_id):
                yield out
            return
        children = []
        for i in range(params.n):
            child = params.clone()
            child.n = 1
            if params.seed is not None:
                child.seed = params.seed + i
            children.append(self._one(ids, child, f"{i}_{request_id}"))
        finals: list[Any] = [None] * params.n
        done = 0
        async for i, out in merge_async_iterators(*children):
            for c in out.outputs:
                c.index = i
            done += bool(out.finished)
            out.request_id = request_id
            if params.output_kind == RequestOutputKind.FINAL_ONLY:
                finals[i] = out
                continue
            out.finished = done == params.n
            yield out
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            merged = finals[0]
            merged.outputs = [f.outputs[0] for f in finals]
            merged.finished = True
            yield merged

    async def _one(self, ids: list[int], params: Any, request_id: str) -> AsyncGenerator[Any, None]:
        try:
            async for out in self.router.stream(ids, params, request_id):
                yield out
        except NoCapacity as e:  # includes an unavailable coordinator
            self._observed(False)
            raise self._unavailable(f"no engine can take the request now: {e}") from None
        except EngineFailure as e:
            log.warning("request %s: %s", request_id, e)
            self._observed(False)
            raise self._unavailable(f"the request failed in {e.phase} ({e.engine_id}); retry it") from None
        self._observed(True)

    def _observed(self, served: bool) -> None:
        if self.health is not None:
            self.health.observe(served)

    async def abort(self, request_id: Any) -> None:
        """Requests end when vLLM's frontend closes their generator (the router then aborts both sides)."""

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    # ---- the rest of vLLM's EngineClient: state, and operations a cluster front end does not offer --------------
    is_running = True
    is_stopped = False
    errored = False

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError("the cluster front end does not die with an engine")

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """Admission is the front end's (`Admission`, before vLLM's app: a bound on requests in flight and queued)
        and the router's (no engine free is a 503 from `generate`)."""

    async def check_health(self) -> None:
        """/health is the front end's own (`HealthWatch`)."""

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def is_sleeping(self) -> bool:
        return False

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        return None


def _not_offered(name: str):
    async def method(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name} is not offered by the cluster front end")

    method.__name__ = name
    return method


def cluster_engine_client(vllm_config: Any, router: Router, metrics: ServiceMetrics) -> Any:
    """A `ClusterEngineClient` that is also a vLLM `EngineClient` (vLLM's abstract methods the cluster does not
    offer - LoRA, sleep, profiling, cache resets, pausing - answer NotImplementedError, a 501 in vLLM's app)."""
    from vllm.engine.protocol import EngineClient

    missing = {name: _not_offered(name) for name in EngineClient.__abstractmethods__
               if not hasattr(ClusterEngineClient, name)}
    cls = type("ClusterEngineClient", (ClusterEngineClient, EngineClient), missing)
    return cls(vllm_config, router, metrics)


# ---- the app ----------------------------------------------------------------------------------------------------
async def build_frontend(settings: FrontendSettings, coordinator: Any, replica: int = 0) -> tuple[Any, Any]:
    """vLLM's OpenAI app over the cluster, behind the front end's own layers (`guarded`): (ASGI app, engine client).
    The client's `health` (a started `HealthWatch`) is to be stopped with the app. `replica`: this front end's index
    among those sharing the port (/health says which one answered)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.usage.usage_lib import UsageContext

    args = vllm_args(settings)
    vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    metrics = ServiceMetrics()
    router = Router(coordinator, first_token_from_prefill=settings.first_token_from_prefill,
                    local_prefill_queue=settings.local_prefill_queue,
                    local_prefill_when_idle=settings.local_prefill_when_idle, policy=settings.routing_policy,
                    stall_s=settings.stall_timeout_s, failover_wait_s=settings.failover_wait_s,
                    local_prefill_speed=settings.local_prefill_speed, watch_routes=True)
    client = cluster_engine_client(vllm_config, router, metrics)
    tasks = await client.get_supported_tasks()
    app = build_app(args, tasks, vllm_config.model_config)
    await init_app_state(client, app.state, args, tasks)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) in VLLM_ROUTES]
    app.title, app.description = "hybrid-pd", "vLLM's OpenAI API over disaggregated prefill/decode"
    transfer_seen: dict[str, tuple[str, TransferTotals]] = {}  # engine -> (role, its last reported totals)
    retry = {"Retry-After": str(settings.retry_after_s)}
    client.health = HealthWatch(coordinator, router, settings.model_name)
    await client.health.start()

    @app.get("/health")
    async def health():
        """See `health_report`; answered from the front end's last snapshot (`HealthWatch`), `age_s` old."""
        code, body = await client.health.report()
        body = {**body, "frontend": replica}
        return body if code == 200 else JSONResponse(body, status_code=code, headers=retry)

    @app.get("/metrics", response_class=Response)
    async def metrics_route():
        """Prometheus: this front end's requests and latencies, pool sizes, scaling, NIXL transfer totals."""
        try:
            metrics.cluster_state = await cluster_state(coordinator, router, transfer_seen)
        except Exception as e:  # noqa: BLE001 - the front end's own metrics still render
            log.warning("cluster state unavailable for /metrics: %s", e)
            metrics.cluster_state = {**metrics.cluster_state, "pools": {}}  # unknown now: no stale pool sizes
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return guarded(app, settings, metrics), client


# The front end is supervised by Ray: killed, it is restarted in place (pinned to its node by `cluster.cli.launch`) and
# serves again on its own, with its settings as it was created with - nobody has to call `start` again.
@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class HTTPFrontend:
    """One front-end process: vLLM's OpenAI app over the cluster, served by uvicorn on the configured address.

    Created with its settings (`cluster.cli.frontends.start_http`), it starts serving at once and again after each
    restart; `start` waits for that and returns the URL. Several replicas share one port (`http.replicas`, SO_REUSEPORT:
    the kernel spreads new connections over the listening processes); each has its own router, admission bound and
    metrics. Created bare (tests), `start(settings)` starts it."""

    def __init__(self, settings: FrontendSettings | None = None, replica: int = 0) -> None:
        self.server = None
        self.task: asyncio.Task | None = None
        self.client: Any = None
        self.settings, self.replica = settings, replica
        self.url: str | None = None
        self.started_at = time.time()
        self.restarts = _count_start(replica)
        self._boot: asyncio.Task | None = None
        if settings is not None:
            self._boot = asyncio.get_running_loop().create_task(self._start(settings))

    async def start(self, settings: FrontendSettings | None = None) -> str:
        """The URL once this front end serves (its boot failing raises here)."""
        if self._boot is None:
            if settings is None:
                raise ValueError("a front end created without settings needs them in start()")
            self.settings = settings
            self._boot = asyncio.get_running_loop().create_task(self._start(settings))
        return await asyncio.shield(self._boot)

    async def info(self) -> dict[str, Any]:
        """What a supervisor needs: this process's pid, its replica index, how often it was restarted, whether it
        serves (and the error if its boot failed)."""
        import os

        error = None
        if self._boot is not None and self._boot.done() and not self._boot.cancelled() and self._boot.exception():
            error = f"{type(self._boot.exception()).__name__}: {self._boot.exception()}"
        serving = bool(self.server is not None and self.server.started and self.task is not None and not self.task.done())
        return {"pid": os.getpid(), "replica": self.replica, "restarts": self.restarts, "url": self.url,
                "node_ip": ray.util.get_node_ip_address(), "serving": serving, "started_at": self.started_at,
                "error": error}

    async def _start(self, settings: FrontendSettings) -> str:
        import uvicorn

        from actors.host.cores import normal_priority, start_host_cores

        normal_priority("HTTP front end")  # every token crosses this process: not at Ray's worker niceness
        self.host_cores = start_host_cores(f"HTTP front end {self.replica}")  # off the cores decode engines reserve
        coordinator = CoordinatorClient.named(settings.coordinator_name, settings.namespace)
        app, self.client = await build_frontend(settings, coordinator, replica=self.replica)
        bind = bind_host(settings.host)
        config = uvicorn.Config(app, host=bind, port=settings.port, log_level="warning", access_log=False,
                                lifespan="on", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        try:
            sock = listening_socket(bind, settings.port, shared=settings.replicas > 1)
        except OSError as e:
            raise RuntimeError(f"the HTTP server could not listen on {bind}:{settings.port}: {e} (is the port "
                               "taken?)") from None
        self.task = asyncio.get_running_loop().create_task(self._serve(settings, sock))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError(f"the HTTP server on {bind}:{settings.port} stopped while starting")
            await asyncio.sleep(0.05)
        host = f"[{bind}]" if ":" in bind else bind
        self.url = f"http://{host}:{settings.port}"
        if self.restarts:
            log.warning("HTTP front end replica %d restarted (restart %d): serving again on %s", self.replica,
                        self.restarts, self.url)
        return self.url

    async def _serve(self, settings: FrontendSettings, sock: Any) -> None:
        try:
            await self.server.serve(sockets=[sock])
        except SystemExit:  # uvicorn exits the process when it cannot start; here it is an error to report
            raise RuntimeError(f"the HTTP server could not start on {settings.host}:{settings.port}") from None

    async def stop(self) -> None:
        if self._boot is not None and not self._boot.done():
            self._boot.cancel()
            with contextlib.suppress(BaseException):
                await self._boot
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            await asyncio.wait_for(asyncio.shield(self.task), 30)
        if self.client is not None:
            await self.client.health.stop()
        _forget_starts(self.replica)


NODE_HOST = "node"  # http.host: the address Ray knows this node by


def bind_host(host: str) -> str:
    """The address to bind for `http.host`: as given, or for "node" this node's address as Ray knows it (the
    cluster's own network: each node's front end on its own address, none on every interface)."""
    return ray.util.get_node_ip_address() if host == NODE_HOST else host


def listening_socket(host: str, port: int, *, shared: bool) -> Any:
    """The front end's listening socket. `shared`: SO_REUSEPORT, so that every replica of one deployment listens on
    the same port and the kernel spreads connections over them (only processes of the same user can join). Without
    it a second server on the port fails to bind, as it should."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _start_key(replica: int) -> bytes:
    return f"pd-frontend-starts/{ray.get_runtime_context().get_actor_id()}/{replica}".encode()


def _count_start(replica: int) -> int:
    """How many times this front-end actor was restarted before this start (kept in Ray's GCS key-value store, which
    outlives the process; 0 or 1 from Ray's own flag where that store is not reachable)."""
    from ray.experimental import internal_kv

    try:
        key = _start_key(replica)
        starts = int(internal_kv._internal_kv_get(key) or 0) + 1
        internal_kv._internal_kv_put(key, str(starts).encode(), overwrite=True)
        return starts - 1
    except Exception:  # noqa: BLE001 - not in an actor, or no GCS: the flag only
        try:
            return int(ray.get_runtime_context().was_current_actor_reconstructed)
        except Exception:  # noqa: BLE001
            return 0


def _forget_starts(replica: int) -> None:
    from ray.experimental import internal_kv

    with contextlib.suppress(Exception):
        internal_kv._internal_kv_del(_start_key(replica))
