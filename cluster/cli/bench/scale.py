"""`bench scale`: the coordinator's negotiation for up to 64 x 64 synthetic engines against pairwise handshakes."""

from __future__ import annotations

import statistics
import time

from cluster.cli.bench.transfer import MODELS


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
