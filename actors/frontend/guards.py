"""The front end's own layers in front of vLLM's app (ASGI middleware, `guarded` stacks them): the API key on every
route but /health (`ApiKey`), admission control - a bound on generation requests in flight and queued, 429 +
Retry-After past it (`Admission`) - the body limit, valid JSON and the cap on `n` (`BodyGuard`), and each generation
request's outcome counted by status (`Outcomes`). Each answers before the next one costs anything, with an
OpenAI-style error body (`send_error`)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
from collections import deque
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge
from pydantic import TypeAdapter, ValidationError

from cluster.core.metrics import ServiceMetrics

if TYPE_CHECKING:
    from actors.frontend.server import FrontendSettings

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")  # admission control and the cap on n apply to these
OPEN_ROUTES = ("/health",)  # the only route that never needs the API key (liveness probes)
QUEUE_READ_AHEAD_BYTES = 1 << 16  # of a waiting request's body, read to hear its client leave (`Admission`)


# ---- the app ----------------------------------------------------------------------------------------------------
def guarded(app: Any, settings: FrontendSettings, metrics: ServiceMetrics) -> Any:
    """The front end's own layers around vLLM's app (ASGI middleware, outermost first), each answering before the
    next one costs anything: `Outcomes` (counts generation requests by status, holds a stream's status line),
    `ApiKey` (when a key is set: every route but /health; before a request can take a place in the queue),
    `Admission` (generation requests in flight and queued; 429 past them, before the body is read), `BodyGuard`
    (body size, valid JSON, `n`/`best_of` at most `max_n`), then vLLM's app. vLLM's app is already built, so they
    are wrapped by hand rather than added with `add_middleware`."""
    refused = Counter("pd_requests_refused", "Generation requests the front end refused by its own limits, by reason: "
                      "queue_full (429: http.max_requests_in_flight in flight and http.max_queued_requests waiting), "
                      "n_over_limit (400: n or best_of above http.max_n)", ["reason"], registry=metrics.registry)
    for reason in ("queue_full", "n_over_limit"):
        refused.labels(reason)  # each series exported from the start, at 0
    inner = BodyGuard(app, settings.max_body_bytes, settings.max_n, refused)
    inner = Admission(inner, settings.max_requests_in_flight, settings.max_queued_requests, settings.retry_after_s,
                       refused, Gauge("pd_requests_queued", "Generation requests waiting for one in flight to end "
                                      "(http.max_queued_requests)", registry=metrics.registry))
    if settings.api_key:
        inner = ApiKey(inner, settings.api_key)
    return Outcomes(inner, metrics, settings.retry_after_s)


class ApiKey:
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
        await send_error(send, 401, "a valid API key is required: send `Authorization: Bearer <key>`",
                          "invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])


def _is_generation(scope: dict) -> bool:
    return scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_ROUTES


class Admission:
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
            return await send_error(
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


class BodyGuard:
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
            return await send_error(send, 413, f"request body exceeds {self.limit} bytes", "request_too_large")
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                return await send_error(send, 413, f"request body exceeds {self.limit} bytes", "request_too_large")
            if not message.get("more_body"):
                break
        if body:
            try:
                parsed = json.loads(body)
                json.dumps(parsed, ensure_ascii=False).encode("utf-8")
            except (ValueError, RecursionError, UnicodeError) as e:
                return await send_error(send, 400, f"the request body is not valid JSON: {str(e)[:200]}", "invalid_json")
            over = self._over_max_n(scope, parsed)
            if over is not None:
                if self.refused is not None:
                    self.refused.labels("n_over_limit").inc()
                name, value = over
                return await send_error(send, 400, f"{name} must be at most {self.max_n}, got {value}: each choice is "
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


class Outcomes:
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
                    return await send_error(send, error[0], body=error[1], retry_after=self.retry_after)
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


async def send_error(send: Any, status: int, message: str = "", code: str | None = None, body: bytes | None = None,
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
