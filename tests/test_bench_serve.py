"""`bench serve`'s bookkeeping (no engines): the run order of its rounds, the medians and per-round ratios it
reports, and the verdict on the issue's targets - on results shaped like vLLM's bench client's."""

from __future__ import annotations

import argparse

import pytest

from cluster.cli.bench.serve import (METRICS, add_args, check_targets, ratios, resolve_local_prefill, round_order,
                                     summarize, table)


def _row(target: str, conc: int, rnd: int, scale: float, failed: int = 0) -> dict:
    """A result row whose every latency is `scale` x 10 ms and every throughput 100 / `scale`."""
    return {"target": target, "concurrency": conc, "round": rnd, "completed": 8, "failed": failed,
            **{k: (10.0 * scale if k.endswith("_ms") else 100.0 / scale) for k in METRICS}}


def test_rounds_alternate_which_target_goes_first_and_stock_pd_runs_once():
    assert round_order(["cluster", "vllm", "stock-pd"], 3) == [
        (1, "cluster"), (1, "vllm"), (1, "stock-pd"), (2, "vllm"), (2, "cluster"), (3, "cluster"), (3, "vllm")]
    assert round_order(["vllm"], 2) == [(1, "vllm"), (2, "vllm")]
    assert round_order(["cluster", "vllm"], 1) == [(1, "cluster"), (1, "vllm")]


def test_ratios_pair_each_round_with_its_own_baseline():
    # the machine slows down 2x in round 2 for both targets: the per-round ratio stays 1.2x, while medians of each
    # target's figures taken separately would be as good as the order of the runs made them
    rows = [_row("cluster", 1, 1, 1.2), _row("vllm-tp1", 1, 1, 1.0), _row("vllm-tp1", 1, 2, 2.0), _row("cluster", 1, 2, 2.4),
            _row("cluster", 1, 3, 1.2), _row("vllm-tp1", 1, 3, 1.0)]
    got = ratios(rows)[("cluster", 1)]
    assert got["median_tpot_ms"] == pytest.approx([1.2, 1.2, 1.2])
    assert got["output_throughput"] == pytest.approx([1 / 1.2] * 3)
    (s,) = [s for s in summarize(rows) if s["target"] == "cluster"]
    assert s["rounds"] == 3 and s["median_tpot_ms"] == pytest.approx(12.0)
    assert s["ratio"]["median_ttft_ms"] == pytest.approx(1.2)


def test_summary_takes_the_median_round_and_sums_failures():
    rows = [_row("cluster", 8, 1, 1.0, failed=1), _row("vllm-tp1", 8, 1, 1.0),
            _row("cluster", 8, 2, 3.0), _row("vllm-tp1", 8, 2, 1.0),
            _row("cluster", 8, 3, 1.5, failed=2), _row("vllm-tp1", 8, 3, 1.0)]
    (s,) = [s for s in summarize(rows) if s["target"] == "cluster"]
    assert s["failed"] == 3
    assert s["median_ttft_ms"] == pytest.approx(15.0)  # not the mean (18.3): one slow round does not set the figure
    assert s["ratio"]["output_throughput"] == pytest.approx(1 / 1.5)
    timed_out = {**_row("stock-pd", 8, 1, 1.0), "failed": "timed out after 600 s", **{k: None for k in METRICS}}
    (t,) = [s for s in summarize(rows + [timed_out]) if s["target"] == "stock-pd"]
    assert t["failed"] == "timed out after 600 s" and t["median_ttft_ms"] is None and t["ratio"] == {}


def test_stock_pd_once_is_set_against_the_median_baseline():
    rows = [_row("vllm-tp1", 1, 1, 1.0), _row("vllm-tp1", 1, 2, 3.0), _row("vllm-tp1", 1, 3, 2.0), _row("stock-pd", 1, 1, 20.0)]
    assert ratios(rows)[("stock-pd", 1)]["median_ttft_ms"] == pytest.approx([10.0])


def test_targets_verdicts_see_each_bound():
    def run(tpot: float, ttft: float, tok: float, stock: float) -> list[str]:
        rows = []
        for rnd in (1, 2):
            c1, c8 = _row("cluster", 1, rnd, 1.0), _row("cluster", 8, rnd, 1.0)
            c1["median_tpot_ms"], c1["median_ttft_ms"], c8["output_throughput"] = 10 * tpot, 10 * ttft, 100 * tok
            rows += [c1, c8, _row("vllm-tp1", 1, rnd, 1.0), _row("vllm-tp1", 8, rnd, 1.0)]
        return check_targets(summarize(rows + [_row("stock-pd", 1, 1, stock), _row("stock-pd", 8, 1, stock)]))

    ok = run(0.95, 1.25, 1.15, 5.0)
    assert len(ok) == 5 and all(line.endswith(("met", "met)")) and "MISSED" not in line for line in ok), ok
    missed = run(1.05, 1.35, 1.05, 5.0)
    assert all(line.endswith("MISSED)") for line in missed[:3]), missed
    assert "1.05x" in missed[0] and "1.35x" in missed[1] and "1.05x" in missed[2]
    assert "(rounds: 1.05x, 1.05x)" in missed[0]  # every round's ratio beside the median
    behind = run(1.0, 1.0, 1.0, 0.5)  # stock P/D twice as fast on everything: behind on all eight figures
    assert behind[3].startswith("concurrency 1: ahead of vLLM's stock P/D on every figure: MISSED")
    assert all(k in behind[3] for k in METRICS)
    rows = [_row("cluster", 8, 1, 1.0), _row("vllm-tp1", 8, 1, 1.0),
            {**_row("stock-pd", 8, 1, 1.0), "failed": "timed out after 600 s", **{k: None for k in METRICS}}]
    (timed_out,) = check_targets(summarize(rows))[3:]
    assert timed_out.endswith("met (vLLM's stock P/D: timed out after 600 s)"), timed_out


def test_the_baseline_is_vllms_better_server_figure_by_figure():
    # TP 2 has the lower TTFT, TP 1 the higher throughput: each ratio is taken against the better of the two
    tp1, tp2 = _row("vllm-tp1", 8, 1, 1.0), _row("vllm-tp2", 8, 1, 2.0)
    tp2["median_ttft_ms"] = 5.0
    got = ratios([_row("cluster", 8, 1, 1.0), tp1, tp2])[("cluster", 8)]
    assert got["median_ttft_ms"] == pytest.approx([2.0])  # 10 ms against TP 2's 5
    assert got["output_throughput"] == pytest.approx([1.0])  # 100 tok/s against TP 1's 100, not TP 2's 50
    assert got["median_tpot_ms"] == pytest.approx([1.0])
    assert {s["target"] for s in summarize([_row("cluster", 8, 1, 1.0), tp1, tp2]) if s["ratio"]} == {"cluster"}


def test_table_prints_the_median_ratio():
    rows = [_row("cluster", 1, 1, 1.1), _row("vllm-tp1", 1, 1, 1.0), _row("cluster", 1, 2, 1.3), _row("vllm-tp1", 1, 2, 1.0)]
    lines = table(summarize(rows))
    assert lines[2].startswith("| cluster | 1 | 0 | 12.0 (1.20x) |") and "(" not in lines[3]


def test_rounds_must_be_positive():
    p = argparse.ArgumentParser()
    add_args(p)
    assert p.parse_args([]).rounds == 3
    with pytest.raises(SystemExit):
        p.parse_args(["--rounds", "0"])


def test_the_cluster_takes_deploy_yamls_local_prefill_rule_unless_told(tmp_path):
    """`--local-prefill-speed`: deploy (the default) takes deploy.yaml's rule and decode step budget, off neither, a
    number that speed with the file's budget; anything else is refused as the command line is read."""
    p = argparse.ArgumentParser()
    add_args(p)
    assert p.parse_args([]).local_prefill_speed == "deploy"
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("transfer:\n  local_prefill_speed: 0.4\ndecode:\n  max_num_batched_tokens: 384\n")
    assert resolve_local_prefill("deploy", deploy) == (0.4, 384)
    assert resolve_local_prefill("0.25", deploy) == (0.25, 384)
    assert resolve_local_prefill("off", tmp_path / "absent.yaml") == (None, None)  # the file is not read
    for bad in ("0", "1.5", "fast", "-1"):
        with pytest.raises(SystemExit):
            p.parse_args(["--local-prefill-speed", bad])
