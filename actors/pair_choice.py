"""Which pair takes a request, and the load one front end's router has put on each engine (`PairChoice`, owned by
`actors.router.Router` as `choice`; the router runs requests, this decides where).

routing.policy "cache": the prefill engine of least cost - its queue plus the prompt past the longest prefix it can
resume, attention blocks and a recurrent-state checkpoint (`cluster.core.prefix.choose_prefill`; each engine answers
`resumable` for itself, so every front end sees one picture) - then among the decode engines the coordinator
approved for it the least loaded (`choose_decode`). "load": the least-loaded engine of each pool, prefixes ignored.
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

from actors.engine_client import UNRESPONSIVE_S, error_text
from cluster.core.prefix import EngineView, choose_decode, choose_prefill, local_is_sooner, prefill_cost

log = logging.getLogger("pd.router")
POLICIES = ("cache", "load")
VIEW_TIMEOUT_S = 0.5  # an engine's `resumable` answer later than this: routed as if it held nothing
# an engine a request found stuck is avoided where another can take the request, this long (by then the coordinator
# has taken an engine that stays silent out: `actors.engine_client.Silence`)
SUSPECT_S = UNRESPONSIVE_S


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


class PairChoice:
    def __init__(self, policy: str = "cache", local_prefill_queue: int | None = None,
                 local_prefill_when_idle: bool = False,
                 resumable: Callable[[str, list[int]], Awaitable[EngineView]] | None = None,
                 local_prefill_speed: float | None = None):
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
        return Choice(p_id, d_id, uncached, local, reason)

    def pick(self, candidates: list[str], role: str) -> str:
        """The engine of `candidates` with the fewest of this router's requests (ties in turn)."""
        if not candidates:
            raise NoCapacity("no engine available")
        return min(self.rotated(candidates, role), key=lambda e: self.inflight[e])

    def suspect(self, engine_id: str, why: str, now: float | None = None) -> None:
        """A request found `engine_id` stuck (alive, not serving): new requests avoid it for SUSPECT_S where another
        engine can take them (the router leaves `wary()` out of its candidates, `Router._once`) - rather than each waiting out the stall time on it again - while the coordinator
        decides (it takes out an engine that fails, dies or stays silent; one that recovers is used again after)."""
        now = time.monotonic() if now is None else now
        if self.suspects.get(engine_id, 0.0) <= now:
            self.suspected += 1
            log.warning("engine %s is avoided for %g s where another can serve: %s", engine_id, SUSPECT_S, why)
        self.suspects[engine_id] = now + SUSPECT_S

    def trust(self, engine_id: str) -> None:
        """New requests may go to `engine_id` again (the coordinator, which had not answered, lists it again)."""
        self.suspects.pop(engine_id, None)

    def left(self, listed: set[str]) -> None:
        """The coordinator lists only `listed` now: a suspect that left is forgotten - pools reuse engine ids, and one
        listed again under that id is a new engine."""
        for engine_id in [e for e in self.suspects if e not in listed]:
            del self.suspects[engine_id]

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
        if len(candidates) == 1 and not local_rule:  # one prefill engine: nothing to ask
            views = {candidates[0]: EngineView(candidates[0])}
        else:
            # the decode engines are asked only where one may prefill the request itself: otherwise what they hold
            # saves bytes on the wire, not compute, and asking them - the busiest actors, streaming every request's
            # tokens - cost more in time to first token (bench prefix-routing: 9.4 ms per choice asking all four)
            t0 = time.monotonic()
            views = await self._views(prompt_token_ids, candidates + (decodes if local_rule else []))
            self.view_seconds += time.monotonic() - t0
            self.views += 1
        n = len(prompt_token_ids)
        p_views = [dataclasses.replace(views[p], queued_tokens=max(views[p].queued_tokens, self.pending_tokens[p]))
                   for p in candidates]
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
