"""A minimal proxy in front of vLLM's stock P/D (two `vllm serve` processes with its NixlConnector), the baseline of
`python -m cluster bench serve`: what a user of vLLM's disaggregated prefill puts in front of it. Per completion: the
prefill server runs the prompt with max_tokens 1 and `kv_transfer_params: {"do_remote_decode": true}`, then the
decode server gets the original request plus the transfer parameters the prefill server returned, and its response
(streamed or not) is passed through. Other routes (/v1/models, /tokenize, ...) go to the decode server.

    python -m cluster.cli.bench.stock_pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web


def make_app(prefill: str, decode: str) -> web.Application:
    session: dict[str, aiohttp.ClientSession] = {}

    async def start(_: web.Application) -> None:
        session["s"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def stop(_: web.Application) -> None:
        await session["s"].close()

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        first = {**body, "max_tokens": 1, "stream": False,
                 "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        first.pop("stream_options", None)
        first.pop("max_completion_tokens", None)
        async with session["s"].post(prefill + request.path, json=first) as r:
            answer = await r.json()
            if r.status != 200:
                return web.json_response(answer, status=r.status)
        body["kv_transfer_params"] = answer.get("kv_transfer_params")
        async with session["s"].post(decode + request.path, json=body) as r:
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "")})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def passthrough(request: web.Request) -> web.Response:
        data = await request.read()
        async with session["s"].request(request.method, decode + request.path, data=data,
                                        headers={"Content-Type": request.headers.get("Content-Type", "")}) as r:
            return web.Response(body=await r.read(), status=r.status,
                                headers={"Content-Type": r.headers.get("Content-Type", "")})

    app = web.Application(client_max_size=1 << 24)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_route("*", "/{tail:.*}", passthrough)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m cluster.cli.bench.stock_pd_proxy")
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    web.run_app(make_app(args.prefill, args.decode), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
