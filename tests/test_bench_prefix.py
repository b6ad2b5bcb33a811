"""`bench prefix-routing`: its arithmetic without engines - the unavoidable prompt tokens of a conversation, the
prompt tokens computed read off each kind of /metrics page, the per-turn summary, the verdicts and their "not
measured" reasons, how many prefixes one engine holds, the bench's cluster shape, vLLM's bench client accepting its
arguments - and (marked engine) one tiny live run of the whole command against the cache-routed cluster."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli.bench.multi_turn import (BlockPool, MultiTurn, Turn, check_multi_turn, check_prefix_workload,
                                          client_argv, client_row, counters, fill_unavoidable, metric_sum,
                                          prompt_token_use, routes_said, unavoidable_tokens)
from cluster.cli.bench.prefix_report import check_targets, multi_turn_summary, percentile, turn_table, vllm_lines
from cluster.cli.bench.prefix_routing import (add_args, bench_cores, cores_said, default_kv_cache_gib,
                                              deploy_for_prefix_bench)

REPO = Path(__file__).resolve().parents[1]


# ---- the unavoidable tokens ----------------------------------------------------------------------------------------
def test_unavoidable_is_the_first_prompt_then_each_prompt_past_the_last_whole_block_of_the_previous():
    # 512 first tokens, then 32 reply + 64 user per turn, 128-token blocks: each previous prompt resumable at the
    # last boundary before its last token - 384 (512 is a whole number of blocks: one short), 512, 640, 768
    assert unavoidable_tokens([512, 608, 704, 800, 896], 128) == [512, 224, 192, 160, 128]
    assert unavoidable_tokens([500, 596, 692], 128) == [500, 212, 180]
    assert unavoidable_tokens([100, 150], 128) == [100, 150]  # nothing resumable under one block
    assert unavoidable_tokens([128, 129], 128) == [128, 129]  # the N-1 boundary of a one-block prompt is 0
    assert unavoidable_tokens([129, 200], 128) == [129, 72]
    assert unavoidable_tokens([5, 9, 12], 1) == [5, 5, 4]  # block 1: the new tokens and the previous last one
    assert unavoidable_tokens([], 64) == []
    for n, b in ((700, 128), (1000, 64), (333, 32), (640, 128)):  # more than the new tokens, at most a block more
        u = unavoidable_tokens([n, n + 50], b)[1]
        assert 50 < u <= 50 + b
    with pytest.raises(ValueError, match="extends"):
        unavoidable_tokens([200, 150], 128)
    with pytest.raises(ValueError, match="block size"):
        unavoidable_tokens([1], 0)


def test_fill_unavoidable_goes_per_conversation_and_target_and_ignores_turn_order_of_arrival():
    rows = [Turn("cache", 1, 2, 608, 96), Turn("cache", 0, 1, 512, 512), Turn("cache", 1, 1, 512, 512),
            Turn("load", 0, 1, 300, 300), Turn("cache", 0, 2, 608, 96)]
    fill_unavoidable(rows, 128)
    assert [(r.target, r.conversation, r.turn, r.unavoidable_tokens) for r in rows] == [
        ("cache", 1, 2, 224), ("cache", 0, 1, 512), ("cache", 1, 1, 512), ("load", 0, 1, 300), ("cache", 0, 2, 224)]


def test_multi_turn_prompt_lengths_and_the_model_length_check():
    spec = MultiTurn(8, 5, 0.5, 512, 64, 32, 0)
    assert spec.prompt_lengths() == [512, 608, 704, 800, 896]
    assert spec.rng(3).random() == spec.rng(3).random() != spec.rng(4).random()  # the same on every target
    check_multi_turn(spec, 2048)
    with pytest.raises(SystemExit, match="lower --turns"):
        check_multi_turn(MultiTurn(8, 20, 0.5, 512, 64, 32, 0), 2048)
    with pytest.raises(SystemExit, match="--arrival-s"):
        check_multi_turn(MultiTurn(8, 5, 0.5, 512, 64, 32, 0, arrival_s=-1), 2048)


def test_conversations_start_together_or_as_poisson_arrivals():
    assert MultiTurn(4, 5, 0.5, 512, 64, 32, 0).start_offsets() == [0.0] * 4
    spec = MultiTurn(400, 5, 0.5, 512, 64, 32, 7, arrival_s=1.5)
    starts = spec.start_offsets()
    assert starts == spec.start_offsets() != MultiTurn(400, 5, 0.5, 512, 64, 32, 8, arrival_s=1.5).start_offsets()
    assert starts[0] == 0 and all(b > a for a, b in zip(starts, starts[1:]))
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert 1.3 < sum(gaps) / len(gaps) < 1.7  # mean 1.5 s
    assert sorted(gaps)[len(gaps) // 2] < 1.5 * 0.85  # exponential: the median gap is ln 2 of the mean


# ---- /metrics -------------------------------------------------------------------------------------------------------
CLUSTER_PAGE = """# TYPE pd_prompt_tokens_total counter
pd_prompt_tokens_total 5000.0
# TYPE pd_cached_prompt_tokens_total counter
pd_cached_prompt_tokens_total{role="prefill"} 3072.0
pd_cached_prompt_tokens_total{role="decode"} 2048.0
# TYPE pd_requests_local_prefill_total counter
pd_requests_local_prefill_total 0.0
# TYPE pd_requests_colocated_total counter
pd_requests_colocated_total{role="prefill"} 0.0
pd_requests_colocated_total{role="decode"} 0.0
# TYPE pd_requests_retried_total counter
pd_requests_retried_total 0.0
"""
VLLM_PAGE = """# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny-hybrid"} 5000.0
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-hybrid",source="local_compute"} 1900.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-hybrid",source="local_cache_hit"} 3100.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-hybrid",source="external_kv_transfer"} 0.0
# TYPE vllm:prompt_tokens_cached_total counter
vllm:prompt_tokens_cached_total{engine="0",model_name="tiny-hybrid"} 3100.0
"""


def test_counters_read_both_kinds_of_metrics_page():
    assert metric_sum(CLUSTER_PAGE, "pd_cached_prompt_tokens_total") == 5120  # both roles
    assert metric_sum(CLUSTER_PAGE, "pd_cached_prompt_tokens_total", {"role": "decode"}) == 2048
    assert metric_sum(CLUSTER_PAGE, "pd_no_such_total") is None
    c = counters(CLUSTER_PAGE, "cluster")
    assert (c["prompt"], c["cached"], c["decode_cached"], c["local_prefill"]) == (5000, 3072, 2048, 0)
    v = counters(VLLM_PAGE, "vllm")
    assert (v["prompt"], v["computed"], v["cached"]) == (5000, 1900, 3100)


def test_routing_decisions_and_mispredictions_are_read_and_said():
    page = CLUSTER_PAGE + """# TYPE pd_routing_decisions_total counter
pd_routing_decisions_total{reason="hit"} 10.0
pd_routing_decisions_total{reason="load"} 4.0
# TYPE pd_prefix_mispredictions_total counter
pd_prefix_mispredictions_total{role="prefill"} 1.0
pd_prefix_mispredictions_total{role="decode"} 5.0
"""
    before = counters(page, "cluster")
    assert (before["route_hit"], before["route_spread"], before["route_load"], before["mispredicted"]) == (
        10, None, 4, 1)
    after = {**before, "route_hit": 40.0, "route_spread": 3.0, "route_load": 20.0, "mispredicted": 3.0}
    use = prompt_token_use(before, after, "cluster")
    assert use["routes"] == {"hit": 30, "spread": 3, "load": 16, "only": None, "local": None}  # spread: new
    assert use["mispredicted"] == 2
    assert routes_said(use) == ", routes hit 30 / spread 3 / load 16, 2 mispredicted"
    assert routes_said(prompt_token_use(before, before, "cluster")) == ""  # no choice between the two scrapes
    # the rarer reasons are said when they happened: one prefill engine left to choose, a decode engine's own prefill
    rare = prompt_token_use(before, {**after, "route_only": 2.0, "route_local": 0.0}, "cluster")
    assert routes_said(rare) == ", routes hit 30 / spread 3 / load 16 / only 2, 2 mispredicted"
    # the choices that asked the engines and those that had no engine to ask (`pd_routing_unasked_total`)
    asked = prompt_token_use({**before, "views": 5.0, "unasked": 1.0}, {**after, "views": 35.0, "unasked": 20.0},
                             "cluster")
    assert routes_said(asked).endswith(", 2 mispredicted, engines asked in 30 choices, 19 routed without asking")
    assert counters(page + "# TYPE pd_routing_unasked_total counter\npd_routing_unasked_total 7.0\n",
                    "cluster")["unasked"] == 7


def test_prompt_token_use_is_the_difference_of_two_scrapes():
    before = counters(CLUSTER_PAGE, "cluster")
    after = {**before, "prompt": 9000.0, "cached": 5072.0, "decode_cached": 4000.0}
    use = prompt_token_use(before, after, "cluster")
    assert (use["prompt_tokens"], use["cached_tokens"], use["computed_tokens"]) == (4000, 2000, 2000)
    assert use["decode_cached_tokens"] == 1952 and use["note"] is None
    # a request a decode engine prefilled itself was not computed by a prefill engine: the figure is flagged
    odd = prompt_token_use(before, {**after, "local_prefill": 3.0}, "cluster")
    assert odd["computed_tokens"] == 2000 and "local_prefill 3" in odd["note"]
    v0 = counters(VLLM_PAGE, "vllm")
    v = prompt_token_use(v0, {**v0, "prompt": 6000.0, "computed": 2300.0, "cached": 3700.0}, "vllm")
    assert (v["prompt_tokens"], v["computed_tokens"], v["cached_tokens"]) == (1000, 400, 600)
    missing = prompt_token_use({}, {}, "cluster")
    assert missing["computed_tokens"] is None and "lacks counters" in missing["note"]


# ---- summary and verdicts -------------------------------------------------------------------------------------------
def _turns(target: str, ttft_by_turn: dict[int, list[float]], fail: tuple[int, int] | None = None) -> list[Turn]:
    """Conversations of `target` with the given TTFTs per turn (one conversation per value), prompts of 512 then +96
    per turn, 32-token replies; `fail`: (conversation, turn) that failed."""
    rows = []
    for turn, values in sorted(ttft_by_turn.items()):
        for conv, ttft in enumerate(values):
            row = Turn(target, conv, turn, 512 + 96 * (turn - 1), 512 if turn == 1 else 96, ttft_ms=ttft,
                       latency_s=1.0, output_tokens=32)
            if fail == (conv, turn):
                row.ttft_ms, row.latency_s, row.output_tokens, row.error = None, None, 0, "APIError: boom"
            rows.append(row)
    fill_unavoidable(rows, 128)
    return rows


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    values = [12.0, 3.5, 7.0, 100.0, 42.0]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None and percentile([5.0], 99) == 5.0


def test_multi_turn_summary_per_turn_and_later_turns():
    rows = _turns("cache", {1: [200.0, 220.0, 240.0], 2: [50.0, 60.0, 70.0], 3: [40.0, 80.0, 90.0]}, fail=(1, 3))
    use = {"prompt_tokens": 4000, "cached_tokens": 2400, "computed_tokens": 1600, "note": None}
    s = multi_turn_summary(rows, 10.0, use)
    assert [x["turn"] for x in s["by_turn"]] == [1, 2, 3]
    t1, t2, t3 = s["by_turn"]
    assert (t1["requests"], t1["failed"], t1["ttft_p50_ms"]) == (3, 0, 220.0)
    assert t2["ttft_p50_ms"] == 60.0 and t3["failed"] == 1 and t3["ttft_p50_ms"] == 65.0  # 40, 90 (80 failed)
    assert s["ttft_p50_later_turns_ms"] == 60.0  # 50, 60, 70, 40, 90
    assert (s["requests"], s["failed"], s["errors"]) == (9, 1, ["APIError: boom"])
    assert s["output_tokens"] == 8 * 32 and s["output_throughput"] == pytest.approx(25.6)
    # unavoidable: 512 per conversation's first turn, then 224 (608 - 384), then 192 (704 - 512): failed turns count
    # (their prompt tokens were sent)
    assert s["unavoidable_tokens"] == 3 * (512 + 224 + 192)
    assert s["computed_over_unavoidable"] == pytest.approx(1600 / 2784, abs=1e-3)
    assert s["unsent"] is None  # nothing expected given
    # 4 conversations x 3 turns expected, the fourth never started (a timeout while it waited for its start)
    assert multi_turn_summary(rows, 10.0, use, expected=12)["unsent"] == 3
    assert multi_turn_summary(rows, 10.0, use, expected=9)["unsent"] == 0


def _results(cache_ttft: float, load_ttft: float, computed: int, cache_tps: float, load_tps: float,
             vllm: bool = True) -> dict:
    def target(ttft: float, comp: int, tps: float) -> dict:
        rows = _turns("x", {1: [300.0, 300.0], 2: [ttft, ttft], 3: [ttft, ttft]})
        mt = multi_turn_summary(rows, 5.0, {"prompt_tokens": 2 * (512 + 608 + 704), "cached_tokens": 1000,
                                            "computed_tokens": comp, "note": None})
        return {"multi_turn": mt, "random": {"completed": 8, "failed": 0, "output_throughput": tps,
                                             "p50_ttft_ms": 90.0},
                "prefix": {"completed": 8, "failed": 0, "output_throughput": tps / 2, "p50_ttft_ms": 80.0}}
    out = {"cache": target(cache_ttft, computed, cache_tps), "load": target(load_ttft, 3000, load_tps)}
    if vllm:
        out["vllm"] = target(load_ttft / 2, 1500, load_tps * 1.1)
    return out


def test_verdicts_met():
    # unavoidable per conversation 512 + 224 + 192 = 928, two conversations: 1856
    lines = check_targets(_results(40.0, 100.0, 2000, 97.0, 100.0))
    assert lines[0] == "multi-turn TTFT p50 of turns >= 2: cache <= 0.6x load: 0.40x (40.0 vs 100.0 ms) (<= 0.6x: met)"
    assert lines[1].startswith("multi-turn prompt tokens computed (cache) <= 1.2x the unavoidable: 1.08x (2000 "
                               "computed, 1000 resumed, 1856 unavoidable)") and lines[1].endswith("(<= 1.2x: met)")
    assert lines[2] == ("random workload output throughput: cache >= 0.95x load: 0.97x (97.0 vs 100.0 tok/s) "
                        "(>= 0.95x: met)")


def test_verdicts_missed_with_their_figures():
    lines = check_targets(_results(70.0, 100.0, 2400, 90.0, 100.0))
    assert "0.70x (70.0 vs 100.0 ms) (<= 0.6x: MISSED)" in lines[0]
    assert "1.29x (2400 computed" in lines[1] and lines[1].endswith("MISSED)")
    assert "0.90x (90.0 vs 100.0 tok/s) (>= 0.95x: MISSED)" in lines[2]
    # failed random requests on either side miss the throughput target whatever the ratio
    res = _results(40.0, 100.0, 1800, 120.0, 100.0)
    res["cache"]["random"]["failed"] = 2
    assert check_targets(res)[2].endswith("failed requests on cache) (>= 0.95x: MISSED)")


def test_verdicts_not_measured_say_why():
    res = _results(40.0, 100.0, 1800, 97.0, 100.0)
    only_cache = {"cache": res["cache"]}
    lines = check_targets(only_cache)
    assert lines[0].endswith("not measured (load not in --targets)") and "met" in lines[1]
    assert lines[2].endswith("not measured (load not in --targets)")
    failed = {**res, "load": {"error": "RuntimeError: an engine did not start"}}
    assert "load failed: RuntimeError: an engine did not start" in check_targets(failed)[0]
    no_random = {t: {k: v for k, v in r.items() if k != "random"} for t, r in res.items()}
    assert check_targets(no_random)[2].endswith("not measured (random not in --workloads)")
    no_counters = json.loads(json.dumps(res))
    no_counters["cache"]["multi_turn"]["prompt_tokens"] = {"computed_tokens": None,
                                                           "note": "the target's /metrics lacks counters for x"}
    assert check_targets(no_counters)[1].endswith("not measured (the target's /metrics lacks counters for x)")


def test_cache_vs_vllm_lines_and_turn_table():
    res = _results(40.0, 100.0, 1800, 97.0, 100.0)
    lines = vllm_lines(res)
    assert lines[0] == "cache vs vllm, multi-turn TTFT p50, turns >= 2: 40.0 ms vs 50.0 ms (0.80x)"
    assert any(ln.startswith("cache vs vllm, multi-turn computed / unavoidable: 0.97 vs 0.81") for ln in lines)
    assert any("random workload output throughput: 97.0 tok/s vs 110.0 tok/s (0.88x)" in ln for ln in lines)
    assert vllm_lines({"cache": res["cache"]}) == ["cache vs vllm: not measured (needs both in --targets)"]
    table = turn_table(res)
    assert table[0] == ("| turn | cache TTFT p50 / p99 (failed) | load TTFT p50 / p99 (failed) | "
                        "vllm TTFT p50 / p99 (failed) |")
    assert table[2] == "| 1 | 300.0 / 300.0 (0) | 300.0 / 300.0 (0) | 300.0 / 300.0 (0) |"
    assert table[3].startswith("| 2 | 40.0 / 40.0 (0) | 100.0 / 100.0 (0) |")


# ---- the engine's cache and the prefix workload ---------------------------------------------------------------------
def test_prefixes_one_engine_holds():
    # the tiny GDN model at 1 GiB: 8192 blocks of 128 KiB; a 512-token prefix keeps 4 attention blocks + 3 states
    assert BlockPool(128, 131072, 1, 1, 3).held(1 << 30, 512) == 8192 // 7
    assert BlockPool(128, 131072, 2, 1, 3).held(1 << 30, 512) == 4096 // 7  # two layers per group: half the blocks
    assert BlockPool(128, 131072, 1, 1, 0).held(1 << 30, 100) == 8192  # attention only, a prefix under a block


def test_the_default_cache_holds_three_eighths_of_the_conversations_at_their_last_turn():
    """gdn-wide's pool (blocks of 2 x 128 KiB, one attention and three state groups): the default multi-turn shape's
    last turn, 1,856 tokens, keeps 15 attention blocks and a checkpoint (18 blocks); 6 of 16 conversations: 108
    blocks, 27 MiB. Room for the requests in flight, or for two last turns, when the conversations are few."""
    wide = BlockPool(block_size=128, page_bytes=131072, regions=2, attention_groups=1, state_groups=3)
    spec = MultiTurn(16, 4, 2.0, 1024, 256, 16, 0, 2.0)
    assert spec.prompt_lengths()[-1] + 16 == 1856 and wide.blocks(1856) == 18
    assert default_kv_cache_gib(wide, spec, 576, 8) == (
        27 / 1024, "108 blocks: one engine holding 6 of the 16 conversations at their last turn")
    tiny = BlockPool(128, 131072, 1, 1, 3)  # one region: half the bytes
    assert default_kv_cache_gib(tiny, spec, 576, 8)[0] == math.ceil(108 * 131072 / (1 << 20)) / 1024
    two = MultiTurn(2, 4, 2.0, 1024, 256, 16, 0, 2.0)
    assert default_kv_cache_gib(wide, two, 576, 8) == (  # 8 in flight of 5 + 3 blocks
        8 * 8 * 256 / 1024 / 1024, "64 blocks: room for 8 requests of 576 tokens in flight")
    assert default_kv_cache_gib(wide, two, 576, 1) == (
        2 * 18 * 256 / 1024 / 1024, "36 blocks: room for two conversations' last turns")
    assert BlockPool(16, 1000, 1, 2, 0).blocks(17) == 4  # attention only: two groups, two blocks each


def test_the_prefix_workload_must_be_resumable_at_the_prefix():
    check_prefix_workload(512, 32, 128, 10, 2)
    with pytest.raises(SystemExit, match="whole number of blocks"):
        check_prefix_workload(500, 32, 128, 10, 2)
    with pytest.raises(SystemExit, match="under a block"):
        check_prefix_workload(512, 128, 128, 10, 2)
    with pytest.raises(SystemExit, match="prompts-per-prefix"):
        check_prefix_workload(512, 32, 128, 10, 1)


def test_client_argv_is_accepted_by_the_installed_vllm_bench_client():
    serve = pytest.importorskip("vllm.benchmarks.serve")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    a = parser.parse_args(client_argv("http://127.0.0.1:1", "tiny-hybrid", "/m", "/out", workload="prefix",
                                      num_prompts=20, concurrency=8, seed=3, input_len=0, output_len=16,
                                      prefix_len=512, suffix_len=32, prefixes=10))
    assert a.dataset_name == "prefix_repetition" and a.num_prompts == 20 and a.max_concurrency == 8
    assert (a.prefix_repetition_prefix_len, a.prefix_repetition_suffix_len, a.prefix_repetition_num_prefixes,
            a.prefix_repetition_output_len) == (512, 32, 10, 16)
    assert a.request_rate == float("inf") and a.ignore_eos and a.temperature == 0.0 and a.seed == 3
    r = parser.parse_args(client_argv("http://127.0.0.1:1", "tiny-hybrid", "/m", "/out", workload="random",
                                      num_prompts=64, concurrency=8, seed=0, input_len=512, output_len=64))
    assert (r.dataset_name, r.random_input_len, r.random_output_len, r.num_prompts) == ("random", 512, 64, 64)
    with pytest.raises(ValueError):
        client_argv("u", "m", "/m", "/o", workload="multi-turn", num_prompts=1, concurrency=1, seed=0, input_len=1,
                    output_len=1)


def test_client_row_has_no_latency_when_nothing_completed():
    res = {"completed": 0, "failed": 4, "duration": 3.2, "request_throughput": 0.0, "output_throughput": 0.0,
           "total_token_throughput": 0.0, "p50_ttft_ms": 0.0, "p99_ttft_ms": 0.0}
    row = client_row(res)
    assert row["failed"] == 4 and row["p50_ttft_ms"] is None and row["output_throughput"] == 0.0


# ---- the bench's cluster and options --------------------------------------------------------------------------------
def test_the_bench_cluster_is_two_and_two_shared_cores_all_disaggregated_with_the_policy():
    from cluster.core.config import DeployConfig

    cfg = DeployConfig.model_validate({"prefill": {"tp": 2, "max_replicas": 3, "enable_prefix_caching": False},
                                       "decode": {"tp": 1}, "transfer": {"local_prefill_queue": 3,
                                                                         "local_prefill_when_idle": True,
                                                                         "local_prefill_speed": 0.5}})
    out = deploy_for_prefix_bench(cfg, 12345, "load", 2.0, cores=[0, 1])
    for pool in (out.prefill, out.decode):
        assert (pool.tp, pool.min_replicas, pool.max_replicas, pool.share_cores, pool.enable_prefix_caching,
                pool.kv_cache_gib) == (1, 2, 2, True, True, 2.0)
        assert not pool.autoscaling
    # prefill and decode on cores of their own: on 2 cores each pool's engines share one
    assert (out.prefill.env["VLLM_CPU_OMP_THREADS_BIND"], out.decode.env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert cores_said(out) == "the prefill engines sharing core 0, the decode engines core 1"
    assert out.transfer.local_prefill_queue is None and out.transfer.local_prefill_when_idle is False
    assert out.transfer.local_prefill_speed is None
    assert out.routing.policy == "load" and out.http.port == 12345 and out.coordinator.namespace == "pd-bench-prefix"
    assert out.model == cfg.model and out.transfer.verify == cfg.transfer.verify
    assert cfg.prefill.tp == 2 and cfg.http.port == 8000  # the loaded config untouched
    assert deploy_for_prefix_bench(cfg, 1, "cache", 1).routing.policy == "cache"


def test_the_bench_puts_prefill_and_decode_on_cores_of_their_own():
    from cluster.core.config import DeployConfig

    assert bench_cores([5, 3]) == {"prefill": "3", "decode": "5"}
    # more cores: still two (the local Ray instance offers 2 CPUs), a pool on each
    assert bench_cores(range(16)) == bench_cores([0, 1])
    assert bench_cores([7]) == {"prefill": None, "decode": None}
    # the file's own thread settings give way to the bench's binding; its other env and own-core fields are dropped
    # or kept as they validate; the loaded config is left as it was
    cfg = DeployConfig.model_validate({"prefill": {"share_cores": True, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-3",
                                                                                "OMP_NUM_THREADS": "4",
                                                                                "UCX_TLS": "cma"}},
                                       "decode": {"reserve_cores": True, "cores_per_rank": 2}})
    out = deploy_for_prefix_bench(cfg, 1, "cache", 1.0, cores=[2, 3])
    assert out.prefill.env == {"UCX_TLS": "cma", "VLLM_CPU_OMP_THREADS_BIND": "2"}
    assert out.decode.env == {"VLLM_CPU_OMP_THREADS_BIND": "3"}
    assert (out.decode.share_cores, out.decode.reserve_cores, out.decode.cores_per_rank) == (True, None, 1)
    assert cfg.prefill.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3" and cfg.decode.reserve_cores is True
    one = deploy_for_prefix_bench(cfg, 1, "cache", 1.0, cores=[0])
    assert one.decode.share_cores and "VLLM_CPU_OMP_THREADS_BIND" not in one.prefill.env
    assert cores_said(one) == "all four engines sharing every core"


def test_parser_defaults_and_refusals():
    p = argparse.ArgumentParser()
    add_args(p)
    a = p.parse_args([])
    assert a.targets == "cache,load,vllm" and a.workloads == ["multi-turn", "prefix", "random"]
    assert (a.conversations, a.turns, a.think_s, a.kv_cache_gib, a.seed, a.arrival_s) == (16, 4, 2.0, None, 0, 2.0)
    assert (a.first_tokens, a.user_tokens, a.reply_tokens) == (1024, 256, 16)
    assert a.prefixes is None and a.out_dir == "results" and Path(a.deploy) == REPO / "deploy.yaml"
    assert p.parse_args(["--workloads", "random,multi-turn"]).workloads == ["multi-turn", "random"]
    assert p.parse_args(["--out", "/tmp/x"]).out_dir == "/tmp/x"
    for bad in (["--workloads", "chat"], ["--workloads", "random,random"], ["--turns", "0"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


# ---- live -----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """The whole command, tiny: the cache-routed cluster (2 + 2 engines), two conversations of two turns (most of
    its ~3 minutes is the four engines loading on two cores)."""
    out = tmp_path_factory.mktemp("bench-prefix")
    cmd = [sys.executable, "-m", "cluster", "bench", "prefix-routing", "--targets", "cache", "--workloads",
           "multi-turn", "--conversations", "2", "--turns", "2", "--think-s", "0.1", "--step-timeout", "150",
           "--first-tokens", "500", "--user-tokens", "64", "--reply-tokens", "32", "--arrival-s", "0",
           "--out", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    return r, out


@pytest.mark.engine
def test_live_tiny_run_has_no_failed_request_and_sane_turns(live_run):
    r, out = live_run
    tail = r.stdout[-4000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    assert "| turn | cache TTFT p50 / p99 (failed) |" in r.stdout, tail
    assert "GiB KV/state cache per engine (sized by default, " in r.stdout, tail  # the cache sized for the model
    doc = json.loads((out / "bench_prefix_routing.json").read_text())
    assert doc["problems"] == [] and set(doc["results"]) == {"cache"}
    assert doc["config"]["deploy"]["routing"]["policy"] == "cache"
    res = doc["results"]["cache"]
    mt = res["multi_turn"]
    assert (mt["requests"], mt["failed"]) == (4, 0), mt
    assert [(x["turn"], x["requests"], x["failed"]) for x in mt["by_turn"]] == [(1, 2, 0), (2, 2, 0)]
    assert all(0 < x["ttft_p50_ms"] <= x["ttft_p99_ms"] for x in mt["by_turn"]), mt["by_turn"]
    turns = doc["turns"]
    assert len(turns) == 4 and all(t["error"] is None and t["output_tokens"] == 32 for t in turns)
    for t in turns:  # turn 2 = turn 1's prompt + its 32-token reply + a 64-token message
        assert t["prompt_tokens"] == (500 if t["turn"] == 1 else 500 + 32 + 64), t
    block = res["block_size"]
    assert mt["unavoidable_tokens"] == 2 * (500 + 596 - 499 // block * block)
    use = mt["prompt_tokens"]
    assert use["prompt_tokens"] == mt["prompt_tokens_sent"] == 2 * (500 + 596) and use["note"] is None, use
    assert mt["unavoidable_tokens"] <= use["computed_tokens"] <= use["prompt_tokens"]  # never under the minimum
    assert mt["output_throughput"] > 0 and "prefix" not in res and "random" not in res
    assert doc["targets"][0].endswith("not measured (load not in --targets)")
    assert doc["targets"][1].endswith(("(<= 1.2x: met)", "(<= 1.2x: MISSED)")), doc["targets"]
    png = (out / "bench_prefix_routing.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
