"""`python -m cluster bench e2e`: the tiny hybrid model served colocated and disaggregated, side by side in one run.

For each (prefill TP, decode TP) pair it starts the engines once, then alternates colocated requests (the decode
engine runs the whole request itself) and disaggregated ones (prefill engine -> NIXL -> decode engine) on the same
prompts, and prints time to first token, the transfer's share of it, bytes and descriptors per request, and the
engines' peak resident memory. Results also go to results/bench_e2e.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path


async def _ttft(stream_factory) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first = None
    n = 0
    async for item in stream_factory():
        if first is None and item["token_ids"]:
            first = time.perf_counter() - t0
        n += len(item["token_ids"])
    return first or 0.0, time.perf_counter() - t0, n


async def _bench_pair(model_dir, p_tp: int, d_tp: int, prompt_len: int, reps: int, max_tokens: int) -> dict:
    import ray

    from actors.coordinator import CoordinatorActor
    from actors.engine import launch_engine_actor, stop_engine_actors
    from cluster.router import Router

    coord = CoordinatorActor.remote()
    (P, ps), (D, ds) = (
        launch_engine_actor(model_dir, p_tp, role="prefill", engine_id=f"bench-p{p_tp}"),
        launch_engine_actor(model_dir, d_tp, role="decode", engine_id=f"bench-d{d_tp}"),
    )
    try:
        startup = (await ps, await ds)
        await P.register.remote(coord)
        await D.register.remote(coord)
        router = Router(coord)
        rng = random.Random(1)
        sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        colo, disagg, transfers = [], [], []
        peak = 0
        for i in range(reps + 1):  # the first round warms both paths and is not counted
            prompt = [1] + [rng.randrange(3, 1024) for _ in range(prompt_len - 1)]
            c = await _ttft(lambda: _stream(D, prompt, dict(sampling), f"colo-{i}"))
            await D.transfer_stats.remote()
            d = await _ttft(lambda: router.generate(prompt, dict(sampling)))
            stats = await D.transfer_stats.remote()
            peak = max(peak, sum(await asyncio.gather(P.rss_bytes.remote(), D.rss_bytes.remote())))
            if i:
                colo.append(c)
                disagg.append(d)
                transfers.append(stats)
        t_ms = [max(s["ms"] for s in st) for st in transfers]
        return {
            "prefill_tp": p_tp,
            "decode_tp": d_tp,
            "prompt_tokens": prompt_len,
            "engine_startup_s": [round(x, 1) for x in startup],
            "ttft_colocated_ms": round(statistics.median(x[0] for x in colo) * 1e3, 1),
            "ttft_disaggregated_ms": round(statistics.median(x[0] for x in disagg) * 1e3, 1),
            "transfer_ms": round(statistics.median(t_ms), 2),
            "transfer_share_of_ttft": round(statistics.median(t_ms) / (statistics.median(x[0] for x in disagg) * 1e3), 3),
            "itl_colocated_ms": round(statistics.median((x[1] - x[0]) / max(1, x[2] - 1) for x in colo) * 1e3, 2),
            "itl_disaggregated_ms": round(statistics.median((x[1] - x[0]) / max(1, x[2] - 1) for x in disagg) * 1e3, 2),
            "bytes_per_request": sum(s["bytes"] for s in transfers[-1]),
            "descriptors_per_request": sum(s["descriptors"] for s in transfers[-1]),
            "descriptors_uncoalesced": sum(s["descriptors_uncoalesced"] for s in transfers[-1]),
            "plan_us_per_rank": round(statistics.median(s["plan_us"] for st in transfers for s in st), 1),
            "peak_rss_gib": round(peak / 2**30, 2),
        }
    finally:
        stop_engine_actors([P, D])
        ray.kill(coord)


async def _stream(engine, prompt, sampling, rid):
    async for ref in engine.decode.options(num_returns="streaming").remote(prompt, sampling, None, rid):
        yield await ref


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster bench")
    sub = ap.add_subparsers(dest="which", required=True)
    e = sub.add_parser("e2e", help="colocated vs disaggregated serving of the tiny model")
    e.add_argument("--pairs", default="1x2,2x1", help="prefill x decode TP pairs (default 1x2,2x1)")
    e.add_argument("--prompt-tokens", type=int, default=700)
    e.add_argument("--reps", type=int, default=5)
    e.add_argument("--max-tokens", type=int, default=16)
    e.add_argument("--model", default="gdn")
    e.add_argument("--out", default="results/bench_e2e.json")
    args = ap.parse_args(argv)

    import ray

    from cluster.models import ensure_model

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    model_dir = ensure_model(args.model)
    rows = []
    for pair in args.pairs.split(","):
        p, d = (int(x) for x in pair.lower().split("x"))
        print(f"bench e2e: prefill TP {p} -> decode TP {d} ...", flush=True)
        rows.append(asyncio.run(_bench_pair(model_dir, p, d, args.prompt_tokens, args.reps, args.max_tokens)))
        print(json.dumps(rows[-1]), flush=True)
    ray.shutdown()
    keys = ["prefill_tp", "decode_tp", "ttft_colocated_ms", "ttft_disaggregated_ms", "transfer_ms", "transfer_share_of_ttft",
            "bytes_per_request", "descriptors_per_request", "descriptors_uncoalesced", "peak_rss_gib"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")
    return 0
