"""Which pair takes a request, and the load one front end's router has put on each engine (`PairChoice`, owned by
`actors.frontend.router.Router` as `choice`; the router runs requests, this decides where).

routing.policy "cache": the prefill engine of least cost - its queue plus the prompt past the longest prefix it can
resume, attention blocks and a recurrent-state checkpoint (`cluster.core.prefix.choose_prefill`; each engine answers
`resumable` for itself, so every front end sees one picture) - then among the decode engines the coordinator
approved for it the least loaded (`choose_decode`). "load": the least-loaded engine of each pool, prefixes ignored.
The engines are asked only when one of them may hold the prompt's first block (`EngineRoots`: each engine's set of
first-block hashes, copied at most once per ROOTS_REFRESH_S, plus the prompts this router sent there since): a prompt
nobody can resume anything of is routed at once on the load this router counts, as by "load".
Conditional disaggregation - the decode engine prefilling a request itself, with no transfer - is decided here too:
when the prefill engine is backlogged (`local_prefill_queue`), the decode engine would reach the first token sooner
with its own prompts queued, at a fraction of the prefill engine's speed (`local_prefill_speed`,
`cluster.core.prefix.local_is_sooner`), the decode engine is idle (`local_prefill_when_idle`), or it resumes a longer
prefix than the prefill engine and computes less.

The load counters are this router's own view, kept by the router as requests start and end (`inflight`, `heading`,
`headed_decoding`, `pending_tokens`, `local_tokens`): what it routed and has not seen an engine report yet counts,
so requests routed in one burst spread instead of all taking the one hit."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from collections import Counter
from typing import Awaitable, Callable

from actors.clients.engine_client import UNRESPONSIVE_S, error_text
from cluster.core.prefix import (EngineView, PrefixRoots, choose_decode, choose_prefill, local_is_sooner, prefill_cost,
                                 root_hash)

log = logging.getLogger("pd.router")
POLICIES = ("cache", "load")
VIEW_TIMEOUT_S = 0.5  # an engine's `resumable` answer later than this: routed as if it held nothing
# an engine a request found stuck is avoided where another can take the request, this long (by then the coordinator
# has taken an engine that stays silent out: `actors.clients.engine_client.Silence`)
SUSPECT_S = UNRESPONSIVE_S
ROOTS_REFRESH_S = 1.0  # a router copies an engine's first-block hashes at most this often (only while it routes)
ROOTS_TIMEOUT_S = 5.0  # ... and goes on without them (asking that engine about every prompt) when it has not answered
ROOTS_STALE_S = 2 * ROOTS_REFRESH_S  # a copy older than this (the router was idle) is not trusted: engines are asked
# a prompt this router sent to an engine counts as held there until a copy asked after it has it (the engine records
# it once it has prefilled it, the copy has it a refresh later), or for this long
ROUTED_KEEP_S = 60.0
UNHASHED_MAX = 256  # ... of those sent before the engine's first copy (its block size unknown), the latest this many


class NoCapacity(RuntimeError):
    """No engine (or no approved pair) can take the request now."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """Where one request goes: its prefill and decode engine, the prompt tokens the prefill engine is expected to
    compute, whether the decode engine prefills it itself instead (`local`), and why the prefill engine was chosen
    (`cluster.core.prefix`'s reasons, "only", or "load")."""

    prefill: str
    decode: str
    uncached: int
    local: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class _Copy:
    """A router's copy of one engine's first-block hashes (`PrefixRoots`) and when the question it answered was
    asked."""

    version: tuple[int, int]
    block_size: int
    hashes: frozenset[int] | None
    asked_at: float


def _on_this_loop(future: asyncio.Future) -> bool:
    try:
        return future.get_loop() is asyncio.get_running_loop()
    except RuntimeError:  # no event loop running
        return False


class EngineRoots:
    """One router's copy of which prompts each engine may resume something of: its record's first-block hashes
    (`cluster.core.prefix.PrefixRoots`, asked with `ask(engine id, known version)` in the background at most once per
    ROOTS_REFRESH_S per engine while this router routes) plus the prompts this router sent there (`routed`, until a
    copy asked after them has them). A copy older than ROOTS_STALE_S is not trusted (the router was idle: it asks
    while the copy is refreshed), so a prefix another front end put on an engine is seen by every choice made
    ROOTS_STALE_S after it was recorded; the prompts this router sent are seen at once. Eviction makes the copy say
    too much, never too little: an evicted prefix is asked about until the next copy drops it. An engine not
    answered yet, whose answer failed, or whose set is too big to send may hold anything."""

    def __init__(self, ask: Callable[[str, tuple[int, int] | None], Awaitable[PrefixRoots | None]] | None):
        self._ask = ask
        self._known: dict[str, _Copy] = {}
        self._routed: dict[str, dict[int, float]] = {}  # id -> first-block hash -> when this router sent it there
        self._unhashed: dict[str, list[tuple[float, list[int]]]] = {}  # id -> (when, prompt) sent before its copy
        self._questions: dict[str, tuple[asyncio.Future, float]] = {}  # id -> the question under way, when asked
        self._asked_at: dict[str, float] = {}
        self.failures = 0  # questions that failed or timed out (that engine is asked about every prompt until one is)

    def may_hold(self, engine_id: str, prompt_token_ids: list[int], now: float | None = None) -> bool:
        """Whether `engine_id` may resume some of the prompt (and the copy is refreshed if due)."""
        now = time.monotonic() if now is None else now
        self._refresh(engine_id, now)
        copy = self._known.get(engine_id)
        if copy is None or copy.hashes is None or now - copy.asked_at > ROOTS_STALE_S:
            return True
        h = root_hash(prompt_token_ids, copy.block_size) if copy.block_size else None
        return h is not None and (h in copy.hashes or h in self._routed.get(engine_id, ()))

    def routed(self, engine_id: str, prompt_token_ids: list[int], now: float | None = None) -> None:
        """This router sent the prompt to `engine_id`, which holds its blocks once it has computed them (before the
        engine's first copy its block size is not known here: the prompt waits for it)."""
        now = time.monotonic() if now is None else now
        copy = self._known.get(engine_id)
        if copy is None:
            waiting = self._unhashed.setdefault(engine_id, [])
            if len(waiting) >= UNHASHED_MAX:
                del waiting[0]
            waiting.append((now, prompt_token_ids))
            return
        h = root_hash(prompt_token_ids, copy.block_size) if copy.block_size else None
        if h is not None:
            self._routed.setdefault(engine_id, {})[h] = now

    def left(self, listed: set[str]) -> None:
        """Engines no longer listed are forgotten (one listed again under the same id is a new engine)."""
        for engine_id in [e for e in {*self._known, *self._questions, *self._routed, *self._unhashed}
                          if e not in listed]:
            self._known.pop(engine_id, None)
            self._routed.pop(engine_id, None)
            self._unhashed.pop(engine_id, None)
            self._asked_at.pop(engine_id, None)
            entry = self._questions.pop(engine_id, None)
            if entry is not None and _on_this_loop(entry[0]):  # (another loop's is left alone: its answer is ignored)
                entry[0].cancel()

    def _refresh(self, engine_id: str, now: float) -> None:
        entry = self._questions.get(engine_id)
        if entry is not None:
            question, asked_at = entry
            if question.done():  # answered, its callback not run yet: taken now
                self._answered(engine_id, question, asked_at)
            elif _on_this_loop(question):
                return  # under way
            else:  # asked from an event loop that ended: asked again from this one
                del self._questions[engine_id]
                self._asked_at.pop(engine_id, None)
        if self._ask is None or now - self._asked_at.get(engine_id, now - ROOTS_REFRESH_S) < ROOTS_REFRESH_S:
            return
        self._asked_at[engine_id] = now
        waiting = self._unhashed.get(engine_id)
        if waiting:
            waiting[:] = [w for w in waiting if w[0] >= now - ROUTED_KEEP_S]
        copy = self._known.get(engine_id)
        question = asyncio.ensure_future(asyncio.wait_for(self._ask(engine_id, copy and copy.version),
                                                          ROOTS_TIMEOUT_S))
        self._questions[engine_id] = (question, now)
        question.add_done_callback(lambda f: self._answered(engine_id, f, now))

    def _answered(self, engine_id: str, question: asyncio.Future, asked_at: float) -> None:
        entry = self._questions.get(engine_id)
        if entry is None or entry[0] is not question:  # taken already, or forgotten (the engine left)
            if not question.cancelled():
                question.exception()  # (retrieved: nothing to keep)
            return
        del self._questions[engine_id]
        if question.cancelled():  # its event loop ended: asked again at the next choice, the copy kept
            self._asked_at.pop(engine_id, None)
            return
        if question.exception() is not None:
            self.failures += 1
            self._known.pop(engine_id, None)  # asked about every prompt until it answers
            log.debug("engine %s did not say which prefixes it holds: %s", engine_id, error_text(question.exception()))
            return
        answer, copy = question.result(), self._known.get(engine_id)
        if answer is not None:
            copy = _Copy(answer.version, answer.block_size,
                         None if answer.hashes is None else frozenset(answer.hashes), asked_at)
        elif copy is not None:  # unchanged since the copy
            copy = dataclasses.replace(copy, asked_at=asked_at)
        else:
            return
        self._known[engine_id] = copy
        for when, prompt in self._unhashed.pop(engine_id, ()):
            self.routed(engine_id, prompt, when)
        routed = self._routed.get(engine_id)
        if routed:  # in a copy asked after it was sent (the engine has recorded it), or sent long ago
            for h in [h for h, t in routed.items() if t < asked_at - ROUTED_KEEP_S
                      or (t <= asked_at and copy.hashes is not None and h in copy.hashes)]:
                del routed[h]


class PairChoice:
    def __init__(self, policy: str = "cache", local_prefill_queue: int | None = None,
                 local_prefill_when_idle: bool = False,
                 resumable: Callable[[str, list[int]], Awaitable[EngineView]] | None = None,
                 local_prefill_speed: float | None = None,
                 roots: Callable[[str, tuple[int, int] | None], Awaitable[PrefixRoots | None]] | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
        if local_prefill_queue is not None and local_prefill_queue < 0:
            raise ValueError(f"local_prefill_queue must be >= 0 or None, not {local_prefill_queue!r}")
        if local_prefill_speed is not None and not 0 < local_prefill_speed <= 1:
            raise ValueError(f"local_prefill_speed must be in (0, 1] or None, not {local_prefill_speed!r}")
        self.policy = policy
        self.local_prefill_queue = local_prefill_queue
        self.local_prefill_when_idle = local_prefill_when_idle
        self.local_prefill_speed = local_prefill_speed
        self._resumable = resumable  # (engine id, prompt) -> what that engine can resume of it
        # engine id -> this router's requests on it: prefills in flight on a prefill engine, decodes on a decode engine
        self.inflight: Counter[str] = Counter()
        # decode engine id -> this router's disaggregated requests bound for it, from their prefill's start to their end
        self.heading: Counter[str] = Counter()
        self.headed_decoding: Counter[str] = Counter()  # of those, the ones already decoding (also in inflight)
        self.pending_tokens: Counter[str] = Counter()  # prefill engine id -> this router's prompt tokens routed there
        # decode engine id -> prompt tokens of this router's requests it prefills itself, until their first output
        self.local_tokens: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()  # prefill engines chosen, by reason (`cluster.core.prefix`)
        self.suspects: dict[str, float] = {}  # engine id -> until when new requests avoid it (`suspect`)
        self.suspected = 0  # engines marked so
        self.view_failures = 0  # engines that did not answer `resumable` in time
        self.views, self.view_seconds = 0, 0.0  # choices that asked the engines, and the seconds they waited
        self.unasked = 0  # choices that did not ask: no engine may hold the prompt's first block (`roots`)
        self.roots = EngineRoots(roots)
        self._rr: collections.defaultdict[str, itertools.count] = collections.defaultdict(itertools.count)

    async def choose(self, prompt_token_ids: list[int], prefills: list[str], routes: dict[str, list[str]],
                     avoid: set[str], prefer_not: frozenset[str] | set[str] = frozenset(),
                     pair: tuple[str, str] | None = None) -> Choice:
        """The pair for one request among the ready, paired `prefills` (`routes`: the coordinator's approved decode
        engines per prefill engine), never an engine of `avoid`, another than `prefer_not` where one exists; `pair`
        pins it (it must be approved). The decision is counted. No await after the load checks: the caller counts
        the request on its engines (`heading`, `pending_tokens`) before anything else runs, so the next choice sees
        it. NoCapacity when no approved decode engine is left."""
        local_by_cache, reason = False, "load"
        uncached = len(prompt_token_ids)
        queued = 0  # prompt tokens ahead at the chosen prefill engine, by its own answer (cache policy)
        if pair is None and self.policy == "cache":
            p_id, d_id, uncached, local_by_cache, reason, queued = await self._by_cost(
                prompt_token_ids, prefills, prefer_not, routes, avoid)
        else:
            p_id = pair[0] if pair else self.pick([p for p in prefills if p not in prefer_not] or prefills, "prefill")
            decodes = [d for d in routes[p_id] if d not in avoid] if p_id in prefills else []
            if pair and pair[1] not in decodes:
                raise NoCapacity(f"pair {pair[0]} -> {pair[1]} is not approved by the coordinator")
            if not decodes:
                raise NoCapacity(f"no decode engine is approved for prefill engine {p_id}")
            d_id = pair[1] if pair else self.pick(decodes, "decode")
        backlogged = self.local_prefill_queue is not None and self.inflight[p_id] >= self.local_prefill_queue
        # the prefill engine's queue: every front end's prompts there where it was asked, else this router's own
        ahead = max(self.pending_tokens[p_id], queued)
        sooner = self.local_prefill_speed is not None and local_is_sooner(
            uncached, len(prompt_token_ids), ahead, self.local_tokens[d_id], self.local_prefill_speed)
        idle = self.local_prefill_when_idle and self.inflight[d_id] == 0 and self.heading[d_id] == 0
        local = pair is None and (backlogged or sooner or idle or local_by_cache)
        if pair is None:
            self.decisions["local" if local else reason] += 1
        if self.policy == "cache":
            # the prefill engine holds the prompt next unless the decode engine prefills it; the decode engine holds
            # it either way, which counts only where decode engines are asked (local_prefill_queue set)
            for engine_id in ([] if local else [p_id]) + ([d_id] if self.local_prefill_queue is not None else []):
                self.roots.routed(engine_id, prompt_token_ids)
        return Choice(p_id, d_id, uncached, local, reason)

    def pick(self, candidates: list[str], role: str) -> str:
        """The engine of `candidates` with the fewest of this router's requests (ties in turn)."""
        if not candidates:
            raise NoCapacity("no engine available")
        return min(self.rotated(candidates, role), key=lambda e: self.inflight[e])

    def suspect(self, engine_id: str, why: str, now: float | None = None) -> None:
        """A request found `engine_id` stuck (alive, not serving): new requests avoid it for SUSPECT_S where another
        engine can take them (the router leaves `wary()` out of its candidates, `Router._once`) - rather than each
        waiting out the stall time on it again - while the coordinator decides (it takes out an engine that fails, dies
        or stays silent; one that recovers is used again after)."""
        now = time.monotonic() if now is None else now
        if self.suspects.get(engine_id, 0.0) <= now:
            self.suspected += 1
            log.warning("engine %s is avoided for %g s where another can serve: %s", engine_id, SUSPECT_S, why)
        self.suspects[engine_id] = now + SUSPECT_S

    def trust(self, engine_id: str) -> None:
        """New requests may go to `engine_id` again (the coordinator, which had not answered, lists it again)."""
        self.suspects.pop(engine_id, None)

    def left(self, listed: set[str]) -> None:
        """The coordinator lists only `listed` now: a suspect that left, and what the engine held, are forgotten -
        pools reuse engine ids, and one listed again under that id is a new engine."""
        for engine_id in [e for e in self.suspects if e not in listed]:
            del self.suspects[engine_id]
        self.roots.left(listed)

    def wary(self, now: float | None = None) -> set[str]:
        """The engines new requests avoid now (`suspect`)."""
        now = time.monotonic() if now is None else now
        for engine_id in [e for e, until in self.suspects.items() if until <= now]:
            del self.suspects[engine_id]
        return set(self.suspects)

    def rotated(self, ids: list[str], role: str) -> list[str]:
        """`ids` from a round-robin start, one rotation per pool (shared, the prefill and decode choices of
        consecutive requests would fall in step: with two engines a pool would always start from the same one): ties
        between equal engines go to each in turn."""
        if not ids:
            return ids
        start = next(self._rr[role]) % len(ids)
        return ids[start:] + ids[:start]

    async def _by_cost(self, prompt_token_ids: list[int], prefills: list[str], prefer_not: frozenset[str] | set[str],
                       routes: dict[str, list[str]], avoid: set[str]) -> tuple[str, str, int, bool, str, int]:
        """routing.policy cache: the prefill engine of least cost (`choose_prefill`: its queue plus the prompt past
        the prefix it can resume), then among the decode engines approved for it the least loaded (`choose_decode`;
        with `local_prefill_queue` set they are asked too, and ties go to the one holding most of the prompt).
        Returns (prefill engine, decode engine, the prompt tokens the prefill engine is expected to compute, whether
        the decode engine should prefill it itself: conditional disaggregation is on and that engine resumes a
        longer prefix, computing less than the prefill engine's cost, why the prefill engine was chosen, and the
        prompt tokens queued there: its own answer for every front end where it was asked, at least this router's)."""
        candidates = self.rotated([p for p in prefills if p not in prefer_not] or prefills, "prefill")
        decodes = sorted({d for p in candidates for d in routes[p] if d not in avoid})
        local_rule = self.local_prefill_queue is not None
        asked = candidates + (decodes if local_rule else [])
        if len(candidates) == 1 and not local_rule:  # one prefill engine: nothing to ask
            views = {}
        elif not [e for e in asked if self.roots.may_hold(e, prompt_token_ids)]:  # (each copy refreshed when due)
            # nobody can resume any of it: routed on this router's load, at once
            views = {}
            self.unasked += 1
        else:
            # the decode engines are asked only where one may prefill the request itself: otherwise what they hold
            # saves bytes on the wire, not compute, and asking them - the busiest actors, streaming every request's
            # tokens - cost more in time to first token (bench prefix-routing: 9.4 ms per choice asking all four)
            t0 = time.monotonic()
            views = await self._views(prompt_token_ids, asked)
            self.view_seconds += time.monotonic() - t0
            self.views += 1
        n = len(prompt_token_ids)
        p_views = [dataclasses.replace(v, queued_tokens=max(v.queued_tokens, self.pending_tokens[p]))
                   for p, v in ((p, views.get(p, EngineView(p))) for p in candidates)]
        p_id, reason = choose_prefill(n, p_views)
        if len(candidates) == 1 and not local_rule:
            reason = "only"
        p_view = next(v for v in p_views if v.engine_id == p_id)
        approved = self.rotated([d for d in routes[p_id] if d not in avoid], "decode")
        if not approved:
            raise NoCapacity(f"no decode engine is approved for prefill engine {p_id}")
        d_known = {d: views.get(d, EngineView(d)) for d in approved}  # unasked: their load as this router sees it
        # this router's requests on each: decoding there (inflight, which includes those it prefilled itself) plus
        # those in prefill headed there (heading, less those of them already decoding: counted once)
        d_views = [dataclasses.replace(v, running=max(v.running, self.inflight[d]) + self.heading[d]
                                       - self.headed_decoding[d]) for d, v in d_known.items()]
        d_id = choose_decode(d_views)
        d_hit = d_known[d_id].resumable.checkpoint_tokens
        local = local_rule and d_hit > p_view.resumable.checkpoint_tokens and n - d_hit < prefill_cost(n, p_view)
        return p_id, d_id, n - p_view.resumable.checkpoint_tokens, local, reason, p_view.queued_tokens

    async def _views(self, prompt_token_ids: list[int], engine_ids: list[str]) -> dict[str, EngineView]:
        """Each engine's `resumable` answer; one that does not answer within VIEW_TIMEOUT_S (or has left) is seen as
        holding nothing, with this router's own load."""
        async def one(engine_id: str) -> EngineView:
            try:
                if self._resumable is None:
                    raise RuntimeError("no way to ask the engines")
                return await asyncio.wait_for(self._resumable(engine_id, prompt_token_ids), VIEW_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - slow, gone, or failing: routed on load; its requests tell
                self.view_failures += 1
                log.debug("engine %s did not say what it holds: %s", engine_id, error_text(e))
                return EngineView(engine_id)

        return dict(zip(engine_ids, await asyncio.gather(*(one(e) for e in engine_ids))))
