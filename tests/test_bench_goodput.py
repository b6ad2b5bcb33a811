"""`bench goodput`: its bookkeeping on results shaped like vLLM's bench client's saved results (no engines) - SLO
attainment, the highest rate within the SLOs, the baseline and where it first fails, the verdicts, the table - its
argument defaults, and (marked engine) one tiny live run of the whole command."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli.bench.goodput import (add_args, check_workload, client_argv, deploy_for_bench, length_ranges,
                                   prompts_at, rate_seed)
from cluster.cli.bench.goodput_report import (FIGURES, LATENCIES, attains, check_targets, error_row, first_failing_rate,
                                          highest_rate_within_slo, pick_baseline, row_from_result, summarize, table)

REPO = Path(__file__).resolve().parents[1]


def _result(completed: int = 40, failed: int = 0, good: int | None = None, duration: float = 20.0,
            itl: float = 10.0, ttft: float = 100.0, tpot: float = 12.0) -> dict:
    """A saved result of vLLM 0.32's bench client (`--save-result`, percentiles 50,90,99, goodput SLOs set): the keys
    the benchmark reads, with vLLM's relations - throughput and goodput over one duration, p50 <= p90 <= p99."""
    good = completed if good is None else good
    res = {"duration": duration, "completed": completed, "failed": failed, "total_input_tokens": 1024 * completed,
           "total_output_tokens": 128 * completed, "request_throughput": completed / duration,
           "request_goodput": good / duration, "output_throughput": 128 * completed / duration,
           "total_token_throughput": 1152 * completed / duration, "max_output_tokens_per_s": 300.0,
           "max_concurrent_requests": 9}
    for name, v in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        scale = v if completed else 0.0  # vLLM reports 0 for the percentiles of an empty list
        res.update({f"mean_{name}_ms": scale, f"median_{name}_ms": scale, f"std_{name}_ms": 0.0,
                    f"p50_{name}_ms": scale, f"p90_{name}_ms": 1.5 * scale, f"p99_{name}_ms": 2 * scale})
    return res


def _rows(target: str, per_rate: dict[float, dict]) -> list[dict]:
    return [row_from_result(target, rate, i, res) for i, (rate, res) in enumerate(sorted(per_rate.items()))]


def _attaining(target: str, fractions: dict[float, float], itl: float = 10.0, n: int = 40) -> list[dict]:
    """Rows of `target` whose attainment at each rate is the given fraction (of n requests, none failed); goodput
    grows with the rate until the fraction drops."""
    return _rows(target, {rate: _result(n, 0, round(f * n), duration=n / rate, itl=itl) for rate, f in fractions.items()})


# ---- one row -------------------------------------------------------------------------------------------------------
def test_row_recovers_good_requests_and_attainment_counts_failed_as_missed():
    r = row_from_result("cluster", 2.0, 5, _result(completed=36, failed=4, good=27, duration=23.7))
    assert (r["sent"], r["completed"], r["failed"], r["good"]) == (40, 36, 4, 27)
    assert r["attainment"] == pytest.approx(27 / 40)  # good / sent: the 4 failed did not meet their SLOs
    assert r["good_over_completed"] == pytest.approx(27 / 36)  # = request_goodput / request_throughput
    assert r["request_goodput"] == pytest.approx(27 / 23.7, abs=1e-3) and r["p99_itl_ms"] == 20.0
    assert r["error"] is None and set(FIGURES) <= set(r)


def test_a_run_that_completed_nothing_has_no_figures_not_zero_latency():
    r = row_from_result("stock-pd", 4.0, 0, _result(completed=0, failed=40))
    assert r["attainment"] == 0.0 and r["good_over_completed"] is None
    assert all(r[k] is None for k in LATENCIES), r  # vLLM's 0.0 ms would read as the best ITL of the run
    assert r["request_goodput"] == r["request_throughput"] == r["output_throughput"] == 0.0
    with pytest.raises(ValueError, match="--goodput"):
        row_from_result("x", 1.0, 0, {**_result(), "request_goodput": None})


# ---- highest rate within the SLOs, the baseline, where it first fails ----------------------------------------------
def test_highest_rate_within_slo_needs_every_lower_rate_to_attain():
    rows = _attaining("a", {1: 1.0, 2: 0.95, 3: 0.9, 4: 0.85, 6: 0.5})
    assert highest_rate_within_slo(rows, "a") == 3  # exactly 90% counts
    assert first_failing_rate(rows, "a") == 4
    # non-monotonic: 3 req/s dips below 90%, 4 req/s gets through again on a noisy machine - it does not count
    bumpy = _attaining("b", {1: 1.0, 2: 0.95, 3: 0.8, 4: 0.95, 6: 0.3})
    assert highest_rate_within_slo(bumpy, "b") == 2 and first_failing_rate(bumpy, "b") == 3
    low = _attaining("c", {1: 0.7, 2: 0.95})
    assert highest_rate_within_slo(low, "c") is None and first_failing_rate(low, "c") == 1
    never = _attaining("d", {1: 1.0, 2: 1.0})
    assert highest_rate_within_slo(never, "d") == 2 and first_failing_rate(never, "d") is None
    assert highest_rate_within_slo(never, "absent") is None


def test_a_rate_without_a_result_is_not_sustained():
    rows = _attaining("a", {1: 1.0, 2: 1.0}) + [error_row("a", 3, 2, "timed out after 900 s"),
                                                error_row("a", 4, 3, "not run: 3 req/s did not finish")]
    assert not attains(rows[2]) and highest_rate_within_slo(rows, "a") == 2 and first_failing_rate(rows, "a") == 3


def test_the_baseline_is_the_better_vllm_server_ties_broken_by_goodput():
    tp1 = _attaining("vllm-tp1", {1: 1.0, 2: 0.95, 4: 0.5})
    tp2 = _attaining("vllm-tp2", {1: 1.0, 2: 0.8, 4: 0.7})
    assert pick_baseline(tp1 + tp2) == "vllm-tp1"
    tie = _attaining("vllm-tp2", {1: 1.0, 2: 0.95, 4: 0.7})  # same highest rate (2), more goodput at 4 req/s
    assert pick_baseline(tp1 + tie) == "vllm-tp2"
    assert pick_baseline(tp1 + _attaining("vllm-tp2", {1: 1.0, 2: 0.95, 4: 0.5})) == "vllm-tp1"  # full tie: order
    assert pick_baseline(_attaining("cluster", {1: 1.0})) is None
    assert pick_baseline(tp2 + [error_row("vllm-tp1", r, 0, "did not run: RuntimeError") for r in (1, 2, 4)]) == "vllm-tp2"


# ---- summary and verdicts ------------------------------------------------------------------------------------------
def _run(cluster: dict[float, float], cluster_itl: float, base: dict[float, float], base_itl: float = 10.0) -> list[dict]:
    return (_attaining("cluster", cluster, itl=cluster_itl) + _attaining("vllm-tp1", base, itl=base_itl)
            + _attaining("vllm-tp2", {r: min(f, 0.5) for r, f in base.items()}, itl=base_itl))


def test_verdicts_met():
    rows = _run({1: 1.0, 2: 1.0, 3: 0.95, 4: 0.9, 6: 0.6}, 4.0, {1: 1.0, 2: 0.95, 3: 0.6, 4: 0.4, 6: 0.2})
    s = summarize(rows)
    assert s["baseline"] == "vllm-tp1" and s["baseline_first_failing_rate"] == 3
    assert s["targets"]["cluster"]["highest_rate_within_slo"] == 4 and s["targets"]["vllm-tp1"]["highest_rate_within_slo"] == 2
    assert s["cluster_goodput_ratio_there"] == pytest.approx(0.95 / 0.6, rel=0.03)
    assert [x["rate"] for x in s["itl_p99_ratio"]] == [1, 2, 3, 4, 6] and s["itl_p99_ratio_median"] == pytest.approx(0.4)
    assert s["highest_rate_ratio"] == pytest.approx(2.0)
    lines = check_targets(rows, s)
    assert lines[0].startswith("decode ITL p99 <= 0.5x vLLM's better server's at each rate: median 0.40x over rates "
                               "1, 2, 3, 4, 6")
    assert lines[0].endswith("(<= 0.5x: met)") and sum("req/s: 0.40x of vllm-tp1 (<= 0.5x: met)" in ln for ln in lines) == 5
    assert "(3 req/s): 1.58x" in lines[6] and lines[6].endswith("(>= 1.3x: met)"), lines[6]
    assert "2.00x (4 vs 2 req/s)" in lines[7] and lines[7].endswith("(>= 1.3x: met)") and "MISSED" not in "".join(lines)


def test_verdicts_missed_with_the_figures_that_missed():
    rows = _run({1: 1.0, 2: 0.95, 3: 0.7, 4: 0.5, 6: 0.3}, 6.0, {1: 1.0, 2: 0.95, 3: 0.65, 4: 0.5, 6: 0.3})
    lines = check_targets(rows, summarize(rows))
    assert "median 0.60x" in lines[0] and lines[0].endswith("MISSED)")
    assert all(ln.endswith("(<= 0.5x: MISSED)") for ln in lines[1:6])
    assert "(3 req/s): 1.08x" in lines[6] and lines[6].endswith("(>= 1.3x: MISSED)"), lines[6]
    assert "1.00x (2 vs 2 req/s)" in lines[7] and lines[7].endswith("(>= 1.3x: MISSED)")


def test_decode_latency_is_set_against_the_better_server_at_each_rate():
    """The baseline (for goodput and the sustained rate) is vLLM's server that sustains the higher rate, but the decode
    ITL p99 target is taken against whichever server decoded better at each rate, as `bench serve` takes its
    baseline figure by figure: a baseline with stalls at some rate must not flatter the cluster there."""
    ours = (_attaining("cluster", {1: 1.0, 2: 1.0}, itl=8.0) + _attaining("vllm-tp1", {1: 1.0}, itl=20.0)
            + _attaining("vllm-tp1", {2: 1.0}, itl=10.0))
    rows = ours + _attaining("vllm-tp2", {1: 1.0, 2: 0.5}, itl=40.0)
    s = summarize(rows)
    assert s["baseline"] == "vllm-tp1"
    assert s["itl_p99_ratio"] == [{"rate": 1, "ratio": pytest.approx(0.4), "against": "vllm-tp1"},
                                  {"rate": 2, "ratio": pytest.approx(0.8), "against": "vllm-tp1"}]
    worse = _attaining("vllm-tp2", {1: 1.0, 2: 0.5}, itl=16.0)  # better than TP 1 at 1 req/s, not the baseline
    s = summarize(ours + worse)
    assert s["baseline"] == "vllm-tp1" and s["itl_p99_ratio"][0] == {"rate": 1, "ratio": pytest.approx(0.5),
                                                                      "against": "vllm-tp2"}
    lines = check_targets(ours + worse, s)
    assert lines[1].endswith("at 1 req/s: 0.50x of vllm-tp2 (<= 0.5x: met)"), lines[1]


def test_per_rate_itl_verdicts_and_a_baseline_that_never_fails():
    # the cluster's ITL p99 is 0.4x at 1 req/s and 0.7x at 2: one rate met, one missed, the median (0.55x) missed
    rows = (_attaining("cluster", {1: 1.0}, itl=4.0) + _attaining("cluster", {2: 1.0}, itl=7.0)
            + _attaining("vllm-tp1", {1: 1.0, 2: 1.0}))
    lines = check_targets(rows, summarize(rows))
    assert "median 0.55x" in lines[0] and lines[0].endswith("MISSED)")
    assert lines[1].endswith("0.40x of vllm-tp1 (<= 0.5x: met)") and lines[2].endswith("0.70x of vllm-tp1 (<= 0.5x: MISSED)")
    assert "not measured (vllm-tp1 attains >= 90% at every rate up to 2 req/s: add higher --rates)" in lines[3]
    assert "1.00x (2 vs 2 req/s)" in lines[4]


def test_a_cluster_that_finished_nothing_misses_everything_it_can():
    rates = (1, 2, 4)
    base = _attaining("vllm-tp1", {1: 1.0, 2: 0.95, 4: 0.6})
    nothing = _rows("cluster", {r: _result(completed=0, failed=40, duration=40 / r) for r in rates})
    s = summarize(base + nothing)
    assert s["targets"]["cluster"]["highest_rate_within_slo"] is None and s["itl_p99_ratio"] == []
    assert s["cluster_goodput_ratio_there"] == 0.0
    lines = check_targets(base + nothing, s)
    assert lines[0].endswith("not measured (no rate at which the cluster and a server finished requests)")
    assert "(4 req/s): 0.00x" in lines[1] and lines[1].endswith("MISSED)")
    assert lines[2].endswith("< 1 req/s (the lowest rate) vs 2 req/s (>= 1.3x: MISSED)"), lines[2]
    # a cluster that did not start at all: no result anywhere
    down = [error_row("cluster", r, 0, "did not run: DeployError: bad file") for r in rates]
    lines = check_targets(base + down, summarize(base + down))
    assert "the cluster has no result there (did not run: DeployError: bad file) (>= 1.3x: MISSED)" in lines[1]
    assert lines[2].endswith("MISSED)")
    # neither sustains the lowest rate: undecided, not met
    low = _attaining("vllm-tp1", {1: 0.5, 2: 0.2})
    lines = check_targets(low + nothing[:2], summarize(low + nothing[:2]))
    assert "not measured (neither attains 90% at the lowest rate, 1 req/s: add lower --rates)" in lines[2]
    assert check_targets(base, summarize(base))[0].startswith("no verdicts")


def test_table_marks_the_baseline_and_gives_ratios_beside_other_targets():
    rows = _run({2: 1.0}, 4.0, {2: 1.0}) + [error_row("stock-pd", 2, 1, "timed out after 900 s")]
    lines = table(rows, 2, "vllm-tp1")
    assert lines[0].startswith("| target | completed | failed | good/sent | goodput | req/s | out tok/s | ITL p50 |")
    cluster, = [ln for ln in lines if ln.startswith("| cluster |")]
    assert cluster.startswith("| cluster | 40 | 0 | 1.00 (1.00x) | 2.00 (1.00x) |") and "| 8.0 (0.40x) |" in cluster
    base, = [ln for ln in lines if ln.startswith("| vllm-tp1 (baseline) |")]
    assert "x)" not in base
    stock, = [ln for ln in lines if ln.startswith("| stock-pd |")]
    assert "timed out after 900 s" in stock and stock.count("|") == lines[0].count("|")
    # a baseline figure that prints as 0 gets no ratio beside the other targets' (vLLM's ITL p50 of 0.003 ms)
    for r in rows:
        if r["target"] == "vllm-tp1":
            r["p50_itl_ms"] = 0.003
    cluster, = [ln for ln in table(rows, 2, "vllm-tp1") if ln.startswith("| cluster |")]
    itl_p50 = cluster.split("|")[8].strip()
    assert "x)" not in itl_p50 and itl_p50.replace(".", "").isdigit(), cluster


def test_a_rate_that_runs_out_of_time_stops_the_higher_ones(monkeypatch):
    import cluster.cli.bench.goodput as bg

    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--rates", "6,1,2,4"])
    sent = []

    def client(argv_for, *, api_key, timeout_s):
        argv = argv_for("/out")
        rate = float(argv[argv.index("--request-rate") + 1])
        sent.append((rate, int(argv[argv.index("--seed") + 1])))
        if rate == 2:
            raise subprocess.TimeoutExpired("client", timeout_s)
        return _result()

    monkeypatch.setattr(bg, "run_client", client)
    rows = bg.measure("stock-pd", "http://x", "m", "/m", args, timeout_s=900)
    assert sent == [(1, 0), (2, 1)]  # lowest first, a seed per rate; nothing sent after the rate that ran out
    assert [(r["rate"], r["error"]) for r in rows] == [
        (1, None), (2, "timed out after 900 s"), (4, "not run: 2 req/s did not finish"),
        (6, "not run: 2 req/s did not finish")]


# ---- workload and options ------------------------------------------------------------------------------------------
def test_parser_defaults_are_the_issues_workload():
    p = argparse.ArgumentParser()
    add_args(p)
    a = p.parse_args([])
    assert a.targets == "cluster,vllm-tp1,vllm-tp2" and a.rates == [2, 4, 6, 8, 12, 16] and a.num_prompts == 40
    # at least 8 s of arrivals at a rate: 40 prompts at 2-4 req/s, 64 at 8, 128 at 16
    assert [prompts_at(r, a.num_prompts, a.min_seconds) for r in a.rates] == [40, 40, 48, 64, 96, 128]
    assert (a.slo_ttft_ms, a.slo_tpot_ms) == (2000, 40) and a.prefix_caching == "deploy"
    assert length_ranges(a.input_len, a.output_len, a.range_ratio) == ((512, 1536), (64, 192))
    assert Path(a.deploy) == REPO / "deploy.yaml" and a.out_dir == "results"
    assert p.parse_args(["--rates", "0.5,2"]).rates == [0.5, 2]
    for bad in (["--rates", "0,1"], ["--rates", "fast"], ["--num-prompts", "0"], ["--prefix-caching", "maybe"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    with pytest.raises(SystemExit, match="lower --input-len"):
        check_workload(p.parse_args(["--input-len", "1800"]), 2048)
    with pytest.raises(ValueError, match="range-ratio"):
        length_ranges(1024, 128, 1.0)


def test_each_rate_has_its_own_prompts_and_every_target_the_same():
    rates = [4, 1, 2]
    assert [rate_seed(7, rates, r) for r in (1, 2, 4)] == [7, 8, 9]


def test_client_argv_is_accepted_by_the_installed_vllm_bench_client():
    argv = client_argv("http://127.0.0.1:1", "tiny-hybrid", "/m", "/out", rate=2.5, num_prompts=40, seed=3,
                       input_len=1024, output_len=128, range_ratio=0.5, slo_ttft_ms=2000, slo_tpot_ms=40, warmups=2)
    serve = pytest.importorskip("vllm.benchmarks.serve")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    a = parser.parse_args(argv)
    assert (a.request_rate, a.burstiness, a.num_prompts, a.seed, a.temperature) == (2.5, 1.0, 40, 3, 0.0)
    assert (a.random_input_len, a.random_output_len, a.random_range_ratio) == (1024, 128, "0.5")
    assert a.goodput == ["ttft:2000", "tpot:40"] and a.ignore_eos and a.dataset_name == "random"
    assert a.percentile_metrics == "ttft,tpot,itl" and a.metric_percentiles == "50,90,99"


def test_the_cluster_runs_as_deployed_but_for_its_port_and_coordinator():
    from cluster.core.config import DeployConfig

    cfg = DeployConfig.model_validate({"prefill": {"tp": 1, "enable_prefix_caching": True},
                                       "decode": {"tp": 1, "max_replicas": 2}, "transfer": {"local_prefill_queue": 3}})
    out = deploy_for_bench(cfg, 12345, "deploy")
    before, after = cfg.model_dump(), out.model_dump()
    assert after["http"]["port"] == 12345 and after["coordinator"]["namespace"] == "pd-bench-goodput"
    for d in (before, after):
        d["http"].pop("port"), d["coordinator"].pop("name"), d["coordinator"].pop("namespace")
    assert after == before and cfg.http.port == 8000  # nothing else changed, the loaded config untouched
    forced = deploy_for_bench(cfg, 1, "off")
    assert forced.prefill.enable_prefix_caching is False and forced.decode.enable_prefix_caching is False


# ---- live -----------------------------------------------------------------------------------------------------------
@pytest.mark.engine
def test_live_tiny_run_writes_results_with_no_failed_request(tmp_path):
    """The whole command, tiny: the deploy file's cluster and vLLM's server at TP 1, one rate, 4 short requests."""
    cmd = [sys.executable, "-m", "cluster", "bench", "goodput", "--targets", "cluster,vllm-tp1", "--rates", "2",
           "--num-prompts", "4", "--min-seconds", "0", "--input-len", "256", "--output-len", "16", "--warmups", "1", "--rate-timeout", "150",
           "--out-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=420)
    tail = r.stdout[-4000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    assert "| target | completed | failed |" in r.stdout and "input 128-384 tokens" in r.stdout, tail
    doc = json.loads((tmp_path / "bench_goodput.json").read_text())
    assert {"time", "machine", "config", "rows", "summary", "targets", "problems"} <= set(doc) and doc["problems"] == []
    assert doc["config"]["workload"]["input_tokens"] == [128, 384] and doc["config"]["workload"]["output_tokens"] == [8, 24]
    assert doc["machine"]["usable_cpus"] >= 1 and doc["machine"].get("cpu_model")
    if len(platform.node()) > 3:
        assert platform.node() not in json.dumps(doc)
    assert [(row["target"], row["rate"]) for row in doc["rows"]] == [("cluster", 2), ("vllm-tp1", 2)]
    for row in doc["rows"]:
        assert row["error"] is None and row["failed"] == 0 and row["completed"] == 4, row
        assert row["attainment"] == pytest.approx(row["good"] / 4) and 0 <= row["good"] <= 4
        assert 0 < row["p50_itl_ms"] <= row["p90_itl_ms"] <= row["p99_itl_ms"], row
        assert 0 < row["p50_ttft_ms"] <= row["p99_ttft_ms"] and row["output_throughput"] > 0
        assert row["request_goodput"] <= row["request_throughput"] + 1e-9
    s = doc["summary"]
    assert s["baseline"] == "vllm-tp1" and set(s["targets"]) == {"cluster", "vllm-tp1"}
    assert [x["rate"] for x in s["itl_p99_ratio"]] == [2] and s["itl_p99_ratio_median"] > 0
    assert doc["targets"][0].startswith("decode ITL p99 <= 0.5x vLLM's better server's at each rate: median")
    assert len(doc["targets"]) == 4 and all(("met" in ln) or ("MISSED" in ln) or ("not measured" in ln) for ln in doc["targets"])
    png = (tmp_path / "bench_goodput.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
