"""A bounded concurrent load against the HTTP service: `clients` loops of streamed completions for `duration_s`.

Every response is checked and put in one outcome class:
  complete         HTTP 200, well-formed SSE chunks, one id, a final `[DONE]`, and (with `ignore_eos`) exactly
                   `max_tokens` tokens in `usage`;
  refused_4xx      a 4xx answer (the request was bad, or unauthorized);
  refused_503      503 with `Retry-After`: the service said "not now", cleanly. The client waits Retry-After
                   (with +-50% jitter) before its next request, as a well-behaved client does;
  failed_midstream accepted (200) and then ended with an error event;
  malformed        anything else: a 5xx other than a clean 503, a 503 without Retry-After, a broken or short stream,
                   a transport error.
"lost" = accepted and neither completed nor cleanly refused (failed mid-stream, or malformed after the 200). Also
p50/p99 time to first token and inter-token latency, and output tokens per second. `python -m cluster bench load`
runs it against a URL.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

OUTCOMES = ("complete", "refused_4xx", "refused_503", "failed_midstream", "malformed")


def percentile_ms(xs: list[float], q: int) -> float | None:
    """The q-th percentile of durations in seconds, in ms (None with fewer than two)."""
    return round(statistics.quantiles(xs, n=100)[q - 1] * 1e3, 1) if len(xs) >= 2 else None


@dataclass
class LoadResult:
    requests: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    lost: int = 0  # accepted (200) and then neither completed nor cleanly refused
    errors: list[str] = field(default_factory=list)  # every outcome but complete and refused_503, with the reason
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    # when things happened (time.perf_counter()), for windows around an event (`bench faults`): each request's
    # (start, end, outcome), each TTFT's request start, each ITL's arrival
    timeline: list[tuple[float, float, str]] = field(default_factory=list)
    ttft_at: list[float] = field(default_factory=list)
    itl_at: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0

    def merge(self, one: "LoadResult") -> None:
        """Add another result's requests (one request's, run into a result of its own) to this one."""
        self.requests += one.requests
        for k, v in one.outcomes.items():
            self.outcomes[k] += v
        self.lost += one.lost
        self.tokens += one.tokens
        for name in ("errors", "ttft_s", "itl_s", "timeline", "ttft_at", "itl_at"):
            getattr(self, name).extend(getattr(one, name))

    @property
    def ok(self) -> int:
        return self.outcomes["complete"]

    def summary(self) -> dict[str, Any]:
        pct = percentile_ms
        return {
            "requests": self.requests, **self.outcomes, "lost": self.lost,
            "ttft_p50_ms": pct(self.ttft_s, 50), "ttft_p99_ms": pct(self.ttft_s, 99),
            "itl_p50_ms": pct(self.itl_s, 50), "itl_p99_ms": pct(self.itl_s, 99),
            "output_tokens_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "requests_per_s": round(self.ok / self.wall_s, 2) if self.wall_s else 0.0,
            "first_errors": self.errors[:5],
        }


def _retry_after(r: httpx.Response) -> float | None:
    try:
        return float(r.headers["retry-after"])
    except (KeyError, ValueError):
        return None


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], res: LoadResult) -> float | None:
    """One streamed request, classified into `res`; returns the seconds to wait before the next one (Retry-After of
    a clean 503), else None."""
    res.requests += 1
    t0 = time.perf_counter()
    last = None
    ids, n_usage, done, chunks, accepted = set(), None, False, 0, False

    def outcome(kind: str, why: str | None = None) -> None:
        res.outcomes[kind] += 1
        res.timeline.append((t0, time.perf_counter(), kind))
        if why is not None:
            res.errors.append(f"{kind}: {why}")
        if accepted and kind in ("failed_midstream", "malformed"):
            res.lost += 1

    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code == 503 and _retry_after(r) is not None:
                await r.aread()
                outcome("refused_503")
                return _retry_after(r)
            if 400 <= r.status_code < 500:
                outcome("refused_4xx", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return None
            if r.status_code != 200:
                outcome("malformed", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return None
            accepted = True
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    outcome("malformed", f"not an SSE data line: {line[:100]!r}")
                    return None
                if line == "data: [DONE]":
                    done = True
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    outcome("failed_midstream", f"error event after {chunks} chunks: {obj['error'].get('message')}")
                    return None
                ids.add(obj["id"])
                if obj.get("usage"):
                    n_usage = obj["usage"]["completion_tokens"]
                if obj["choices"]:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s.append(now - t0)
                        res.ttft_at.append(t0)
                    else:
                        res.itl_s.append(now - last)
                        res.itl_at.append(now)
                    last = now
                    chunks += 1
    except Exception as e:  # noqa: BLE001 - a transport failure of one request
        outcome("malformed", f"{type(e).__name__}: {e}")
        return None
    if not done or len(ids) != 1 or n_usage != body["max_tokens"]:
        outcome("malformed", f"done={done} ids={len(ids)} usage={n_usage} chunks={chunks}")
        return None
    outcome("complete")
    res.tokens += n_usage
    return None


async def run_load(url: str, model: str, clients: int = 32, duration_s: float = 60.0,
                   max_tokens: int | tuple[int, ...] = 32, prompt_tokens: tuple[int, int] = (16, 400),
                   api_key: str | None = None, seed: int = 0,
                   on_answer: Callable[[LoadResult, float | None], float | None] | None = None) -> LoadResult:
    """`clients` concurrent loops, each sending one streamed request after another until `duration_s` is over
    (requests in flight then finish; none is started after). `max_tokens`: a number, or choices drawn per request.
    `on_answer(its result, Retry-After)`: told each request's own result as it ends; returns the seconds to wait
    before the next request (`bench soak` classifies each request and waits after a 429)."""
    res = LoadResult()
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.perf_counter() + duration_s
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def loop(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            n = rng.randint(*prompt_tokens)
            out = rng.choice(max_tokens) if isinstance(max_tokens, tuple) else max_tokens
            body = {"model": model, "prompt": [1] + [rng.randrange(3, 1000) for _ in range(n)], "max_tokens": out,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if on_answer is None:
                wait = await _one(client, url, body, res)
            else:
                one = LoadResult()  # this request alone, for the hook
                wait = on_answer(one, await _one(client, url, body, one))
                res.merge(one)
            if wait is not None:  # honour Retry-After (at least 50 ms), with jitter: clients must not come back in lockstep
                await asyncio.sleep(min(max(wait, 0.05) * rng.uniform(0.5, 1.5), max(0.0, deadline - time.perf_counter())))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits, headers=headers) as client:
        await asyncio.gather(*(loop(client) for _ in range(clients)))
    res.wall_s = time.perf_counter() - t0
    return res
