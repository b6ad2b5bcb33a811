"""The rules of continuing a request elsewhere: which requests may fail over mid-stream (`continuation_refused`),
which may take their first token from the prefill engine (`first_token_refused`, the same question: the decode engine
then continues from prompt + that token), and the parameters of a continuation (`continuation_params`). The router
(`actors.frontend.router`) applies them; they are pure functions of vLLM's SamplingParams."""

from __future__ import annotations

from typing import Any

FAILOVERS = 2  # a streaming request continues on another pair at most this often


def continuation_refused(params: Any) -> str | None:
    """Why a request that already streamed tokens cannot continue on another pair (None: it can). Continuing
    prefills the prompt plus the tokens sent and decodes on: exact for greedy sampling; a seeded request continues
    from `seed + tokens sent` (deterministic, but not the tokens the first engine would have drawn); unseeded sampling
    keeps its distribution. Refused where the continuation would be another request: presence/frequency penalties
    (they count only generated tokens, and the sent ones become prompt), structured output (its grammar state would
    restart), stop strings (the engine holds back the text that may begin one: it died with the engine), and outputs
    that are not deltas."""
    if not is_delta(params):
        return "its outputs are not deltas"
    if params.presence_penalty or params.frequency_penalty:
        return "presence/frequency penalties would count the tokens already sent as prompt"
    if getattr(params, "structured_outputs", None) is not None:
        return "structured output would restart its grammar"
    if params.stop:
        return "stop strings: the engine holds back text that might start one, and that text died with it"
    return None


def first_token_refused(params: Any) -> str | None:
    """Why the prefill engine cannot sample a request's first token (None: it can). The decode engine continues
    from prompt + that token with `continuation_params`, so what a continuation refuses is refused here too
    (`continuation_refused`); beyond that, a seeded random request (its generator would restart on the decode engine,
    and vLLM's own server draws every token from one) and bad words (a banned sequence could start in the first
    token, which the decode engine sees as prompt)."""
    why = continuation_refused(params)
    if why is not None:
        return why
    from vllm.sampling_params import SamplingType

    if params.sampling_type == SamplingType.RANDOM_SEED:
        return "seeded sampling draws every token from one generator"
    if params.bad_words:
        return "bad words could span the first token"
    return None


def continuation_params(params: Any, sent: int) -> Any:
    """The sampling parameters of a request's continuation after `sent` tokens (see `continuation_refused`)."""
    p = params.clone()
    p.max_tokens = max(1, params.max_tokens - sent) if params.max_tokens is not None else None
    p.min_tokens = max(0, (params.min_tokens or 0) - sent)
    if params.seed is not None:
        p.seed = params.seed + sent
    p.prompt_logprobs = None  # the first output already carried them
    p.truncate_prompt_tokens = None
    return p


def is_delta(params: Any) -> bool:
    from vllm.sampling_params import RequestOutputKind

    return params.output_kind == RequestOutputKind.DELTA
