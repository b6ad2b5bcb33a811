"""`bench e2e` and `bench prefix`: one prefill and one decode engine started together (`pair`), the same requests
served colocated and disaggregated (`bench_pair`), or with and without a cached prefix (`bench_prefix`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time


async def _ttft(stream_factory) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first = None
    n = 0
    async for item in stream_factory():
        if first is None and item["token_ids"]:
            first = time.perf_counter() - t0
        n += len(item["token_ids"])
    return first or 0.0, time.perf_counter() - t0, n


@contextlib.asynccontextmanager
async def pair(model_dir, p_tp: int, d_tp: int, engine_kwargs: dict | None = None):
    """A coordinator, one prefill and one decode engine, registered, and a router over them: yields (prefill client,
    decode client, router, the engines' startup seconds); everything stops afterwards."""
    from actors.control.coordinator import start_coordinator
    from actors.engine.actor import launch_engine_actor, stop_engine_actors
    from actors.frontend.router import Router

    coord = start_coordinator()
    (P, ps), (D, ds) = (
        launch_engine_actor(model_dir, p_tp, role="prefill", engine_id=f"bench-p{p_tp}", engine_kwargs=engine_kwargs),
        launch_engine_actor(model_dir, d_tp, role="decode", engine_id=f"bench-d{d_tp}", engine_kwargs=engine_kwargs),
    )
    try:
        startup = (await ps, await ds)
        await P.register(coord)
        await D.register(coord)
        yield P, D, Router(coord), startup
    finally:
        stop_engine_actors([P, D])
        coord.kill()


async def bench_pair(model_dir, p_tp: int, d_tp: int, prompt_lens: list[int], reps: int, max_tokens: int,
                      concurrency: int = 8) -> list[dict]:
    """One prefill and one decode engine; per prompt length a row (engines started once per pair)."""
    from actors.engine.settings import DEFAULT_MAX_MODEL_LEN

    # the engines' context as long as the longest request, never shorter than their default
    longest = {"max_model_len": max(DEFAULT_MAX_MODEL_LEN, max(prompt_lens) + max_tokens)}
    async with pair(model_dir, p_tp, d_tp, longest) as (P, D, router, startup):
        rows = []
        for prompt_len in prompt_lens:
            print(f"  {prompt_len}-token prompts ...", flush=True)
            rows.append(await measure_pair(P, D, router, startup, p_tp, d_tp, prompt_len, reps, max_tokens,
                                            concurrency))
            print(json.dumps(rows[-1]), flush=True)
        return rows


async def measure_pair(P, D, router, startup, p_tp: int, d_tp: int, prompt_len: int, reps: int, max_tokens: int,
                        concurrency: int) -> dict:
    from cluster.cli.bench.transfer_side import memcpy_seconds

    rng = random.Random(1)
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    colo, disagg, transfers = [], [], []
    peak = 0
    for i in range(reps + 1):  # the first round warms both paths and is not counted
        prompt = [1] + [rng.randrange(3, 1024) for _ in range(prompt_len - 1)]
        c = await _ttft(lambda: _stream(D, prompt, dict(sampling), f"colo-{i}"))
        await D.transfer_stats()
        d = await _ttft(lambda: router.generate(prompt, dict(sampling)))
        stats = await D.transfer_stats()
        peak = max(peak, sum(await asyncio.gather(P.rss_bytes(), D.rss_bytes())))
        if i:
            colo.append(c)
            disagg.append(d)
            transfers.append(stats)
    # the same request stream at `concurrency` in flight: output tokens per second, colocated vs disaggregated
    stream = [[1] + [rng.randrange(3, 1024) for _ in range(prompt_len - 1)] for _ in range(concurrency * 2)]

    async def drain(gen) -> int:
        return sum([len(item["token_ids"]) async for item in gen])

    async def phase(make) -> float:
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(drain(make(i, p)) for i, p in enumerate(stream))))
        return tokens / (time.perf_counter() - t0)

    tput_colo = tput_disagg = None
    if concurrency:
        tput_colo = round(await phase(lambda i, p: _stream(D, p, dict(sampling), f"tput-colo-{i}")), 1)
        tput_disagg = round(await phase(lambda i, p: router.generate(p, dict(sampling))), 1)
    await D.transfer_stats()
    # a read's time: from planning it to the decode engine seeing it done (max over the decode ranks, which read in
    # parallel), against one thread copying the same bytes in this process - the ceiling on one host
    t_ms = [max((s["ms"] for s in st), default=0.0) for st in transfers]
    nbytes = sum(s["bytes"] for s in transfers[-1])
    memcpy_ms = memcpy_seconds(nbytes) * 1e3
    return {
        "throughput_colocated_tok_s": tput_colo,
        "throughput_disaggregated_tok_s": tput_disagg,
        "concurrency": concurrency,
        "prefill_tp": p_tp,
        "decode_tp": d_tp,
        "prompt_tokens": prompt_len,
        "engine_startup_s": [round(x, 1) for x in startup],
        "ttft_colocated_ms": round(statistics.median(x[0] for x in colo) * 1e3, 1),
        "ttft_disaggregated_ms": round(statistics.median(x[0] for x in disagg) * 1e3, 1),
        "transfer_ms": round(statistics.median(t_ms), 2),
        "transfer_share_of_ttft": round(statistics.median(t_ms) / (statistics.median(x[0] for x in disagg) * 1e3), 5),
        "transfer_gbps": round(nbytes / statistics.median(t_ms) / 1e6, 2) if statistics.median(t_ms) else None,
        "memcpy_ms": round(memcpy_ms, 2),
        "transfer_over_memcpy": round(memcpy_ms / statistics.median(t_ms), 3) if statistics.median(t_ms) else None,
        "itl_colocated_ms": round(statistics.median((x[1] - x[0]) / max(1, x[2] - 1) for x in colo) * 1e3, 2),
        "itl_disaggregated_ms": round(statistics.median((x[1] - x[0]) / max(1, x[2] - 1) for x in disagg) * 1e3, 2),
        "bytes_per_request": nbytes,
        "descriptors_per_request": sum(s["descriptors"] for s in transfers[-1]),
        "descriptors_uncoalesced": sum(s["descriptors_uncoalesced"] for s in transfers[-1]),
        "plan_us_per_rank": round(statistics.median(s["plan_us"] for st in transfers for s in st), 1),
        "peak_rss_gib": round(peak / 2**30, 2),
    }


async def bench_prefix(model_dir, p_tp: int, d_tp: int, prefix_len: int, suffix_len: int, reps: int,
                        max_tokens: int) -> dict:
    """Prefix caching in P/D: per round a new shared prefix (a document) with two different suffixes (questions),
    sent one after the other through the router: the first finds nothing cached (a miss), the second finds the
    prefix in both engines' caches (a hit). TTFT, the decode engine's bytes read and each engine's cached tokens."""
    async with pair(model_dir, p_tp, d_tp, {"enable_prefix_caching": True}) as (P, D, router, _):
        rng = random.Random(2)
        sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        words = lambda n: [rng.randrange(3, 1024) for _ in range(n)]  # noqa: E731
        runs: dict[str, list[dict]] = {"miss": [], "hit": []}
        for i in range(reps + 1):  # the first round warms both engines and is not counted
            doc = [1] + words(prefix_len - 1)
            for kind in ("miss", "hit"):
                cached_p = (await P.transfer_totals()).cached_prompt_tokens
                await D.transfer_stats()
                ttft, _, _ = await _ttft(lambda: router.generate(doc + words(suffix_len), dict(sampling)))
                reads = [s for s in await D.transfer_stats() if s["ok"]]
                if i:
                    runs[kind].append({
                        "ttft_ms": ttft * 1e3, "bytes": sum(s["bytes"] for s in reads),
                        "prefill_cached": (await P.transfer_totals()).cached_prompt_tokens - cached_p,
                        "decode_cached": max((s["cached_tokens"] for s in reads), default=0),
                    })
        med = lambda kind, key: statistics.median(r[key] for r in runs[kind])  # noqa: E731
        return {
            "prefill_tp": p_tp, "decode_tp": d_tp, "prompt_tokens": prefix_len + suffix_len, "shared_prefix": prefix_len,
            "ttft_miss_ms": round(med("miss", "ttft_ms"), 1), "ttft_hit_ms": round(med("hit", "ttft_ms"), 1),
            "ttft_hit_over_miss": round(med("hit", "ttft_ms") / med("miss", "ttft_ms"), 3),
            "bytes_miss": int(med("miss", "bytes")), "bytes_hit": int(med("hit", "bytes")),
            "prefill_cached_tokens_miss": int(med("miss", "prefill_cached")),
            "prefill_cached_tokens_hit": int(med("hit", "prefill_cached")),
            "decode_cached_tokens_hit": int(med("hit", "decode_cached")),
        }


async def _stream(engine, prompt, sampling, rid):
    async for ref in engine.decode(prompt, sampling, None, rid):
        yield await ref
