"""Are a server's greedy tokens right? A teacher-forced check against vLLM's own server on the same weights.

`python -m cluster check-outputs --target URL --reference URL --model NAME --vocab N [--prompts N]
[--prompt-tokens N] [--max-tokens N] [--tolerance NATS]`:
each prompt runs greedy on the target (the cluster's endpoint; `return_token_ids` gives the tokens it chose), then the
reference (vLLM's OpenAI server on the same model directory) is fed prompt + output as token ids with
`prompt_logprobs` and says, position by position, how far each chosen token is below its own top choice. A right
server's tokens are the reference's top choice or within bfloat16 noise of it (measured at the Qwen3.5-0.8B shape:
up to 0.25 nats); a wrong token is typically 10-20 nats below. An output shorter than `--max-tokens` fails too (the
target is asked to ignore EOS). Tokens are compared, not text, so the check sees every position, and it needs
weights whose logits depend on the input (`build-model --config` draws them so: `real_model.informative_share`).

Exit status 0 when every chosen token is within `--tolerance` of the reference's top choice, 1 otherwise, 2 when a
server cannot be asked (named in the error)."""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from typing import Any

TOLERANCE = 1.0  # nats: bf16 noise measured up to 0.25, a wrong token typically 10+ below
TOP = 5  # prompt_logprobs asked of the reference: its top choices, the chosen token always included


@dataclass
class Checked:
    """One request: the chosen tokens and, for each, the reference's top log-probability minus the chosen token's;
    `wanted`: the output length asked for (None: any)."""

    prompt: list[int]
    output: list[int]
    gaps: list[float]
    wanted: int | None = None

    @property
    def short(self) -> bool:
        return self.wanted is not None and len(self.output) != self.wanted

    @property
    def worst(self) -> float:
        return max(self.gaps, default=0.0)

    def first_over(self, tolerance: float) -> int | None:
        """Index of the first output token more than `tolerance` below the reference's top choice (None: none)."""
        return next((i for i, g in enumerate(self.gaps) if g > tolerance), None)


def _extra(obj: Any, name: str) -> Any:
    """A vLLM-only field of an `openai` response object (kept as an extra attribute by the client)."""
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


def reference_gaps(client, model: str, prompt: list[int], output: list[int], top: int = TOP) -> list[float]:
    """For each token of `output`, teacher-forced after `prompt` on the reference server (an `openai.OpenAI` client
    to vLLM's server): its top log-probability minus the token's, >= 0 (0: the reference's own greedy choice)."""
    if not prompt:
        raise ValueError("an empty prompt has no position to teacher-force from")
    if not output:
        return []
    resp = client.completions.create(model=model, prompt=list(prompt) + list(output), max_tokens=1, temperature=0.0,
                                     extra_body={"prompt_logprobs": top})
    positions = _extra(resp.choices[0], "prompt_logprobs")
    if positions is None or len(positions) != len(prompt) + len(output):
        raise RuntimeError(f"the reference returned no prompt_logprobs for {len(prompt) + len(output)} tokens "
                           f"(got {None if positions is None else len(positions)}): is it vLLM's server?")
    gaps = []
    for token, entries in zip(output, positions[len(prompt):]):
        logprobs = {int(t): float(e["logprob"] if isinstance(e, dict) else e.logprob) for t, e in entries.items()}
        if token not in logprobs:
            raise RuntimeError(f"token {token} missing from the reference's prompt_logprobs")
        gaps.append(max(logprobs.values()) - logprobs[token])
    return gaps


def greedy_tokens(client, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The target's greedy output for a token prompt, as token ids (vLLM's `return_token_ids`)."""
    resp = client.completions.create(model=model, prompt=list(prompt), max_tokens=max_tokens, temperature=0.0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = _extra(resp.choices[0], "token_ids")
    if ids is None:
        raise RuntimeError("the target returned no token_ids (vLLM's return_token_ids): is it a vLLM front end?")
    return [int(t) for t in ids]


def random_prompts(count: int, tokens: int, vocab: int, seed: int = 0, first: int = 3) -> list[list[int]]:
    """`count` prompts of `tokens` token ids drawn from [first, vocab) (ids below `first`: the specials)."""
    rng = random.Random(seed)
    return [[rng.randrange(first, vocab) for _ in range(tokens)] for _ in range(count)]


def check(target, reference, model: str, prompts: list[list[int]], max_tokens: int,
          reference_model: str | None = None) -> list[Checked]:
    """Each prompt greedy on `target`, then teacher-forced on `reference` (both `openai.OpenAI` clients)."""
    out = []
    for prompt in prompts:
        try:
            output = greedy_tokens(target, model, prompt, max_tokens)
        except Exception as e:  # noqa: BLE001 - said with the role, then raised again
            raise CheckError("target", e) from e
        try:
            gaps = reference_gaps(reference, reference_model or model, prompt, output)
        except Exception as e:  # noqa: BLE001
            raise CheckError("reference", e) from e
        out.append(Checked(prompt, output, gaps, max_tokens))
    return out


class CheckError(RuntimeError):
    """A server could not be asked: which one (target or reference), its URL where known, and why."""

    def __init__(self, role: str, cause: Exception):
        url = getattr(getattr(cause, "request", None), "url", None)
        super().__init__(f"{role}{f' ({url})' if url else ''}: {type(cause).__name__}: {cause}")


def report(results: list[Checked], tolerance: float) -> str:
    lines = [f"{'prompt':>6} {'tokens':>6} {'output':>6} {'worst gap':>10}  verdict"]
    for i, r in enumerate(results):
        bad = r.first_over(tolerance)
        if r.short:
            verdict = f"{len(r.output)} tokens, {r.wanted} asked for"
        elif bad is not None:
            verdict = f"token {bad} ({r.output[bad]}) is {r.gaps[bad]:.2f} nats below the top"
        else:
            verdict = "ok"
        lines.append(f"{i:>6} {len(r.prompt):>6} {len(r.output):>6} {r.worst:>10.3f}  {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import openai

    parser = argparse.ArgumentParser(prog="python -m cluster check-outputs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="base URL of the server checked (e.g. http://127.0.0.1:8000)")
    parser.add_argument("--reference", required=True, help="base URL of vLLM's own server on the same model")
    parser.add_argument("--model", required=True, help="the model name the target serves")
    parser.add_argument("--reference-model", help="the model name the reference serves (default: --model)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--vocab", type=int, required=True,
                        help="the model's vocabulary size: prompt token ids are drawn below it (1024 for the local builds)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help=f"nats (default {TOLERANCE})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for field in ("prompts", "prompt_tokens", "max_tokens"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')} must be >= 1")
    if args.vocab <= 3:
        parser.error("--vocab must be > 3 (ids 0-2 are the specials)")
    target = openai.OpenAI(base_url=f"{args.target.rstrip('/')}/v1", api_key="EMPTY")
    reference = openai.OpenAI(base_url=f"{args.reference.rstrip('/')}/v1", api_key="EMPTY")
    prompts = random_prompts(args.prompts, args.prompt_tokens, args.vocab, args.seed)
    try:
        results = check(target, reference, args.model, prompts, args.max_tokens, args.reference_model)
    except CheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(results, args.tolerance))
    return 0 if all(r.first_over(args.tolerance) is None and not r.short for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
