"""The HTTP front door: vLLM's own OpenAI server with the whole cluster behind it as one engine.

vLLM's frontend does everything a client sees - its FastAPI app, protocol models, chat templates, sampling-parameter
conversion, logprob and SSE formatting, /tokenize and /detokenize - and calls vLLM's `EngineClient` protocol for
generation (not the project's `actors.engine_client.EngineClient`, which the router uses to reach each engine).
`ClusterEngineClient` is that engine client: each request goes through the router to a prefill engine and a decode
engine (`actors.router`), and the decode engine's own vLLM `RequestOutput`s come back (batched per engine step over
one channel per decode engine: a local socket on this node, a Ray stream across nodes) to vLLM's formatting. The project's own code here is only what P/D serving adds:
`n > 1` fanned out over pairs, prompt logprobs from the prefill engine, router failures as 503s (with Retry-After,
and before the first byte of a stream), and the layers in front of vLLM's app (`guarded`): the API key on every route
but /health, admission control (a bound on generation requests in flight and queued, 429 + Retry-After past it),
the body limit and the cap on `n`; `/health` (answered from a snapshot kept in the background, `HealthWatch`) and
`/metrics` for the cluster.

`HTTPFrontend` is the Ray actor that runs it with uvicorn on `http.host:http.port` (pinned to the node that started
it), so that a token crosses one process hop - decode engine to front end - on its way to the client.

Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models, /version, /health,
/metrics (Prometheus), /openapi.json, /docs, /redoc. vLLM's other routes (responses, messages, pooling, elastic EP,
RL, dev endpoints) are not served.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, AsyncGenerator

import ray
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter, Gauge
from pydantic import TypeAdapter, ValidationError

from actors.coordinator_client import CoordinatorClient
from actors.router import EngineFailure, NoCapacity, Router
from cluster.core.config import HttpConfig
from cluster.core.metrics import ServiceMetrics, TransferTotals

log = logging.getLogger("pd.frontend")
FRONTEND_ACTOR = "pd-http-frontend"
# vLLM routes served as they are (everything else vLLM's app registers is dropped); /health and /metrics are ours
VLLM_ROUTES = {
    "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models", "/version",
    "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
}
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")  # admission control and the cap on n apply to these
OPEN_ROUTES = ("/health",)  # the only route that never needs the API key (liveness probes)
DEPARTED = "(departed) "  # `_cluster_state`'s key prefix for the summed totals of engines that left, per role
HEALTH_REFRESH_S = 1.0  # /health's snapshot is at most this old while the coordinator answers
QUEUE_READ_AHEAD_BYTES = 1 << 16  # of a waiting request's body, read to hear its client leave (`_Admission`)
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
    vLLM's middleware guards only /v1/; the front end's own (`_ApiKey`) guards every route but /health."""
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
        """Admission is the front end's (`_Admission`, before vLLM's app: a bound on requests in flight and queued)
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
def guarded(app: Any, settings: FrontendSettings, metrics: ServiceMetrics) -> Any:
    """The front end's own layers around vLLM's app (ASGI middleware, outermost first), each answering before the
    next one costs anything: `_Outcomes` (counts generation requests by status, holds a stream's status line),
    `_ApiKey` (when a key is set: every route but /health; before a request can take a place in the queue),
    `_Admission` (generation requests in flight and queued; 429 past them, before the body is read), `_BodyGuard`
    (body size, valid JSON, `n`/`best_of` at most `max_n`), then vLLM's app. vLLM's app is already built, so they
    are wrapped by hand rather than added with `add_middleware`."""
    refused = Counter("pd_requests_refused", "Generation requests the front end refused by its own limits, by reason: "
                      "queue_full (429: http.max_requests_in_flight in flight and http.max_queued_requests waiting), "
                      "n_over_limit (400: n or best_of above http.max_n)", ["reason"], registry=metrics.registry)
    for reason in ("queue_full", "n_over_limit"):
        refused.labels(reason)  # each series exported from the start, at 0
    inner = _BodyGuard(app, settings.max_body_bytes, settings.max_n, refused)
    inner = _Admission(inner, settings.max_requests_in_flight, settings.max_queued_requests, settings.retry_after_s,
                       refused, Gauge("pd_requests_queued", "Generation requests waiting for one in flight to end "
                                      "(http.max_queued_requests)", registry=metrics.registry))
    if settings.api_key:
        inner = _ApiKey(inner, settings.api_key)
    return _Outcomes(inner, metrics, settings.retry_after_s)


class _ApiKey:
    """ASGI middleware: `Authorization: Bearer <key>` on every route but /health - generation, /tokenize,
    /detokenize, /v1/models, /version, /metrics, the API documents (/openapi.json, /docs, /redoc) and unknown paths
    (401 rather than 404: no route list for strangers). A 401 in the front end's error shape, answered before the
    body is read or the request is counted against admission. CORS preflights (OPTIONS) pass, as in vLLM's own
    middleware: a browser cannot send the key on them. The comparison is of SHA-256 digests in constant time."""

    def __init__(self, app: Any, key: str):
        self.app, self.digest = app, hashlib.sha256(key.encode()).digest()

    def allowed(self, scope: dict) -> bool:
        if scope["path"] in OPEN_ROUTES or scope.get("method") == "OPTIONS":
            return True
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(hashlib.sha256(token).digest(), self.digest)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await _send_error(send, 401, "a valid API key is required: send `Authorization: Bearer <key>`",
                          "invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])


def _is_generation(scope: dict) -> bool:
    return scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_ROUTES


class _Admission:
    """ASGI middleware: admission control for generation requests (POST /v1/completions, /v1/chat/completions).
    At most `max_in_flight` are served at once, each from its admission to its response's last byte (a stream's end,
    or its client leaving); up to `max_queued` more wait, first come first served, for one of those to end. Past both
    a request is answered at once with 429 + Retry-After, before its body is read and before anything is routed (a
    stream gets the 429 in place of its status line, never a stream that carries an error), and counted in
    `pd_requests_refused_total{reason="queue_full"}`. Other routes (/tokenize, /v1/models, /health, /metrics) are not
    counted. Without the bound every request a client opens holds a coroutine, its body and its own prefill in the
    front end, and past what the engines can run it only waits inside them, where nothing can refuse it any more.

    A waiting request whose client leaves gives its place in the queue back at once: uvicorn does not cancel it but
    says so only through `receive`, so a waiting request's body is read ahead (up to QUEUE_READ_AHEAD_BYTES) to hear
    the disconnect, and replayed to the app once admitted. Otherwise connections opened and dropped in a burst would
    hold the queue until places in flight freed, and every live client meanwhile got 429s."""

    def __init__(self, app: Any, max_in_flight: int, max_queued: int, retry_after_s: int, refused: Any, queued: Any):
        self.app, self.max_in_flight, self.max_queued = app, max_in_flight, max_queued
        self.retry_after_s, self.refused, self.queued_gauge = retry_after_s, refused, queued
        self.in_flight = 0
        self._waiting: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if not _is_generation(scope):
            return await self.app(scope, receive, send)
        early: list[dict] = []  # what was read of the request while it waited
        admitted = await self._enter(lambda: _until_gone(receive, early))
        if admitted is None:  # its client left while it waited: nobody to answer
            return
        if not admitted:
            self.refused.labels("queue_full").inc()
            return await _send_error(
                send, 429, f"too many requests: {self.in_flight} in flight and {self.queued} waiting, the most this "
                f"server takes; retry after {self.retry_after_s} s", "queue_full",
                retry_after=str(self.retry_after_s).encode())

        async def replay() -> dict:
            return early.pop(0) if early else await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            self._leave()

    async def _enter(self, gone: Any = None) -> bool | None:
        """Take a place in flight, waiting in the queue for one if need be: True; False when the queue is full too;
        None when `gone()` (awaited while the request waits) ends first - its client left."""
        if self.in_flight < self.max_in_flight:  # nobody waits while a place is free: `_leave` hands places over
            self.in_flight += 1
            return True
        if len(self._waiting) >= self.max_queued:
            return False
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        self.queued_gauge.set(len(self._waiting))
        watch = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            if watch is None:
                await turn
            else:
                await asyncio.wait({turn, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._give_up(turn)
            raise
        finally:
            if watch is not None:
                watch.cancel()
            self.queued_gauge.set(len(self._waiting))
        if watch is not None and watch.done() and not watch.cancelled():
            self._give_up(turn)
            self.queued_gauge.set(len(self._waiting))
            return None
        return True

    def _give_up(self, turn: asyncio.Future) -> None:
        """A waiting request leaves: its place in the queue goes, and a place in flight handed to it meanwhile passes
        on to the next."""
        if turn.done() and not turn.cancelled():
            self._leave()
        else:
            turn.cancel()
            with contextlib.suppress(ValueError):
                self._waiting.remove(turn)

    def _leave(self) -> None:
        """A request in flight ended: its place goes to the longest waiting request, or is freed."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # `in_flight` stays: the place changes hands
                self.queued_gauge.set(len(self._waiting))
                return
        self.in_flight -= 1


async def _until_gone(receive: Any, early: list[dict]) -> None:
    """Returns once the client of a waiting request has left (http.disconnect), keeping in `early` what it read of the
    request meanwhile; past QUEUE_READ_AHEAD_BYTES of body it stops reading (and returns only when cancelled)."""
    read = 0
    try:
        while read <= QUEUE_READ_AHEAD_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            early.append(message)
            read += len(message.get("body", b""))
    except Exception:  # noqa: BLE001 - a connection that cannot be read is one whose client is gone
        return
    await asyncio.get_running_loop().create_future()


class _BodyGuard:
    """ASGI middleware for request bodies: at most `limit` bytes (413), and valid JSON without lone surrogates
    (400 `invalid_json` instead of a parser's 500 on 30k-deep nesting or 5000-digit numbers), checked before any
    handler parses it; a generation request's `n` or `best_of` above `max_n` is a 400 naming the field and the limit
    (vLLM's own check of n says the same, with its far higher VLLM_MAX_N_SEQUENCES; vLLM 0.32 ignores best_of, but a
    client that asks for it expects that many generations), before anything is routed: each choice is a request of
    its own on the cluster."""

    def __init__(self, app: Any, limit: int, max_n: int | None = None, refused: Any = None):
        self.app, self.limit, self.max_n, self.refused = app, limit, max_n, refused

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
                parsed = json.loads(body)
                json.dumps(parsed, ensure_ascii=False).encode("utf-8")
            except (ValueError, RecursionError, UnicodeError) as e:
                return await _send_error(send, 400, f"the request body is not valid JSON: {str(e)[:200]}", "invalid_json")
            over = self._over_max_n(scope, parsed)
            if over is not None:
                if self.refused is not None:
                    self.refused.labels("n_over_limit").inc()
                name, value = over
                return await _send_error(send, 400, f"{name} must be at most {self.max_n}, got {value}: each choice is "
                                         "a request of its own on this cluster", "n_over_limit", param=name)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _over_max_n(self, scope: dict, parsed: Any) -> tuple[str, int] | None:
        """(field, value) of a generation request's `n` or `best_of` above `max_n`, read as vLLM's request models read
        an int (pydantic's lax mode: 129, 129.0, "129" are all 129); None when within it, or not an int at all (vLLM's
        validation answers that)."""
        if self.max_n is None or not isinstance(parsed, dict) or scope["path"] not in GENERATION_ROUTES:
            return None
        for name in ("n", "best_of"):
            if parsed.get(name) is None:
                continue
            try:
                value = _INT.validate_python(parsed[name])
            except ValidationError:
                continue
            if value > self.max_n:
                return name, value
        return None


_INT = TypeAdapter(int)


class _Outcomes:
    """ASGI middleware: counts each generation request's outcome by HTTP status (401s and 429s included), adds
    Retry-After to 503s, and holds an event stream's status line until its first event - so that a request that
    failed before anything was generated (no engine free, an engine that died) is a plain HTTP error with its status,
    not a 200 whose stream carries an error."""

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
                      retry_after: bytes | None = None, param: str | None = None,
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An error answer in the front end's shape - vLLM's `{"error": {"message", "type", "param", "code"}}`, `code` the
    HTTP status, plus `reason`, a short name of the cause - with Retry-After on 429s and 503s."""
    if body is None:
        body = json.dumps({"error": {"message": message, "type": HTTPStatus(status).phrase.replace(" ", ""),
                                     "param": param, "code": status, "reason": code}}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]
    if retry_after is not None and status in (429, 503):
        head.append((b"retry-after", retry_after))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


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
            metrics.cluster_state = await _cluster_state(coordinator, router, transfer_seen)
        except Exception as e:  # noqa: BLE001 - the front end's own metrics still render
            log.warning("cluster state unavailable for /metrics: %s", e)
            metrics.cluster_state = {**metrics.cluster_state, "pools": {}}  # unknown now: no stale pool sizes
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return guarded(app, settings, metrics), client


class HealthWatch:
    """/health's answer, kept by the front end: `health_report` run in the background every `interval_s`, and the
    last result (its snapshot) given to every /health call with its age - so that /health costs the coordinator
    nothing per call (a load balancer polling it, or a flood of it, asks the coordinator nothing more) and answers at
    once while the coordinator is slow. Its semantics are `health_report`'s (200 ok, 200 degraded, 503 unavailable;
    never 503 while requests have routes).

    A snapshot can be up to `interval_s` (plus one report) behind, so what requests meet refreshes it sooner:
    `observe` is told each generation request's outcome, and asks for a refresh at once when the outcome contradicts
    the snapshot (served while it says unavailable, refused or failed while it says 200) or the router's state changed
    (degraded mode began or ended, the coordinator stopped or started answering). A /health call made after such a
    request waits for that refresh, up to `wait_s`, then answers what it has. Refreshes are `min_gap_s` apart at
    least, so a storm of failing requests cannot turn into a storm of coordinator calls."""

    def __init__(self, coordinator: Any, router: Router, model_name: str, interval_s: float = HEALTH_REFRESH_S,
                 wait_s: float = 2.0, min_gap_s: float = 0.1, timeout_s: float = 5):
        self.coordinator, self.router, self.model_name = coordinator, router, model_name
        self.interval_s, self.wait_s, self.min_gap_s, self.timeout_s = interval_s, wait_s, min_gap_s, timeout_s
        self.snapshot: tuple[int, dict, float] | None = None  # (status code, body, time.monotonic() when taken)
        self.refreshes = 0  # refreshes ended
        self._begun = 0  # refreshes begun
        self._wanted = 0  # the first refresh that begins after the latest `kick`
        self._seen: tuple = ()  # the router's state when the last refresh began
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._ended: asyncio.Event | None = None

    async def start(self) -> None:
        """Take the first snapshot, then keep it fresh in the background (on the running event loop)."""
        self._wake, self._ended = asyncio.Event(), asyncio.Event()
        await self._refresh()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def report(self) -> tuple[int, dict]:
        """The last snapshot (after waiting up to `wait_s` for a refresh that `kick` asked for), with `age_s`: how
        many seconds ago it was taken."""
        deadline = time.monotonic() + self.wait_s
        while self.snapshot is None or self.refreshes < self._wanted:
            left = deadline - time.monotonic()
            if left <= 0 or self._ended is None:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ended.wait(), left)
        if self.snapshot is None:  # never refreshed (not started, or its first report still running)
            return 503, {"status": "unavailable", "model": self.model_name, "error": "starting"}
        code, body, taken = self.snapshot
        return code, {**body, "age_s": round(time.monotonic() - taken, 3)}

    def observe(self, served: bool) -> None:
        """A generation request was served (True), or refused for want of an engine or failed (False)."""
        contradicts = self.snapshot is not None and (self.snapshot[0] == 200) != served
        if self.snapshot is None or contradicts or self._router_state() != self._seen:
            self.kick()

    def kick(self) -> None:
        """Refresh now (or `min_gap_s` after the last refresh ended); /health waits for that refresh."""
        self._wanted = self._begun + 1
        if self._wake is not None:
            self._wake.set()

    def _router_state(self) -> tuple:
        return self.router.degraded, self.router.coordinator_unreachable

    async def _refresh(self) -> None:
        self._begun += 1
        begun = self._begun
        self._seen = self._router_state()
        try:
            code, body = await health_report(self.coordinator, self.router, self.model_name, self.timeout_s)
            self.snapshot = (code, body, time.monotonic())
        except Exception as e:  # noqa: BLE001 - keep the last snapshot (its age tells), try again next time
            log.warning("/health: could not refresh the cluster's state: %s", e)
        self.refreshes = begun
        ended, self._ended = self._ended, asyncio.Event()
        if ended is not None:
            ended.set()

    async def _run(self) -> None:
        while True:
            began = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            await asyncio.sleep(max(0.0, began + self.min_gap_s - time.monotonic()))
            self._wake.clear()  # kicks until now are answered by this refresh
            await self._refresh()


async def health_report(coordinator: Any, router: Router, model_name: str, timeout_s: float = 5) -> tuple[int, dict]:
    """/health's status code and body: 200 "ok" while a prefill/decode pair is ready; 200 "degraded" while only one
    pool has ready engines (they serve requests whole); 200 "ok" with "coordinator": "unreachable..." while the
    coordinator does not answer and the router serves on its last routes; 503 when no engine can serve. Asked while
    the coordinator restarts, it can fail the first question and answer the router's: what requests are routed on
    decides, so /health never says 503 while they are served."""
    try:
        coordinator = CoordinatorClient.of(coordinator)
        ready = {role: await asyncio.wait_for(coordinator.ready(role), timeout_s)
                 for role in ("prefill", "decode")}
        routes = await asyncio.wait_for(coordinator.routes(), timeout_s)
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
    desc = await asyncio.wait_for(CoordinatorClient.of(coordinator).describe(), 5)
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
    for engine_id in [e for e in seen if e not in roles and not e.startswith(DEPARTED)]:
        # an engine that left: its last totals fold into its role's departed sum (the map stays as big as the pools)
        role, engine_totals = seen.pop(engine_id)
        _, departed = seen.get(DEPARTED + role, (role, TransferTotals()))
        seen[DEPARTED + role] = (role, departed + engine_totals)
    totals = TransferTotals()
    per_role = ("cached_prompt_tokens", "computed_prompt_tokens", "predicted_prompt_tokens", "mispredicted")
    by_role: dict[str, dict[str, int]] = {key: {"prefill": 0, "decode": 0} for key in per_role}
    for role, engine_totals in seen.values():  # counters never go down: engines that left count in DEPARTED sums
        totals += engine_totals
        for key in per_role:
            by_role[key][role] += getattr(engine_totals, key)
    return {"pools": pools, "transfers": totals, **by_role, "retried": router.retried,
            "routing": dict(router.choice.decisions), "routing_views": router.choice.views,
            "routing_view_seconds": router.choice.view_seconds, "routing_view_failures": router.choice.view_failures,
            "routing_unasked": router.choice.unasked,
            "scaling": desc.get("pools", {}), "colocated": dict(router.colocated), "degraded": router.degraded,
            "failed_over": router.failed_over, "waited_for_capacity": router.waited_for_capacity,
            "suspected": router.choice.suspected,
            "first_from_prefill": router.first_from_prefill,
            "stale_routed": router.stale_routed, "local_prefill": router.local_prefill}


# The front end is supervised by Ray: killed, it is restarted in place (pinned to its node by `cluster.cli.launch`) and
# serves again on its own, with its settings as it was created with - nobody has to call `start` again.
@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class HTTPFrontend:
    """One front-end process: vLLM's OpenAI app over the cluster, served by uvicorn on the configured address.

    Created with its settings (`cluster.cli.launch.start_http`), it starts serving at once and again after each restart;
    `start` waits for that and returns the URL. Several replicas share one port (`http.replicas`, SO_REUSEPORT: the
    kernel spreads new connections over the listening processes); each has its own router, admission bound and
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

        from actors.cores import normal_priority, start_host_cores

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
