"""Where every benchmark's figures go: a table on stdout (`table`), results/bench_<name>.json and a PNG plot next to it
(`write_results`)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def write_results(name: str, rows: list[dict], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench_{name}.json"
    path.write_text(json.dumps({"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}, indent=2))
    try:
        plot(name, rows, out_dir / f"bench_{name}.png")
    except Exception as e:  # noqa: BLE001 - the JSON is the result; a plot failure is reported, not fatal
        print(f"(no plot: {e})")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


def plot(name: str, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if name == "transfer":
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for key in sorted({(r["model"], r["prefill_tp"], r["decode_tp"]) for r in rows}):
            sel = [r for r in rows if (r["model"], r["prefill_tp"], r["decode_tp"]) == key and r["blocks"] == "scattered"]
            label = f"{key[0]} P{key[1]}->D{key[2]} (scattered blocks)"
            axes[0].plot([r["prompt_tokens"] for r in sel], [r["nixl_gbps"] for r in sel], "o-", label=label)
            axes[1].plot([r["prompt_tokens"] for r in sel], [r["ratio_to_memcpy"] for r in sel], "o-", label=label)
        axes[0].plot([r["prompt_tokens"] for r in rows], [r["memcpy_gbps"] for r in rows], "k.", label="memcpy (same bytes)")
        axes[0].set(xscale="log", xlabel="prompt tokens", ylabel="GB/s", title="NIXL READ of a request's state")
        axes[1].axhline(0.7, color="grey", ls="--", lw=1)
        axes[1].set(xscale="log", xlabel="prompt tokens", ylabel="NIXL / memcpy", title="ratio to the memcpy ceiling")
        axes[0].legend(fontsize=7)
    elif name == "load":
        r = rows[0]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        keys = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
        ax.bar(keys, [r[k] or 0 for k in keys])
        ax.set(ylabel="ms", title=f"{r['clients']} clients, {r['ok']} requests, {r['output_tokens_per_s']} tok/s, "
               f"{r['lost']} lost, {r['refused_503']} refused (503)")
    elif name == "prefix":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        labels = [f"P{r['prefill_tp']}->D{r['decode_tp']}" for r in rows]
        x = range(len(rows))
        for ax, key, unit in ((axes[0], "ttft", "ms"), (axes[1], "bytes", "bytes read by the decode engine")):
            miss, hit = (f"{key}_miss_ms", f"{key}_hit_ms") if key == "ttft" else ("bytes_miss", "bytes_hit")
            ax.bar([i - 0.2 for i in x], [r[miss] for r in rows], 0.4, label="no cached prefix")
            ax.bar([i + 0.2 for i in x], [r[hit] for r in rows], 0.4, label="prefix cached on both engines")
            ax.set_xticks(list(x), labels)
            ax.set(ylabel=unit, title=f"{key.upper() if key == 'ttft' else key} (median)")
        axes[0].legend()
    elif name == "faults":
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        x = range(len(rows))
        labels = [r["scenario"] for r in rows]
        for ax, key in ((axes[0], "ttft"), (axes[1], "itl")):
            ax.bar([i - 0.2 for i in x], [r[f"{key}_p99_ms_before"] or 0 for r in rows], 0.4, label="before the kill")
            ax.bar([i + 0.2 for i in x], [r[f"{key}_p99_ms_fault"] or 0 for r in rows], 0.4, label="fault window")
            ax.set_xticks(list(x), labels, fontsize=8)
            ax.set(ylabel="ms", title=f"{key.upper()} p99")
        axes[0].legend()
        fig.suptitle("one engine / the coordinator SIGKILLed under load: failed requests "
                     + ", ".join(f"{r['scenario']} {r['failed']}" for r in rows), fontsize=9)
    elif name == "scale":
        fig, ax = plt.subplots(figsize=(7, 4.5))
        n = [r["prefill_engines"] for r in rows]
        ax.plot(n, [r["coordinator_ms"] for r in rows], "o-", label="coordinator (registrations, cached plans)")
        ax.plot(n, [r["pairwise_ms"] for r in rows], "s-", label="pairwise handshakes (plan per pair)")
        ax.set(xscale="log", yscale="log", xlabel="engines per pool (P = D)", ylabel="ms of planning",
               title="negotiation cost as pools grow")
        ax.legend()
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        labels = [f"P{r['prefill_tp']}->D{r['decode_tp']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["ttft_colocated_ms"] for r in rows], 0.4, label="colocated TTFT")
        ax.bar([i + 0.2 for i in x], [r["ttft_disaggregated_ms"] for r in rows], 0.4, label="disaggregated TTFT")
        ax.set_xticks(list(x), labels)
        ax.set(ylabel="ms", title="time to first token (median)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: list[dict], keys: list[str]) -> None:
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))
