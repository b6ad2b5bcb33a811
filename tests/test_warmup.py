"""The warm-up's plan (`actors.engine.warmup`), on a stand-in vLLM engine that records what it is asked (the live
checks - that the warm-up leaves nothing to compile - are in tests/test_first_touch.py and test_busy_engines.py):
every feature alone, then all of them in one batch, then a prompt past the step budget; the progress watch started
before that long prompt; prompts clear of special tokens; each phase timed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from actors.engine.warmup import feature_params, long_prompt_len, ordinary_ids, prompt_ids, warm_up


class Engine:
    """A stand-in `AsyncLLM`: `generate` records each request and how many ran at once."""

    def __init__(self, vocab: int = 64, budget: int = 256, context: int = 2048):
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: vocab,
                                                                        max_model_len=context),
                                           scheduler_config=SimpleNamespace(max_num_batched_tokens=budget))
        self.requests: list[tuple[str, list[int], object, int]] = []  # (id, prompt, params, running with it)
        self.running = 0
        self.events: list[str] = []

    def get_tokenizer(self):
        return SimpleNamespace(all_special_ids=[0, 1, 2])

    async def generate(self, prompt, params, request_id):
        self.running += 1
        self.requests.append((request_id, prompt["prompt_token_ids"], params, self.running))
        self.events.append(request_id)
        await asyncio.sleep(0.01)
        self.running -= 1
        yield SimpleNamespace()


def test_every_feature_alone_then_together_then_a_long_prompt():
    engine = Engine()
    phases: list[str] = []
    report = asyncio.run(warm_up(engine, phase=phases.append,
                                 before_long_prompt=lambda: engine.events.append("watch started")))
    names = list(feature_params())
    assert {"greedy", "logprobs", "sampling", "penalties", "n=2", "json", "regex"} <= set(names)
    alone, together, long = engine.requests[:len(names)], engine.requests[len(names):-1], engine.requests[-1]
    assert [r[0].split("-")[1] for r in alone] == names and all(r[3] == 1 for r in alone)  # one at a time
    assert len(together) == len(names) and max(r[3] for r in together) == len(names)  # all in one batch
    assert engine.events[-2] == "watch started" and "long" in long[0]
    assert len(long[1]) == report.long_prompt_tokens == long_prompt_len(256, 2048) > 256
    assert all(t not in (0, 1, 2) for r in engine.requests for t in r[1])
    assert len({tuple(r[1]) for r in engine.requests}) == len(engine.requests)  # no prefix-cache shortcut
    assert list(report.phases) == [*names, "together", "long prompt"] and phases == list(report.phases)
    assert report.total_s == sum(report.phases.values()) and "long prompt" in str(report)


def test_feature_params_ask_for_what_compiles():
    p = feature_params()
    assert p["logprobs"].logprobs and p["logprobs"].prompt_logprobs
    assert p["sampling"].top_k and p["sampling"].top_p < 1 and p["sampling"].min_p and p["sampling"].seed is not None
    assert p["penalties"].repetition_penalty != 1 and p["penalties"].stop and p["n=2"].n == 2
    assert p["json"].structured_outputs.json and p["regex"].structured_outputs.regex
    assert "json" not in feature_params(structured=False)


def test_prompts_and_lengths():
    ordinary = ordinary_ids(10, {0, 9})
    assert ordinary == list(range(1, 9))
    assert prompt_ids(50, ordinary, seed=3) == prompt_ids(50, ordinary, seed=3) != prompt_ids(50, ordinary, seed=4)
    assert long_prompt_len(256, 2048) == 385 and long_prompt_len(8192, 2048) == 2048 - 4 - 1
