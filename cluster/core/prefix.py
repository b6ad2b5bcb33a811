"""Cache-aware routing, the pure part: what an engine can resume a prompt from (`PrefixRecord`) and the choice of a
prefill engine by cost (`choose_prefill`) and of a decode engine (`choose_decode`).

The hybrid rule. vLLM's prefix caching keeps a GDN/Mamba layer's recurrent state only at some block boundaries
(mamba_cache_mode "align": at the last block boundary before a prefill's prompt ends - the scheduler cuts the
prefill there to keep it), while attention blocks are kept for every full block. A prompt can be resumed from position k
only when every attention block before k is cached *and* a state checkpoint sits at k: attention blocks past the last
checkpoint are worth nothing to a prefill (they are recomputed with the state). A decode engine needs no checkpoint
(it reads the state from the prefill engine, and only the attention blocks it lacks), so for it every shared leading
block counts. vLLM never resumes a whole prompt: at least its last token is computed.

Where the record comes from. Each engine keeps its own record (`EngineActor`, `actors/engine/prefix.py`) of the
blocks it computed, so that every front end asks the engines and sees one picture; the record is an estimate of
vLLM's cache, and every prefill checks it: the engine compares what the record predicted with what vLLM reports it
reused (`num_cached_tokens`) and counts each difference (`mispredicted`). What it cannot see is eviction before it
happens: the record drops its least recently used blocks beyond the engine's block capacity (vLLM evicts
least-recently-freed blocks, tail blocks of a prompt first; the record does the same), and a prediction that turns
out too long costs that one request its hit, then the record is rewritten from what the engine computed. An engine
that restarts starts with an empty cache and an empty record; one that leaves takes its record with it.

Hashes are Python's hash of (previous hash, tuple of the block's token ids): ints and tuples of ints hash alike in
every process (no PYTHONHASHSEED), so a front end and an engine agree without exchanging a seed.

Asking costs a round trip to every engine per request, so the routers ask only when an engine may hold something of
the prompt: a prefix is resumable only from its first block, and each record keeps the set of first-block hashes it
holds (`roots`, versioned), which the routers copy (`actors.frontend.pair_choice`). A prompt whose first block no engine
holds - a new conversation, a prompt that shares nothing - is routed on load without a question.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from typing import Iterable, Sequence

ROOT = 0x5044  # the hash before the first block


def root_hash(tokens: Sequence[int], block_size: int) -> int | None:
    """The hash of the first block of `tokens` (`block_hashes`' first), None when no block of them can be resumed: a
    prompt of `block_size` tokens or fewer (vLLM computes at least the last token)."""
    return block_hashes(tokens, block_size, 1)[0] if len(tokens) - 1 >= block_size else None


def block_hashes(tokens: Sequence[int], block_size: int, blocks: int | None = None) -> list[int]:
    """The chained hash of each full block of `tokens` (the first `blocks` of them when given)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, not {block_size}")
    n = len(tokens) // block_size if blocks is None else min(blocks, len(tokens) // block_size)
    out, h = [], ROOT
    for i in range(n):
        h = hash((h, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


@dataclasses.dataclass(frozen=True)
class Resumable:
    """What an engine holds of one prompt: `checkpoint_tokens` - the longest prefix a prefill can resume from (the
    hybrid rule; equal to the attention prefix for models without recurrent state), `attention_tokens` - the leading
    tokens whose attention blocks it holds (what a decode engine need not read)."""

    checkpoint_tokens: int = 0
    attention_tokens: int = 0


class PrefixRecord:
    """One engine's record of the blocks in its prefix cache: block hash -> whether a state checkpoint sits at that
    block's end, least recently used first. `capacity`: the engine's block pool (blocks of every cache group);
    a cached block of tokens takes one block in each of the `attention_groups`, a checkpoint one in each of the
    `state_groups` (vLLM's align mode keeps no state block between checkpoints). `stateful`: the model has
    recurrent state (the hybrid rule applies); otherwise every block end is a checkpoint."""

    def __init__(self, block_size: int, capacity: int, stateful: bool = True, attention_groups: int = 1,
                 state_groups: int = 0):
        if block_size < 1 or capacity < 0:
            raise ValueError(f"block_size must be >= 1 and capacity >= 0, not {block_size}, {capacity}")
        self.block_size, self.capacity, self.stateful = block_size, capacity, stateful
        self.attention_groups, self.state_groups = max(1, attention_groups), state_groups
        self._blocks: collections.OrderedDict[int, bool] = collections.OrderedDict()
        self.used = 0  # pool blocks the recorded blocks and checkpoints take
        self.evicted = 0  # blocks the record dropped for capacity
        self.roots: set[int] = set()  # the hashes of the prompts' first blocks held (a subset of the blocks')
        # changes with `roots`; its first part tells this record from another engine's under the same id (a restart)
        self.version = (random.SystemRandom().getrandbits(62), 0)

    def __len__(self) -> int:
        return len(self._blocks)

    def resumable(self, tokens: Sequence[int], hashes: Sequence[int] | None = None) -> Resumable:
        """What this engine can resume of `tokens` (`hashes`: their `block_hashes`, when already computed)."""
        usable = max(0, len(tokens) - 1) // self.block_size  # vLLM computes at least the last token
        hashes = block_hashes(tokens, self.block_size, usable) if hashes is None else hashes[:usable]
        attention = checkpoint = 0
        for i, h in enumerate(hashes):
            mark = self._blocks.get(h)
            if mark is None:
                break
            attention = i + 1
            if mark or not self.stateful:
                checkpoint = i + 1
        return Resumable(checkpoint * self.block_size, attention * self.block_size)

    def record(self, tokens: Sequence[int], computed: int, checkpoints: Iterable[int] = ()) -> None:
        """The engine holds the full blocks of `tokens[:computed]` now, with state checkpoints at the token positions
        `checkpoints` (block boundaries; others are ignored). Most recently used: the prompt's first block, so that
        capacity evicts a prompt's tail before its head, as vLLM does."""
        n = min(computed, len(tokens)) // self.block_size
        if n == 0:
            return
        marks = {c // self.block_size for c in checkpoints if c % self.block_size == 0 and 0 < c <= n * self.block_size}
        hashes = block_hashes(tokens, self.block_size, n)
        for i in range(n - 1, -1, -1):
            h = hashes[i]
            had = self._blocks.pop(h, None)
            mark = bool(had) or (i + 1) in marks
            self.used += (self.attention_groups if had is None else 0) + (self.state_groups if mark and not had else 0)
            self._blocks[h] = mark
        if hashes[0] not in self.roots:
            self.roots.add(hashes[0])
            self._changed()
        while self.used > self.capacity and self._blocks:
            self._drop(*self._blocks.popitem(last=False))
            self.evicted += 1

    def _drop(self, h: int, mark: bool) -> None:
        self.used -= self.attention_groups + (self.state_groups if mark else 0)
        if h in self.roots:
            self.roots.discard(h)
            self._changed()

    def _changed(self) -> None:
        self.version = (self.version[0], self.version[1] + 1)

    def forget(self, tokens: Sequence[int], after: int) -> None:
        """vLLM reused less of `tokens` than the record said: drop the blocks past `after` tokens (evicted, or the
        checkpoint there was)."""
        for h in block_hashes(tokens, self.block_size)[after // self.block_size:]:
            if h in self._blocks:
                self._drop(h, self._blocks.pop(h))


@dataclasses.dataclass(frozen=True)
class PrefixRoots:
    """An engine's answer to which prompts it may hold something of (`PrefixRecord.roots`): its record's `version`,
    `block_size` (0: it caches no prefixes) and the first-block hashes held - None when there are too many to send
    (then it may hold any prompt)."""

    version: tuple[int, int]
    block_size: int
    hashes: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True)
class EngineView:
    """One engine as the router sees it for one prompt: what it can resume of it (`Resumable`) and its load -
    `queued_tokens`: prompt tokens it is computing or about to (every front end's prefills past their hits), and
    `running`: requests it is decoding."""

    engine_id: str
    resumable: Resumable = Resumable()
    queued_tokens: int = 0
    running: int = 0


def prefill_cost(prompt_tokens: int, view: EngineView) -> int:
    """A prefill engine's cost for a prompt, in prompt tokens computed before this prompt's first token: its queue,
    then the prompt past the prefix it can resume."""
    return view.queued_tokens + max(0, prompt_tokens - view.resumable.checkpoint_tokens)


def choose_prefill(prompt_tokens: int, views: Sequence[EngineView]) -> tuple[str, str]:
    """The prefill engine of least cost (`prefill_cost`; ties: the shorter queue, then the order given - callers
    rotate it) and why: "hit" (it resumes part of the prompt and no engine is cheaper), "spread" (another engine
    holds a longer prefix but is loaded enough that computing the prompt here is cheaper), or "load" (nobody holds
    any of it)."""
    if not views:
        raise ValueError("no prefill engine to choose from")
    best = min(views, key=lambda v: (prefill_cost(prompt_tokens, v), v.queued_tokens))
    longest = max(v.resumable.checkpoint_tokens for v in views)
    if longest == 0:
        return best.engine_id, "load"
    if best.resumable.checkpoint_tokens == longest:
        return best.engine_id, "hit"
    return best.engine_id, "spread"


def choose_decode(views: Sequence[EngineView]) -> str:
    """The decode engine with the fewest requests running (a decode slot sets every one of its requests' inter-token
    latency), then the one holding most of the prompt's attention blocks (fewer bytes to read), then the order
    given."""
    if not views:
        raise ValueError("no decode engine to choose from")
    return min(views, key=lambda v: (v.running, -v.resumable.attention_tokens)).engine_id


def local_is_sooner(prefill_tokens: int, local_tokens: int, prefill_queued: int, local_queued: int,
                    speed: float) -> bool:
    """Whether a decode engine prefilling a prompt itself reaches its first token before the prefill engine would.
    The prefill engine would compute `prefill_tokens` of it after the `prefill_queued` prompt tokens waiting there;
    the decode engine `local_tokens` after the `local_queued` of the prompts it is prefilling itself, at `speed`
    (0 < speed <= 1) times the prefill engine's rate - in chunks that share its steps with the running decodes. With
    nothing queued at the prefill engine it never is; under a backlog the decode engine takes the share of the prompts
    it finishes sooner, and no more."""
    if not 0 < speed <= 1:
        raise ValueError(f"speed must be in (0, 1], not {speed!r}")
    return (local_queued + local_tokens) / speed < prefill_queued + prefill_tokens
