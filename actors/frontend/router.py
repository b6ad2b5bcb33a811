"""Request orchestration: one request through one approved prefill/decode pair.

  1. a prefill engine runs the prompt with `max_tokens=1` and remote decode requested. When the request allows it
     (`first_token_refused`: streamed, greedy or unseeded, no stop strings, penalties on generated tokens, bad words
     or structured output) the prefill engine prefills the whole prompt and samples the first token with the
     request's own parameters; that token goes to the client at once, and the decode engine gets the prompt plus
     it, loads the state of the prompt and recomputes only that token. Otherwise vLLM's default for hybrid models:
     the prefill side stops one token short (the recurrent state cannot be rewound) and the decode side recomputes
     the last prompt token and samples the first token. The prefill's answer comes back on the front end's channel
     from that engine (`submit_prefill`; see 3.), not as a Ray call's return;
  2. its transfer parameters (block ids per cache group, engine id, token count) go to a decode engine that the
     coordinator has approved for that prefill engine; the decode engine's connector pulls the state with NIXL using
     the negotiated pair plan and decodes;
  3. tokens stream back over one channel per (front end, engine) - `actors.engine.decode_channel` - each of whose
     messages carries every output the engine produced for that front end since the last one (typically one engine step
     for all its requests). When both run on one node the messages go over a ZeroMQ socket on a Unix path private to
     the front end (no Ray object per step); the Ray stream of the same channel stays open as its lifeline - it
     breaks when the engine dies - and carries the messages themselves across nodes. A failure
     on either side frees the request's blocks on both sides at once (the prefill side's blocks would otherwise wait
     for vLLM's abort timeout); a request that had not streamed a token yet is retried
     once on a pair without the failed engine, otherwise it ends with a clear error. A dead engine is reported to the
     coordinator, which takes it out of every pair. An engine leaving its pool (scale-down) refuses new requests
     while it drains, and one that has left has no client any more: both are failures before the first token, so a
     request that raced the departure is retried on another pair.
  Degraded mode: while no pair is ready - the decode pool is empty, or the prefill pool is - one engine of the other
  pool runs each request whole (a prefill engine decodes, a decode engine prefills), with the same outputs.
  The routes (which pairs may serve) come from the coordinator; the front end's router keeps them current with a
  watch (`watch_routes`: one question held at the coordinator, answered on each change) instead of asking per request.
  While the coordinator is unreachable (it died and Ray is restarting it) the router keeps serving on the routes the
  coordinator last gave it, with the engine clients it holds: those pairs' plans are installed in their engines.

Kept in one module past the usual size: `Router` is one thing, the request path's state - routes, engine clients,
channels, load counters, suspects - which every step of a request reads; its parts that stand alone are modules of
their own (`request`, `pair_choice`, `failover`, `actors.engine.decode_channel`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections import Counter
from typing import Any, AsyncIterator, Awaitable

from actors.clients.coordinator_client import CoordinatorClient
from actors.engine.decode_channel import STALL_S, DecodeChannel, DecodeError, EngineStuck, probe_timeout_s
from actors.clients.engine_client import EngineClient, Prefilled, error_text
from actors.frontend.failover import FAILOVERS, continuation_refused, first_token_refused, is_delta
from actors.frontend.pair_choice import POLICIES, NoCapacity, PairChoice
from actors.frontend.request import Attempt, Request
from cluster.core.verify import TRANSFER_VERIFY_FAILED

log = logging.getLogger("pd.router")
COORDINATOR_TIMEOUT_S = 10.0
# while a coordinator's answer is late by this much, its last routes serve (it is restarting, or wedged): an unread
# answer costs every request this long; a wrong stale route costs a retry on another pair
ROUTES_FALLBACK_AFTER_S = 1.0
ROUTES_STALE_S = 300.0  # ... for at most this long after the last answer; then requests get 503
PREFILL_TIMEOUT_S = 600.0  # a prefill that has not answered by then is treated as a failed engine
FAILOVER_WAIT_S = 90.0  # a stream failing over that finds no engine waits this long for one (routing.failover_wait_s)
CAPACITY_POLL_S = 0.5
# the routes watch (`Router._watch_routes`): the coordinator holds each question up to this long for a change, and a
# watch question whose answer is this much later than that (ROUTES_FALLBACK_AFTER_S) no longer vouches for the routes
WATCH_WAIT_S = 2.0
WATCH_GAP_S = 0.05  # at least this between two questions of one watch


async def _awaitable(ref: Any) -> Any:
    return await ref


async def _answer(inbox: Any) -> Prefilled:
    """A prefill's answer from its channel inbox (`submit_prefill`): the engine's Prefilled, or its failure raised -
    the channel's error when it broke (the engine died, left or was found stuck), the prefill's own as a
    RuntimeError."""
    out = await inbox.get()
    if isinstance(out, BaseException):
        raise out
    if isinstance(out, DecodeError):
        raise RuntimeError(f"{out.kind}: {out.message}")
    return out


def _ours(question: asyncio.Future | None) -> bool:
    """A shared coordinator question (`Router._listed`, `Router._answered_meanwhile`) this event loop can use: one
    asked from it and not cancelled - a question left by a loop that ended is never waited on from another."""
    return question is not None and question.get_loop() is asyncio.get_running_loop() and not question.cancelled()


def _ask_again(question: asyncio.Future | None, asked_at: float) -> bool:
    """Whether a shared question is asked anew: none usable here, or its answer is CAPACITY_POLL_S old."""
    return not _ours(question) or (question.done() and time.monotonic() - asked_at >= CAPACITY_POLL_S)


class CoordinatorUnavailable(NoCapacity):
    """The coordinator did not answer (restarting, overloaded or gone)."""


class EngineFailure(RuntimeError):
    """An engine failed while serving the request; `phase` is 'prefill', 'decode', 'transfer' (the decode engine
    could not read the state: `engine_id` is then the prefill engine) or 'verify' (what it read differs from the
    prefill side's bytes, transfer.verify: `engine_id` is the prefill engine; no engine is at fault as far as anyone
    knows, so the retry prefers another pair but may take the same). `streamed`: tokens had already reached the
    caller (then the request cannot be retried transparently). `stuck`: the engine is alive but did not serve
    (`EngineStuck`): new requests avoid it for a while (`PairChoice.suspect`). `unknown`: nothing failed - this
    front end has no client for the engine and the coordinator does not answer."""

    def __init__(self, phase: str, engine_id: str, cause: BaseException | str, streamed: bool = False):
        text = str(cause) if isinstance(cause, EngineStuck) else error_text(cause) if isinstance(cause, BaseException) else cause
        super().__init__(f"{phase} failed on engine {engine_id}: {text}")
        self.phase, self.engine_id, self.streamed = phase, engine_id, streamed
        self.engine_died = isinstance(cause, BaseException) and _is_actor_death(cause)
        self.stuck = isinstance(cause, EngineStuck)
        self.unknown = False  # no client for the engine, and the coordinator did not answer (`Router.engine`)


def _is_actor_death(e: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError))


TRANSPORTS = ("auto", "ray")
__all__ = ["CoordinatorUnavailable", "EngineFailure", "NoCapacity", "POLICIES", "Router"]


class Router:
    """Runs each request on the pair `choice` (`actors.frontend.pair_choice.PairChoice`) picks: with `policy` "cache" by
    cost (the prompt tokens each prefill engine would compute past the prefix it can resume, plus its queue; then the
    least-loaded decode engine approved for it), with "load" the least-loaded of each; retries, failover and
    degraded mode here.

    `decode_transport`: "auto" - decode outputs over a local ZeroMQ socket from engines on this node, over the Ray
    stream from the others; "ray" - always over the Ray stream. `first_token_from_prefill`: the prefill engine
    samples the first token of the requests that allow it (see the module's docstring), which reaches the client
    without waiting for the transfer and a decode step. `local_prefill_queue` (None: off): when the least-loaded
    prefill engine already has that many of this router's prompts in prefill, the request goes whole to the decode
    engine picked for it (conditional disaggregation; `local_prefill` counts them). `local_prefill_speed` (None: off):
    so does a request whose first token that decode engine, prefilling at this fraction of the prefill engine's
    speed after the prompts it already prefills itself, reaches sooner than the prefill engine after its queue (this
    router's prompts on each). `local_prefill_when_idle`: so
    does a request whose decode engine has none of this router's requests in flight and none in prefill headed for it
    - there is no decode stream for its prefill to stall, and the decode engine (at the decode TP) answers it with no
    transfer; `local_prefill` counts these too."""

    def __init__(self, coordinator: Any, decode_transport: str = "auto", first_token_from_prefill: bool = True,
                 local_prefill_queue: int | None = None, local_prefill_when_idle: bool = False,
                 policy: str = "cache", stall_s: float = STALL_S, failover_wait_s: float = FAILOVER_WAIT_S,
                 local_prefill_speed: float | None = None, watch_routes: bool = False,
                 prefill_over_channel: bool = True):
        if stall_s <= 0:
            raise ValueError(f"stall_s must be > 0, not {stall_s!r}")
        if failover_wait_s < 0:
            raise ValueError(f"failover_wait_s must be >= 0, not {failover_wait_s!r}")
        if decode_transport not in TRANSPORTS:
            raise ValueError(f"decode_transport must be one of {TRANSPORTS}, not {decode_transport!r}")
        self.coordinator = CoordinatorClient.of(coordinator)
        self.choice = PairChoice(policy, local_prefill_queue, local_prefill_when_idle, self._resumable,
                                 local_prefill_speed, self._prefix_roots)
        self.stall_s = stall_s
        self.failover_wait_s = failover_wait_s
        self.waited_for_capacity = 0  # streams failing over that found no engine and waited for one to join
        self._listing: asyncio.Future | None = None  # the coordinator's engine lists, one poll shared by waiting streams
        self._listing_at = 0.0
        self.decode_transport = decode_transport
        self.first_token_from_prefill = first_token_from_prefill
        self._engines: dict[str, EngineClient] = {}
        self._cleanup: set[asyncio.Task] = set()
        # decode engine id -> this front end's output stream from it (bound to the event loop that opened it)
        self._channels: dict[str, DecodeChannel] = {}
        self._unreachable: set[str] = set()  # engines that could not reach this front end's local socket
        self._reporting: set[str] = set()  # engines whose failure report to the coordinator is under way
        self.retried = 0  # requests retried on another pair after an engine failure
        self.failed_over = 0  # streams continued on another pair after their engine failed mid-stream
        self.first_from_prefill = 0  # requests whose first token the prefill engine sampled
        self.local_prefill = 0  # requests their decode engine prefilled itself: a backlogged prefill engine or an idle decode engine
        # degraded mode: requests served whole by one engine while no pair is ready, by the serving engine's role;
        # the role serving that way now (None: pairs are serving)
        self.colocated: Counter[str] = Counter()
        self.degraded: str | None = None
        self.prefill_timeout_s = PREFILL_TIMEOUT_S
        self._routes: tuple[float, dict[str, list[str]]] | None = None  # (when, the coordinator's last routes)
        self.watch_routes = watch_routes
        self.prefill_over_channel = prefill_over_channel
        self._watch: asyncio.Task | None = None  # the routes watch, on the event loop that started it
        self._watch_asked_at = 0.0  # when the watch's question under way was asked
        self.watch_answers = 0  # routes the watch received (each a change, or the routes as they were after a wait)
        self.coordinator_unreachable = False  # the last routes question went unanswered
        self._routes_question: asyncio.Future | None = None  # while unreachable: the routes question under way
        self._routes_asked_at = 0.0
        self._outage_suspects: set[str] = set()  # engines avoided for failing while the coordinator did not answer
        self.stale_routed = 0  # requests routed on the coordinator's last routes while it did not answer

    async def routes(self) -> dict[str, list[str]]:
        """Ready prefill engine -> approved ready decode engines, from the coordinator; while it does not answer
        within ROUTES_FALLBACK_AFTER_S (dead and restarting, or wedged), the last routes it gave, for up to
        ROUTES_STALE_S after they were given - at once from then on: the coordinator is asked again in the background
        (`_answered_meanwhile`), and its first answer ends the fallback. The first answer is waited for as long as any
        coordinator call.

        With `watch_routes` no request asks while the routes watch vouches for the routes it holds (`_watched`): the
        watch keeps one question at the coordinator, answered when the routes change (`routes_after`), so a request
        routes on routes as fresh as one it asked itself, without the Ray round trip on its way to the first token."""
        watched = self._watched()
        if watched is not None:
            return watched
        if self._routes is None or time.monotonic() - self._routes[0] > ROUTES_STALE_S:
            routes = await self._ask("routes")
        elif self.coordinator_unreachable:
            answer = self._answered_meanwhile()
            if answer is None:
                return self._routes[1]
            routes = answer
        else:
            try:
                routes = await asyncio.wait_for(self.coordinator.routes(), ROUTES_FALLBACK_AFTER_S)
            except (asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - RayActorError, ActorUnavailableError, ...
                if not self.coordinator_unreachable:
                    log.warning("the coordinator does not answer (%s): serving on its last routes", error_text(e))
                self.coordinator_unreachable = True
                return self._routes[1]
        if self._routes_question is not None:  # an answer taken here ends any question still out (or sitting)
            self._routes_question.cancel()
            self._routes_question = None
        if self.coordinator_unreachable:
            log.warning("the coordinator answers again")
            self.coordinator_unreachable = False
            for engine_id in self._outage_suspects:  # it decides now: listed engines are trusted again
                self.choice.trust(engine_id)
            self._outage_suspects.clear()
        self._take_routes(routes)
        self._start_watch(routes)
        return routes

    def _take_routes(self, routes: dict[str, list[str]]) -> None:
        """The coordinator's answer becomes the router's routes: engines and channels no longer listed are let go."""
        self._routes = (time.monotonic(), routes)
        listed = set(routes).union(*routes.values())
        for engine_id in [e for e in self._engines if e not in listed]:  # left (or not ready): asked again if it returns
            del self._engines[engine_id]
        for engine_id in [e for e, c in self._channels.items() if c.closed and e not in listed]:
            del self._channels[engine_id]  # its stream ended when it left: nothing waits on it
        self.choice.left(listed)

    def _watched(self) -> dict[str, list[str]] | None:
        """The routes, if the watch vouches for them: it runs on this event loop, its question is under way for no
        longer than the coordinator holds one plus ROUTES_FALLBACK_AFTER_S, and the coordinator answers (otherwise a
        request asks, with the fallback rules)."""
        if not self._watching() or self.coordinator_unreachable or self._routes is None:
            return None
        if time.monotonic() - self._watch_asked_at > WATCH_WAIT_S + ROUTES_FALLBACK_AFTER_S:
            return None
        return self._routes[1]

    def _watching(self) -> bool:
        """Whether a routes watch runs on this event loop."""
        return self._watch is not None and not self._watch.done() and _ours(self._watch)

    def _start_watch(self, routes: dict[str, list[str]]) -> None:
        """Start the routes watch from an answer the coordinator just gave (none while one runs on this loop)."""
        if not self.watch_routes or self._watching():
            return
        self._watch_asked_at = time.monotonic()
        self._watch = asyncio.ensure_future(self._watch_routes(routes))

    async def _watch_routes(self, known: dict[str, list[str]]) -> None:
        """Keep the router's routes current: ask the coordinator for them once they differ from `known`
        (`CoordinatorActor.routes_after`, held up to WATCH_WAIT_S), take each answer, ask again. It ends at the first
        question that fails or is late (the coordinator died, restarts or is wedged): requests ask it themselves then,
        with the fallback rules of `routes`, and its next answer starts a new watch."""
        try:
            while self._watch is asyncio.current_task():  # a newer watch (another event loop's) replaces this one
                asked = self._watch_asked_at = time.monotonic()
                routes = await asyncio.wait_for(self.coordinator.routes_after(known, WATCH_WAIT_S),
                                                WATCH_WAIT_S + ROUTES_FALLBACK_AFTER_S)
                if self.coordinator_unreachable:  # a request found it away meanwhile: its rules decide from here
                    return
                self.watch_answers += 1
                if routes != known:
                    self._take_routes(routes)
                    known = routes
                else:
                    self._routes = (time.monotonic(), routes)
                await asyncio.sleep(max(0.0, asked + WATCH_GAP_S - time.monotonic()))
        except asyncio.CancelledError:
            raise
        except AttributeError as e:  # a coordinator without the watch's call (an older one): requests ask, as before
            self.watch_routes = False
            log.info("routes watch off (%s); requests ask the coordinator", e)
        except Exception as e:  # noqa: BLE001 - RayActorError, ActorUnavailableError, a timeout: requests ask again
            log.info("routes watch ended (%s); requests ask the coordinator", error_text(e))

    def _answered_meanwhile(self) -> dict[str, list[str]] | None:
        """While requests are routed on the coordinator's last routes: its answer to the routes question asked in
        the background, if one came; otherwise None, with a question under way - one at a time (each waits up to
        2 x ROUTES_FALLBACK_AFTER_S: calls queued for a restarting actor are answered once it is back), at most one
        per CAPACITY_POLL_S - so that no request waits on a coordinator that is restarting. A question left by an
        event loop that ended is not waited on from another."""
        question = self._routes_question
        if _ours(question) and question.done() and question.exception() is None:
            self._routes_question = None
            return question.result()
        if _ask_again(question, self._routes_asked_at):
            self._routes_asked_at = time.monotonic()
            question = self._routes_question = asyncio.ensure_future(self._routes_answer())
            question.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure is not an error here
        return None

    async def _routes_answer(self) -> dict[str, list[str]]:
        return await asyncio.wait_for(self.coordinator.routes(), 2 * ROUTES_FALLBACK_AFTER_S)

    async def _ask(self, method: str, *args: Any) -> Any:
        """A coordinator call with a deadline - COORDINATOR_TIMEOUT_S, or ROUTES_FALLBACK_AFTER_S while requests are
        routed on its last routes (it did not answer the last routes question: no call waits long on it); failures
        become CoordinatorUnavailable (a 503, not a 500)."""
        deadline = ROUTES_FALLBACK_AFTER_S if self.coordinator_unreachable else COORDINATOR_TIMEOUT_S
        try:
            return await asyncio.wait_for(getattr(self.coordinator, method)(*args), deadline)
        except (asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - RayActorError, ActorUnavailableError, ...
            raise CoordinatorUnavailable(f"{method}: {error_text(e)}") from None

    async def engine(self, engine_id: str, phase: str = "decode") -> EngineClient:
        """The client of a registered engine (asked of the coordinator once, then kept until the engine fails a
        request); EngineFailure in `phase` once it has left, or when the coordinator cannot say (`unknown`: the
        routes are its last ones, and this engine is one this front end has no client for - never asked, or dropped
        when it died: another pair takes the request, rather than a 503 for an engine the routes may list only
        because they are old)."""
        if engine_id not in self._engines:
            try:
                engine = await self._ask("client", engine_id)
            except CoordinatorUnavailable as e:
                failure = EngineFailure(phase, engine_id, f"its client is not known here and the coordinator does "
                                                          f"not answer ({e})")
                failure.unknown = True
                raise failure from None
            if engine is None:  # it left (scale-down, death) after the coordinator listed it: try another pair
                raise EngineFailure(phase, engine_id, "the engine left the cluster")
            self._engines[engine_id] = engine
        return self._engines[engine_id]

    async def _resumable(self, engine_id: str, prompt_token_ids: list[int]) -> Any:
        """What engine `engine_id` can resume of a prompt (its own answer: `PairChoice` asks it)."""
        return await (await self.engine(engine_id)).resumable(prompt_token_ids)

    async def _prefix_roots(self, engine_id: str, known: tuple[int, int] | None) -> Any:
        """Which prompts engine `engine_id` may resume something of (`PairChoice` copies it)."""
        return await (await self.engine(engine_id)).prefix_roots(known)

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: dict[str, Any],
        request_id: str | None = None,
        pair: tuple[str, str] | None = None,
        retries: int = 1,
    ) -> AsyncIterator[dict[str, Any]]:
        """`stream` with plain values: `sampling` holds vLLM SamplingParams fields; yields the new tokens of each
        step as {"token_ids": [...], "text": "...", "finish_reason": None | "stop" | "length"}."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(**sampling, output_kind=RequestOutputKind.DELTA)
        async with contextlib.aclosing(self.stream(prompt_token_ids, params, request_id, pair, retries)) as outs:
            async for out in outs:
                c = out.outputs[0]
                yield {"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason}

    async def stream(
        self,
        prompt_token_ids: list[int],
        params: Any,
        request_id: str | None = None,
        pair: tuple[str, str] | None = None,
        retries: int = 1,
        failovers: int = FAILOVERS,
    ) -> AsyncIterator[Any]:
        """Yield the decode engine's vLLM RequestOutputs for one request (n = 1): deltas or one final output, as
        `params.output_kind` says. Prompt logprobs, when asked for, come from the prefill engine (the decode engine
        never computes the prompt's logits) on the first output. `pair` pins (prefill engine id, decode engine id);
        it must be a pair the coordinator approved (and is never retried elsewhere). A request that fails before
        anything reached the caller is retried up to `retries` times on a pair without the failed engine; one whose
        engine fails after tokens were streamed continues on another pair up to `failovers` times (the prompt plus
        the tokens already sent are prefilled again and decoding resumes: `continuation_params` says when and how).
        An engine that died is reported to the coordinator, which removes it from every pair at once."""
        req = Request(list(prompt_token_ids), params, request_id or uuid.uuid4().hex, pair)
        wait_until: float | None = None  # set once a failover found no engine: the end of its wait
        while True:
            try:
                async with contextlib.aclosing(self._once(req.attempt())) as outs:
                    original = list(req.prompt) if req.sent else None  # one copy, not one per output
                    async for out in outs:
                        if original is not None:  # a continuation: to the caller it is the same request
                            out.prompt_token_ids, out.prompt_logprobs = original, None
                        if is_delta(params) and out.outputs:
                            req.sent += list(out.outputs[0].token_ids)
                        yield out
                return
            except NoCapacity as e:
                # a request that has sent nothing is refused at once (503: its client can retry it); a stream
                # failing over cannot be retried by its client: it waits for an engine to join (a replacement)
                if req.pair is not None or not req.sent:
                    raise
                if wait_until is None:
                    wait_until = time.monotonic() + self.failover_wait_s
                    self.waited_for_capacity += 1
                    log.warning("request %s: %s; waiting up to %g s for an engine", req.rid, e, self.failover_wait_s)
                else:  # an engine was listed and still could not take it: look again a poll later, not at once
                    await asyncio.sleep(CAPACITY_POLL_S)
                if not await self._capacity(req.avoid, wait_until):
                    raise NoCapacity(f"{e} (waited {self.failover_wait_s:g} s for an engine to join)") from None
                continue
            except EngineFailure as e:
                verify = e.phase == "verify"
                outage = self.coordinator_unreachable and (e.engine_died or e.unknown)
                if e.stuck or outage:
                    # alive but not serving; or dead, or out of reach, while the coordinator cannot take it out of
                    # the routes (they are its last ones): new requests go elsewhere until it decides
                    self.choice.suspect(e.engine_id, str(e))
                    if outage and not e.stuck:
                        self._outage_suspects.add(e.engine_id)
                if not verify and not e.unknown:
                    if not self.coordinator_unreachable or e.engine_died or e.stuck:
                        self._forget(e.engine_id)  # ask the coordinator again: it may have left or been replaced
                    self._background(self._report_failure(e.engine_id))
                if req.pair is not None and not verify:
                    raise
                if e.streamed or req.sent:
                    why = continuation_refused(params) or ("it failed over too often" if req.failed_over >= failovers
                                                           else None)
                    if why is not None:
                        raise EngineFailure(e.phase, e.engine_id, f"{e}; not continued elsewhere: {why}",
                                            streamed=True) from None
                    req.failed_over += 1
                    self.failed_over += 1
                    log.warning("request %s: %s after %d tokens; continuing on another pair", req.rid, e, len(req.sent))
                elif req.retried >= retries:
                    raise
                else:
                    req.retried += 1
                    self.retried += 1
                    log.warning("request %s: %s; retrying on another pair", req.rid, e)
                (req.prefer_not if verify else req.avoid).add(e.engine_id)

    async def _capacity(self, avoid: set[str], until: float) -> bool:
        """Wait until an engine outside `avoid` (those that failed this request) is ready (True), or `until` passes
        (False). An engine of `avoid` that leaves the coordinator's lists and is listed again has registered anew - a
        replacement under the same id - and is taken off `avoid`."""
        left: set[str] = set()
        while True:
            listed = await self._listed()
            if listed is not None:
                left |= avoid - listed
                for engine_id in left & listed:  # a new engine: nothing held for the old one applies to it
                    avoid.discard(engine_id)
                    left.discard(engine_id)
                    self._engines.pop(engine_id, None)
                    self._channels.pop(engine_id, None)
                if listed - avoid:
                    return True
            if time.monotonic() >= until:
                return False
            await asyncio.sleep(CAPACITY_POLL_S)

    async def _servable(self, routes: dict[str, list[str]], avoid: set[str]) -> bool:
        """Whether an engine outside `avoid` can take a request: a ready prefill engine (paired, or alone), or a ready
        decode engine alone."""
        if any(p not in avoid for p in routes):
            return True
        try:
            return any(d not in avoid for d in await self._ask("ready", "decode"))
        except CoordinatorUnavailable:
            return False

    async def _listed(self) -> set[str] | None:
        """Every engine the coordinator lists (paired, or a ready decode engine); None while it does not answer. One
        question per CAPACITY_POLL_S, shared by every stream waiting for capacity (a burst of failovers that find no
        engine is one poll, not one per stream)."""
        if _ask_again(self._listing, self._listing_at):
            self._listing_at = time.monotonic()
            self._listing = asyncio.ensure_future(self._list_engines())
        return await asyncio.shield(self._listing)

    async def _list_engines(self) -> set[str] | None:
        try:
            routes = await self.routes()
            return set(routes).union(*routes.values()) | set(await self._ask("ready", "decode"))
        except CoordinatorUnavailable:
            return None  # restarting: asked again

    def _forget(self, engine_id: str) -> None:
        """Drop what is cached about an engine that failed a request: its client, and its channel only if that broke
        (a live channel carries this front end's other requests on the engine)."""
        self._engines.pop(engine_id, None)
        channel = self._channels.get(engine_id)
        if channel is not None and channel.closed:
            del self._channels[engine_id]

    async def _report_failure(self, engine_id: str) -> None:
        """Let the coordinator check the engine now (rather than at its next periodic check); once per engine at a
        time: the requests that fail together on one engine make one report, not one each."""
        if engine_id in self._reporting:
            return
        self._reporting.add(engine_id)
        try:
            await asyncio.wait_for(_awaitable(self.coordinator.engine_failed(engine_id)),
                                   2 * COORDINATOR_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the coordinator's own health checks remain
            log.warning("could not report %s to the coordinator: %s", engine_id, e)
        finally:
            self._reporting.discard(engine_id)

    async def _channel(self, engine_id: str, engine: EngineClient, phase: str = "decode") -> "DecodeChannel":
        """This front end's channel from the engine (opened on first use; `phase` names the failure if it cannot
        be)."""
        channel = self._channels.get(engine_id)
        # a channel opened under another event loop (a caller that runs each batch under its own asyncio.run) has
        # no reader any more: its outputs would never arrive
        if channel is None or channel.closed or channel.loop is not asyncio.get_running_loop():
            # registered before any await: concurrent first requests to an engine share one channel
            local = self.decode_transport == "auto" and engine_id not in self._unreachable
            channel = self._channels[engine_id] = DecodeChannel(engine_id, engine, local, self.stall_s)
        try:
            await channel.opened()
        except Exception as e:
            raise EngineFailure(phase, engine_id, e) from None
        if channel.closed:
            if channel.unreachable:  # the engine cannot reach our socket (another /tmp?): the Ray stream from now on
                self._unreachable.add(engine_id)
            raise EngineFailure(phase, engine_id, channel.error)
        return channel

    async def _once(self, attempt: Attempt) -> AsyncIterator[Any]:
        """One try on one pair (or one engine, degraded): routing, then the prefill, the transfer and the decode
        (`_decode`). Engines a request found stuck (`PairChoice.suspect`) are left out like those the request failed
        on while anything else can serve - another pair, or one engine alone - rather than each request waiting out
        the stall on them again."""
        req = attempt.request
        pair, avoid = req.pair, req.avoid
        routes = await self.routes()
        self.stale_routed += self.coordinator_unreachable
        wary = self.choice.wary() - avoid if pair is None else set()
        if wary and await self._servable(routes, avoid | wary):
            avoid = avoid | wary
        prefills = [p for p in routes if p not in avoid]
        if pair is None:
            paired = [p for p in prefills if any(d not in avoid for d in routes[p])]
            if not paired:  # one pool has no ready engine (or nothing is paired): one engine serves it all
                async with contextlib.aclosing(self._colocated(attempt, prefills, avoid)) as outs:
                    async for out in outs:
                        yield out
                return
            prefills = paired
            if self.degraded is not None:
                log.warning("no longer degraded: prefill/decode pairs serve requests again")
                self.degraded = None
        if not prefills:
            raise NoCapacity("no prefill engine is registered and ready")
        load = self.choice
        chosen = await load.choose(attempt.prompt, prefills, routes, avoid, req.prefer_not, pair)
        p_id, d_id, uncached = chosen.prefill, chosen.decode, chosen.uncached
        if chosen.local:
            # conditional disaggregation: the least-loaded prefill engine already has its queue, the decode engine
            # has no stream to stall, or it resumes more of the prompt; the decode engine computes this prompt in its
            # own steps instead, with no transfer (vLLM's chunked prefill)
            self.local_prefill += 1
            queued = len(attempt.prompt)
            load.local_tokens[d_id] += queued  # no await since the choice: the next choice sees this prompt there
            try:
                decode = await self.engine(d_id, "decode")
                async with contextlib.aclosing(self._decode(attempt, d_id, decode)) as outs:
                    async for out in outs:
                        load.local_tokens[d_id] -= queued  # its prefill is done
                        queued = 0
                        yield out
            finally:
                load.local_tokens[d_id] -= queued
            return

        load.heading[d_id] += 1  # no await since the choice's load checks: a request routed next sees this one
        load.pending_tokens[p_id] += uncached
        try:
            prefill, decode = await self.engine(p_id, "prefill"), await self.engine(d_id, "decode")
            first_token = self.first_token_from_prefill and first_token_refused(attempt.params) is None
            load.inflight[p_id] += 1
            try:
                sampled = attempt.params if first_token else None
                if self.prefill_over_channel:
                    answer = self._prefill_on_channel(attempt, p_id, prefill, sampled)
                    cancel = functools.partial(self._cancel_on_channel, prefill, attempt.rid)
                else:
                    ref = prefill.prefill(attempt.prompt, attempt.rid, prompt_logprobs=attempt.params.prompt_logprobs,
                                          first_token=sampled, continued=attempt.continued)
                    answer, cancel = _awaitable(ref), functools.partial(self._cancel_prefill, prefill, ref)
                try:
                    prefilled: Prefilled = await self._prefilled(prefill, answer)
                except (asyncio.CancelledError, EngineStuck) as e:  # client gone, or a hung engine: stop it
                    self._background(cancel())
                    if isinstance(e, asyncio.CancelledError):
                        raise
                    raise EngineFailure("prefill", p_id, e) from None
                except EngineFailure:
                    raise
                except Exception as e:
                    if self.prefill_over_channel and not _is_actor_death(e):
                        # the channel broke with the engine alive (its socket, an overflow): an answer it sent may
                        # be lost with the blocks it holds - freed, or the prefill stopped
                        self._background(cancel())
                    raise EngineFailure("prefill", p_id, e) from None
            finally:
                load.inflight[p_id] -= 1
                load.pending_tokens[p_id] -= uncached
                uncached = 0
            first = prefilled.first
            if first is None:
                async with contextlib.aclosing(self._decode(attempt, d_id, decode, prefilled, p_id, prefill)) as outs:
                    async for out in outs:
                        yield out
                return
            # the prefill engine sampled the first token: it goes out now; the decode engine continues from it
            def let_go() -> None:  # no decode engine will read the state the prefill engine holds for it
                self._background(self._release_prefill(prefill, prefilled))

            reason = first.outputs[0].finish_reason if first.outputs else "no output"
            if reason not in ("length", "stop") or not first.outputs[0].token_ids:  # aborted (the engine is stopping)
                let_go()
                raise EngineFailure("prefill", p_id,
                                    f"the prefill engine ended the request without a first token ({reason})")
            self.first_from_prefill += 1
            finished = reason == "stop" or attempt.params.max_tokens == 1
            if not finished:
                first.outputs[0].finish_reason = first.outputs[0].stop_reason = None
            first.finished = finished
            first.prompt_logprobs = prefilled.prompt_logprobs
            try:
                yield first
            except BaseException:  # the consumer went away
                let_go()
                raise
            if finished:  # the first token ended it (a stop token, or max_tokens 1)
                let_go()
                return
            rest = attempt.after_first_token(first.outputs[0].token_ids)
            original = list(attempt.prompt)  # what this try sent, on every output (one copy, not one per output)
            held = dataclasses.replace(prefilled, prompt_logprobs=None)
            async with contextlib.aclosing(self._decode(rest, d_id, decode, held, p_id, prefill)) as outs:
                async for out in outs:
                    out.prompt_token_ids, out.prompt_logprobs = original, None
                    yield out
        finally:
            load.heading[d_id] -= 1
            load.pending_tokens[p_id] -= uncached  # 0 unless the prefill never started

    async def _prefilled(self, prefill: EngineClient, answer: Awaitable[Prefilled]) -> Prefilled:
        """A prefill's answer. Every `stall_s` without one the engine is asked whether it is stuck
        (`EngineClient.stuck`: failed - not stepping, `actors.engine.progress` - or dead, or no answer to its health
        twice in a row): then, or with no answer within `prefill_timeout_s`, `EngineStuck` is raised; a busy, healthy
        engine is waited for."""
        waiting = asyncio.ensure_future(answer)
        t0 = time.monotonic()
        try:
            while True:
                left = self.prefill_timeout_s - (time.monotonic() - t0)
                if left <= 0:
                    raise EngineStuck(f"no answer within {self.prefill_timeout_s:.0f} s")
                done, _ = await asyncio.wait({waiting}, timeout=min(self.stall_s, left))
                if done:
                    return waiting.result()
                verdict = await prefill.stuck(probe_timeout_s(self.stall_s))
                if verdict is not None and not waiting.done():
                    raise EngineStuck(f"no answer for {time.monotonic() - t0:.0f} s and the engine is {verdict.why}")
        finally:
            if not waiting.done():
                waiting.cancel()  # the engine's prefill is stopped by the caller (`_cancel_on_channel`, `_cancel_prefill`)

    async def _colocated(self, attempt: Attempt, prefills: list[str], avoid: set[str]) -> AsyncIterator[Any]:
        """Degraded mode: no prefill/decode pair is ready, so one engine runs the whole request - a ready prefill
        engine while the decode pool is empty, a ready decode engine while the prefill pool is (counted in
        `colocated`, logged when it starts and stops)."""
        role, engines = "prefill", prefills
        if not engines:
            role, engines = "decode", [d for d in await self._ask("ready", "decode") if d not in avoid]
        if not engines:
            raise NoCapacity("no prefill or decode engine is registered and ready")
        if self.degraded != role:
            log.warning("degraded: no ready %s engine is paired; %s engines serve requests whole",
                        "decode" if role == "prefill" else "prefill", role)
            self.degraded = role
        e_id = self.choice.pick(engines, role)
        engine = await self.engine(e_id, "decode")
        self.colocated[role] += 1
        async with contextlib.aclosing(self._decode(attempt, e_id, engine)) as outs:
            async for out in outs:
                yield out

    async def _decode(self, attempt: Attempt, d_id: str, decode: EngineClient, prefilled: Prefilled | None = None,
                      p_id: str | None = None, prefill: EngineClient | None = None) -> AsyncIterator[Any]:
        """Stream one try's outputs from engine `d_id`: the decode side of a pair, reading the state `prefilled`
        describes from prefill engine `p_id`, or (prefilled None) the whole request on that one engine."""
        rid, params = attempt.rid, attempt.params
        kv_params = prefilled.kv_transfer_params if prefilled else None
        self.choice.inflight[d_id] += 1
        headed = prefilled is not None  # a disaggregated request: also in `heading` until its end
        self.choice.headed_decoding[d_id] += headed
        finished = streamed = False
        inbox = None
        try:
            channel = await self._channel(d_id, decode)
            inbox = channel.join(rid, delta=is_delta(params))
            try:
                await decode.submit_decode(channel.id, rid, attempt.prompt, params, kv_params, attempt.continued)
            except Exception as e:
                raise EngineFailure("decode", d_id, e) from None
            while not finished:
                out = await inbox.get()
                if isinstance(out, BaseException):  # the channel broke: the engine died or left
                    raise EngineFailure("decode", d_id, out, streamed=streamed)
                if isinstance(out, DecodeError) and out.kind == TRANSFER_VERIFY_FAILED:  # before any token exists
                    raise EngineFailure("verify", p_id, f"transfer verify: {out.message}")
                if isinstance(out, DecodeError):  # the request failed inside the engine
                    raise EngineFailure("decode", d_id, f"{out.kind}: {out.message}", streamed=streamed)
                reason = out.outputs[0].finish_reason if out.outputs else None
                if reason == "error" and (prefilled is None or streamed):  # not a state read: this engine failed it
                    raise EngineFailure("decode", d_id, "the engine ended the request with an error", streamed=streamed)
                if reason == "error":
                    # vLLM ends a request whose prompt state could not be read (kv_load_failure_policy "fail"): the
                    # prefill engine left or died after its prefill. A clean failure, retried on another pair.
                    raise EngineFailure("transfer", p_id, f"decode engine {d_id} could not read the prompt's state",
                                        streamed=streamed)
                if reason == "abort":  # the engine stopped under the request: never a short success
                    raise EngineFailure("decode", d_id, "the engine aborted the request (it is shutting down)",
                                        streamed=streamed)
                finished = bool(out.finished)
                if not streamed and prefilled and prefilled.prompt_logprobs is not None:
                    out.prompt_logprobs = prefilled.prompt_logprobs
                streamed = True  # whatever reached the caller cannot be taken back: no retry from here on
                yield out
        except EngineFailure:
            raise
        except Exception as e:
            raise EngineFailure("decode", d_id, e, streamed=streamed) from None
        finally:
            self.choice.inflight[d_id] -= 1
            self.choice.headed_decoding[d_id] -= headed
            if inbox is not None:
                inbox.leave()
            if not finished:  # the consumer went away, or an error: stop the decode side, free the prefill side
                try:
                    decode.abort(rid)
                except Exception:  # noqa: BLE001 - the engine may be gone
                    pass
                if prefill is not None and prefilled is not None:
                    self._background(self._release_prefill(prefill, prefilled))

    def _background(self, coro) -> None:
        """Run clean-up to completion even though the request's own task is being cancelled."""
        task = asyncio.ensure_future(coro)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def _release_prefill(self, prefill: EngineClient, prefilled: Prefilled) -> None:
        """Free the prefill side's blocks of a request whose decode side ended early (a no-op when the decode
        engine already read them)."""
        remote_id = prefilled.kv_transfer_params.get("remote_request_id")
        try:
            await asyncio.wait_for(prefill.release([remote_id]), 10)
        except Exception as e:  # noqa: BLE001 - best effort; vLLM's lease expiry remains the fallback
            log.warning("could not release prefill blocks of %s: %s", remote_id, e)

    async def _prefill_on_channel(self, attempt: Attempt, p_id: str, prefill: EngineClient,
                                  first_token: Any) -> Prefilled:
        """A prefill whose answer comes on this front end's channel from the engine (`submit_prefill`): on one node
        over its local socket, with no Ray return on the way to the first token. Waited for by `_prefilled` as a
        whole - the channel's opening and the submission included - so an engine that stopped answering altogether
        is found stuck there too."""
        channel = await self._channel(p_id, prefill, "prefill")
        inbox = channel.join(attempt.rid, delta=False)
        try:
            await prefill.submit_prefill(channel.id, attempt.rid, attempt.prompt, attempt.params.prompt_logprobs,
                                         first_token, attempt.continued)
            return await _answer(inbox)
        finally:
            inbox.leave()

    async def _cancel_on_channel(self, prefill: EngineClient, rid: str) -> None:
        """Stop a prefill started with `submit_prefill` that nobody waits for; if it finished first, the engine frees
        the blocks it holds for a decode engine (`EngineActor.cancel_prefill`)."""
        try:
            await asyncio.wait_for(prefill.cancel_prefill(rid), 30)
        except Exception as e:  # noqa: BLE001 - best effort; vLLM's lease expiry remains the fallback
            log.warning("could not cancel the prefill of %s: %s", rid, e)

    async def _cancel_prefill(self, prefill: EngineClient, ref: Any) -> None:
        """Cancel a prefill nobody waits for; if it finished first, free the blocks it holds for a decode engine."""
        import ray

        ray.cancel(ref)
        try:
            prefilled = await asyncio.wait_for(ref, 30)
        except Exception:  # noqa: BLE001 - cancelled (the usual case) or failed: nothing is held
            return
        await self._release_prefill(prefill, prefilled)
