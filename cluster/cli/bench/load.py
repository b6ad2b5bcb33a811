"""`bench load`: concurrent streamed clients against the HTTP service (a running one, or deploy.yaml's started here)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from cluster.cli.bench.results import write_results


def main(args: argparse.Namespace, out_dir: Path) -> int:
    """Run `args.clients` streamed clients for `args.duration` s; the summary to stdout and results/bench_load.json;
    exit status 1 when any request was lost or malformed."""
    from cluster.cli.bench.loadgen import run_load

    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    cluster = None
    if args.url:
        url, model = args.url.rstrip("/"), args.model or "tiny-hybrid"
    else:
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
