"""Start the cluster a deployment file describes: `python -m cluster run deploy.yaml` (what `make run` does).

Today it builds the model if needed, starts a local Ray instance (or joins RAY_ADDRESS), the coordinator and the
prefill and decode engines, registers them (the coordinator negotiates every pair), and runs one disaggregated
completion to show the path works, with its transfer statistics. The HTTP endpoint is not yet available.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from cluster.config import DeployConfig, DeployError, load_deploy


def say(msg: str) -> None:
    print(f"[run {time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def _demo(cfg: DeployConfig, engines: dict, coordinator) -> None:
    from cluster.router import Router

    router = Router(coordinator)
    model_dir = engines["model_dir"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = "the prefill engine hands its state to the decode engine and the decode engine"
    ids = tok(prompt)["input_ids"]
    say(f"disaggregated completion of a {len(ids)}-token prompt ...")
    t0 = time.perf_counter()
    first = None
    text = ""
    async for out in router.generate(ids, {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}):
        first = first or time.perf_counter() - t0
        text += out["text"]
    say(f"  time to first token {first * 1e3:.0f} ms, total {(time.perf_counter() - t0) * 1e3:.0f} ms")
    say(f"  {prompt!r} -> {text!r}")
    for d in engines["decode"]:
        for s in await d.transfer_stats.remote():
            say(
                f"  transfer to decode rank {s['decode_rank']}: {s['bytes']} bytes in {s['descriptors']} descriptors "
                f"from prefill ranks {s['remote_ranks']}, {s['ms']:.1f} ms (plan {s['plan_us']:.0f} us)"
            )


def main(argv: list[str]) -> int:
    path = argv[0] if argv else "deploy.yaml"
    try:
        cfg = load_deploy(path)
    except DeployError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    from actors.coordinator import get_or_create_coordinator
    from actors.engine import launch_engine_actor, stop_engine_actors
    from cluster.models import ensure_model

    model_dir = Path(cfg.model.path) if cfg.model.path else ensure_model(cfg.model.builtin)
    say(f"model {cfg.model.name}: {model_dir}")
    address = os.environ.get("RAY_ADDRESS")
    ray.init(address=address, include_dashboard=False, log_to_driver=False, **({} if address else {"num_cpus": 2}))
    say(f"Ray: {'joined ' + address if address else 'local instance'}")
    coordinator = get_or_create_coordinator()
    pools = {"prefill": cfg.prefill, "decode": cfg.decode}
    launched = []
    for role, pool in pools.items():
        for i in range(max(pool.min_replicas, 1)):
            handle, ref = launch_engine_actor(
                model_dir, pool.tp, role=role, engine_id=f"{role}-{i}", served_model=cfg.model.name,
                max_model_len=cfg.model.max_model_len, dtype=cfg.model.dtype, device=cfg.device,
                extra_env={"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(pool.kv_cache_gib)))},
            )
            launched.append((role, i, pool.tp, handle, ref))
            say(f"starting {role} engine {role}-{i} (TP {pool.tp}) ...")
    handles = [h for *_, h, _ in launched]
    try:
        pending = {ref: (role, i, tp) for role, i, tp, _, ref in launched}
        t0 = time.time()
        while pending:
            done, _ = ray.wait(list(pending), timeout=10)
            for ref in done:
                role, i, tp = pending.pop(ref)
                say(f"{role}-{i} (TP {tp}) ready in {ray.get(ref):.0f} s")
            if pending and not done:
                say(f"  still loading: {', '.join(f'{r}-{i}' for r, i, _ in pending.values())} ({time.time() - t0:.0f} s)")
        for role, i, tp, handle, _ in sorted(launched, key=lambda x: x[0] != "prefill"):
            result = ray.get(handle.register.remote(coordinator))
            say(f"registered {role}-{i}; negotiated pairs: {result['pairs'] or 'none yet'}")
        engines = {"model_dir": model_dir, "decode": [h for r, *_, h, _ in launched if r == "decode"]}
        asyncio.run(_demo(cfg, engines, coordinator))
        say("HTTP endpoint: not yet available (the serving issue); the engines above served the completion")
    except KeyboardInterrupt:
        say("interrupted")
    finally:
        say("shutting down engines ...")
        stop_engine_actors(handles)
        ray.shutdown()
        say("done")
    return 0
