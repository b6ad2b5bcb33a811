"""An engine actor's prefix record (`EnginePrefixes`, owned by `EngineActor` as `prefixes`): what of a prompt this
engine can resume, answered to every front end's router (`EngineActor.resumable`) from the actor's memory - never
from vLLM's EngineCore, which answers only between steps - and checked against vLLM's own count on every prefill
(`cluster.core.prefix` says how and what it cannot see)."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from cluster.core.metrics import TransferTotals
from cluster.core.prefix import PrefixRecord, PrefixRoots, Resumable

log = logging.getLogger("pd.engine")
# a record holding more first blocks than this sends none (the routers then ask it about every prompt, as without
# the set): the set travels whole to every front end's router each time it changes
ROOTS_MAX = 50_000


class EnginePrefixes:
    """The record (None until the engine started, and for an engine without prefix caching: then nothing is ever
    resumable) and its check, counted into the engine's `TransferTotals`."""

    def __init__(self, totals: TransferTotals):
        self.totals = totals
        self.record: PrefixRecord | None = None

    def start(self, vllm_config: Any, total_blocks: int, groups: list[str]) -> None:
        """Size the record from the started engine: its block size, its block pool, and its cache groups' kinds
        ("attention" or "state", `actors.engine.report`): a cached block of tokens takes a block of each attention
        group, a state checkpoint one of each state group."""
        cache = vllm_config.cache_config
        if not cache.enable_prefix_caching:
            return
        states = sum(kind == "state" for kind in groups)
        self.record = PrefixRecord(cache.block_size, total_blocks, stateful=states > 0,
                                   attention_groups=len(groups) - states, state_groups=states)
        log.info("prefix record: block size %d, %d pool blocks, %d attention and %d state groups", cache.block_size,
                 total_blocks, len(groups) - states, states)

    def roots(self, known: tuple[int, int] | None = None) -> PrefixRoots | None:
        """The first-block hashes the record holds (`PrefixRoots`), or None when they are still those of version
        `known`. No record: block size 0 - nothing is ever resumable here."""
        r = self.record
        if r is None:
            return PrefixRoots((0, 0), 0, ())
        if known == r.version:
            return None
        return PrefixRoots(r.version, r.block_size, tuple(r.roots) if len(r.roots) <= ROOTS_MAX else None)

    def predict(self, tokens: Sequence[int]) -> Resumable:
        return self.record.resumable(tokens) if self.record is not None else Resumable()

    def prefilled(self, tokens: Sequence[int], predicted: int, reused: int, computed: int) -> None:
        """A prompt ran here: vLLM reused `reused` of its tokens (`num_cached_tokens`) where the record predicted
        `predicted`, and computed it up to `computed` (its attention blocks cached). vLLM's align mode keeps the
        state at the last block boundary before the prompt's end - strictly before: a 512-token prompt of 128-token
        blocks keeps it at 384, whether the prefill computed all 512 tokens or stopped one short."""
        self.totals.computed_prompt_tokens += max(0, len(tokens) - reused)
        if self.record is None:
            return
        self.totals.predicted_prompt_tokens += predicted
        if reused != predicted:
            self.totals.mispredicted += 1
            if reused < predicted:  # evicted (or the checkpoint was): the record held more than vLLM does
                self.record.forget(tokens, reused)
        block = self.record.block_size
        self.record.record(tokens, computed, checkpoints=(reused, (len(tokens) - 1) // block * block))

    def decoded(self, tokens: Sequence[int]) -> None:
        """A decode ended normally with `tokens` (prompt and output) computed or read here: their attention blocks
        are cached (a decode engine reads only what it lacks of them next time)."""
        if self.record is not None:
            self.record.record(tokens, len(tokens))
