"""`bench transfer`: real NIXL READs between two Ray actors (`transfer_side.TransferSide`) of a request's whole hybrid
state, laid out as the planner lays it out for real model shapes, against a one-thread memcpy of the same bytes."""

from __future__ import annotations

import random
import statistics
import time


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
            # the conv-state layout CPU engines run (actors.engine.settings.CPU_CONV_STATE_LAYOUT)
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
