"""The HTTP front door: vLLM's own OpenAI server with the whole cluster behind it as one engine.

vLLM's frontend does everything a client sees - its FastAPI app, protocol models, chat templates, sampling-parameter
conversion, logprob and SSE formatting, /tokenize and /detokenize - and calls vLLM's `EngineClient` protocol for
generation (not the project's `actors.engine_client.EngineClient`, which the router uses to reach each engine).
`ClusterEngineClient` is that engine client: each request goes through the router to a prefill engine and a decode
engine (`actors.router`), and the decode engine's own vLLM `RequestOutput`s come back (batched per engine step over
one channel per decode engine: a local socket on this node, a Ray stream across nodes) to vLLM's formatting. The project's own code here is only what P/D serving adds:
`n > 1` fanned out over pairs, prompt logprobs from the prefill engine, router failures as 503s (with Retry-After,
and before the first byte of a stream), the body limit, `/health` and `/metrics` for the cluster.

`HTTPFrontend` is the Ray actor that runs it with uvicorn on `http.host:http.port` (pinned to the node that started
it), so that a token crosses one process hop - decode engine to front end - on its way to the client.

Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models, /version, /health,
/metrics (Prometheus), /openapi.json, /docs. vLLM's other routes (responses, messages, pooling, elastic EP, RL, dev
endpoints) are not served.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, AsyncGenerator

import ray
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from actors.router import EngineFailure, NoCapacity, Router
from cluster.core.metrics import ServiceMetrics, TransferTotals

log = logging.getLogger("pd.frontend")
FRONTEND_ACTOR = "pd-http-frontend"
# vLLM routes served as they are (everything else vLLM's app registers is dropped); /health and /metrics are ours
VLLM_ROUTES = {
    "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models", "/version",
    "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
}


@dataclass(frozen=True)
class FrontendSettings:
    """What the front end needs to know; built from `deploy.yaml` by `cluster.launch`."""

    model_name: str
    model_dir: str
    max_model_len: int
    coordinator_name: str
    namespace: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "bfloat16"
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 2
    first_token_from_prefill: bool = True
    local_prefill_queue: int | None = None
    local_prefill_when_idle: bool = False


def vllm_args(settings: FrontendSettings):
    """The arguments vLLM's own `vllm serve` would get for this model (its parser, its defaults)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", settings.model_dir, "--served-model-name", settings.model_name,
            "--max-model-len", str(settings.max_model_len), "--dtype", settings.dtype,
            "--host", settings.host, "--port", str(settings.port), "--disable-log-stats", "--enforce-eager"]
    if settings.api_key:
        argv += ["--api-key", settings.api_key]
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
            raise self._unavailable(f"no engine can take the request now: {e}") from None
        except EngineFailure as e:
            log.warning("request %s: %s", request_id, e)
            raise self._unavailable(f"the request failed in {e.phase} ({e.engine_id}); retry it") from None

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
        """Admission is the router's: no engine free is a 503 from `generate`."""

    async def check_health(self) -> None:
        """/health is the front end's own (it asks the coordinator)."""

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
class _BodyGuard:
    """ASGI middleware for request bodies: at most `limit` bytes (413), and valid JSON without lone surrogates
    (400 `invalid_json` instead of a parser's 500 on 30k-deep nesting or 5000-digit numbers), checked before any
    handler parses it."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await _send_error(send, 413, f"request body exceeds {self.limit} bytes", "request_too_large")
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                return await _send_error(send, 413, f"request body exceeds {self.limit} bytes", "request_too_large")
            if not message.get("more_body"):
                break
        if body:
            try:
                json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
            except (ValueError, RecursionError, UnicodeError) as e:
                return await _send_error(send, 400, f"the request body is not valid JSON: {str(e)[:200]}", "invalid_json")
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class _Outcomes:
    """ASGI middleware: counts each generation request's outcome by HTTP status, adds Retry-After to 503s, and holds
    an event stream's status line until its first event - so that a request that failed before anything was
    generated (no engine free, an engine that died) is a plain HTTP error with its status, not a 200 whose stream
    carries an error."""

    def __init__(self, app: Any, metrics: ServiceMetrics, retry_after_s: int):
        self.app, self.metrics, self.retry_after = app, metrics, str(retry_after_s).encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/") or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        held: dict | None = None
        state = {"status": None, "swallow": False}

        async def send_(message: dict) -> None:
            nonlocal held
            if state["swallow"]:
                return
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if message["status"] == 503:
                    headers.append((b"retry-after", self.retry_after))
                message = {**message, "headers": headers}
                if (dict(headers).get(b"content-type") or b"").startswith(b"text/event-stream"):
                    held = message
                    return
                state["status"] = message["status"]
                return await send(message)
            if message["type"] == "http.response.body" and held is not None:
                start, held = held, None
                error = _leading_error(message.get("body", b""))
                if error is not None:
                    state["status"], state["swallow"] = error[0], True
                    return await _send_error(send, error[0], body=error[1], retry_after=self.retry_after)
                state["status"] = start["status"]
                await send(start)
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            status = state["status"]
            self.metrics.requests.labels(str(status) if status else "disconnected").inc()


def _leading_error(chunk: bytes) -> tuple[int, bytes] | None:
    """(status, error body) when an event stream's first event is an error with an HTTP status."""
    if not chunk.startswith(b'data: {"error"'):
        return None
    try:
        body = json.loads(chunk[len(b"data: "):].split(b"\n\n", 1)[0])
        status = int(body["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None
    return (status, json.dumps(body).encode()) if 400 <= status < 600 else None


async def _send_error(send: Any, status: int, message: str = "", code: str | None = None, body: bytes | None = None,
                      retry_after: bytes | None = None) -> None:
    if body is None:
        body = json.dumps({"error": {"message": message, "type": HTTPStatus(status).phrase.replace(" ", ""),
                                     "param": None, "code": status, "reason": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None and status == 503:
        headers.append((b"retry-after", retry_after))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def build_frontend(settings: FrontendSettings, coordinator: Any) -> tuple[Any, Any]:
    """vLLM's OpenAI app over the cluster: (ASGI app, engine client)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.usage.usage_lib import UsageContext

    args = vllm_args(settings)
    vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    metrics = ServiceMetrics()
    router = Router(coordinator, first_token_from_prefill=settings.first_token_from_prefill,
                    local_prefill_queue=settings.local_prefill_queue,
                    local_prefill_when_idle=settings.local_prefill_when_idle)
    client = cluster_engine_client(vllm_config, router, metrics)
    tasks = await client.get_supported_tasks()
    app = build_app(args, tasks, vllm_config.model_config)
    await init_app_state(client, app.state, args, tasks)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) in VLLM_ROUTES]
    app.title, app.description = "hybrid-pd", "vLLM's OpenAI API over disaggregated prefill/decode"
    transfer_seen: dict[str, tuple[str, TransferTotals]] = {}  # engine -> (role, its last reported totals)
    retry = {"Retry-After": str(settings.retry_after_s)}

    @app.get("/health")
    async def health():
        """See `health_report`."""
        code, body = await health_report(coordinator, router, settings.model_name)
        return body if code == 200 else JSONResponse(body, status_code=code, headers=retry)

    @app.get("/metrics", response_class=Response)
    async def metrics_route(request: Request):
        """Prometheus: this front end's requests and latencies, pool sizes, scaling, NIXL transfer totals."""
        if settings.api_key and not _key_ok(request, settings.api_key):
            return JSONResponse({"error": {"message": "Unauthorized", "type": "Unauthorized", "param": None,
                                           "code": 401}}, status_code=401)
        try:
            metrics.cluster_state = await _cluster_state(coordinator, router, transfer_seen)
        except Exception as e:  # noqa: BLE001 - the front end's own metrics still render
            log.warning("cluster state unavailable for /metrics: %s", e)
            metrics.cluster_state = {**metrics.cluster_state, "pools": {}}  # unknown now: no stale pool sizes
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # outermost, around vLLM's own middleware (API key, CORS); vLLM's app is already built, so wrapped by hand
    return _Outcomes(_BodyGuard(app, settings.max_body_bytes), metrics, settings.retry_after_s), client


def _key_ok(request: Any, key: str) -> bool:
    import hmac

    got = request.headers.get("authorization", "")
    return hmac.compare_digest(got.encode(), f"Bearer {key}".encode())


async def health_report(coordinator: Any, router: Router, model_name: str, timeout_s: float = 5) -> tuple[int, dict]:
    """/health's status code and body: 200 "ok" while a prefill/decode pair is ready; 200 "degraded" while only one
    pool has ready engines (they serve requests whole); 200 "ok" with "coordinator": "unreachable..." while the
    coordinator does not answer and the router serves on its last routes; 503 when no engine can serve. Asked while
    the coordinator restarts, it can fail the first question and answer the router's: what requests are routed on
    decides, so /health never says 503 while they are served."""
    try:
        ready = {role: await asyncio.wait_for(coordinator.ready.remote(role), timeout_s)
                 for role in ("prefill", "decode")}
        routes = await asyncio.wait_for(coordinator.routes.remote(), timeout_s)
    except Exception as e:  # noqa: BLE001 - coordinator down or slow: unavailable, not an error page
        try:  # what requests are routed on now: the coordinator's answer, or its last routes while it restarts
            routes = await router.routes()
        except Exception:  # noqa: BLE001 - no routes to fall back on
            routes = {}
        if any(routes.values()):
            body = {"status": "ok", "model": model_name, "ready": {
                "prefill": len(routes), "decode": len({d for ds in routes.values() for d in ds})}}
            if router.coordinator_unreachable:
                body["coordinator"] = "unreachable: serving on its last routes"
            return 200, body
        return 503, {"status": "unavailable", "model": model_name, "error": type(e).__name__}
    paired = any(routes.values())
    status = "ok" if paired else "degraded" if ready["prefill"] or ready["decode"] else "unavailable"
    body = {"status": status, "model": model_name, "ready": {k: len(v) for k, v in ready.items()}}
    if status == "degraded":
        body["serving"] = "prefill engines decode" if ready["prefill"] else "decode engines prefill"
    return (200 if status != "unavailable" else 503), body


async def _cluster_state(coordinator: Any, router: Router, seen: dict[str, tuple[str, TransferTotals]]) -> dict[str, Any]:
    """Pool sizes, autoscaling decisions and signals from the coordinator, and running totals from the engines
    (bounded by a timeout): the decode engines' transfers, every engine's prompt tokens found in its prefix cache."""
    desc = await asyncio.wait_for(coordinator.describe.remote(), 5)
    pools: dict[tuple[str, str], int] = {}
    for e in desc["engines"].values():
        pools[(e["role"], e["state"])] = pools.get((e["role"], e["state"]), 0) + 1
    for role in ("prefill", "decode"):
        for st in ("ready", "draining"):
            pools.setdefault((role, st), 0)
    roles = {k: e["role"] for k, e in desc["engines"].items()}

    async def one(engine_id: str) -> tuple[str, TransferTotals]:
        engine = await router.engine(engine_id, roles[engine_id])
        return roles[engine_id], await asyncio.wait_for(engine.transfer_totals(), 5)

    for engine_id, got in zip(roles, await asyncio.gather(*(one(e) for e in roles), return_exceptions=True)):
        if isinstance(got, tuple):
            seen[engine_id] = got
    totals = TransferTotals()
    cached = {"prefill": 0, "decode": 0}
    for role, engine_totals in seen.values():  # counters never go down: engines that left keep their last totals
        totals += engine_totals
        cached[role] += engine_totals.cached_prompt_tokens
    return {"pools": pools, "transfers": totals, "cached_prompt_tokens": cached, "retried": router.retried,
            "scaling": desc.get("pools", {}), "colocated": dict(router.colocated), "degraded": router.degraded,
            "failed_over": router.failed_over, "first_from_prefill": router.first_from_prefill,
            "stale_routed": router.stale_routed, "local_prefill": router.local_prefill}


@ray.remote(num_cpus=0)
class HTTPFrontend:
    """The front end's process: vLLM's OpenAI app over the cluster, served by uvicorn on the configured address."""

    def __init__(self) -> None:
        self.server = None
        self.task: asyncio.Task | None = None

    async def start(self, settings: FrontendSettings) -> str:
        import uvicorn

        coordinator = ray.get_actor(settings.coordinator_name, namespace=settings.namespace)
        app, _ = await build_frontend(settings, coordinator)
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False,
                                lifespan="on", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.task = asyncio.get_running_loop().create_task(self._serve(settings))
        while not self.server.started:
            if self.task.done():  # e.g. the port is taken
                self.task.result()
                raise RuntimeError(f"the HTTP server on {settings.host}:{settings.port} stopped while starting")
            await asyncio.sleep(0.05)
        return f"http://{settings.host}:{settings.port}"

    async def _serve(self, settings: FrontendSettings) -> None:
        try:
            await self.server.serve()
        except SystemExit:  # uvicorn exits the process when it cannot bind or start; here it is an error to report
            raise RuntimeError(f"the HTTP server could not start on {settings.host}:{settings.port} (is the port "
                               "taken?)") from None

    async def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            await asyncio.wait_for(asyncio.shield(self.task), 30)
