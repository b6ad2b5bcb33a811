"""`python -m cluster bench {e2e,prefix,transfer,scale}` (and load, serve, faults, soak): each measures its candidates side by side in one run and prints
ratios (these machines are shared and noisy). Results go to results/bench_<name>.json and a PNG plot next to it.

- e2e: a builtin model (`--model`: tiny, or a real-size build such as qwen3.5-0.8b) served colocated (the decode
  engine alone runs the whole request) and disaggregated (prefill engine -> NIXL -> decode engine) on the same
  prompts, at each `--prompt-tokens` length: one request at a time for time to first token, inter-token latency, the
  transfer's time and share of TTFT and its ratio to one thread copying the same bytes, then the same request stream
  `--concurrency` at a time for throughput; bytes and descriptors per request; the engines' peak resident memory.
- prefix: prefix caching in P/D - a request whose prompt shares a prefix with the one before (cached on both
  engines) against one that shares nothing: TTFT, bytes the decode engine reads, tokens each engine found cached.
- transfer: real NIXL READs between two Ray actors of a request's full hybrid state laid out as the planner lays it out
  for real model shapes, verified by checksums, against a single-process memcpy of the same bytes.
- scale: the coordinator's negotiation (registrations, plans cached per layout pair) for up to 64 x 64 engines with
  synthetic layouts, against pairwise handshakes (a plan and a metadata round trip per pair).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


@contextlib.asynccontextmanager
async def _pair(model_dir, p_tp: int, d_tp: int, engine_kwargs: dict | None = None):
    """A coordinator, one prefill and one decode engine, registered, and a router over them: yields (prefill client,
    decode client, router, the engines' startup seconds); everything stops afterwards."""
    from actors.coordinator_client import CoordinatorClient
    from actors.engine import launch_engine_actor, stop_engine_actors
    from actors.router import Router

    coord = CoordinatorClient.start()
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


async def _bench_pair(model_dir, p_tp: int, d_tp: int, prompt_lens: list[int], reps: int, max_tokens: int,
                      concurrency: int = 8) -> list[dict]:
    """One prefill and one decode engine; per prompt length a row (engines started once per pair)."""
    from actors.engine_settings import DEFAULT_MAX_MODEL_LEN

    # the engines' context as long as the longest request, never shorter than their default
    longest = {"max_model_len": max(DEFAULT_MAX_MODEL_LEN, max(prompt_lens) + max_tokens)}
    async with _pair(model_dir, p_tp, d_tp, longest) as (P, D, router, startup):
        rows = []
        for prompt_len in prompt_lens:
            print(f"  {prompt_len}-token prompts ...", flush=True)
            rows.append(await _measure_pair(P, D, router, startup, p_tp, d_tp, prompt_len, reps, max_tokens,
                                            concurrency))
            print(json.dumps(rows[-1]), flush=True)
        return rows


async def _measure_pair(P, D, router, startup, p_tp: int, d_tp: int, prompt_len: int, reps: int, max_tokens: int,
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


async def _bench_prefix(model_dir, p_tp: int, d_tp: int, prefix_len: int, suffix_len: int, reps: int,
                        max_tokens: int) -> dict:
    """Prefix caching in P/D: per round a new shared prefix (a document) with two different suffixes (questions),
    sent one after the other through the router: the first finds nothing cached (a miss), the second finds the
    prefix in both engines' caches (a hit). TTFT, the decode engine's bytes read and each engine's cached tokens."""
    async with _pair(model_dir, p_tp, d_tp, {"enable_prefix_caching": True}) as (P, D, router, _):
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


# ---- transfer: NIXL READs of a request's full state vs memcpy -----------------------------------------------------
MODELS = {"qwen3.5-0.8b": "configs/models/qwen3.5-0.8b.json", "qwen3.5-35b-a3b": "configs/models/qwen3.5-35b-a3b.json"}


def naive_descriptors(pair, plan, decode_rank: int) -> int:
    """What a per-element scheme posts: one descriptor per (attention layer, kernel block, KV head, K|V) and per
    (state layer, conv sub-projection | recurrent state) - no merging of heads, of K and V, or of adjacent blocks."""
    d = pair.decode
    kv_blocks = -(-(plan.end_token - plan.first_token) // d.kernel_block_size)
    attn_layers = sum(len(g.layers) for g in d.groups if g.kind == "attention")
    state_layers = sum(len(g.layers) for g in d.groups if g.kind == "state")
    # per state layer: each (prefill rank, conv sub-projection | recurrent state) piece this rank needs
    return attn_layers * kv_blocks * d.kv_heads_local * 2 + state_layers * len(pair.state_reads[decode_rank])


def sample_blocks(pair, tokens: int, scattered: bool = False, pool: int = 0) -> tuple[list, list, int]:
    """Block ids of one request on both sides: consecutive (a fresh engine's allocation, the best case for
    coalescing) or `scattered` (random distinct ids out of `pool` pages, as after a long-running engine's churn)."""
    rng = random.Random(tokens)
    blocks, pages = [], []
    for layout in (pair.prefill, pair.decode):
        at, per_group = 0, []
        sizes = [1 if g.kind == "state" else -(-tokens // layout.block_size) for g in layout.groups]
        ids = rng.sample(range(max(pool, sum(sizes))), sum(sizes)) if scattered else list(range(sum(sizes)))
        for n in sizes:
            per_group.append(ids[at:at + n])
            at += n
        blocks.append(per_group)
        pages.append(max(ids) + 1)
    return blocks[0], blocks[1], max(pages)


def bench_transfer(models: list[str], pairs: list[tuple[int, int]], tokens: list[int], reps: int) -> list[dict]:
    import ray

    from cluster.cli.bench.transfer_side import TransferSide
    from cluster.core.hf_config import load_config, model_shape, ssm_dtype
    from cluster.core.layout import offline_layout
    from cluster.core.planner import plan_pair, plan_request

    rows = []
    for name in models:
        cfg = load_config(MODELS[name])
        model = model_shape(cfg)
        sdtype = ssm_dtype(cfg, "bfloat16")
        for p_tp, d_tp in pairs:
            # the conv-state layout CPU engines run (actors.engine_settings.CPU_CONV_STATE_LAYOUT)
            pair = plan_pair(*(offline_layout(model, tp, "bfloat16", sdtype, conv_layout="SD") for tp in (p_tp, d_tp)))
            n_max = max(tokens)
            _, _, pool = sample_blocks(pair, n_max)
            pool *= 2  # room to scatter
            P = TransferSide.remote(pair.prefill, pool, True)
            D = TransferSide.remote(pair.decode, pool, False)
            try:
                ray.get(D.connect.remote(ray.get(P.metadata.remote())))
                for n, scattered in ((n, s) for n in tokens for s in (False, True)):
                    pb, db, _ = sample_blocks(pair, n, scattered, pool)
                    plan = plan_request(pair, pb, db, n - 1)
                    plan_us = []
                    for _ in range(max(reps, 20)):
                        t0 = time.perf_counter()
                        plan_request(pair, pb, db, n - 1)
                        plan_us.append((time.perf_counter() - t0) * 1e6)
                    nbytes = sum(plan.bytes(r) for r in range(d_tp))
                    ray.get(D.clear.remote())
                    first = ray.get(D.read.remote(plan))
                    ok = ray.get(P.checksums.remote(plan, "remote")) == ray.get(D.checksums.remote(plan, "local"))
                    if not ok:
                        raise RuntimeError(f"{name} {p_tp}->{d_tp} {n} tokens: bytes read differ from the prefill side's")
                    runs = [ray.get(D.read.remote(plan)) for _ in range(reps)]
                    post = statistics.median(r["post_s"] for r in runs)
                    wire = statistics.median(r["wire_s"] for r in runs)
                    memcpy = ray.get(D.memcpy.remote(nbytes))
                    lanes = first["lanes"]
                    memcpy_lanes = ray.get(D.memcpy.remote(nbytes, lanes)) if lanes > 1 else memcpy
                    row = {
                        "model": name, "prefill_tp": p_tp, "decode_tp": d_tp, "prompt_tokens": n,
                        "blocks": "scattered" if scattered else "consecutive",
                        "bytes": nbytes, "verified": ok, "transfers": first["transfers"],
                        "nixl_ms": round(post * 1e3, 2), "nixl_wire_ms": round(wire * 1e3, 2),
                        "nixl_gbps": round(nbytes / post / 1e9, 2), "nixl_wire_gbps": round(nbytes / wire / 1e9, 2),
                        "memcpy_ms": round(memcpy * 1e3, 2), "memcpy_gbps": round(nbytes / memcpy / 1e9, 2),
                        "ratio_to_memcpy": round(memcpy / post, 3),
                        "lanes": lanes, "memcpy_lanes_gbps": round(nbytes / memcpy_lanes / 1e9, 2),
                        "ratio_to_memcpy_lanes": round(memcpy_lanes / post, 3),
                        "descriptors_posted": first["posted"],
                        "descriptors": sum(plan.descriptors(r) for r in range(d_tp)),
                        "descriptors_uncoalesced": sum(plan.uncoalesced),
                        "descriptors_naive": sum(naive_descriptors(pair, plan, r) for r in range(d_tp)),
                        "plan_us": round(statistics.median(plan_us), 1),
                        "plan_us_per_decode_rank": round(statistics.median(plan_us) / d_tp, 1),
                    }
                    row["naive_over_descriptors"] = round(row["descriptors_naive"] / row["descriptors"], 1)
                    rows.append(row)
                    print(f"  {name} P{p_tp}->D{d_tp} {n:>6} tokens {row['blocks'][:5]}: {nbytes / 2**20:6.1f} MiB  NIXL {row['nixl_gbps']:6.2f} GB/s "
                          f"(wire {row['nixl_wire_gbps']:6.2f}, {lanes} lanes)  memcpy {row['memcpy_gbps']:6.2f} GB/s  ratio {row['ratio_to_memcpy']:.2f}"
                          f" ({lanes} threads: {row['memcpy_lanes_gbps']:6.2f}, {row['ratio_to_memcpy_lanes']:.2f})  "
                          f"descriptors {row['descriptors']} (naive {row['descriptors_naive']})  plan {row['plan_us']} us", flush=True)
            finally:
                ray.kill(P)
                ray.kill(D)
    return rows


# ---- scale: the coordinator's negotiation as pools grow, against pairwise handshakes --------------------------------
def bench_scale(sizes: list[int], model_name: str = "qwen3.5-0.8b", p_tp: int = 1, d_tp: int = 2) -> list[dict]:
    import os as _os

    from cluster.core.coordinator import Coordinator, EngineRecord
    from cluster.core.hf_config import load_config, model_shape, ssm_dtype
    from cluster.core.layout import offline_layout
    from cluster.core.planner import plan_pair

    cfg = load_config(MODELS[model_name])
    model = model_shape(cfg)
    sdtype = ssm_dtype(cfg, "bfloat16")
    layouts = {tp: offline_layout(model, tp, "bfloat16", sdtype) for tp in (p_tp, d_tp)}
    meta_bytes = 2048  # a NIXL agent's metadata blob is ~1-3 KB per rank

    def record(role: str, i: int, tp: int) -> EngineRecord:
        ranks = [{"agent_metadata": _os.urandom(meta_bytes), "region_bases": [1 << 40] * layouts[tp].num_regions,
                  "device_id": r, "memory_type": "DRAM"} for r in range(tp)]
        return EngineRecord(f"{role}-{i}", role, "m", layouts[tp], ranks)

    rows = []
    for n in sizes:
        prefills = [record("prefill", i, p_tp) for i in range(n)]
        decodes = [record("decode", i, d_tp) for i in range(n)]
        coord = Coordinator()
        t0 = time.perf_counter()
        pushes = payload_bytes = 0
        for rec in [x for pair in zip(prefills, decodes) for x in pair]:  # engines join alternately, as pools grow
            new = coord.register(rec)
            pushes += len({d for _, d in new})  # one push per affected decode engine, carrying its new plans
            payload_bytes += sum(len(coord.payload(p, d)) for p, d in new)
        coord_s = time.perf_counter() - t0
        # pairwise: every decode engine handshakes with every prefill engine it may read from: one round trip per
        # remote prefill rank, then validates and plans the pair itself (no shared cache)
        t0 = time.perf_counter()
        sample = min(n * n, 64)
        for k in range(sample):
            plan_pair(prefills[k % n].layout, decodes[k // n % n].layout)
        pairwise_s = (time.perf_counter() - t0) / sample * n * n
        row = {
            "prefill_engines": n, "decode_engines": n, "pairs": n * n,
            "coordinator_ms": round(coord_s * 1e3, 2), "coordinator_plans_computed": coord.plans_computed,
            "coordinator_messages": 2 * n + pushes, "coordinator_payload_mib": round(payload_bytes / 2**20, 2),
            "registration_us_median": round(statistics.median(coord.negotiation_us), 1),
            "pairwise_ms": round(pairwise_s * 1e3, 2), "pairwise_plans_computed": n * n,
            "pairwise_round_trips": n * n * p_tp, "pairwise_metadata_mib": round(n * n * p_tp * meta_bytes / 2**20, 2),
        }
        row["pairwise_over_coordinator"] = round(row["pairwise_ms"] / max(row["coordinator_ms"], 1e-3), 1)
        rows.append(row)
        print(f"  {n:>3} x {n:<3} engines: coordinator {row['coordinator_ms']:9.2f} ms ({row['coordinator_plans_computed']} plans, "
              f"{row['coordinator_messages']} messages)  pairwise {row['pairwise_ms']:9.2f} ms ({n * n} plans, "
              f"{row['pairwise_round_trips']} round trips)", flush=True)
    return rows


# ---- output ------------------------------------------------------------------------------------------------------
def write_results(name: str, rows: list[dict], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench_{name}.json"
    path.write_text(json.dumps({"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}, indent=2))
    try:
        _plot(name, rows, out_dir / f"bench_{name}.png")
    except Exception as e:  # noqa: BLE001 - the JSON is the result; a plot failure is reported, not fatal
        print(f"(no plot: {e})")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


def _plot(name: str, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if name == "transfer":
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for key in sorted({(r["model"], r["prefill_tp"], r["decode_tp"]) for r in rows}):
            sel = [r for r in rows if (r["model"], r["prefill_tp"], r["decode_tp"]) == key and r["blocks"] == "scattered"]
            label = f"{key[0]} P{key[1]}->D{key[2]} (scattered blocks)"
            axes[0].plot([r["prompt_tokens"] for r in sel], [r["nixl_gbps"] for r in sel], "o-", label=label)
            axes[1].plot([r["prompt_tokens"] for r in sel], [r["ratio_to_memcpy"] for r in sel], "o-", label=label)
        axes[0].plot([r["prompt_tokens"] for r in rows], [r["memcpy_gbps"] for r in rows], "k.", label="memcpy (same bytes)")
        axes[0].set(xscale="log", xlabel="prompt tokens", ylabel="GB/s", title="NIXL READ of a request's state")
        axes[1].axhline(0.7, color="grey", ls="--", lw=1)
        axes[1].set(xscale="log", xlabel="prompt tokens", ylabel="NIXL / memcpy", title="ratio to the memcpy ceiling")
        axes[0].legend(fontsize=7)
    elif name == "load":
        r = rows[0]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        keys = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
        ax.bar(keys, [r[k] or 0 for k in keys])
        ax.set(ylabel="ms", title=f"{r['clients']} clients, {r['ok']} requests, {r['output_tokens_per_s']} tok/s, "
               f"{r['lost']} lost, {r['refused_503']} refused (503)")
    elif name == "prefix":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        labels = [f"P{r['prefill_tp']}->D{r['decode_tp']}" for r in rows]
        x = range(len(rows))
        for ax, key, unit in ((axes[0], "ttft", "ms"), (axes[1], "bytes", "bytes read by the decode engine")):
            miss, hit = (f"{key}_miss_ms", f"{key}_hit_ms") if key == "ttft" else ("bytes_miss", "bytes_hit")
            ax.bar([i - 0.2 for i in x], [r[miss] for r in rows], 0.4, label="no cached prefix")
            ax.bar([i + 0.2 for i in x], [r[hit] for r in rows], 0.4, label="prefix cached on both engines")
            ax.set_xticks(list(x), labels)
            ax.set(ylabel=unit, title=f"{key.upper() if key == 'ttft' else key} (median)")
        axes[0].legend()
    elif name == "faults":
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        x = range(len(rows))
        labels = [r["scenario"] for r in rows]
        for ax, key in ((axes[0], "ttft"), (axes[1], "itl")):
            ax.bar([i - 0.2 for i in x], [r[f"{key}_p99_ms_before"] or 0 for r in rows], 0.4, label="before the kill")
            ax.bar([i + 0.2 for i in x], [r[f"{key}_p99_ms_fault"] or 0 for r in rows], 0.4, label="fault window")
            ax.set_xticks(list(x), labels, fontsize=8)
            ax.set(ylabel="ms", title=f"{key.upper()} p99")
        axes[0].legend()
        fig.suptitle("one engine / the coordinator SIGKILLed under load: failed requests "
                     + ", ".join(f"{r['scenario']} {r['failed']}" for r in rows), fontsize=9)
    elif name == "scale":
        fig, ax = plt.subplots(figsize=(7, 4.5))
        n = [r["prefill_engines"] for r in rows]
        ax.plot(n, [r["coordinator_ms"] for r in rows], "o-", label="coordinator (registrations, cached plans)")
        ax.plot(n, [r["pairwise_ms"] for r in rows], "s-", label="pairwise handshakes (plan per pair)")
        ax.set(xscale="log", yscale="log", xlabel="engines per pool (P = D)", ylabel="ms of planning",
               title="negotiation cost as pools grow")
        ax.legend()
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        labels = [f"P{r['prefill_tp']}->D{r['decode_tp']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["ttft_colocated_ms"] for r in rows], 0.4, label="colocated TTFT")
        ax.bar([i + 0.2 for i in x], [r["ttft_disaggregated_ms"] for r in rows], 0.4, label="disaggregated TTFT")
        ax.set_xticks(list(x), labels)
        ax.set(ylabel="ms", title="time to first token (median)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load_main(args: argparse.Namespace, out_dir: Path) -> int:
    import os as _os

    from cluster.cli.bench.loadgen import run_load

    key = _os.environ.get(args.api_key_env) if args.api_key_env else None
    cluster = None
    if args.url:
        url, model = args.url.rstrip("/"), args.model or "tiny-hybrid"
    else:
        import ray

        from cluster.core.config import load_deploy
        from cluster.cli.launch import serve
        from cluster.cli.local_ray import start_ray

        cfg = load_deploy(args.deploy)
        key = key or cfg.http.resolved_api_key()
        start_ray(cfg.coordinator.namespace)
        cluster = serve(cfg)
        url, model = cluster.url, args.model or cfg.model.name
    try:
        print(f"bench load: {args.clients} clients for {args.duration:.0f} s against {url} ...", flush=True)
        res = asyncio.run(run_load(url, model, args.clients, args.duration, args.max_tokens, api_key=key))
    finally:
        if cluster is not None:
            import ray

            from cluster.cli.launch import stop_cluster

            stop_cluster(cluster, shutdown_serve=True)
            ray.shutdown()
    summary = {"clients": args.clients, "duration_s": args.duration, "max_tokens": args.max_tokens, **res.summary()}
    print(json.dumps(summary, indent=2))
    write_results("load", [summary], out_dir)
    return 0 if summary["lost"] == 0 and summary["malformed"] == 0 else 1


def _pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in p.lower().split("x")) for p in text.split(",")]  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    from cluster.cli.real_model import BUILTIN_NAMES

    ap = argparse.ArgumentParser(prog="python -m cluster bench")
    sub = ap.add_subparsers(dest="which", required=True)
    e = sub.add_parser("e2e", help="colocated vs disaggregated serving of a builtin model: TTFT, ITL, the transfer "
                       "against memcpy")
    e.add_argument("--pairs", default="1x2", help="prefill x decode TP pairs (default 1x2)")
    e.add_argument("--prompt-tokens", default="700", help="prompt lengths, comma separated (default 700)")
    e.add_argument("--reps", type=int, default=5)
    e.add_argument("--max-tokens", type=int, default=16)
    e.add_argument("--concurrency", type=int, default=8, help="requests in flight in the throughput phase "
                   "(0: skip it)")
    e.add_argument("--model", default="gdn", choices=BUILTIN_NAMES, help="a builtin model, tiny or real-size "
                   "(qwen3.5-0.8b: real-size state per request; default gdn)")
    t = sub.add_parser("transfer", help="NIXL READs of a request's full hybrid state vs a memcpy of the same bytes")
    t.add_argument("--models", default="qwen3.5-0.8b,qwen3.5-35b-a3b", help=f"from {', '.join(MODELS)}")
    t.add_argument("--pairs", default="1x1,1x2,2x1", help="prefill x decode TP pairs")
    t.add_argument("--tokens", default="1024,4096,16384", help="prompt lengths")
    t.add_argument("--reps", type=int, default=5)
    pf = sub.add_parser("prefix", help="prefix caching in P/D: TTFT, bytes read and cached tokens, miss vs hit")
    pf.add_argument("--pairs", default="1x2", help="prefill x decode TP pairs (default 1x2)")
    pf.add_argument("--prefix-tokens", type=int, default=1024, help="the shared prefix (a document)")
    pf.add_argument("--suffix-tokens", type=int, default=64, help="what differs (a question)")
    pf.add_argument("--reps", type=int, default=8)
    pf.add_argument("--max-tokens", type=int, default=8)
    pf.add_argument("--model", default="gdn", choices=BUILTIN_NAMES)
    c = sub.add_parser("scale", help="coordinator negotiation cost for up to 64 x 64 engines vs pairwise handshakes")
    c.add_argument("--sizes", default="1,2,4,8,16,32,64")
    lo = sub.add_parser("load", help="concurrent streamed clients against the HTTP service; lost/malformed, p50/p99")
    lo.add_argument("--url", help="a running service (default: start deploy.yaml's cluster here, then stop it)")
    lo.add_argument("--deploy", default="deploy.yaml")
    lo.add_argument("--model", help="model name (default: the deployment's)")
    lo.add_argument("--clients", type=int, default=32)
    lo.add_argument("--duration", type=float, default=60.0)
    lo.add_argument("--max-tokens", type=int, default=32)
    lo.add_argument("--api-key-env", help="environment variable holding the API key")
    for p in (e, t, pf, c, lo):
        p.add_argument("--out-dir", default="results")
    from cluster.cli.bench import faults as bench_faults, goodput as bench_goodput, prefix_routing as bench_prefix
    from cluster.cli.bench import serve as bench_serve, soak as bench_soak

    sv = sub.add_parser("serve", help="vLLM's own bench client: this cluster vs vLLM's server vs vLLM's stock P/D")
    bench_serve.add_args(sv)
    gp = sub.add_parser("goodput", help="vLLM's own bench client, Poisson mixed lengths: goodput and ITL vs rate")
    bench_goodput.add_args(gp)
    pr = sub.add_parser("prefix-routing", help="routing.policy cache vs load vs vLLM's server: multi-turn TTFT, "
                        "prompt tokens computed, vLLM's bench client on shared prefixes and on random prompts")
    bench_prefix.add_args(pr)
    fa = sub.add_parser("faults", help="an engine or the coordinator SIGKILLed under streaming load, per scenario")
    bench_faults.add_args(fa)
    so = sub.add_parser("soak", help="the deployment's cluster under mixed streaming traffic with a fault every minute: "
                        "nothing failed, nothing left behind")
    bench_soak.add_args(so)
    args = ap.parse_args(argv)
    out_dir = Path(args.out_dir)

    if args.which == "serve":
        return bench_serve.main(args)
    if args.which == "goodput":
        return bench_goodput.main(args)
    if args.which == "faults":
        return bench_faults.main(args)
    if args.which == "soak":
        return bench_soak.main(args)
    if args.which == "prefix-routing":
        return bench_prefix.main(args)

    if args.which == "load":
        return _load_main(args, out_dir)

    if args.which == "scale":
        print("bench scale: registering synthetic engines (Qwen3.5-0.8B layouts, prefill TP 1, decode TP 2)")
        write_results("scale", bench_scale([int(x) for x in args.sizes.split(",")]), out_dir)
        return 0

    import ray

    from cluster.cli.local_ray import start_ray

    start_ray()
    try:
        if args.which == "transfer":
            print("bench transfer: NIXL READs between two Ray actors (DRAM, UCX), planner layouts of real models")
            rows = bench_transfer(args.models.split(","), _pairs(args.pairs), [int(x) for x in args.tokens.split(",")], args.reps)
            write_results("transfer", rows, out_dir)
            return 0
        from cluster.cli.real_model import builtin_model

        model_dir = builtin_model(args.model)
        rows = []
        if args.which == "prefix":
            for p, d in _pairs(args.pairs):
                print(f"bench prefix: prefill TP {p} -> decode TP {d}, {args.prefix_tokens}-token shared prefix + "
                      f"{args.suffix_tokens} new tokens, {args.reps} rounds ...", flush=True)
                rows.append(asyncio.run(_bench_prefix(model_dir, p, d, args.prefix_tokens, args.suffix_tokens,
                                                      args.reps, args.max_tokens)))
            _table(rows, list(rows[0]))
            write_results("prefix", rows, out_dir)
            return 0
        for p, d in _pairs(args.pairs):
            print(f"bench e2e: {args.model}, prefill TP {p} -> decode TP {d} ...", flush=True)
            rows += asyncio.run(_bench_pair(model_dir, p, d, [int(n) for n in args.prompt_tokens.split(",")], args.reps,
                                            args.max_tokens, args.concurrency))
    finally:
        ray.shutdown()
    keys = ["prefill_tp", "decode_tp", "prompt_tokens", "ttft_colocated_ms", "ttft_disaggregated_ms", "transfer_ms",
            "transfer_share_of_ttft", "transfer_gbps", "memcpy_ms", "transfer_over_memcpy",
            "itl_colocated_ms", "itl_disaggregated_ms", "throughput_colocated_tok_s", "throughput_disaggregated_tok_s",
            "bytes_per_request", "descriptors_per_request", "peak_rss_gib"]
    _table(rows, keys)
    write_results("e2e", rows, out_dir)
    return 0


def _table(rows: list[dict], keys: list[str]) -> None:
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))
