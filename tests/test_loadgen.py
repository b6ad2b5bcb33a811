"""`bench load`'s outcome classes, against a real HTTP server that answers each way a service can (a stand-in: the
malformed and refused answers cannot be caused on demand in the real service): complete, 4xx, 503 with Retry-After
(which the client honours, with jitter), an error event mid-stream, and malformed answers; "lost" counts only
accepted requests that neither completed nor were cleanly refused."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from actors.engine.settings import free_port
from cluster.cli.bench.loadgen import run_load

KINDS = ["retry_after", "bad_request", "complete", "error_event", "server_error", "bare_503", "truncated"]


def _app(seen: list[tuple[str, float]]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict):
        kind = KINDS[len(seen) % len(KINDS)]
        seen.append((kind, time.monotonic()))

        def chunk(text: str, usage: int | None = None) -> str:
            obj = {"id": "cmpl-1", "choices": [{"index": 0, "text": text}]}
            if usage is not None:
                obj = {"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": usage}}
            return f"data: {json.dumps(obj)}\n\n"

        async def stream(kind: str):
            yield chunk("a")
            if kind == "error_event":
                yield 'data: {"error": {"message": "engine died", "code": 503}}\n\n'
                yield "data: [DONE]\n\n"
                return
            yield chunk("b")
            if kind == "truncated":
                return
            yield chunk("", usage=body["max_tokens"])
            yield "data: [DONE]\n\n"

        if kind == "retry_after":
            return JSONResponse({"error": {"message": "busy", "code": 503}}, status_code=503, headers={"Retry-After": "2"})
        if kind == "bare_503":
            return JSONResponse({"error": {"message": "busy", "code": 503}}, status_code=503)
        if kind == "bad_request":
            return JSONResponse({"error": {"message": "bad", "code": 400}}, status_code=400)
        if kind == "server_error":
            return PlainTextResponse("boom", status_code=500)
        return StreamingResponse(stream(kind), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server():
    seen: list[tuple[str, float]] = []
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(_app(seen), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", seen
    srv.should_exit = True
    thread.join(10)


def test_every_outcome_has_its_class(server):
    url, seen = server
    res = asyncio.run(run_load(url, "m", clients=1, duration_s=5.0, max_tokens=2))
    s = res.summary()
    counts = {k: sum(1 for kind, _ in seen if kind == k) for k in KINDS}
    assert s["requests"] == len(seen) >= len(KINDS)
    assert s["complete"] == counts["complete"] and s["refused_4xx"] == counts["bad_request"]
    assert s["refused_503"] == counts["retry_after"] and s["failed_midstream"] == counts["error_event"]
    assert s["malformed"] == counts["server_error"] + counts["bare_503"] + counts["truncated"]
    assert s["lost"] == counts["error_event"] + counts["truncated"]  # accepted, then neither completed nor refused
    # the client waited Retry-After (2 s, +-50%) after each clean 503, and not after the other answers (which take
    # milliseconds; the margin is for a loaded machine)
    for (kind, t), (_, t_next) in zip(seen, seen[1:]):
        gap = t_next - t
        assert (gap >= 0.95) if kind == "retry_after" else (gap < 0.95), (kind, gap)
