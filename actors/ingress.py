"""The HTTP ingress: an OpenAI-style completions API (FastAPI) in a Ray Serve deployment, in front of the router.

Routes: `POST /v1/completions` (JSON or Server-Sent Events), `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus). Every error is an OpenAI-style body {"error": {message, type, param, code}}: 400 for invalid requests
(including prompts that do not fit the context), 401 for a missing or wrong API key, 404 for an unknown model or
route, 413 for an oversized body, 503 with Retry-After when no engine or pair can take the request or an engine
failed. A client that disconnects cancels the request, which aborts it on the decode engine and frees the prefill
engine's blocks (`cluster.router`).

`build_app(service)` is the plain FastAPI app (usable without Serve, e.g. with a TestClient); `Ingress` is the Serve
deployment that wraps it (`ingress_app(settings)` builds the Serve application).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.metrics import ServiceMetrics
from cluster.openai_api import (
    APIError, CompletionRequest, chunk, completion, error_body, model_list, new_id, request_schema, usage, validation_error,
)
from cluster.router import CoordinatorUnavailable, EngineFailure, NoCapacity, Router

log = logging.getLogger("pd.ingress")
APP_NAME = "hybrid-pd"


@dataclass(frozen=True)
class IngressSettings:
    """What the ingress needs to know; built from `deploy.yaml` by `cluster.launch`."""

    model_name: str
    model_dir: str
    max_model_len: int
    coordinator_name: str
    namespace: str
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 2


class Service:
    """The state behind the routes: router, tokenizer, limits, metrics."""

    def __init__(self, settings: IngressSettings, coordinator: Any, tokenizer: Any | None = None):
        self.settings = settings
        self.coordinator = coordinator
        self.router = Router(coordinator)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
        self.tokenizer = tokenizer
        cfg = json.loads((Path(settings.model_dir) / "config.json").read_text())
        self.vocab_size = int((cfg.get("text_config") or cfg).get("vocab_size") or len(tokenizer))
        self.created = int(time.time())
        self.metrics = ServiceMetrics()
        self.transfer_seen: dict[str, dict[str, float]] = {}  # decode engine -> its last reported transfer totals
        self.api_key = settings.api_key.encode() if settings.api_key else None

    # ---- request preparation ------------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           type="invalid_request_error", code="invalid_api_key")

    async def parse(self, request: Request) -> CompletionRequest:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.settings.max_body_bytes:
            raise APIError(413, f"request body exceeds {self.settings.max_body_bytes} bytes", code="request_too_large")
        body = b""
        async for part in request.stream():
            body += part
            if len(body) > self.settings.max_body_bytes:
                raise APIError(413, f"request body exceeds {self.settings.max_body_bytes} bytes", code="request_too_large")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, too deep, a 5000-digit number
            raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
        try:
            req = CompletionRequest.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        if req.model != self.settings.model_name:
            raise APIError(404, f"the model '{req.model}' does not exist; this service serves '{self.settings.model_name}'",
                           param="model", code="model_not_found")
        req.check_supported()
        return req

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            try:
                ids = list(self.tokenizer(req.prompt)["input_ids"])
            except (TypeError, ValueError) as e:
                raise APIError(400, f"the prompt cannot be tokenized: {str(e)[:200]}", param="prompt", code="invalid_value") from None
            if not ids:
                raise APIError(400, "the prompt encodes to no tokens", param="prompt", code="invalid_value")
            return ids
        bad = [t for t in req.prompt if t >= self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range: the vocabulary has {self.vocab_size} tokens",
                           param="prompt", code="invalid_value")
        return list(req.prompt)

    def budget(self, req: CompletionRequest, n_prompt: int) -> int:
        """max_tokens after checking prompt + max_tokens against the context (null: all that fits)."""
        limit = self.settings.max_model_len
        if n_prompt >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has {n_prompt}",
                           param="prompt", code="context_length_exceeded")
        if req.max_tokens is None:
            return limit - n_prompt
        if n_prompt + req.max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; you requested "
                           f"{n_prompt + req.max_tokens} ({n_prompt} in the prompt, {req.max_tokens} for the completion)",
                           param="max_tokens", code="context_length_exceeded")
        return req.max_tokens

    # ---- serving ------------------------------------------------------------------------------------------------
    async def run(self, ids: list[int], sampling: dict[str, Any], rid: str) -> AsyncIterator[dict[str, Any]]:
        """The router's stream, with its failures turned into API errors and latencies recorded."""
        t0 = time.perf_counter()
        last = None  # time of the previous output that carried tokens
        try:
            async with contextlib.aclosing(self.router.generate(ids, sampling, request_id=rid)) as outputs:
                async for out in outputs:
                    now = time.perf_counter()
                    n = len(out["token_ids"])
                    if n and last is None:
                        self.metrics.ttft.observe(now - t0)
                    elif n:
                        for _ in range(n):
                            self.metrics.itl.observe((now - last) / n)
                    if n:
                        last = now
                    self.metrics.completion_tokens.inc(n)
                    yield out
        except NoCapacity as e:
            raise APIError(503, f"no engine can take the request now: {e}", type="service_unavailable_error",
                           code="no_capacity", headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        except EngineFailure as e:
            log.warning("request %s: %s", rid, e)
            raise APIError(503, f"the request failed in {e.phase} ({e.engine_id}); retry it", type="service_unavailable_error",
                           code="engine_failure", headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        except CoordinatorUnavailable as e:
            raise APIError(503, f"the coordinator is unavailable: {e}", type="service_unavailable_error",
                           code="no_capacity", headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        self.metrics.e2e.observe(time.perf_counter() - t0)

    async def cluster_state(self) -> dict[str, Any]:
        """Pool sizes, autoscaling decisions and signals from the coordinator, and transfer totals from the decode
        engines (bounded by a timeout)."""
        desc = await asyncio.wait_for(self.coordinator.describe.remote(), 5)
        pools: dict[tuple[str, str], int] = {}
        for e in desc["engines"].values():
            pools[(e["role"], e["state"])] = pools.get((e["role"], e["state"]), 0) + 1
        for role in ("prefill", "decode"):
            for st in ("ready", "draining"):
                pools.setdefault((role, st), 0)
        totals = {"transfers": 0, "bytes": 0, "descriptors": 0, "seconds": 0.0}
        decode_ids = [k for k, e in desc["engines"].items() if e["role"] == "decode"]

        async def one(engine_id: str) -> dict[str, float]:
            handle = await self.router._handle(engine_id, "decode")
            return await asyncio.wait_for(handle.transfer_totals.remote(), 5)

        for engine_id, got in zip(decode_ids, await asyncio.gather(*(one(d) for d in decode_ids), return_exceptions=True)):
            if isinstance(got, dict):
                self.transfer_seen[engine_id] = got
        # counters never go down: engines that left or did not answer keep their last totals
        for seen in self.transfer_seen.values():
            for k in totals:
                totals[k] += seen[k]
        return {"pools": pools, "transfers": totals, "retried": self.router.retried, "scaling": desc.get("pools", {})}


class _Outcome:
    """Counts one request's end exactly once: 200, an API error's status, a client disconnect, or 500."""

    def __init__(self, metrics: ServiceMetrics):
        self.m, self.done = metrics, False

    def end(self, error: BaseException | None) -> None:
        if self.done:
            return
        self.done = True
        self.m.inflight.dec()
        if error is None:
            self.m.requests.labels("200").inc()
        elif isinstance(error, APIError):
            self.m.requests.labels(str(error.status)).inc()
            self.m.errors.labels(error.code or "error").inc()
        elif isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            self.m.disconnects.inc()
        else:
            self.m.requests.labels("500").inc()
            self.m.errors.labels("internal_error").inc()


async def _close(stream: Any) -> None:
    try:
        await stream.aclose()
    except BaseException:  # noqa: BLE001 - closing runs the router's clean-up; its errors are not the caller's
        pass


class _Stream(StreamingResponse):
    """A streaming response that runs `abandoned()` when it ends, however it ends (a client that disconnects before
    the body starts never runs the body's own clean-up)."""

    def __init__(self, content: Any, abandoned: Any, **kw: Any):
        super().__init__(content, **kw)
        self._abandoned = abandoned

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._abandoned()


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def build_app(service: Service) -> FastAPI:
    app = FastAPI(title="hybrid-pd", description="OpenAI-style completions over disaggregated prefill/decode")
    m = service.metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(error_body(str(e.detail), param=None, code=code), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(f"invalid request: {e.errors()[0].get('msg')}", code="invalid_value"), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", type="server_error", code="internal_error"), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        try:
            ready = {role: await asyncio.wait_for(service.coordinator.ready.remote(role), 5) for role in ("prefill", "decode")}
        except Exception as e:  # noqa: BLE001 - coordinator down or slow: unavailable, not an error page
            return JSONResponse({"status": "unavailable", "model": service.settings.model_name, "error": type(e).__name__},
                                status_code=503, headers={"Retry-After": str(service.settings.retry_after_s)})
        ok = bool(ready["prefill"] and ready["decode"])
        body = {"status": "ok" if ok else "unavailable", "model": service.settings.model_name,
                "ready": {k: len(v) for k, v in ready.items()}}
        if not ok:
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(service.settings.retry_after_s)})
        return body

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        service.authorize(request)
        try:
            m.cluster_state = await service.cluster_state()
        except Exception as e:  # noqa: BLE001 - the service's own metrics still render
            log.warning("cluster state unavailable for /metrics: %s", e)
            m.cluster_state = {**m.cluster_state, "pools": {}}  # unknown now: no stale pool sizes
        return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        service.authorize(request)
        return model_list(service.settings.model_name, service.created)

    @app.post("/v1/completions", openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": request_schema()}}}})
    async def completions(request: Request) -> Response:
        try:
            service.authorize(request)
            req = await service.parse(request)
            ids = service.prompt_ids(req)
            max_tokens = service.budget(req, len(ids))
        except APIError as e:
            m.requests.labels(str(e.status)).inc()
            m.errors.labels(e.code or "error").inc()
            raise
        rid, created = new_id(), int(time.time())
        m.prompt_tokens.inc(len(ids))
        stream = service.run(ids, req.sampling(max_tokens), rid)
        m.inflight.inc()
        outcome = _Outcome(m)
        try:
            # the first output arrives before any byte is sent, so a failure before it is a plain HTTP error
            first = await anext(stream, None)
        except BaseException as e:
            outcome.end(e)
            await _close(stream)
            raise
        if not req.stream:
            text, n, finish = "", 0, None
            try:
                out = first
                while out is not None:
                    text += out["text"]
                    n += len(out["token_ids"])
                    finish = out["finish_reason"] or finish
                    out = await anext(stream, None)
            except BaseException as e:
                outcome.end(e)
                await _close(stream)
                raise
            outcome.end(None)
            return JSONResponse(completion(rid, req.model, text, finish, usage(len(ids), n), created))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[bytes]:
            n = 0
            try:
                out = first
                while out is not None:
                    n += len(out["token_ids"])
                    if out["text"] or out["finish_reason"]:
                        yield _sse(chunk(rid, req.model, created, out["text"], out["finish_reason"]))
                    out = await anext(stream, None)
                if include_usage:
                    yield _sse({**chunk(rid, req.model, created, "", None), "choices": [], "usage": usage(len(ids), n)})
                yield b"data: [DONE]\n\n"
                outcome.end(None)
            except APIError as e:  # mid-stream: the status line is already sent; an error event ends the stream
                outcome.end(e)
                yield _sse(e.body())
                yield b"data: [DONE]\n\n"
            except BaseException as e:
                outcome.end(e)
                raise

        async def abandoned() -> None:  # the response ended without events() finishing (client gone before/while)
            outcome.end(asyncio.CancelledError())
            await _close(stream)

        return _Stream(events(), abandoned, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def _make_deployment():
    from ray import serve

    @serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=512, num_replicas=1)
    @serve.ingress()
    class Ingress:
        """The Serve replica: looks up the coordinator by name and serves `build_app`."""

        def __init__(self, settings: IngressSettings):
            import ray

            coordinator = ray.get_actor(settings.coordinator_name, namespace=settings.namespace)
            self.service = Service(settings, coordinator)

        def __serve_build_asgi_app__(self) -> FastAPI:
            return build_app(self.service)

    return Ingress


def ingress_app(settings: IngressSettings):
    """The Serve application (bind it with `serve.run(ingress_app(s), name=APP_NAME, route_prefix="/")`)."""
    return _make_deployment().bind(settings)
