"""A bounded concurrent load against the HTTP service: `clients` loops of streamed completions for `duration_s`.

Every response is checked: HTTP 200, well-formed SSE chunks, one id, a final `[DONE]`, and (with `ignore_eos`) exactly
`max_tokens` tokens in `usage`. Reports lost and malformed responses, p50/p99 time to first token and inter-token
latency, and output tokens per second. `python -m cluster bench load` runs it against a URL.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class LoadResult:
    requests: int = 0
    ok: int = 0
    errors: list[str] = field(default_factory=list)  # lost or malformed, with the reason
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float | None:
            return round(statistics.quantiles(xs, n=100)[q - 1] * 1e3, 1) if len(xs) >= 2 else None

        return {
            "requests": self.requests, "ok": self.ok, "lost_or_malformed": len(self.errors),
            "ttft_p50_ms": pct(self.ttft_s, 50), "ttft_p99_ms": pct(self.ttft_s, 99),
            "itl_p50_ms": pct(self.itl_s, 50), "itl_p99_ms": pct(self.itl_s, 99),
            "output_tokens_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "requests_per_s": round(self.ok / self.wall_s, 2) if self.wall_s else 0.0,
            "first_errors": self.errors[:5],
        }


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], res: LoadResult) -> None:
    res.requests += 1
    t0 = time.perf_counter()
    last = None
    ids, n_usage, done, chunks = set(), None, False, 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    res.errors.append(f"not an SSE data line: {line[:100]!r}")
                    return
                if line == "data: [DONE]":
                    done = True
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    res.errors.append(f"error event: {obj['error'].get('message')}")
                    return
                ids.add(obj["id"])
                if obj.get("usage"):
                    n_usage = obj["usage"]["completion_tokens"]
                if obj["choices"]:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s.append(now - t0)
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    chunks += 1
    except Exception as e:  # noqa: BLE001 - any failure of one request is a lost or malformed response
        res.errors.append(f"{type(e).__name__}: {e}")
        return
    if not done or len(ids) != 1 or n_usage != body["max_tokens"]:
        res.errors.append(f"malformed: done={done} ids={len(ids)} usage={n_usage} chunks={chunks}")
        return
    res.ok += 1
    res.tokens += n_usage


async def run_load(url: str, model: str, clients: int = 32, duration_s: float = 60.0, max_tokens: int = 32,
                   prompt_tokens: tuple[int, int] = (16, 400), api_key: str | None = None, seed: int = 0) -> LoadResult:
    """`clients` concurrent loops, each sending one streamed request after another until `duration_s` is over
    (requests in flight then finish; none is started after)."""
    res = LoadResult()
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.perf_counter() + duration_s
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def loop(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            n = rng.randint(*prompt_tokens)
            body = {"model": model, "prompt": [1] + [rng.randrange(3, 1000) for _ in range(n)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            await _one(client, url, body, res)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits, headers=headers) as client:
        await asyncio.gather(*(loop(client) for _ in range(clients)))
    res.wall_s = time.perf_counter() - t0
    return res
