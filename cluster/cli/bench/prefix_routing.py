"""`python -m cluster bench prefix-routing`: does routing on what each prefill engine holds pay? The same cluster
with `routing.policy: cache` and with `routing.policy: load`, and vLLM's own OpenAI server, one after the other on
this machine, on three workloads.

Targets, each started, run through every workload of `--workloads` in turn, then stopped:
  cache  the deploy file's cluster (`--deploy`) reshaped for this bench: 2 prefill + 2 decode engines at TP 1, prefix
         caching on in both pools, autoscaling off (min = max = 2), prefill and decode on cores of their own
         (`bench_cores`: the two prefill engines share the first core, the two decode engines the second), every request
         disaggregated (no `transfer.local_prefill_speed`, `local_prefill_queue`, nor `local_prefill_when_idle`),
         `--kv-cache-gib` per engine, and `routing.policy: cache`;
  load   the same cluster with `routing.policy: load` (prefixes ignored);
  vllm   vLLM's own OpenAI server, one engine at TP 1 with prefix caching on, started as `bench goodput` starts it
         (`cluster.cli.bench.targets.vllm_server`: its KV cache is the cluster's per-engine one, 1 GiB).
Workloads, in this order on each target (the multi-turn one first, on empty caches):
  multi-turn  `--conversations` conversations (all at once, or starting as Poisson arrivals one per `--arrival-s`),
              `--turns` turns each, written here with the official `openai` client (AsyncOpenAI, streamed
              /v1/completions with token-id prompts and vLLM's `return_token_ids`): each turn's prompt is the
              conversation so far plus a new "user message" of random token ids, and the assistant's reply (its
              token ids, greedy, `ignore_eos`) is appended to it; an exponential think time (mean `--think-s`)
              before each turn; seeded, so every target gets the same conversations. Per turn number TTFT p50 /
              p99; output throughput; failures; and from the target's /metrics before and after, the prompt tokens
              its prefill engines computed against those resumed from their prefix cache, and the router's choices
              by reason.
  prefix      vLLM's bench client (unmodified, `vllm.benchmarks.serve` in a subprocess as `bench goodput` runs it)
              with its `prefix_repetition` dataset: `--prefixes` shared prefixes, `--prompts-per-prefix` prompts
              each (a prefix + a random suffix, shuffled), by default more prefixes than one engine's cache holds.
  random      vLLM's bench client with its `random` dataset: prompts that share nothing, throughput (what routing
              by cache must not cost).

The unavoidable prompt tokens of a conversation (`unavoidable_tokens`): its first turn whole; then each turn's new
tokens plus the previous turn's prompt past its last block boundary (before its last token). vLLM's prefix caching
on a hybrid model ("align" mode) keeps a prefill's recurrent state only at the last block boundary its prompt
reached, so that boundary is where the best prefill engine - the one that ran the previous turn - can resume;
whatever comes after it (the tail of the previous prompt, the reply that only the decode engine saw, the new message)
must be computed. vLLM's own server resumes at the same boundary (measured: not inside the reply it decoded itself).

The targets the issue sets, with figures and ratios of this one run (`check_targets`): multi-turn TTFT p50 over
turns >= 2, cache <= 0.6x load; prompt tokens the cache cluster computed on the multi-turn workload <= 1.2x the
unavoidable; random-workload output throughput, cache >= 0.95x load. Then the same figures cache against vllm.
results/bench_prefix_routing.json and .png (TTFT p50 by turn number, per target).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import threading
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from cluster.cli.bench.multi_turn import (BlockPool, MultiTurn, check_multi_turn, check_prefix_workload, client_argv,
                                          client_row, prompt_token_use, routes_said, run_multi_turn, scrape, vocabulary)
from cluster.cli.bench.prefix_report import (check_targets, fmt, multi_turn_summary, num, plot, turn_table, vllm_lines,
                                             workload_table)
from cluster.cli.bench.targets import REPO
from cluster.cli.real_model import BUILTIN_NAMES

KNOWN_TARGETS = ("cache", "load", "vllm")
CLUSTER_TARGETS = {"cache": "cache", "load": "load"}  # target -> routing.policy
DEFAULT_TARGETS = "cache,load,vllm"
KNOWN_WORKLOADS = ("multi-turn", "prefix", "random")
GIB = 1 << 30
BENCH_NAMESPACE = "pd-bench-prefix"


# ---- the targets --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def heartbeat(say: Callable[[float], None], every_s: float = 30.0) -> Iterator[None]:
    """Call `say(seconds so far)` every `every_s` while the block runs: vLLM's bench client runs silent
    (--disable-tqdm) for minutes on the prefix workload."""
    stop = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not stop.wait(every_s):
            say(time.monotonic() - t0)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def bench_cores(cores: Sequence[int]) -> dict[str, str | None]:
    """Where the bench's four engines compute on a host whose usable cores are `cores`: per pool, the
    VLLM_CPU_OMP_THREADS_BIND its engines share (the pools share cores, `share_cores: true`). Prefill and decode never
    on the same cores, as in the product's default (cores as devices), each pool's two engines sharing one core of the
    pool's own - the prefill engines the first core, the decode engines the second, one OpenMP thread each (measured on
    2 cores, 16 conversations of 4 long turns: TTFT p50 of turns >= 2 211 ms against 688 with all four engines on both
    cores, 2 threads each, whose parallel regions waited on each other's time slices). Two cores whatever the host has:
    the bench's local Ray instance offers 2 CPUs (`cluster.cli.local_ray.LOCAL_CPUS`), too few for four engines owning
    cores. 1 core: all share it."""
    ids = sorted(cores)
    if len(ids) >= 2:
        return {"prefill": str(ids[0]), "decode": str(ids[1])}
    return {"prefill": None, "decode": None}


# the deploy file's thread settings the bench's binding replaces (an engine's env wins over its launcher's binding)
BINDING_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "GOMP_CPU_AFFINITY")


def deploy_for_prefix_bench(cfg: Any, port: int, policy: str, kv_cache_gib: float,
                            cores: Sequence[int] | None = None) -> Any:
    """The deploy file's config reshaped for this bench, validated again: 2 prefill + 2 decode engines at TP 1,
    prefix caching on, no autoscaling, each pool on cores of its own (`bench_cores` of `cores`, this process's by
    default), every request disaggregated, `kv_cache_gib` per engine, `routing.policy` = `policy`; its own HTTP port
    and coordinator name and namespace. The model, HTTP limits, transfer checks and the pools' other env stay the
    file's."""
    from cluster.core.config import DeployConfig

    data = cfg.model_dump()
    binds = bench_cores(sorted(os.sched_getaffinity(0)) if cores is None else cores)
    for role in ("prefill", "decode"):
        env = {k: v for k, v in (data[role].get("env") or {}).items() if k not in BINDING_ENV}
        if binds[role]:
            env["VLLM_CPU_OMP_THREADS_BIND"] = binds[role]
        data[role].update(tp=1, min_replicas=2, max_replicas=2, enable_prefix_caching=True, kv_cache_gib=kv_cache_gib,
                          share_cores=True, cores_per_rank=1, reserve_cores=None, borrow_idle_cores=None, env=env)
    data["transfer"].update(local_prefill_queue=None, local_prefill_when_idle=False, local_prefill_speed=None)
    data["routing"] = {**data.get("routing", {}), "policy": policy}
    data["http"]["port"] = port
    data["coordinator"].update(name=f"{BENCH_NAMESPACE}-coordinator", namespace=BENCH_NAMESPACE)
    return DeployConfig.model_validate(data)


def cores_said(cfg: Any) -> str:
    """How the bench's config places its engines, in words."""
    binds = [getattr(cfg, r).env.get("VLLM_CPU_OMP_THREADS_BIND") for r in ("prefill", "decode")]
    if all(binds):
        return f"the prefill engines sharing core {binds[0]}, the decode engines core {binds[1]}"
    return "all four engines sharing every core"


def engine_kv_bytes(cfg: Any, model_dir: str) -> int:
    """The KV/state cache each prefill engine gets, as the launcher gives it (`cluster.cli.placement.device_options`):
    the pool's kv_cache_gib as vLLM's kv_cache_memory_bytes (older launchers: VLLM_CPU_KVCACHE_SPACE, whole GiB)."""
    from cluster.cli.placement import device_options

    opts = device_options(cfg, "prefill", model_dir)
    explicit = opts.get("engine_kwargs", {}).get("kv_cache_memory_bytes")
    if explicit:
        return int(explicit)
    space = opts.get("extra_env", {}).get("VLLM_CPU_KVCACHE_SPACE")
    if not space:
        raise RuntimeError("the launcher gives prefill engines neither kv_cache_memory_bytes nor "
                           "VLLM_CPU_KVCACHE_SPACE")
    return int(space) * GIB


# the default cache: one engine holds this share of the multi-turn conversations at their last turn, so that the
# two prefill engines together hold most of them, and a turn sent to the engine that lacks its conversation evicts
# others there (as a production cache under load does)
HELD_SHARE = 3 / 8


def default_kv_cache_gib(pool: BlockPool, spec: MultiTurn, longest_request: int, concurrency: int) -> tuple[float, str]:
    """The KV/state cache per engine when --kv-cache-gib is not given, and what sized it: HELD_SHARE of the
    conversations at their last turn (their prompt and reply), and at least room for `concurrency` requests of
    `longest_request` tokens (the prefix and random workloads' in flight) and for two conversations' last turns."""
    last = pool.blocks(spec.prompt_lengths()[-1] + spec.reply_tokens)
    held = math.ceil(HELD_SHARE * spec.conversations)
    sizes = [(held * last, f"one engine holding {held} of the {spec.conversations} conversations at their last turn"),
             (concurrency * pool.blocks(longest_request), f"room for {concurrency} requests of {longest_request} "
                                                           "tokens in flight"),
             (2 * last, "room for two conversations' last turns")]
    blocks, why = max(sizes, key=lambda s: s[0])
    return pool.gib(blocks), f"{blocks} blocks: {why}"


def cache_capacity(pool: BlockPool, cfg: Any, model_dir: str, prefix_len: int) -> dict[str, Any]:
    """One prefill engine's cache (`pool`, sized as the launcher sizes `cfg`'s): bytes, block size, and about how many
    `prefix_len`-token prefixes it holds."""
    kv = engine_kv_bytes(cfg, model_dir)
    return {"kv_bytes": kv, "block_size": pool.block_size, "page_bytes": pool.page_bytes,
            "prefixes_held": pool.held(kv, prefix_len)}


def cluster_block_size(cluster: Any) -> int:
    """The block size the cluster's prefill engines registered with (their run-time layout)."""
    import ray

    sizes = set()
    for client in cluster.refresh_engines().values():
        reg = ray.get(client.registration(), timeout=30)
        if reg.role == "prefill":
            sizes |= {r["layout"]["block_size"] for r in reg.ranks}
    if len(sizes) != 1:
        raise RuntimeError(f"the prefill engines registered block sizes {sorted(sizes)}, not one")
    return sizes.pop()


def vllm_block_size(url: str) -> int | None:
    """vLLM's server's block size, from its `vllm:cache_config_info` gauge (None when it does not say)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "vllm:cache_config_info" and s.labels.get("block_size", "").isdigit():
                return int(s.labels["block_size"])
    return None


def run_workloads(target: str, kind: str, url: str, api_key: str | None, block_size: int, model: str,
                  model_dir: str, token_ids: list[int], args: Any, spec: MultiTurn) -> dict[str, Any]:
    """Every workload of `--workloads`, in order, against one running target; a workload that fails is reported in
    its entry and the others still run."""
    from cluster.cli.bench.goodput import run_client

    def say(msg: str) -> None:
        print(f"  {target}: {msg}", flush=True)

    out: dict[str, Any] = {"block_size": block_size, "turns": []}
    for workload in args.workloads:
        t0 = time.monotonic()
        try:
            before = scrape(url, api_key, kind)
            if workload == "multi-turn":
                say(f"multi-turn: {spec.conversations} conversations x {spec.turns} turns ...")
                rows, seconds = run_multi_turn(url, api_key, model, spec, token_ids, target, block_size,
                                               args.step_timeout, say)
                use = prompt_token_use(before, scrape(url, api_key, kind), kind)
                out["turns"] = [asdict(r) for r in rows]
                out["multi_turn"] = res = multi_turn_summary(rows, seconds, use, spec.conversations * spec.turns)
                say(f"multi-turn: {res['requests'] - res['failed']}/{res['requests']} turns in {seconds:.0f} s, TTFT "
                    f"p50 turns >= 2 {fmt(res['ttft_p50_later_turns_ms'])} ms, computed {num(use['computed_tokens'])}"
                    f" / unavoidable {res['unavoidable_tokens']} prompt tokens"
                    + (f", {use['routing_view_ms']} ms per choice asking the engines" if use.get("routing_view_ms")
                       else "") + routes_said(use) + (f" ({res['errors'][0]})" if res["errors"] else ""))
                continue
            if workload == "prefix":
                n = args.prefixes * args.prompts_per_prefix
                say(f"prefix: vLLM's bench client, {args.prefixes} prefixes x {args.prompts_per_prefix} prompts "
                    f"({args.prefix_len} + {args.suffix_len} tokens), at most {args.concurrency} in flight ...")
                argv = partial(client_argv, url, model, model_dir, workload="prefix", num_prompts=n,
                               concurrency=args.concurrency, seed=args.seed, input_len=0,
                               output_len=args.prefix_output_len, prefix_len=args.prefix_len,
                               suffix_len=args.suffix_len, prefixes=args.prefixes)
            else:
                say(f"random: vLLM's bench client, {args.num_prompts} prompts of {args.input_len} tokens, at most "
                    f"{args.concurrency} in flight ...")
                argv = partial(client_argv, url, model, model_dir, workload="random", num_prompts=args.num_prompts,
                               concurrency=args.concurrency, seed=args.seed, input_len=args.input_len,
                               output_len=args.output_len)
            with heartbeat(lambda s: say(f"{workload}: vLLM's bench client still running ({s:.0f} s)")):
                row = client_row(run_client(argv, api_key=api_key, timeout_s=args.step_timeout))
            row["prompt_tokens"] = prompt_token_use(before, scrape(url, api_key, kind), kind)
            out[workload] = row
            say(f"{workload}: {row['completed']} completed, {row['failed']} failed in {row['duration_s']:.0f} s, "
                f"{fmt(row['output_throughput'])} out tok/s, TTFT p50 {fmt(row['p50_ttft_ms'])} ms, computed "
                f"{num(row['prompt_tokens']['computed_tokens'])} of {num(row['prompt_tokens']['prompt_tokens'])} "
                "prompt tokens" + routes_said(row["prompt_tokens"]))
        except subprocess.TimeoutExpired:
            out[workload.replace("-", "_")] = {"error": f"timed out after {args.step_timeout:.0f} s"}
            say(f"{workload}: timed out after {args.step_timeout:.0f} s")
        except Exception as e:  # noqa: BLE001 - one workload's failure is its entry; the others still run
            msg = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            out[workload.replace("-", "_")] = {"error": msg}
            say(f"{workload} failed after {time.monotonic() - t0:.0f} s: {msg}")
    return out


def bench_cluster(target: str, cfg: Any, model_dir: str, token_ids: list[int], args: Any,
                  spec: MultiTurn) -> dict[str, Any]:
    """The bench's cluster with `routing.policy` = the target's, as `make run` starts it
    (`cluster.cli.bench.targets.local_cluster`)."""
    from actors.engine.settings import free_port
    from cluster.cli.bench.targets import local_cluster

    cfg = deploy_for_prefix_bench(cfg, free_port(), CLUSTER_TARGETS[target], args.kv_cache_gib)
    with local_cluster(cfg, target) as cluster:
        return run_workloads(target, "cluster", cluster.url, cfg.http.resolved_api_key(), cluster_block_size(cluster),
                             cfg.model.name, model_dir, token_ids, args, spec)


def bench_vllm(model_dir: str, name: str, token_ids: list[int], args: Any, spec: MultiTurn, logs: Path,
               fallback_block: int) -> dict[str, Any]:
    """vLLM's own OpenAI server, one engine at TP 1 with prefix caching on (`cluster.cli.bench.targets.vllm_server`)."""
    from cluster.cli.bench.targets import vllm_server

    with vllm_server(model_dir, name, 1, logs, prefix_caching=True, label="vllm-tp1") as url:
        block = vllm_block_size(url) or fallback_block
        return run_workloads("vllm", "vllm", url, None, block, name, model_dir, token_ids, args, spec)


# ---- the command --------------------------------------------------------------------------------------------------
def main(args: Any) -> int:
    from cluster.cli.bench.goodput import VLLM_SERVER_MAX_MODEL_LEN, deploy_model_dir, machine, parse_targets
    from cluster.core.config import load_deploy

    targets = parse_targets(args.targets, KNOWN_TARGETS)
    deploy = Path(args.deploy)
    base = load_deploy(deploy)
    if args.model:  # a builtin kind instead of the deploy file's model (gdn-wide: prefill dominates, as on real models)
        base = base.model_copy(update={"model": base.model.model_copy(update={"builtin": args.model, "path": None})})
    if base.device != "cpu":
        raise SystemExit(f"bench prefix-routing shapes its cluster for a CPU host (cores bound, KV cache in GiB of "
                         f"DRAM); {deploy} has device {base.device!r}")
    model_dir = deploy_model_dir(base)
    spec = MultiTurn(args.conversations, args.turns, args.think_s, args.first_tokens, args.user_tokens,
                     args.reply_tokens, args.seed, args.arrival_s)
    sized = ""
    pool = BlockPool.of(deploy_for_prefix_bench(base, 1, "cache", 1.0), model_dir)  # (the cache's size aside)
    if args.kv_cache_gib is None:
        longest = max(args.prefix_len + args.suffix_len + args.prefix_output_len, args.input_len + args.output_len)
        args.kv_cache_gib, why = default_kv_cache_gib(pool, spec, longest, args.concurrency)
        sized = f"sized by default, {why}"
    bench_cfg = deploy_for_prefix_bench(base, 1, "cache", args.kv_cache_gib)  # for the sizes; each target its own port
    max_len = base.model.max_model_len
    if "vllm" in targets:  # vLLM's server runs at cluster.cli.bench.serve's --max-model-len
        max_len = min(max_len, VLLM_SERVER_MAX_MODEL_LEN)
    check_multi_turn(spec, max_len)
    capacity = cache_capacity(pool, bench_cfg, model_dir, args.prefix_len)
    block = capacity["block_size"]
    if "prefix" in args.workloads:
        if args.prefixes is None:  # more than one engine holds, fewer than the two prefill engines together
            args.prefixes = max(1, math.ceil(1.5 * capacity["prefixes_held"]))
        check_prefix_workload(args.prefix_len, args.suffix_len, block, args.prefixes, args.prompts_per_prefix)
        if args.prefix_len + args.suffix_len + args.prefix_output_len > max_len:
            raise SystemExit(f"--prefix-len + --suffix-len + --prefix-output-len exceed the max model length {max_len}")
    if "random" in args.workloads and args.input_len + args.output_len > max_len:
        raise SystemExit(f"--input-len + --output-len exceed the max model length {max_len}")
    out_dir = Path(args.out_dir)
    logs = out_dir / "bench_prefix_routing_logs"
    logs.mkdir(parents=True, exist_ok=True)
    token_ids = vocabulary(model_dir)

    kv_gib = capacity["kv_bytes"] / GIB
    print(f"bench prefix-routing: {base.model.name} ({model_dir}); the cluster from {deploy} as 2 prefill + 2 decode "
          f"engines at TP 1 ({cores_said(bench_cfg)}), prefix caching on, every request disaggregated, "
          f"{kv_gib:.4g} GiB KV/state cache per engine ({sized or f'--kv-cache-gib {args.kv_cache_gib:g}'}), block "
          f"{block} tokens; "
          f"targets {', '.join(targets)}; workloads {', '.join(args.workloads)}", flush=True)
    lens = spec.prompt_lengths()
    if "multi-turn" in args.workloads:
        print(f"multi-turn: {spec.conversations} conversations x {spec.turns} turns, first message {spec.first_tokens} "
              f"tokens, then {spec.user_tokens} per turn, replies {spec.reply_tokens} (greedy, ignore_eos), think time "
              f"exp. mean {spec.think_s:g} s, "
              + (f"a conversation starting every {spec.arrival_s:g} s (Poisson)" if spec.arrival_s
                 else "all starting together")
              + f", seed {spec.seed}; prompts {lens[0]}..{lens[-1]} tokens", flush=True)
    if "prefix" in args.workloads:
        held = capacity["prefixes_held"]
        print(f"prefix: {args.prefixes} prefixes of {args.prefix_len} tokens x {args.prompts_per_prefix} prompts "
              f"(+{args.suffix_len} random tokens, {args.prefix_output_len} out); one engine holds about {held} such "
              f"prefixes" + ("" if args.prefixes > held else " - FEWER prefixes than that: this run does not test "
                             "eviction"), flush=True)
    if "random" in args.workloads:
        print(f"random: {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} out", flush=True)

    results: dict[str, dict] = {}
    problems: list[str] = []
    for target in targets:
        print(f"{target}:", flush=True)
        t0 = time.monotonic()
        try:
            if target in CLUSTER_TARGETS:
                results[target] = bench_cluster(target, base, model_dir, token_ids, args, spec)
            else:
                results[target] = bench_vllm(model_dir, base.model.name, token_ids, args, spec, logs, block)
        except Exception as e:  # noqa: BLE001 - one target that does not start must not cost the others' results
            msg = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            print(f"  {target} failed: {msg}", flush=True)
            results[target] = {"error": msg, "turns": []}
        res = results[target]
        res["seconds"] = round(time.monotonic() - t0, 1)
        if res.get("error"):
            problems.append(f"{target}: {res['error']}")
        for w in ("multi_turn", "prefix", "random"):
            x = res.get(w) or {}
            if x.get("error"):
                problems.append(f"{target} {w}: {x['error']}")
            elif x.get("failed") or x.get("unsent"):
                problems.append(f"{target} {w}: {x.get('failed') or 0} failed requests"
                                + (f", {x['unsent']} turns not sent" if x.get("unsent") else ""))
        print(f"  {target}: done in {results[target]['seconds']:.0f} s", flush=True)

    if any(r.get("multi_turn") for r in results.values()):
        print("\nmulti-turn TTFT by turn (ms):")
        print("\n".join(turn_table(results)))
    print("\nper workload (TTFT in ms; prompt tokens from each target's /metrics):")
    print("\n".join(workload_table(results)))
    checks = check_targets(results)
    print("targets:\n  " + "\n  ".join(checks))
    print("  " + "\n  ".join(vllm_lines(results)))
    if problems:
        print("problems:\n  " + "\n  ".join(problems))

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench_prefix_routing.json"
    turns = [t for r in results.values() for t in r.pop("turns", [])]
    config = {"deploy_file": str(deploy),
              "deploy": bench_cfg.model_dump(mode="json", exclude={"http": {"api_key", "port"}}),
              "model_dir": model_dir, "targets": targets, "workloads": args.workloads,
              "multi_turn": asdict(spec), "kv_cache_gib_option": args.kv_cache_gib,
              "kv_cache_sized": sized or None, "engine_cache": capacity,
              "prefix": {"prefixes": args.prefixes, "prompts_per_prefix": args.prompts_per_prefix,
                         "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
                         "output_len": args.prefix_output_len},
              "random": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len},
              "concurrency": args.concurrency, "seed": args.seed, "step_timeout_s": args.step_timeout,
              "vllm_server": "vllm.entrypoints.openai.api_server, TP 1, prefix caching on, 1 GiB KV "
                             "(cluster.cli.bench.targets.vllm_server)",
              "client": "multi-turn: openai.AsyncOpenAI, streamed /v1/completions; prefix and random: "
                        "vllm.benchmarks.serve (unmodified, a subprocess per workload)"}
    path.write_text(json.dumps({"benchmark": "prefix-routing", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                "machine": machine(), "config": config, "results": results, "turns": turns,
                                "targets": checks, "cache_vs_vllm": vllm_lines(results), "problems": problems},
                               indent=2))
    try:
        plot(results, path.with_suffix(".png"))
    except Exception as e:  # noqa: BLE001 - the JSON is the result; a plot failure is reported, not fatal
        print(f"(no plot: {e})")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 1 if problems else 0


def _positive(value: str) -> int:
    import argparse

    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"a whole number, 1 or more, not {value!r}")
    return int(value)


def _workloads(text: str) -> list[str]:
    import argparse

    got = [w for w in text.split(",") if w]
    bad = [w for w in got if w not in KNOWN_WORKLOADS]
    if not got or bad or len(set(got)) != len(got):
        raise argparse.ArgumentTypeError(f"comma separated, each at most once, from {', '.join(KNOWN_WORKLOADS)}, "
                                         f"not {text!r}")
    return [w for w in KNOWN_WORKLOADS if w in got]  # always in this order: multi-turn first, on empty caches


def add_args(p: Any) -> None:
    p.add_argument("--deploy", default=str(REPO / "deploy.yaml"), help="the deploy file the bench's cluster is built "
                   "from (default: the repository's deploy.yaml); its model is every target's model")
    p.add_argument("--model", choices=BUILTIN_NAMES, default=None, help="a builtin model instead of the deploy "
                   "file's: gdn-wide (~10x gdn's compute per token, the same block size) makes prefill most of a "
                   "request's time, as on a real model, where the tiny gdn spends it elsewhere; qwen3.5-0.8b is the "
                   "real architecture at its size (640-token blocks)")
    p.add_argument("--targets", default=DEFAULT_TARGETS, help=f"comma separated, from {', '.join(KNOWN_TARGETS)} "
                   f"(default {DEFAULT_TARGETS})")
    p.add_argument("--workloads", type=_workloads, default=list(KNOWN_WORKLOADS),
                   help="comma separated, from multi-turn, prefix, random (default all; run in that order)")
    p.add_argument("--conversations", type=_positive, default=16, help="multi-turn: conversations (default 16)")
    p.add_argument("--turns", type=_positive, default=4, help="multi-turn: turns per conversation (default 4)")
    p.add_argument("--arrival-s", type=float, default=2.0, help="multi-turn: mean gap between conversations' "
                   "starts (Poisson arrivals; default 2 s; 0: all start together)")
    p.add_argument("--think-s", type=float, default=2.0, help="multi-turn: mean think time before each turn, "
                   "exponential (default 2 s; 0: none)")
    p.add_argument("--first-tokens", type=_positive, default=1024, help="multi-turn: first user message "
                   "(default 1024)")
    p.add_argument("--user-tokens", type=_positive, default=256, help="multi-turn: each later user message "
                   "(default 256)")
    p.add_argument("--reply-tokens", type=_positive, default=16, help="multi-turn: each reply (default 16)")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="KV/state cache per cluster engine (default: "
                   "sized from the model's layout for one engine to hold 3/8 of the multi-turn "
                   "conversations at their last turn - the two prefill engines together most of them - and the "
                   "prefix workload's prefixes overflow it)")
    p.add_argument("--prefixes", type=_positive, default=None, help="prefix: shared prefixes (default: 1.5x what one "
                   "engine's cache holds, estimated from the model's layout)")
    p.add_argument("--prompts-per-prefix", type=_positive, default=2, help="prefix: prompts per prefix (default 2)")
    p.add_argument("--prefix-len", type=_positive, default=512, help="prefix: prefix tokens, whole blocks "
                   "(default 512)")
    p.add_argument("--suffix-len", type=_positive, default=32, help="prefix: random tokens after it, under a block "
                   "(default 32)")
    p.add_argument("--prefix-output-len", type=_positive, default=16, help="prefix: output tokens (default 16)")
    p.add_argument("--num-prompts", type=_positive, default=64, help="random: prompts (default 64)")
    p.add_argument("--input-len", type=_positive, default=512, help="random: prompt tokens (default 512)")
    p.add_argument("--output-len", type=_positive, default=64, help="random: output tokens (default 64)")
    p.add_argument("--concurrency", type=_positive, default=8, help="prefix and random: requests in flight at most "
                   "(default 8)")
    p.add_argument("--seed", type=int, default=0, help="the conversations' and vLLM's bench client's seed")
    p.add_argument("--step-timeout", type=float, default=1200, help="seconds per workload and target")
    p.add_argument("--out-dir", "--out", dest="out_dir", default="results")


if __name__ == "__main__":
    raise SystemExit("run `python -m cluster bench prefix-routing`")
