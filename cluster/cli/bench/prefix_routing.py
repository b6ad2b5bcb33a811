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

import asyncio
import contextlib
import json
import math
import os
import random
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from cluster.cli.bench.targets import REPO
from cluster.cli.real_model import BUILTIN_NAMES

KNOWN_TARGETS = ("cache", "load", "vllm")
CLUSTER_TARGETS = {"cache": "cache", "load": "load"}  # target -> routing.policy
DEFAULT_TARGETS = "cache,load,vllm"
KNOWN_WORKLOADS = ("multi-turn", "prefix", "random")
PERCENTILES = (50, 99)
GIB = 1 << 30
# the targets
TTFT_BOUND = 0.6  # multi-turn TTFT p50 of turns >= 2: cache <= 0.6x load
COMPUTED_BOUND = 1.2  # prompt tokens the cache cluster computed <= 1.2x the unavoidable
THROUGHPUT_BOUND = 0.95  # random workload output throughput: cache >= 0.95x load
BENCH_NAMESPACE = "pd-bench-prefix"


# ---- the multi-turn workload (pure) -------------------------------------------------------------------------------
@dataclass(frozen=True)
class MultiTurn:
    """The multi-turn workload: `conversations`, `turns` each; the first user message `first_tokens` long, later ones
    `user_tokens`, each reply `reply_tokens` (ignore_eos); think time exponential with mean `think_s`. `arrival_s`:
    the mean gap between conversations' starts (Poisson arrivals: steady traffic, conversations ending while others
    begin); 0 starts them all together (one think time in, so their turns come in waves)."""

    conversations: int
    turns: int
    think_s: float
    first_tokens: int
    user_tokens: int
    reply_tokens: int
    seed: int
    arrival_s: float = 0.0

    def prompt_lengths(self) -> list[int]:
        """Each turn's prompt length when every reply has `reply_tokens` tokens."""
        lengths, n = [], 0
        for turn in range(self.turns):
            n += self.first_tokens if turn == 0 else self.reply_tokens + self.user_tokens
            lengths.append(n)
        return lengths

    def start_offsets(self) -> list[float]:
        """Each conversation's start, seconds after the workload's: Poisson arrivals at one per `arrival_s` (the
        first at 0), seeded; all 0 when `arrival_s` is 0."""
        if self.arrival_s <= 0:
            return [0.0] * self.conversations
        rng, t, out = random.Random(self.seed * 1_000_003 - 1), 0.0, []
        for _ in range(self.conversations):
            out.append(t)
            t += rng.expovariate(1 / self.arrival_s)
        return out

    def rng(self, conversation: int) -> random.Random:
        """Conversation `conversation`'s own generator: the same messages and think times on every target."""
        return random.Random(self.seed * 1_000_003 + conversation)


def user_message(rng: random.Random, n: int, token_ids: list[int]) -> list[int]:
    """A "user message" of `n` random token ids from `token_ids` (the vocabulary less the special tokens): a new
    conversation's first message shares nothing with any other one."""
    return [rng.choice(token_ids) for _ in range(n)]


def unavoidable_tokens(prompt_lengths: list[int], block_size: int) -> list[int]:
    """Per turn of one conversation (its prompt lengths, in turn order), the prompt tokens a prefill engine must
    compute at the least: the first prompt whole, then each prompt past the last block boundary before the previous
    prompt's last token - where vLLM's "align" mode kept the previous prefill's recurrent state (a hybrid model's
    prefix is resumable only at such a checkpoint). Before its last token, not at its end: when the decode engine
    samples the first token, the prefill engine runs the prompt less its last token (the N-1 boundary), so a prompt of
    a whole number of blocks is resumable one block short (measured: a 512-token turn resumed at 384). That is the
    turn's new tokens (reply + user message) plus the previous prompt's tail past that boundary: the new tokens
    rounded up to the checkpoint granularity, give or take a block."""
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, not {block_size}")
    out, previous = [], 0
    for n in prompt_lengths:
        if n <= previous:
            raise ValueError(f"each turn's prompt extends the previous one: {prompt_lengths}")
        resumable = (previous - 1) // block_size * block_size if previous else 0
        out.append(n - resumable)
        previous = n
    return out


def check_multi_turn(spec: MultiTurn, max_model_len: int) -> None:
    """Refuse, saying what to change, a conversation whose last turn would not fit the model's length."""
    longest = spec.prompt_lengths()[-1] + spec.reply_tokens
    if longest > max_model_len:
        raise SystemExit(f"the last turn of a conversation ({spec.prompt_lengths()[-1]} prompt + {spec.reply_tokens} "
                         f"reply tokens) exceeds the max model length {max_model_len}: lower --turns, "
                         "--first-tokens, --user-tokens or --reply-tokens")
    if spec.conversations < 1 or spec.turns < 1 or spec.think_s < 0 or spec.arrival_s < 0:
        raise SystemExit("--conversations and --turns must be >= 1, --think-s and --arrival-s >= 0")


# ---- the multi-turn client ----------------------------------------------------------------------------------------
@dataclass
class Turn:
    """One request of the multi-turn workload. `ttft_ms` is from sending it to the first token id streamed back."""

    target: str
    conversation: int
    turn: int  # 1-based
    prompt_tokens: int
    new_tokens: int  # past the previous turn's prompt: the previous reply and this user message
    unavoidable_tokens: int | None = None
    ttft_ms: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    error: str | None = None


async def _one_turn(client: Any, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """Stream one completion of a token-id prompt; (TTFT s, latency s, the reply's token ids)."""
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    ttft, reply = None, []
    async with stream:  # closed on an error too: the server sees the client leave
        async for chunk in stream:
            for choice in chunk.choices:
                ids = getattr(choice, "token_ids", None)
                if ids is None and choice.text:
                    raise RuntimeError("the stream carries text but no token ids (the server ignored "
                                       "return_token_ids)")
                if ids:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    reply += list(ids)
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft, time.perf_counter() - t0, reply


async def _conversation(client: Any, model: str, spec: MultiTurn, index: int, token_ids: list[int], target: str,
                        rows: list[Turn], start_s: float = 0.0) -> None:
    """One conversation, `start_s` after the workload's start, then turn after turn; a failed turn ends it (its
    context cannot go on), the turns it did not reach are not sent."""
    rng = spec.rng(index)
    if start_s > 0:
        await asyncio.sleep(start_s)
    context: list[int] = []
    previous = 0  # the previous turn's prompt length
    for turn in range(1, spec.turns + 1):
        if spec.think_s > 0:
            await asyncio.sleep(rng.expovariate(1 / spec.think_s))
        message = user_message(rng, spec.first_tokens if turn == 1 else spec.user_tokens, token_ids)
        prompt = context + message
        row = Turn(target, index, turn, len(prompt), len(prompt) - previous)
        rows.append(row)
        previous = len(prompt)
        try:
            ttft, latency, reply = await _one_turn(client, model, prompt, spec.reply_tokens)
        except Exception as e:  # noqa: BLE001 - the turn's failure is its row; the other conversations go on
            row.error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            return
        row.ttft_ms, row.latency_s, row.output_tokens = ttft * 1000, latency, len(reply)
        context = prompt + reply


async def _multi_turn(url: str, api_key: str | None, model: str, spec: MultiTurn, token_ids: list[int], target: str,
                      timeout_s: float, progress: Callable[[str], None]) -> tuple[list[Turn], float]:
    from openai import AsyncOpenAI

    rows: list[Turn] = []
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0, timeout=timeout_s)
    total = spec.conversations * spec.turns
    t0 = time.perf_counter()

    async def report() -> None:
        while True:
            await asyncio.sleep(15)
            done = sum(r.ttft_ms is not None or r.error is not None for r in rows)
            progress(f"multi-turn: {done}/{total} turns done, {sum(r.error is not None for r in rows)} failed, "
                     f"{time.perf_counter() - t0:.0f} s")

    reporter = asyncio.create_task(report())
    starts = spec.start_offsets()
    try:
        await asyncio.wait_for(asyncio.gather(*(_conversation(client, model, spec, i, token_ids, target, rows,
                                                              starts[i])
                                                for i in range(spec.conversations))), timeout_s)
    except asyncio.TimeoutError:
        for r in rows:
            if r.ttft_ms is None and r.error is None:
                r.error = f"timed out: the workload ran past {timeout_s:.0f} s"
    finally:
        reporter.cancel()
        await client.close()
    return rows, time.perf_counter() - t0


def run_multi_turn(url: str, api_key: str | None, model: str, spec: MultiTurn, token_ids: list[int], target: str,
                   block_size: int, timeout_s: float, progress: Callable[[str], None]) -> tuple[list[Turn], float]:
    """The multi-turn workload against one running target; its turns (each with its unavoidable tokens) and the
    seconds it took."""
    rows, seconds = asyncio.run(_multi_turn(url, api_key, model, spec, token_ids, target, timeout_s, progress))
    fill_unavoidable(rows, block_size)
    return rows, seconds


def fill_unavoidable(rows: list[Turn], block_size: int) -> None:
    """Each turn's unavoidable tokens (`unavoidable_tokens` over its conversation's prompts, sent ones only)."""
    convs: dict[tuple[str, int], list[Turn]] = {}
    for r in rows:
        convs.setdefault((r.target, r.conversation), []).append(r)
    for turns in convs.values():
        turns.sort(key=lambda r: r.turn)
        for r, u in zip(turns, unavoidable_tokens([r.prompt_tokens for r in turns], block_size)):
            r.unavoidable_tokens = u


def vocabulary(model_dir: str) -> list[int]:
    """The model's token ids less its special tokens: what a random "user message" is drawn from."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    if not ids:
        raise RuntimeError(f"the tokenizer of {model_dir} has no ordinary tokens")
    return ids


# ---- /metrics: prompt tokens computed and resumed -----------------------------------------------------------------
# what each kind of target exports: its prompt tokens, those it computed, those it found in its prefix cache
CLUSTER_COUNTERS = {
    "prompt": ("pd_prompt_tokens_total", {}),
    "cached": ("pd_cached_prompt_tokens_total", {"role": "prefill"}),
    "decode_cached": ("pd_cached_prompt_tokens_total", {"role": "decode"}),
    "local_prefill": ("pd_requests_local_prefill_total", {}),
    "colocated": ("pd_requests_colocated_total", {}),
    "retried": ("pd_requests_retried_total", {}),
    "views": ("pd_routing_views_total", {}),
    "unasked": ("pd_routing_unasked_total", {}),
    "view_seconds": ("pd_routing_view_seconds_total", {}),
    "route_hit": ("pd_routing_decisions_total", {"reason": "hit"}),
    "route_spread": ("pd_routing_decisions_total", {"reason": "spread"}),
    "route_load": ("pd_routing_decisions_total", {"reason": "load"}),
    "route_only": ("pd_routing_decisions_total", {"reason": "only"}),
    "route_local": ("pd_routing_decisions_total", {"reason": "local"}),
    "mispredicted": ("pd_prefix_mispredictions_total", {"role": "prefill"}),
}
ROUTE_REASONS = ("hit", "spread", "load", "only", "local")  # pd_routing_decisions' reasons (actors.pair_choice)
VLLM_COUNTERS = {
    "prompt": ("vllm:prompt_tokens_total", {}),
    "computed": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "cached": ("vllm:prompt_tokens_cached_total", {}),
}


def metric_sum(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The sum of the samples `name` in a scraped /metrics page whose labels include `labels`; None when the page
    has no such sample."""
    from prometheus_client.parser import text_string_to_metric_families

    found = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                found = (found or 0.0) + float(s.value)
    return found


def counters(text: str, kind: str) -> dict[str, float | None]:
    """The prompt-token counters of a /metrics page of a `kind` ("cluster" or "vllm") target."""
    return {k: metric_sum(text, name, labels) for k, (name, labels) in
            (CLUSTER_COUNTERS if kind == "cluster" else VLLM_COUNTERS).items()}


def scrape(url: str, api_key: str | None, kind: str) -> dict[str, float | None]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    r.raise_for_status()
    return counters(r.text, kind)


def prompt_token_use(before: dict[str, float | None], after: dict[str, float | None], kind: str) -> dict[str, Any]:
    """Prompt tokens sent, computed by the prefill side and resumed from its prefix cache between two scrapes.
    The cluster exports what its prefill engines found cached (`pd_cached_prompt_tokens_total{role="prefill"}`), so
    computed = prompt - that, which holds while every request was disaggregated: a request a decode engine prefilled
    itself (local prefill, degraded mode) or one retried on another pair would be miscounted - `note` says so.
    vLLM's server exports what it computed (`vllm:prompt_tokens_by_source_total{source="local_compute"}`)."""
    def delta(key: str) -> float | None:
        a, b = after.get(key), before.get(key)
        return None if a is None or b is None else a - b

    prompt, cached = delta("prompt"), delta("cached")
    out: dict[str, Any] = {"prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": None, "note": None}
    if kind == "vllm":
        out["computed_tokens"] = delta("computed")
    elif prompt is not None and cached is not None:
        out["computed_tokens"] = prompt - cached
        out["decode_cached_tokens"] = delta("decode_cached")
        views, seconds = delta("views"), delta("view_seconds")
        # what asking the engines cost each cache-aware choice (in its time to first token)
        out["routing_view_ms"] = round(1000 * seconds / views, 2) if views and seconds is not None else None
        # choices that asked the engines, and those that did not (no engine may hold the prompt's first block)
        out["routing_views"], out["routing_unasked"] = views, delta("unasked")
        # the router's choices by reason, and the prefills whose hit its prediction got wrong
        # (a reason's sample appears on its first choice: absent before, it was 0)
        out["routes"] = {}
        for r in ROUTE_REASONS:
            now = after.get(f"route_{r}")
            out["routes"][r] = None if now is None else now - (before.get(f"route_{r}") or 0.0)
        out["mispredicted"] = delta("mispredicted")
        odd = {k: delta(k) for k in ("local_prefill", "colocated", "retried") if delta(k)}
        if odd:
            out["note"] = ("not every request was prefilled once by a prefill engine ("
                           + ", ".join(f"{k} {v:g}" for k, v in odd.items()) + "): computed tokens are approximate")
    missing = [k for k, v in out.items() if k.endswith("tokens") and v is None and k != "decode_cached_tokens"]
    if missing:
        out["note"] = f"the target's /metrics lacks counters for {', '.join(missing)}"
    return out


def routes_said(use: dict[str, Any]) -> str:
    """", routes hit 40 / spread 3 / load 16, 2 mispredicted" from a cluster's `prompt_token_use`; "" when its
    /metrics did not say."""
    routes = use.get("routes") or {}
    if not any(routes.values()):
        return ""
    shown = [r for r in ROUTE_REASONS if r in ("hit", "spread", "load") or routes.get(r)]
    views, unasked = use.get("routing_views"), use.get("routing_unasked")
    return (", routes " + " / ".join(f"{r} {routes.get(r) or 0:g}" for r in shown)
            + (f", {use['mispredicted']:g} mispredicted" if use.get("mispredicted") is not None else "")
            + (f", engines asked in {views:g} choices, {unasked:g} routed without asking" if views is not None
               and unasked is not None and views + unasked else ""))


# ---- vLLM's bench client: the prefix and random workloads ---------------------------------------------------------
def client_argv(url: str, model: str, tokenizer_dir: str, out_dir: str, *, workload: str, num_prompts: int,
                concurrency: int, seed: int, input_len: int, output_len: int, prefix_len: int = 0,
                suffix_len: int = 0, prefixes: int = 0) -> list[str]:
    """vLLM 0.32's `vllm bench serve` arguments for the prefix (`prefix_repetition`) or random workload: all
    requests at once (`--request-rate inf`) with at most `concurrency` in flight, greedy, ignore_eos."""
    argv = ["--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", tokenizer_dir,
            "--num-prompts", str(num_prompts), "--request-rate", "inf", "--max-concurrency", str(concurrency),
            "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", ",".join(map(str, PERCENTILES)), "--disable-tqdm", "--save-result",
            "--result-dir", out_dir, "--result-filename", "result.json"]
    if workload == "prefix":
        return argv + ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
                       "--prefix-repetition-suffix-len", str(suffix_len), "--prefix-repetition-num-prefixes",
                       str(prefixes), "--prefix-repetition-output-len", str(output_len)]
    if workload == "random":
        return argv + ["--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
                       str(output_len), "--random-range-ratio", "0"]
    raise ValueError(f"vLLM's bench client runs the prefix and random workloads, not {workload!r}")


CLIENT_FIGURES = ("request_throughput", "output_throughput", "total_token_throughput",
                  *(f"p{p}_{m}_ms" for m in ("ttft", "tpot", "e2el") for p in PERCENTILES))


def client_row(result: dict[str, Any]) -> dict[str, Any]:
    """The figures kept of vLLM's saved result: completed, failed, duration, throughputs, TTFT / TPOT / E2E
    percentiles (None where nothing completed: vLLM reports 0 ms for an empty list)."""
    completed = int(result["completed"])
    row: dict[str, Any] = {"completed": completed, "failed": int(result["failed"]),
                           "duration_s": round(float(result["duration"]), 2),
                           "total_input_tokens": int(result.get("total_input_tokens", 0)), "error": None}
    for k in CLIENT_FIGURES:
        v = result.get(k)
        row[k] = None if v is None or (k.endswith("_ms") and not completed) else round(float(v), 3)
    return row


# ---- one engine's prefix cache ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockPool:
    """A prefill engine's block pool as vLLM builds it (`offline_layout` at the cluster's block size): every cache
    group takes its blocks from one pool of `page_bytes` x `regions` blocks; a cached prompt keeps one block per
    attention group per `block_size` tokens and one state block per state group at its checkpoint."""

    block_size: int
    page_bytes: int
    regions: int
    attention_groups: int
    state_groups: int

    @classmethod
    def of(cls, cfg: Any, model_dir: str) -> "BlockPool":
        from cluster.core.hf_config import load_config, model_shape
        from cluster.core.layout import offline_layout
        from cluster.cli.launch import cpu_block_size

        shape = model_shape(load_config(model_dir))
        layout = offline_layout(shape, cfg.prefill.tp, cfg.model.dtype, "float32",
                                block_size=cpu_block_size(cfg, model_dir))
        kinds = [g.kind for g in layout.groups]
        return cls(layout.block_size, layout.page_bytes, layout.num_regions, kinds.count("attention"),
                   kinds.count("state"))

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * max(1, self.regions)

    def blocks(self, tokens: int) -> int:
        """The pool blocks one cached prompt of `tokens` takes (its attention blocks and one state checkpoint)."""
        return math.ceil(tokens / self.block_size) * self.attention_groups + self.state_groups

    def held(self, kv_bytes: int, tokens: int) -> int:
        """About how many cached prompts of `tokens` tokens (a whole number of blocks: a prefix in "align" mode keeps
        its checkpoint at the boundary) a cache of `kv_bytes` holds."""
        return kv_bytes // self.block_bytes // max(1, self.blocks(tokens))

    def gib(self, blocks: int) -> float:
        """KV/state cache in GiB (whole MiB, rounded up) for `blocks` pool blocks."""
        return math.ceil(blocks * self.block_bytes / (1 << 20)) / 1024



def check_prefix_workload(prefix_len: int, suffix_len: int, block_size: int, prefixes: int,
                          prompts_per_prefix: int) -> None:
    """Refuse a prefix workload whose prefixes no hybrid engine could resume: in "align" mode a prefill keeps its
    recurrent state only at the last block boundary its prompt reached, so a later prompt resumes at the prefix only
    when that boundary is the prefix's end - the prefix a whole number of blocks, the suffix shorter than a block."""
    if prefix_len < block_size or prefix_len % block_size:
        raise SystemExit(f"--prefix-len {prefix_len}: a whole number of blocks ({block_size} tokens), or no engine can "
                         "resume the prefix (its recurrent state is kept only at block boundaries)")
    if not 1 <= suffix_len < block_size:
        raise SystemExit(f"--suffix-len {suffix_len}: 1 to {block_size - 1} (under a block), or the state is kept past "
                         "the prefix, in the suffix, and no later prompt resumes at the prefix")
    if prefixes < 1 or prompts_per_prefix < 2:
        raise SystemExit("--prefixes must be >= 1 and --prompts-per-prefix >= 2 (a prefix seen once is never reused)")


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
            cells.append("-" if x is None else f"{_fmt(x['ttft_p50_ms'])} / {_fmt(x['ttft_p99_ms'])} ({x['failed']})")
        lines.append(f"| {turn} | " + " | ".join(cells) + " |")
    return lines


def _fmt(x: float | None) -> str:
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
                         f"{_fmt(mt['output_throughput'])} | {_fmt(mt['ttft_p50_later_turns_ms'])} (turns >= 2) | "
                         f"{_fmt(mt['ttft_p99_later_turns_ms'])} | {mt['prompt_tokens_sent']} | "
                         f"{_num(use.get('computed_tokens'))} (unavoidable {mt['unavoidable_tokens']}) | "
                         f"{_num(use.get('cached_tokens'))} |")
        for w in ("prefix", "random"):
            x = res.get(w)
            if not x:
                continue
            if x.get("error"):
                lines.append(f"| {t} | {w} | - | - | {x['error']} | | | | | |")
                continue
            use = x.get("prompt_tokens") or {}
            lines.append(f"| {t} | {w} | {x['completed']} | {x['failed']} | {_fmt(x['output_throughput'])} | "
                         f"{_fmt(x['p50_ttft_ms'])} | {_fmt(x['p99_ttft_ms'])} | {_num(use.get('prompt_tokens'))} | "
                         f"{_num(use.get('computed_tokens'))} | {_num(use.get('cached_tokens'))} |")
    return lines


def _num(x: float | None) -> str:
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
    """The KV/state cache each prefill engine gets, as the launcher gives it (`cluster.cli.launch._device_options`):
    the pool's kv_cache_gib as vLLM's kv_cache_memory_bytes (older launchers: VLLM_CPU_KVCACHE_SPACE, whole GiB)."""
    from cluster.cli.launch import _device_options

    opts = _device_options(cfg, "prefill", model_dir)
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
                    f"p50 turns >= 2 {_fmt(res['ttft_p50_later_turns_ms'])} ms, computed {_num(use['computed_tokens'])}"
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
                f"{_fmt(row['output_throughput'])} out tok/s, TTFT p50 {_fmt(row['p50_ttft_ms'])} ms, computed "
                f"{_num(row['prompt_tokens']['computed_tokens'])} of {_num(row['prompt_tokens']['prompt_tokens'])} "
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
    from actors.engine_settings import free_port
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
