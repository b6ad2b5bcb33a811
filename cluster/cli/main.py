"""The command line: `python -m cluster <command>` (plan, build-model, check-outputs, bench, run)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from cluster.core.hf_config import ConfigError, load_config, model_shape, ssm_dtype, torch_dtype
from cluster.core.layout import CONV_LAYOUTS, LayoutError, offline_layout
from cluster.core.planner import IncompatiblePair, PairPlan, plan_pair, plan_request


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_pair(args: argparse.Namespace) -> PairPlan:
    cfg = load_config(args.model)
    model = model_shape(cfg)
    dtype = args.dtype or torch_dtype(cfg) or "bfloat16"
    sdtype = args.ssm_dtype or ssm_dtype(cfg, dtype)
    layouts = [
        offline_layout(model, tp, dtype, sdtype, block_size=args.block_size, kernel_block_size=kernel,
                       conv_layout=args.conv_layout)
        for tp, kernel in ((args.prefill_tp, args.prefill_kernel_block), (args.decode_tp, args.decode_kernel_block))
    ]
    return plan_pair(*layouts)


def sample_request(pair: PairPlan, tokens: int):
    """A request of `tokens` prompt tokens laid out on consecutive blocks on both sides."""
    from cluster.cli.bench.transfer import sample_blocks

    prefill_blocks, decode_blocks, _ = sample_blocks(pair, tokens)
    t0 = time.perf_counter()
    plan = plan_request(pair, prefill_blocks, decode_blocks, tokens - 1)
    return plan, (time.perf_counter() - t0) * 1e6


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        pair = build_pair(args)
    except (ConfigError, LayoutError, IncompatiblePair) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = pair.describe()
    req, us = sample_request(pair, args.tokens)
    out["request"] = {
        "prompt_tokens": args.tokens,
        "transferred_tokens": [req.first_token, req.num_tokens],
        "decode_runs_from": req.num_tokens,
        "descriptors": [req.descriptors(r) for r in range(pair.decode.tp)],
        "descriptors_uncoalesced": list(req.uncoalesced),
        "bytes": [req.bytes(r) for r in range(pair.decode.tp)],
        "plan_us": round(us, 1),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    p, d = pair.prefill, pair.decode
    model = p.model
    print(f"model {model.architecture}: {model.num_layers} layers, {len(model.state_layers)} "
          f"{model.state.kind if model.state else '-'} + {len(model.attention_layers)} attention")
    print(f"tp_ratio {pair.tp_ratio} (prefill TP {p.tp} -> decode TP {d.tp})")
    rows = [
        ("", "prefill", "decode"),
        *((k, str(p.summary()[k]), str(d.summary()[k])) for k in p.summary()),
    ]
    for k, a, b in rows:
        print(f"  {k:28} {a:>22} {b:>22}")
    for rank, reads in enumerate(pair.state_reads):
        print(f"decode rank {rank} reads from prefill ranks {list(pair.remote_ranks(rank))}:")
        for r in reads:
            print(f"    {r.piece:5} rank {r.remote_rank}  offset {r.remote_offset:>9}  size {r.size:>9}  -> local {r.local_offset:>9}")
        for h in pair.kv_head_runs[rank]:
            print(f"    kv    rank {h.remote_rank}  heads [{h.remote_slot}, {h.remote_slot + h.count}) -> local heads [{h.local_slot}, {h.local_slot + h.count})")
    r = out["request"]
    print(f"a {args.tokens}-token prompt: {r['descriptors']} descriptors per decode rank "
          f"({r['descriptors_uncoalesced']} uncoalesced), {r['bytes']} bytes, planned in {r['plan_us']} us")
    return 0


def _build_model(rest: list[str]) -> int:
    """`build-model --kind ...`: a tiny model (`cluster.cli.tiny_model`); `build-model --config ...`: a real
    architecture with random weights (`cluster.cli.real_model`)."""
    if any(arg == "--config" or arg.startswith("--config=") for arg in rest):
        from cluster.cli.real_model import main as build_main
    else:
        from cluster.cli.tiny_model import main as build_main
    return build_main(rest)


def _check_outputs(rest: list[str]) -> int:
    from cluster.cli.oracle import main as check_main

    return check_main(rest)


def _bench(rest: list[str]) -> int:
    from cluster.cli.bench import main as bench_main

    return bench_main(rest)


# Commands whose own parser takes the rest of the line. argparse's REMAINDER does not take a rest that starts with an
# option (`build-model --kind gdn` was refused as an unrecognized argument), so these are handed their arguments as
# they are; the subparsers below only list them in `--help`.
PASS_THROUGH = {"build-model": _build_model, "check-outputs": _check_outputs, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in PASS_THROUGH:
        return int(PASS_THROUGH[argv[0]](argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="python -m cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="print the transfer plan of a prefill/decode pair for a model config")
    p.add_argument("--model", required=True, help="a model directory or a config.json")
    p.add_argument("--prefill-tp", type=_positive, required=True)
    p.add_argument("--decode-tp", type=_positive, required=True)
    p.add_argument("--dtype", help="KV / conv state dtype (default: the config's, else bfloat16)")
    p.add_argument("--ssm-dtype", help="recurrent state dtype (default: the config's mamba_ssm_dtype, else --dtype)")
    p.add_argument("--block-size", type=_positive, help="requested logical block size (vLLM raises it for hybrid models)")
    p.add_argument("--prefill-kernel-block", type=_positive, help="prefill attention kernel block size (default: = block size, as on CPU)")
    p.add_argument("--decode-kernel-block", type=_positive, help="decode attention kernel block size")
    p.add_argument("--conv-layout", choices=CONV_LAYOUTS, default="SD",
                   help="conv-state layout of both engines (VLLM_SSM_CONV_STATE_LAYOUT; default SD, what CPU engines run "
                        "here; DS on CUDA)")
    p.add_argument("--tokens", type=_positive, default=4096, help="prompt length of the sample request (default 4096)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)

    b = sub.add_parser("build-model", help="build a tiny hybrid model (--kind), or a real architecture with random "
                       "weights from its config (--config configs/models/NAME.json [--layers N] [--vocab N])")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=lambda a: _build_model(a.rest))

    c = sub.add_parser("check-outputs", help="a server's greedy tokens, teacher-forced against vLLM's own server on the "
                       "same weights (--target URL --reference URL --model NAME --vocab N)")
    c.add_argument("rest", nargs=argparse.REMAINDER)
    c.set_defaults(func=lambda a: _check_outputs(a.rest))

    bench = sub.add_parser("bench", help="benchmarks (e2e: colocated vs disaggregated serving)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=lambda a: _bench(a.rest))

    r = sub.add_parser("run", help="start the cluster described by a deployment file")
    r.add_argument("deploy", nargs="?", default="deploy.yaml")
    r.set_defaults(func=lambda a: __import__("cluster.cli.launch", fromlist=["main"]).main([a.deploy]))

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
