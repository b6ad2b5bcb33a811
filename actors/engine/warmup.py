"""An engine's warm-up before it serves (`warm_up`, run by `EngineActor.start` before the engine registers - the first
engines, replacements and autoscaled ones alike).

vLLM builds or compiles several things the first time a request needs them, inside an engine step: the logprob rank
count (`batched_count_greater_than`, torch.compile + inductor C++: ~12 s of a core on an empty compile cache), the
structured-output grammar backend (in the EngineCore's input thread), the sampler's top-k/top-p/min-p and penalty
paths, and each of them again at batch size 1 and at 2+ (compiled functions specialise on size 1). Left to the first
user request, that request waits seconds and the engine looks stuck to anyone who asks it between steps. So each
engine runs one request per feature, alone, then all of them at once, then a prompt longer than its step budget
(several steps of chunked prefill: the step time a long prompt really takes, for the progress watch to learn);
`WarmupReport` says what each phase cost. Cached compile results make later starts cheap
(`actors.engine.settings.compile_cache_env`).

Prompts are token ids from the model's vocabulary, drawn from a fixed seed and clear of its special tokens; every
request but the structured ones (whose grammar ends them) ignores EOS, so each runs its full length."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

# the JSON schema and regex of the structured-output requests (any grammar builds vLLM's backend; these are small)
WARMUP_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
                 "required": ["answer"]}
WARMUP_REGEX = r"[a-z]{1,6}( [a-z]{1,6}){0,3}"
PROMPT_TOKENS = 24  # the feature requests' prompt length
OUTPUT_TOKENS = 4  # and their output length


@dataclass
class WarmupReport:
    """Seconds per phase of one engine's warm-up, in order - each feature alone ("greedy", "logprobs", ...), all of
    them "together", the "long prompt" - and the long prompt's length."""

    phases: dict[str, float] = field(default_factory=dict)
    long_prompt_tokens: int = 0

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.phases.items())
        return f"{self.total_s:.1f} s ({parts})"


def feature_params(structured: bool = True) -> dict[str, Any]:
    """One vLLM SamplingParams per request feature that builds or compiles something on first use, by name."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    def params(**kw: Any) -> Any:
        return SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, **kw)

    out = {
        "greedy": params(temperature=0.0),
        "logprobs": params(temperature=0.0, logprobs=2, prompt_logprobs=2),
        "sampling": params(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7),
        "random": params(temperature=1.0),
        "penalties": params(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                            min_tokens=2, stop=["\n\n"], logit_bias={0: -1.0}),
        "n=2": params(temperature=0.9, n=2, logprobs=1),
    }
    if structured:
        out["json"] = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0,
                                     structured_outputs=StructuredOutputsParams(json=WARMUP_SCHEMA))
        out["regex"] = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0,
                                      structured_outputs=StructuredOutputsParams(regex=WARMUP_REGEX))
    return out


def ordinary_ids(vocab_size: int, special: set[int]) -> list[int]:
    """The token ids of the model's vocabulary that are not special (what warm-up prompts are drawn from)."""
    ordinary = [t for t in range(min(vocab_size, 1 << 20)) if t not in special]
    if not ordinary:
        raise ValueError("the model's vocabulary has no ordinary token to warm up with")
    return ordinary


def prompt_ids(n: int, ordinary: list[int], seed: int) -> list[int]:
    """`n` token ids drawn from `ordinary` with `seed`."""
    rng = random.Random(seed)
    return [rng.choice(ordinary) for _ in range(n)]


def long_prompt_len(max_num_batched_tokens: int, max_model_len: int) -> int:
    """A prompt past the engine's step budget (prefilled in several steps), within its context: 1.5 budgets, or the
    context less room for the output where that is shorter."""
    return max(1, min(max_num_batched_tokens * 3 // 2 + 1, max_model_len - OUTPUT_TOKENS - 1))


async def _run(engine: Any, prompt: list[int], params: Any, tag: str) -> None:
    async for _ in engine.generate({"prompt_token_ids": prompt}, params, request_id=f"warmup-{tag}-{uuid.uuid4().hex[:8]}"):
        pass


async def warm_up(engine: Any, *, structured: bool = True, phase: Callable[[str], None] = lambda _: None,
                  before_long_prompt: Callable[[], None] = lambda: None) -> WarmupReport:
    """Run the warm-up on a started vLLM `AsyncLLM`. `phase(name)` is told each phase as it begins (the actor's
    progress); `before_long_prompt()` runs when the compile-prone phases are done (the progress watch starts there,
    so that it learns a real long step rather than a compile)."""
    config = engine.vllm_config
    try:
        special = set(engine.get_tokenizer().all_special_ids)
    except Exception:  # noqa: BLE001 - no tokenizer (skip_tokenizer_init): any id will do
        special = set()
    ordinary = ordinary_ids(config.model_config.get_vocab_size(), special)
    features = feature_params(structured)
    report = WarmupReport()

    async def timed(name: str, runs: list[Any]) -> None:
        phase(name)
        t0 = time.monotonic()
        await asyncio.gather(*runs)
        report.phases[name] = time.monotonic() - t0

    # one at a time: each compiled function sees a batch of one first (a trace for size 1) ...
    for i, (name, params) in enumerate(features.items()):
        await timed(name, [_run(engine, prompt_ids(PROMPT_TOKENS, ordinary, seed=i), params, name)])
    # ... then all in one batch (the general trace); new prompts, so nothing comes from the prefix cache
    await timed("together", [_run(engine, prompt_ids(PROMPT_TOKENS, ordinary, seed=100 + i), params,
                                  f"{name}-batched") for i, (name, params) in enumerate(features.items())])
    before_long_prompt()
    n = long_prompt_len(config.scheduler_config.max_num_batched_tokens, config.model_config.max_model_len)
    report.long_prompt_tokens = n
    await timed("long prompt", [_run(engine, prompt_ids(n, ordinary, seed=999), features["greedy"], "long")])
    return report
