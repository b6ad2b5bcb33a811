"""`bench goodput`'s bookkeeping (pure: rows in, figures out): a (target, rate) row from vLLM's saved result, SLO
attainment, the highest rate within the SLOs and where each target first fails, the baseline (vLLM's better server),
the summary and the issue's targets met or MISSED with this run's ratios, the table per rate and the plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


KNOWN_TARGETS = ("cluster", "vllm-tp1", "vllm-tp2", "stock-pd")
BASELINE_CANDIDATES = ("vllm-tp1", "vllm-tp2")
ATTAINMENT = 0.9  # DistServe: a rate is sustained when >= 90% of requests meet both SLOs
PERCENTILES = (50, 90, 99)
LATENCIES = tuple(f"p{p}_{m}_ms" for m in ("ttft", "tpot", "itl") for p in PERCENTILES)
THROUGHPUTS = ("request_throughput", "output_throughput", "request_goodput")
FIGURES = LATENCIES + THROUGHPUTS
# the targets: the cluster against the baseline
ITL_P99_BOUND = 0.5  # decode ITL p99 <= 0.5x vLLM's better server's at each rate (median over the rates measured)
GOODPUT_BOUND = 1.3  # goodput >= 1.3x the baseline's at the rate where the baseline first falls below 90% attainment
RATE_BOUND = 1.3  # highest rate within the SLOs >= 1.3x the baseline's


# ---- bookkeeping (pure: rows in, figures out) ---------------------------------------------------------------------
def row_from_result(target: str, rate: float, seed: int, result: dict[str, Any]) -> dict[str, Any]:
    """One (target, rate) row from vLLM's saved result: completed, failed, good requests (request_goodput x
    duration: vLLM divides both its goodput and its throughput by the same duration), SLO attainment (good / sent),
    good / completed, the latency percentiles and throughputs. A run that completed nothing has no latencies (vLLM
    reports 0 ms for every percentile of an empty list); its throughputs and goodput are 0."""
    completed, failed = int(result["completed"]), int(result["failed"])
    goodput = result.get("request_goodput")
    if goodput is None:
        raise ValueError("vLLM's result has no request_goodput: the client ran without --goodput")
    good = round(float(goodput) * float(result["duration"]))
    sent = completed + failed
    row: dict[str, Any] = {
        "target": target, "rate": rate, "seed": seed, "sent": sent, "completed": completed, "failed": failed,
        "good": good, "attainment": round(good / sent, 4) if sent else None,
        "good_over_completed": round(good / completed, 4) if completed else None,
        "duration_s": round(float(result["duration"]), 2), "error": None,
    }
    for k in LATENCIES:
        row[k] = round(float(result[k]), 3) if completed and result.get(k) is not None else None
    for k in THROUGHPUTS:
        row[k] = round(float(result[k]), 3)
    return row


def error_row(target: str, rate: float, seed: int | None, error: str) -> dict[str, Any]:
    """A (target, rate) that has no result: the target did not start, the client failed or ran out of time, or an
    earlier rate did not finish. It counts as not attaining the SLOs."""
    return {"target": target, "rate": rate, "seed": seed, "sent": None, "completed": None, "failed": None,
            "good": None, "attainment": None, "good_over_completed": None, "duration_s": None, "error": error,
            **{k: None for k in FIGURES}}


def _rows_of(rows: list[dict], target: str) -> list[dict]:
    return sorted((r for r in rows if r["target"] == target), key=lambda r: r["rate"])


def _row_at(rows: list[dict], target: str, rate: float) -> dict | None:
    return next((r for r in rows if r["target"] == target and r["rate"] == rate), None)


def attains(row: dict | None, threshold: float = ATTAINMENT) -> bool:
    """Whether >= `threshold` of the requests sent at this rate met both SLOs (no result: no)."""
    return row is not None and row["attainment"] is not None and row["attainment"] >= threshold


def highest_rate_within_slo(rows: list[dict], target: str, threshold: float = ATTAINMENT) -> float | None:
    """The largest measured rate such that it and every lower measured rate of `target` attain >= `threshold`;
    None when the lowest rate already does not (or the target has no rows). A rate that attains above one that
    did not does not count (a noisy machine can let one through; DistServe's figure reads the same way)."""
    best = None
    for r in _rows_of(rows, target):
        if not attains(r, threshold):
            break
        best = r["rate"]
    return best


def first_failing_rate(rows: list[dict], target: str, threshold: float = ATTAINMENT) -> float | None:
    """The lowest measured rate at which `target` attains < `threshold` (no result counts as below); None when it
    attains at every measured rate."""
    return next((r["rate"] for r in _rows_of(rows, target) if not attains(r, threshold)), None)


def total_goodput(rows: list[dict], target: str) -> float:
    return sum(r["request_goodput"] or 0.0 for r in _rows_of(rows, target))


def pick_baseline(rows: list[dict], candidates: tuple[str, ...] = BASELINE_CANDIDATES) -> str | None:
    """The better of vLLM's servers measured: the higher rate within the SLOs (none counts as 0), ties broken by the
    goodput summed over all rates, then by the order of `candidates`. None when none of them was measured."""
    present = [c for c in candidates if any(r["target"] == c for r in rows)]
    if not present:
        return None
    return max(present, key=lambda c: (highest_rate_within_slo(rows, c) or 0.0, total_goodput(rows, c),
                                       -candidates.index(c)))


def ratio(value: float | None, ref: float | None) -> float | None:
    """value / ref, None when either is missing or ref is 0."""
    if value is None or ref is None or ref == 0:
        return None
    return value / ref


def finished(row: dict | None) -> bool:
    """A result came back and it completed at least one request (figures exist)."""
    return row is not None and row["error"] is None and bool(row["completed"])


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def fmt_rate(rate: float | None, rates: list[float]) -> str:
    """A highest rate within the SLOs as printed: the rate, or "< lowest rate" (none attained), "none" (no rates)."""
    if rate is not None:
        return f"{rate:g} req/s"
    return f"< {min(rates):g} req/s (the lowest rate)" if rates else "none"


def summarize(rows: list[dict], threshold: float = ATTAINMENT) -> dict[str, Any]:
    """DistServe's figures of a run: per target its highest rate within the SLOs and its attainment per rate; the
    baseline; the rate where the baseline first falls below `threshold` attainment and the cluster's goodput ratio
    there; per rate the cluster's ITL p99 ratio to the lower of vLLM's servers' there (figure by figure, as `bench
    serve` takes its baseline) and their median; the ratio of the cluster's highest rate within the SLOs to the
    baseline's."""
    targets = list(dict.fromkeys(r["target"] for r in rows))
    rates = sorted({r["rate"] for r in rows})
    baseline = pick_baseline(rows)
    out: dict[str, Any] = {
        "attainment_threshold": threshold, "rates": rates, "baseline": baseline,
        "targets": {t: {"highest_rate_within_slo": highest_rate_within_slo(rows, t, threshold),
                        "first_rate_below_threshold": first_failing_rate(rows, t, threshold),
                        "total_goodput": round(total_goodput(rows, t), 3),
                        "attainment": [{"rate": r["rate"], "attainment": r["attainment"]} for r in _rows_of(rows, t)]}
                    for t in targets},
        "baseline_first_failing_rate": None, "cluster_goodput_ratio_there": None,
        "itl_p99_ratio": [], "itl_p99_ratio_median": None, "highest_rate_ratio": None,
    }
    if baseline is None or "cluster" not in targets:
        return out
    fail = first_failing_rate(rows, baseline, threshold)
    out["baseline_first_failing_rate"] = fail
    if fail is not None:
        c, b = _row_at(rows, "cluster", fail), _row_at(rows, baseline, fail)
        out["cluster_goodput_ratio_there"] = ratio(c and c["request_goodput"], b and b["request_goodput"])
    for rate in rates:  # decode latency against vLLM's better server at each rate: the lower ITL p99 measured there
        c = _row_at(rows, "cluster", rate)
        servers = [b for b in (_row_at(rows, t, rate) for t in BASELINE_CANDIDATES) if finished(b)]
        if finished(c) and servers:
            best = min(servers, key=lambda b: b["p99_itl_ms"])
            out["itl_p99_ratio"].append({"rate": rate, "ratio": ratio(c["p99_itl_ms"], best["p99_itl_ms"]),
                                         "against": best["target"]})
    got = [x["ratio"] for x in out["itl_p99_ratio"] if x["ratio"] is not None]
    out["itl_p99_ratio_median"] = _median(got) if got else None
    out["highest_rate_ratio"] = ratio(out["targets"]["cluster"]["highest_rate_within_slo"],
                                      out["targets"][baseline]["highest_rate_within_slo"])
    return out


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def check_targets(rows: list[dict], summary: dict[str, Any]) -> list[str]:
    """The issue's three targets against the baseline, each met / MISSED / not measured (with why), as lines:
    decode ITL p99 <= 0.5x vLLM's better server's (per rate, the median over them the headline), goodput >= 1.3x at the
    rate where the baseline first falls below 90% attainment, highest rate within the SLOs >= 1.3x."""
    base = summary["baseline"]
    if base is None or "cluster" not in summary["targets"]:
        return ["no verdicts: they need the cluster and at least one of vLLM's servers (vllm-tp1, vllm-tp2) in --targets"]
    lines = []
    label = f"decode ITL p99 <= {ITL_P99_BOUND}x vLLM's better server's at each rate"
    per = [x for x in summary["itl_p99_ratio"] if x["ratio"] is not None]
    if not per:
        lines.append(f"{label}: not measured (no rate at which the cluster and a server finished requests)")
    else:
        med = summary["itl_p99_ratio_median"]
        over = ", ".join(f"{x['rate']:g}" for x in per)
        lines.append(f"{label}: median {med:.2f}x over rates {over} req/s (<= {ITL_P99_BOUND}x: "
                     f"{_verdict(med <= ITL_P99_BOUND)})")
        lines += [f"  at {x['rate']:g} req/s: {x['ratio']:.2f}x of {x['against']} (<= {ITL_P99_BOUND}x: "
                  f"{_verdict(x['ratio'] <= ITL_P99_BOUND)})" for x in per]

    label = f"goodput >= {GOODPUT_BOUND}x the baseline's where it first falls below {ATTAINMENT:.0%} attainment"
    fail = summary["baseline_first_failing_rate"]
    if fail is None:
        top = max(summary["rates"], default=0)
        lines.append(f"{label}: not measured ({base} attains >= {ATTAINMENT:.0%} at every rate up to {top:g} req/s: "
                     "add higher --rates)")
    else:
        c, b = _row_at(rows, "cluster", fail), _row_at(rows, base, fail)
        cg, bg = c and c["request_goodput"], b and b["request_goodput"]
        head = f"{label} ({fail:g} req/s)"
        if bg is None:
            lines.append(f"{head}: not measured ({base} has no result there: {b and b['error']})")
        elif cg is None:
            lines.append(f"{head}: the cluster has no result there ({c and c['error']}) (>= {GOODPUT_BOUND}x: MISSED)")
        elif bg == 0:
            lines.append(f"{head}: {cg:.2f} vs 0 req/s (>= {GOODPUT_BOUND}x: {_verdict(cg > 0)})")
        else:
            r = cg / bg
            lines.append(f"{head}: {r:.2f}x ({cg:.2f} vs {bg:.2f} req/s) (>= {GOODPUT_BOUND}x: "
                         f"{_verdict(r >= GOODPUT_BOUND)})")

    label = f"highest rate within the SLOs >= {RATE_BOUND}x the baseline's"
    ch = summary["targets"]["cluster"]["highest_rate_within_slo"]
    bh = summary["targets"][base]["highest_rate_within_slo"]
    rates = summary["rates"]
    if ch is None and bh is None:
        lines.append(f"{label}: not measured (neither attains {ATTAINMENT:.0%} at the lowest rate, {min(rates):g} "
                     "req/s: add lower --rates)")
    elif bh is None:
        lines.append(f"{label}: {fmt_rate(ch, rates)} vs {fmt_rate(bh, rates)} (>= {RATE_BOUND}x: met)")
    elif ch is None:
        lines.append(f"{label}: {fmt_rate(ch, rates)} vs {fmt_rate(bh, rates)} (>= {RATE_BOUND}x: MISSED)")
    else:
        r = ch / bh
        lines.append(f"{label}: {r:.2f}x ({ch:g} vs {bh:g} req/s) (>= {RATE_BOUND}x: {_verdict(r >= RATE_BOUND)})")
    return lines


TABLE_COLS = (("good/sent", "attainment"), ("goodput", "request_goodput"), ("req/s", "request_throughput"),
              ("out tok/s", "output_throughput"),
              *((f"{m.upper()} p{p}", f"p{p}_{m}_ms") for m in ("itl", "tpot", "ttft") for p in PERCENTILES))


def table(rows: list[dict], rate: float, baseline: str | None) -> list[str]:
    """A markdown table of one rate, a line per target: completed, failed, SLO attainment, goodput, throughput and
    the ITL / TPOT / TTFT percentiles (ms), each figure of a target other than the baseline with its ratio to the
    baseline's beside it; a row without a result says why."""
    lines = ["| target | completed | failed | " + " | ".join(c for c, _ in TABLE_COLS) + " |",
             "|---|---|---|" + "---|" * len(TABLE_COLS)]
    base = _row_at(rows, baseline, rate) if baseline else None
    for r in (r for r in rows if r["rate"] == rate):
        name = f"{r['target']} (baseline)" if r["target"] == baseline else r["target"]
        if r["error"] is not None:
            lines.append(f"| {name} | - | - | {r['error']} |" + " |" * (len(TABLE_COLS) - 1))
            continue
        cells = []
        for _, k in TABLE_COLS:
            if r[k] is None:
                cells.append("-")
                continue
            digits = 2 if k in ("attainment", "request_goodput", "request_throughput") else 1
            cell = f"{r[k]:.{digits}f}"
            # no ratio to a baseline figure that prints as 0 (vLLM's ITL p50 of 0.003 ms where a chunk carries
            # several tokens): thousands of x say nothing
            x = ratio(r[k], base[k]) if base is not None and r["target"] != baseline \
                and base[k] is not None and round(base[k], digits) != 0 else None
            cells.append(cell + (f" ({x:.2f}x)" if x is not None else ""))
        lines.append(f"| {name} | {r['completed']} | {r['failed']} | " + " | ".join(cells) + " |")
    return lines


def plot(rows: list[dict], summary: dict[str, Any], slo: str, path: Path) -> None:
    """Two panels, one line per target: goodput vs request rate (the offered rate dashed: all requests good) and
    ITL p99 vs request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    rates = summary["rates"]
    for t in summary["targets"]:
        mine = _rows_of(rows, t)
        label = f"{t} (baseline)" if t == summary["baseline"] else t
        for ax, key in ((axes[0], "request_goodput"), (axes[1], "p99_itl_ms")):
            ax.plot([r["rate"] for r in mine], [math.nan if r[key] is None else r[key] for r in mine], "o-", label=label)
    if rates:
        axes[0].plot(rates, rates, "k--", lw=1, label="offered rate")
    axes[0].set(xlabel="request rate (req/s, Poisson)", ylabel="goodput (req/s)", title=f"goodput ({slo})")
    axes[0].set_ylim(bottom=0)
    axes[1].set(xlabel="request rate (req/s, Poisson)", ylabel="ms", title="decode ITL p99", yscale="log")
    axes[0].legend(fontsize=8)
    fig.suptitle("vLLM's bench client, mixed lengths: this cluster vs vLLM's colocated server")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
