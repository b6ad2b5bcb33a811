"""`bench prefix-routing`'s workloads and what measures them: the multi-turn conversations and their client (the
official `openai` package, streamed token-id prompts), the unavoidable prompt tokens of a conversation, the prompt
tokens a target computed and resumed read from its /metrics, vLLM's bench client's arguments and figures for the
prefix and random workloads, and one prefill engine's block pool (how many prefixes it holds)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable


PERCENTILES = (50, 99)  # what vLLM's bench client is asked for



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
ROUTE_REASONS = ("hit", "spread", "load", "only", "local")  # pd_routing_decisions' reasons (pair_choice)
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
        from cluster.cli.placement import cpu_block_size

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
