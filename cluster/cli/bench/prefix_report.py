"""`bench prefix-routing`'s bookkeeping (pure: turns and results in, figures out): percentiles as vLLM's bench client
reports them, the multi-turn summary per target, the issue's targets checked with this run's ratios, the tables and
the plot (TTFT p50 by turn number, per target)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from cluster.cli.bench.multi_turn import Turn

# the targets
TTFT_BOUND = 0.6  # multi-turn TTFT p50 of turns >= 2: cache <= 0.6x load
COMPUTED_BOUND = 1.2  # prompt tokens the cache cluster computed <= 1.2x the unavoidable
THROUGHPUT_BOUND = 0.95  # random workload output throughput: cache >= 0.95x load


# ---- bookkeeping (pure: turns and results in, figures out) --------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """numpy's linear-interpolation percentile (what vLLM's bench client reports); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _r(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


def multi_turn_summary(rows: list[Turn], seconds: float, use: dict[str, Any] | None,
                       expected: int | None = None) -> dict[str, Any]:
    """One target's multi-turn figures: per turn number requests, failures, TTFT p50 / p99; TTFT p50 / p99 over turns
    >= 2 (the ones a cache can resume); output throughput; failures; `unsent`: of the `expected` turns, those never
    sent (after a failed turn of their conversation, or past the timeout - a conversation yet to start included);
    prompt tokens sent, unavoidable (completed turns), and - from /metrics (`use`, `prompt_token_use`) - computed and
    resumed, with computed / unavoidable."""
    turns = sorted({r.turn for r in rows})
    ok = [r for r in rows if r.error is None and r.ttft_ms is not None]
    later = [r.ttft_ms for r in ok if r.turn >= 2]
    out_tokens = sum(r.output_tokens for r in ok)
    unavoidable = sum(r.unavoidable_tokens or 0 for r in rows)
    computed = (use or {}).get("computed_tokens")
    return {
        "by_turn": [{"turn": t, "requests": sum(r.turn == t for r in rows),
                     "failed": sum(r.turn == t and r.error is not None for r in rows),
                     "prompt_tokens_mean": _r(_mean([r.prompt_tokens for r in rows if r.turn == t])),
                     "ttft_p50_ms": _r(percentile([r.ttft_ms for r in ok if r.turn == t], 50)),
                     "ttft_p99_ms": _r(percentile([r.ttft_ms for r in ok if r.turn == t], 99))} for t in turns],
        "requests": len(rows), "failed": sum(r.error is not None for r in rows),
        "unsent": max(0, expected - len(rows)) if expected is not None else None,
        "errors": sorted({r.error for r in rows if r.error})[:5],
        "ttft_p50_later_turns_ms": _r(percentile(later, 50)), "ttft_p99_later_turns_ms": _r(percentile(later, 99)),
        "duration_s": round(seconds, 2), "output_tokens": out_tokens,
        "output_throughput": round(out_tokens / seconds, 2) if seconds > 0 else None,
        "prompt_tokens_sent": sum(r.prompt_tokens for r in rows), "unavoidable_tokens": unavoidable,
        "prompt_tokens": use, "computed_over_unavoidable": _r(ratio(computed, unavoidable), 3),
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def ratio(value: float | None, ref: float | None) -> float | None:
    """value / ref, None when either is missing or ref is 0."""
    if value is None or ref is None or ref == 0:
        return None
    return value / ref


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _get(results: dict[str, dict], target: str, workload: str, key: str) -> Any:
    return ((results.get(target) or {}).get(workload) or {}).get(key)


def check_targets(results: dict[str, dict]) -> list[str]:
    """The issue's three targets as lines, each met / MISSED / not measured (with why): multi-turn TTFT p50 of turns
    >= 2, cache <= 0.6x load; prompt tokens the cache cluster computed on the multi-turn workload <= 1.2x the
    unavoidable; random workload output throughput, cache >= 0.95x load."""
    lines = []
    label = f"multi-turn TTFT p50 of turns >= 2: cache <= {TTFT_BOUND}x load"
    c, lo = (_get(results, t, "multi_turn", "ttft_p50_later_turns_ms") for t in ("cache", "load"))
    if c is None or lo is None:
        lines.append(f"{label}: not measured ({_why(results, ('cache', 'load'), 'multi_turn', 'TTFT of turns >= 2')})")
    else:
        r = c / lo
        lines.append(f"{label}: {r:.2f}x ({c:.1f} vs {lo:.1f} ms) (<= {TTFT_BOUND}x: {_verdict(r <= TTFT_BOUND)})")

    label = f"multi-turn prompt tokens computed (cache) <= {COMPUTED_BOUND}x the unavoidable"
    use = _get(results, "cache", "multi_turn", "prompt_tokens") or {}
    u = _get(results, "cache", "multi_turn", "unavoidable_tokens")
    computed = use.get("computed_tokens")
    if computed is None or not u:
        why = use.get("note") or _why(results, ("cache",), "multi_turn", "counters")
        lines.append(f"{label}: not measured ({why})")
    else:
        r = computed / u
        note = f"; {use['note']}" if use.get("note") else ""
        lines.append(f"{label}: {r:.2f}x ({computed:.0f} computed, {use.get('cached_tokens') or 0:.0f} resumed, "
                     f"{u} unavoidable{note}) (<= {COMPUTED_BOUND}x: {_verdict(r <= COMPUTED_BOUND)})")

    label = f"random workload output throughput: cache >= {THROUGHPUT_BOUND}x load"
    c, lo = (_get(results, t, "random", "output_throughput") for t in ("cache", "load"))
    fails = [t for t in ("cache", "load") if _get(results, t, "random", "failed")]
    if c is None or lo is None or lo == 0:
        lines.append(f"{label}: not measured ({_why(results, ('cache', 'load'), 'random', 'throughput')})")
    else:
        r = c / lo
        note = f"; failed requests on {', '.join(fails)}" if fails else ""
        lines.append(f"{label}: {r:.2f}x ({c:.1f} vs {lo:.1f} tok/s{note}) (>= {THROUGHPUT_BOUND}x: "
                     f"{_verdict(r >= THROUGHPUT_BOUND and not fails)})")
    return lines


def _why(results: dict[str, dict], targets: tuple[str, ...], workload: str, what: str) -> str:
    """Why a verdict has no figure: a target not run, one that failed, a workload not run, or no such figure."""
    for t in targets:
        if t not in results:
            return f"{t} not in --targets"
        if results[t].get("error"):
            return f"{t} failed: {results[t]['error']}"
        w = results[t].get(workload)
        if w is None:
            return f"{workload.replace('_', '-')} not in --workloads"
        if w.get("error"):
            return f"{t}: {w['error']}"
    return f"no {what} (every request failed?)"


def vllm_lines(results: dict[str, dict]) -> list[str]:
    """The cache cluster against vLLM's server, figures and ratios (no target set for these)."""
    if "cache" not in results or "vllm" not in results:
        return ["cache vs vllm: not measured (needs both in --targets)"]
    rows = []
    for label, workload, key, unit in (
            ("multi-turn TTFT p50, turns >= 2", "multi_turn", "ttft_p50_later_turns_ms", "ms"),
            ("multi-turn TTFT p99, turns >= 2", "multi_turn", "ttft_p99_later_turns_ms", "ms"),
            ("multi-turn computed / unavoidable", "multi_turn", "computed_over_unavoidable", "x"),
            ("multi-turn output throughput", "multi_turn", "output_throughput", "tok/s"),
            ("prefix workload TTFT p50", "prefix", "p50_ttft_ms", "ms"),
            ("prefix workload output throughput", "prefix", "output_throughput", "tok/s"),
            ("random workload output throughput", "random", "output_throughput", "tok/s"),
            ("random workload TTFT p50", "random", "p50_ttft_ms", "ms")):
        c, v = _get(results, "cache", workload, key), _get(results, "vllm", workload, key)
        if c is None and v is None:
            continue
        r = ratio(c, v)
        fmt = (lambda x: "-" if x is None else f"{x:.2f}") if unit == "x" else (
            lambda x: "-" if x is None else f"{x:.1f} {unit}")
        rows.append(f"cache vs vllm, {label}: {fmt(c)} vs {fmt(v)}" + (f" ({r:.2f}x)" if r is not None else ""))
    return rows or ["cache vs vllm: no figure both measured"]


def turn_table(results: dict[str, dict]) -> list[str]:
    """A markdown table: per turn number, each target's TTFT p50 / p99 (ms) and failures."""
    targets = [t for t in results if (results[t].get("multi_turn") or {}).get("by_turn")]
    if not targets:
        return []
    turns = sorted({x["turn"] for t in targets for x in results[t]["multi_turn"]["by_turn"]})
    lines = ["| turn | " + " | ".join(f"{t} TTFT p50 / p99 (failed)" for t in targets) + " |",
             "|---|" + "---|" * len(targets)]
    for turn in turns:
        cells = []
        for t in targets:
            x = next((x for x in results[t]["multi_turn"]["by_turn"] if x["turn"] == turn), None)
            cells.append("-" if x is None else f"{fmt(x['ttft_p50_ms'])} / {fmt(x['ttft_p99_ms'])} ({x['failed']})")
        lines.append(f"| {turn} | " + " | ".join(cells) + " |")
    return lines


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def workload_table(results: dict[str, dict]) -> list[str]:
    """A markdown table per target of the prefix and random workloads and the multi-turn totals."""
    lines = ["| target | workload | completed | failed | out tok/s | TTFT p50 | TTFT p99 | prompt tokens | computed | "
             "resumed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t, res in results.items():
        if res.get("error"):
            lines.append(f"| {t} | - | - | - | {res['error']} | | | | | |")
            continue
        mt = res.get("multi_turn")
        if mt:
            use = mt.get("prompt_tokens") or {}
            lines.append(f"| {t} | multi-turn | {mt['requests'] - mt['failed']} | {mt['failed']} | "
                         f"{fmt(mt['output_throughput'])} | {fmt(mt['ttft_p50_later_turns_ms'])} (turns >= 2) | "
                         f"{fmt(mt['ttft_p99_later_turns_ms'])} | {mt['prompt_tokens_sent']} | "
                         f"{num(use.get('computed_tokens'))} (unavoidable {mt['unavoidable_tokens']}) | "
                         f"{num(use.get('cached_tokens'))} |")
        for w in ("prefix", "random"):
            x = res.get(w)
            if not x:
                continue
            if x.get("error"):
                lines.append(f"| {t} | {w} | - | - | {x['error']} | | | | | |")
                continue
            use = x.get("prompt_tokens") or {}
            lines.append(f"| {t} | {w} | {x['completed']} | {x['failed']} | {fmt(x['output_throughput'])} | "
                         f"{fmt(x['p50_ttft_ms'])} | {fmt(x['p99_ttft_ms'])} | {num(use.get('prompt_tokens'))} | "
                         f"{num(use.get('computed_tokens'))} | {num(use.get('cached_tokens'))} |")
    return lines


def num(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def plot(results: dict[str, dict], path: Path) -> None:
    """TTFT p50 by turn number, one line per target (log scale: turn 1 is a whole prompt, later turns a cache hit or
    not), and beside it each target's multi-turn prompt tokens computed against the unavoidable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    names, computed, unavoidable = [], [], []
    for t, res in results.items():
        mt = res.get("multi_turn") or {}
        by = mt.get("by_turn") or []
        if by:
            ax.plot([x["turn"] for x in by], [math.nan if x["ttft_p50_ms"] is None else x["ttft_p50_ms"] for x in by],
                    "o-", label=t)
            names.append(t)
            computed.append((mt.get("prompt_tokens") or {}).get("computed_tokens") or 0)
            unavoidable.append(mt.get("unavoidable_tokens") or 0)
    ax.set(xlabel="turn of the conversation", ylabel="TTFT p50 (ms)", title="multi-turn: TTFT p50 by turn",
           yscale="log")
    ax.xaxis.get_major_locator().set_params(integer=True)
    if names:  # (no multi-turn workload: empty panes)
        ax.legend(fontsize=8)
    x = range(len(names))
    bx.bar([i - 0.2 for i in x], computed, 0.4, label="computed (/metrics)")
    bx.bar([i + 0.2 for i in x], unavoidable, 0.4, label="unavoidable")
    bx.set_xticks(list(x), names)
    bx.set(ylabel="prompt tokens", title="multi-turn: prompt tokens computed")
    bx.legend(fontsize=8, loc="lower right")
    fig.suptitle("prefix routing: routing.policy cache vs load, and vLLM's server")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
