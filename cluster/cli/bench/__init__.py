"""`python -m cluster bench NAME`: the benchmarks' command line. This module only parses and dispatches; each
benchmark is its own module, and each measures its candidates side by side in one run and prints ratios (these
machines are shared and noisy), its figures in results/bench_<name>.json with a PNG plot next to it (`results`).

- e2e, prefix (`pairs`): a builtin model (`--model`: tiny, or a real-size build such as qwen3.5-0.8b) served
  colocated (the decode engine alone runs the whole request) and disaggregated (prefill engine -> NIXL -> decode
  engine) on the same prompts, at each `--prompt-tokens` length: one request at a time for time to first token,
  inter-token latency, the transfer's time and share of TTFT and its ratio to one thread copying the same bytes, then
  the same request stream `--concurrency` at a time for throughput; bytes and descriptors per request; the engines'
  peak resident memory. `prefix`: a request whose prompt shares a prefix with the one before (cached on both engines)
  against one that shares nothing: TTFT, bytes the decode engine reads, tokens each engine found cached.
- transfer (`transfer`): real NIXL READs between two Ray actors of a request's full hybrid state laid out as the
  planner lays it out for real model shapes, verified by checksums, against a single-process memcpy of the same bytes.
- scale (`scale`): the coordinator's negotiation (registrations, plans cached per layout pair) for up to 64 x 64
  engines with synthetic layouts, against pairwise handshakes (a plan and a metadata round trip per pair).
- load (`load`), serve, goodput, prefix-routing, faults, soak: their modules' docstrings.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path


def _pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in p.lower().split("x")) for p in text.split(",")]  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    from cluster.cli.bench import load as bench_load, pairs as bench_pairs, scale as bench_scale
    from cluster.cli.bench import transfer as bench_transfer
    from cluster.cli.bench.results import table, write_results
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
    t.add_argument("--models", default="qwen3.5-0.8b,qwen3.5-35b-a3b", help=f"from {', '.join(bench_transfer.MODELS)}")
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
    from cluster.cli.bench import faults as bench_faults, goodput as bench_goodput, prefix_routing as bench_routing
    from cluster.cli.bench import serve as bench_serve, soak as bench_soak

    sv = sub.add_parser("serve", help="vLLM's own bench client: this cluster vs vLLM's server vs vLLM's stock P/D")
    bench_serve.add_args(sv)
    gp = sub.add_parser("goodput", help="vLLM's own bench client, Poisson mixed lengths: goodput and ITL vs rate")
    bench_goodput.add_args(gp)
    pr = sub.add_parser("prefix-routing", help="routing.policy cache vs load vs vLLM's server: multi-turn TTFT, "
                        "prompt tokens computed, vLLM's bench client on shared prefixes and on random prompts")
    bench_routing.add_args(pr)
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
        return bench_routing.main(args)

    if args.which == "load":
        return bench_load.main(args, out_dir)

    if args.which == "scale":
        print("bench scale: registering synthetic engines (Qwen3.5-0.8B layouts, prefill TP 1, decode TP 2)")
        write_results("scale", bench_scale.bench_scale([int(x) for x in args.sizes.split(",")]), out_dir)
        return 0

    import ray

    from cluster.cli.local_ray import start_ray

    start_ray()
    try:
        if args.which == "transfer":
            print("bench transfer: NIXL READs between two Ray actors (DRAM, UCX), planner layouts of real models")
            rows = bench_transfer.bench_transfer(args.models.split(","), _pairs(args.pairs), [int(x) for x in args.tokens.split(",")], args.reps)
            write_results("transfer", rows, out_dir)
            return 0
        from cluster.cli.real_model import builtin_model

        model_dir = builtin_model(args.model)
        rows = []
        if args.which == "prefix":
            for p, d in _pairs(args.pairs):
                print(f"bench prefix: prefill TP {p} -> decode TP {d}, {args.prefix_tokens}-token shared prefix + "
                      f"{args.suffix_tokens} new tokens, {args.reps} rounds ...", flush=True)
                rows.append(asyncio.run(bench_pairs.bench_prefix(model_dir, p, d, args.prefix_tokens, args.suffix_tokens,
                                                      args.reps, args.max_tokens)))
            table(rows, list(rows[0]))
            write_results("prefix", rows, out_dir)
            return 0
        for p, d in _pairs(args.pairs):
            print(f"bench e2e: {args.model}, prefill TP {p} -> decode TP {d} ...", flush=True)
            rows += asyncio.run(bench_pairs.bench_pair(model_dir, p, d, [int(n) for n in args.prompt_tokens.split(",")], args.reps,
                                            args.max_tokens, args.concurrency))
    finally:
        ray.shutdown()
    keys = ["prefill_tp", "decode_tp", "prompt_tokens", "ttft_colocated_ms", "ttft_disaggregated_ms", "transfer_ms",
            "transfer_share_of_ttft", "transfer_gbps", "memcpy_ms", "transfer_over_memcpy",
            "itl_colocated_ms", "itl_disaggregated_ms", "throughput_colocated_tok_s", "throughput_disaggregated_tok_s",
            "bytes_per_request", "descriptors_per_request", "peak_rss_gib"]
    table(rows, keys)
    write_results("e2e", rows, out_dir)
    return 0
