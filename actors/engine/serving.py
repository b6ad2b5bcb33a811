"""An engine actor's serving component (`EngineServing`): prefills with remote decode (`prefill`), decodes that read
the prompt's state from a prefill engine, and the decode channels that batch a front end's outputs per engine step.
It owns the open decode channels; it reports each request to the load component (`EngineLoad`: counters, first
served), asks transfer.verify (`EngineVerify`) which reads are checked and how their checks ended, and records
prompts in the prefix record. Every decode request runs one path (`_start`, `_pump`): the router's, with
`decode_channel` + `submit_decode`, and `decode`, a plain per-request stream of dicts over a private channel for
tests' and benchmarks' references."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import Any

from actors.engine.connector_ranks import ConnectorRanks
from actors.engine.decode_channel import DecodeError, Outbox, send_outputs
from actors.clients.engine_client import CHANNEL_BACKLOG, Prefilled
from actors.engine.load import EngineLoad
from actors.engine.prefix import EnginePrefixes
from actors.engine.procs import LiveEngine
from actors.engine.verify import EngineVerify
from cluster.core.metrics import TransferTotals
from cluster.core.verify import TRANSFER_VERIFY_FAILED
from cluster.core.wire import FIRST_TOKEN

log = logging.getLogger("pd.engine")
DELIVERED_KEPT = 4096  # answered prefills whose blocks `cancel_prefill` can still free


def _keep_latest(kept: collections.OrderedDict, key: str, value: Any) -> None:
    """Remember `key`, forgetting the oldest past DELIVERED_KEPT."""
    kept[key] = value
    while len(kept) > DELIVERED_KEPT:
        kept.popitem(last=False)


def _ranked(step: dict[int, Any]) -> list[tuple[int, float]]:
    """One position's logprobs as (token id, logprob) pairs, best first."""
    return sorted(((tok, lp.logprob) for tok, lp in step.items()), key=lambda x: -x[1])


def _as_item(output: Any) -> dict[str, Any]:
    """A decode output as `decode` streams it (logprobs ranked, per position)."""
    c = output.outputs[0]
    item: dict[str, Any] = {"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason}
    if c.logprobs:
        item["logprobs"] = [_ranked(step) for step in c.logprobs]
    if output.prompt_logprobs:
        item["prompt_logprobs"] = [_ranked(step) if step else None for step in output.prompt_logprobs]
    return item


class EngineServing:
    """`EngineActor`'s requests. `live`: the engine; `ranks`: its connector's workers; `prefixes`: its prefix record;
    `meter`: its load component; `verifier`: its transfer.verify; `totals`: its running totals (the pairs
    component's), counted into."""

    def __init__(self, engine_id: str, live: LiveEngine, ranks: ConnectorRanks, prefixes: EnginePrefixes,
                 meter: EngineLoad, verifier: EngineVerify, totals: TransferTotals) -> None:
        self.engine_id, self._live, self.ranks, self.prefixes = engine_id, live, ranks, prefixes
        self._meter, self._verifier, self._totals = meter, verifier, totals
        self._channels: dict[str, Outbox] = {}  # open decode channels (one per front end)
        self._prefills: dict[str, asyncio.Task] = {}  # prefills started by `submit_prefill`, until they answer
        # request id -> remote request id of prefills answered on a channel (the latest DELIVERED_KEPT): what
        # `cancel_prefill` frees when the front end gave up on one after its answer left
        self._delivered: collections.OrderedDict[str, str] = collections.OrderedDict()
        # request ids `cancel_prefill` found nothing for (the latest DELIVERED_KEPT): a submission that arrives after
        # its cancel (Ray runs an async actor's calls concurrently) is not started
        self._cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def prefill(self, prompt_token_ids: list[int], request_id: str, prompt_logprobs: int | None = None,
                      first_token: Any = None, continued: int = 0) -> Prefilled:
        """Run the prompt with remote decode requested. Returns the transfer parameters for the decode engine, vLLM's
        prompt logprobs when asked for, and None or the first output (`Prefilled`).

        By default vLLM's prefill side stops one token short for hybrid models (the decode side recomputes the last
        prompt token and samples the first output token). With `first_token` - the request's own vLLM
        SamplingParams - the whole prompt is prefilled and its first output token sampled here, with those
        parameters; `first` is that token's RequestOutput (text, logprobs, finish reason) and the transfer
        parameters describe the state after the whole prompt: the decode engine continues from prompt + that token.
        `continued`: the prompt's last tokens are output the client already has (a failover's continuation); the
        first token's text continues theirs (`_continuation_detokenizer`).

        Prompt logprobs need the logits of the whole prompt, which the transfer request does not return (vLLM's
        prefill side refuses them with remote decode), so they come from a second, local request over the same
        prompt run alongside."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._live.required()
        self._meter.refuse_if_draining()
        transfer = {"do_remote_decode": True, "do_remote_prefill": False}
        if first_token is None:
            params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": transfer})
        else:
            params = first_token.clone()
            params.n, params.max_tokens, params.min_tokens = 1, 1, min(1, params.min_tokens or 0)
            params.prompt_logprobs, params.output_kind = None, RequestOutputKind.FINAL_ONLY
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": {**transfer, FIRST_TOKEN: True}}
        predicted = self.prefixes.predict(prompt_token_ids).checkpoint_tokens
        uncached = len(prompt_token_ids) - predicted
        self._meter.prefill_started(len(prompt_token_ids), uncached)
        try:
            runs = [self._last_output(prompt_token_ids, params, request_id)]
            if prompt_logprobs is not None:
                scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs)
                runs.append(self._last_output(prompt_token_ids, scoring, f"{request_id}-prompt-logprobs"))
            final, *scored = await asyncio.gather(*runs, return_exceptions=True)
        finally:
            self._meter.prefill_done(len(prompt_token_ids), uncached)
        if isinstance(final, BaseException):
            raise final
        if final is None or not final.kv_transfer_params:
            raise RuntimeError(f"prefill of {request_id} returned no transfer parameters")
        if scored and isinstance(scored[0], BaseException):  # nobody will read the prefilled state: free it now
            await self.release([final.kv_transfer_params["remote_request_id"]])
            raise scored[0]
        self._meter.served(request_id)
        self._totals.cached_prompt_tokens += final.num_cached_tokens or 0
        # vLLM's prefill side for remote decode computes all but the last prompt token, unless it samples the first
        self.prefixes.prefilled(prompt_token_ids, predicted, final.num_cached_tokens or 0,
                                len(prompt_token_ids) - (first_token is None))
        kv_transfer_params = dict(final.kv_transfer_params)
        first = None
        if first_token is not None:
            first, final.kv_transfer_params = final, None
            detokenizer = self._continuation_detokenizer(prompt_token_ids, continued, params)
            if detokenizer is not None and first.outputs:
                first.outputs[0].text = "".join(detokenizer.decode_next(t) for t in first.outputs[0].token_ids)
        return Prefilled(kv_transfer_params, scored[0].prompt_logprobs if scored else None, first)

    async def submit_prefill(self, channel_id: str, request_id: str, prompt_token_ids: list[int],
                             prompt_logprobs: int | None = None, first_token: Any = None, continued: int = 0) -> None:
        """Start `prefill`, its answer going to channel `channel_id` (opened by `decode_channel`) as the item
        (request id, Prefilled), or (request id, DecodeError) if it fails: on this node over the channel's local
        socket, with no Ray return on the way to the first token. Refused here (raised) while draining or without the
        channel; `cancel_prefill` stops it. The prefill ends with the channel, like the channel's decodes."""
        self._live.required()
        self._meter.refuse_if_draining()
        channel = self._channels.get(channel_id)
        if channel is None:
            raise RuntimeError(f"channel {channel_id} is not open on engine {self.engine_id}")
        if request_id in self._cancelled:  # its front end gave up on it already
            del self._cancelled[request_id]
            return
        task = asyncio.get_running_loop().create_task(
            self._answer(channel, request_id, prompt_token_ids, prompt_logprobs, first_token, continued))
        self._prefills[request_id] = task
        channel.tasks.add(task)
        task.add_done_callback(channel.tasks.discard)
        task.add_done_callback(lambda _: self._prefills.pop(request_id, None))

    async def _answer(self, channel: Outbox, request_id: str, prompt_token_ids: list[int], prompt_logprobs: int | None,
                      first_token: Any, continued: int) -> None:
        try:
            prefilled = await self.prefill(prompt_token_ids, request_id, prompt_logprobs, first_token, continued)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the front end's request fails with it
            channel.put((request_id, DecodeError(type(e).__name__, str(e))))
            return
        remote_id = prefilled.kv_transfer_params.get("remote_request_id")
        if remote_id:
            _keep_latest(self._delivered, request_id, remote_id)
        channel.put((request_id, prefilled))

    async def cancel_prefill(self, request_id: str) -> None:
        """The front end gave up on a prefill it started with `submit_prefill`: stop it (vLLM aborts it), or - when
        it had already answered - free the blocks it holds for a decode engine (a no-op once one read them)."""
        task = self._prefills.get(request_id)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
            return
        remote_id = self._delivered.pop(request_id, None)
        if remote_id is None:  # not submitted yet (its call overtaken by this one), or long gone
            _keep_latest(self._cancelled, request_id, None)
        elif self._live() is not None:
            await self.release([remote_id])

    async def _last_output(self, prompt_token_ids: list[int], params: Any, request_id: str) -> Any:
        final = None
        async for output in self._live.required().generate({"prompt_token_ids": list(prompt_token_ids)}, params,
                                                           request_id=request_id):
            final = output
        return final

    async def decode(self, prompt_token_ids: list[int], sampling: dict[str, Any], kv_transfer_params: dict[str, Any] | None, request_id: str):
        """Stream a request's new tokens: {"token_ids", "text", "finish_reason"[, "logprobs", "prompt_logprobs"]} per
        step; `sampling`: vLLM SamplingParams' keywords. With `kv_transfer_params` the prompt's state is read from the
        prefill engine they name; without, the engine runs the whole request (colocated). It runs as `submit_decode`'s
        requests do, on a channel of its own; an error output (`DecodeError`) is raised, a RuntimeError."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._live.required()
        self._meter.refuse_if_draining()
        extra = dict(sampling.pop("extra_args", None) or {})
        params = SamplingParams(**sampling, extra_args=extra or None, output_kind=RequestOutputKind.DELTA)
        outbox = Outbox()
        task = self._start(outbox, request_id, prompt_token_ids, params, kv_transfer_params)
        task.add_done_callback(lambda _: outbox.ready.set())  # its end wakes `take` even with no output waiting
        try:
            while not (task.done() and not outbox.items):
                for _, output in await outbox.take():
                    if isinstance(output, DecodeError):
                        raise RuntimeError(f"{output.kind}: {output.message}")
                    yield _as_item(output)
        finally:  # the stream closed or cancelled: so is the request (aborted in the engine), and counted so
            task.cancel()
            await asyncio.wait([task])

    async def decode_channel(self, channel_id: str, address: str | None = None, backlog: int = CHANNEL_BACKLOG):
        """A front end's one stream of decode outputs from this engine (call with num_returns="streaming"): each
        message is a batch [(request id, vLLM RequestOutput | DecodeError)] of everything produced for that front
        end's requests since the last one - typically one engine step for all of them, so a message is paid once per
        step, not once per token and request. With `address` (a ZeroMQ ipc:// address the front end bound on this
        node) the messages go there, pickled, and the stream yields only its opening item, staying open as the
        channel's lifeline; without, they are the stream's items. Requests join with `submit_decode`. When the
        channel ends here (the engine stops, Ray cancels the stream, or the front end stops reading), its requests
        still running are aborted; the front end aborts the requests it gives up on one by one (`abort`). A front end
        that stops reading: on the socket, SOCKET_BACKLOG messages unread; on the Ray stream (called with Ray's
        `_generator_backpressure_num_objects` = `backlog`, as `EngineClient.decode_channel` does), `backlog` messages
        unread hold the stream back, and `backlog` more steps' outputs waiting end it (`Outbox`)."""
        self._live.required()
        channel = self._channels[channel_id] = Outbox(limit=None if address is not None else backlog)
        try:
            async with contextlib.aclosing(send_outputs(channel, channel_id, address)) as outputs:
                async for items in outputs:
                    yield items
        finally:
            if self._channels.get(channel_id) is channel:
                del self._channels[channel_id]

    async def submit_decode(self, channel_id: str, request_id: str, prompt_token_ids: list[int], params: Any,
                            kv_transfer_params: dict[str, Any] | None, continued: int = 0) -> None:
        """Start one request whose outputs go to channel `channel_id` (opened by `decode_channel`). `params` is a
        vLLM SamplingParams (its output_kind chooses deltas or one final output). With `kv_transfer_params` the
        prompt's state is read from the prefill engine they name; without, this engine runs the whole request.
        `continued`: the prompt's last tokens are output tokens the client already has (a first token sampled by the
        prefill engine, or the tokens before a failover); the text of the first new tokens is then detokenized as
        the continuation of those (`_continuation_detokenizer`)."""
        self._live.required()
        self._meter.refuse_if_draining()
        channel = self._channels.get(channel_id)
        if channel is None:
            raise RuntimeError(f"decode channel {channel_id} is not open on engine {self.engine_id}")
        self._start(channel, request_id, prompt_token_ids, params, kv_transfer_params, continued)

    def _start(self, outbox: Outbox, request_id: str, prompt_token_ids: list[int], params: Any,
               kv_transfer_params: dict[str, Any] | None, continued: int = 0) -> asyncio.Task:
        """Start one decode request whose outputs go to `outbox` (a front end's channel, or `decode`'s own); counted
        as a decode until its task ends."""
        remote_id = None
        if kv_transfer_params is not None:
            params = params.clone()
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": kv_transfer_params}
            # the prompt's state is read, not computed here: no prompt logprobs (the prefill engine gives them), and
            # never a request that skips reading it (vLLM's EngineCore dies on the missing blocks)
            params.prompt_logprobs = None
            params.skip_reading_prefix_cache = False
            remote_id = self._verifier.expect(kv_transfer_params)
        self._meter.decode_started()
        task = asyncio.get_running_loop().create_task(
            self._pump(outbox, request_id, prompt_token_ids, params, remote_id, continued, kv_transfer_params is None))
        outbox.tasks.add(task)
        task.add_done_callback(outbox.tasks.discard)
        task.add_done_callback(self._pump_done)
        return task

    def _pump_done(self, _: asyncio.Task) -> None:  # also when cancelled before it ran
        self._meter.decode_done()

    async def _pump(self, channel: "Outbox", request_id: str, prompt_token_ids: list[int], params: Any,
                    verified: str | None = None, continued: int = 0, colocated: bool = False) -> None:
        """Run one request, putting its outputs on its channel. `verified`: the prefill-side id of a request under
        transfer.verify; if its check failed, its error output becomes a DecodeError saying so. `colocated`: the
        engine runs the whole prompt (its prefix-cache hit is counted here; a read's is counted with the read)."""
        detokenizer = self._continuation_detokenizer(prompt_token_ids, continued, params)
        predicted = self.prefixes.predict(prompt_token_ids).checkpoint_tokens if colocated else 0
        generated: list[int] = []  # the output's token ids, for the prefix record (when the engine keeps one)
        track = self.prefixes.record is not None
        from vllm.sampling_params import RequestOutputKind

        cumulative = params.output_kind != RequestOutputKind.DELTA  # each output carries all the tokens so far
        try:
            async for output in self._live.required().generate({"prompt_token_ids": list(prompt_token_ids)}, params,
                                                               request_id=request_id):
                self._meter.served(request_id)
                if colocated:
                    self._totals.cached_prompt_tokens += output.num_cached_tokens or 0
                    self.prefixes.prefilled(prompt_token_ids, predicted, output.num_cached_tokens or 0,
                                            len(prompt_token_ids))
                    colocated = False
                if track and output.outputs:
                    c = output.outputs[0]
                    if cumulative:
                        generated = list(c.token_ids)
                    else:
                        generated.extend(c.token_ids)
                    if c.finish_reason in ("stop", "length"):  # its blocks stay in the cache for the next turn
                        self.prefixes.decoded(list(prompt_token_ids) + generated[:-1])
                if detokenizer is not None and output.outputs:  # deltas (a continuation always streams them)
                    c = output.outputs[0]
                    c.text = "".join(detokenizer.decode_next(token) for token in c.token_ids)
                failure = self._verifier.failure_of(verified) if output.outputs and \
                    output.outputs[0].finish_reason == "error" else None
                if failure is not None:
                    channel.put((request_id, DecodeError(TRANSFER_VERIFY_FAILED, failure)))
                    return
                channel.put((request_id, output))
        except asyncio.CancelledError:  # the engine is stopping or the channel closed: never a silent end
            channel.put((request_id, DecodeError("Cancelled", "the decode engine stopped the request")))
        except Exception as e:  # noqa: BLE001 - the request fails, the engine and channel carry on
            channel.put((request_id, DecodeError(type(e).__name__, str(e)[:500])))
        finally:
            if verified is not None:
                self._verifier.forget(verified)

    def _continuation_detokenizer(self, prompt_token_ids: list[int], continued: int, params: Any) -> Any:
        """A detokenizer for a request whose prompt ends with `continued` output tokens the client already has: vLLM's
        own (`FastIncrementalDetokenizer`), primed with the prompt the client sent and stepped through those tokens,
        so that the new tokens' text continues theirs. vLLM primes a request's detokenizer with its whole prompt, and
        one that ends inside a character (a sent token holding the first bytes of a UTF-8 sequence) is primed
        wrongly: its next text is the whole prompt's. None (vLLM's text stands) for slow tokenizers, requests
        without text, or when priming fails."""
        if not continued:  # every decode request asks: most are not continuations
            return None
        from types import SimpleNamespace

        from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer, uses_fast_detokenizer

        tokenizer = self._live.required().tokenizer
        if tokenizer is None or not uses_fast_detokenizer(tokenizer) or params.detokenize is False:
            return None
        request = SimpleNamespace(request_id="continued", sampling_params=params,
                                  prompt_token_ids=list(prompt_token_ids[:-continued]))
        try:
            detokenizer = FastIncrementalDetokenizer(tokenizer, request)
            for token in prompt_token_ids[-continued:]:
                detokenizer.decode_next(token)
        except Exception as e:  # noqa: BLE001 - vLLM's own text stands
            log.warning("could not prime the continuation's detokenizer: %s", e)
            return None
        return detokenizer

    async def abort(self, request_id: str) -> None:
        engine = self._live()
        if engine is not None:
            await engine.abort(request_id)

    async def release(self, remote_request_ids: list[str]) -> list[str]:
        """Prefill side: free the blocks held for requests no decode engine will read (their decode side failed)."""
        self._live.required()
        freed = await self.ranks.release(list(remote_request_ids))
        return sorted({r for rank in freed for r in rank})

    async def pending_sends(self, wait_s: float = 5.0) -> list[str]:
        """Prefill side: requests whose blocks are still held for a decode engine, after waiting up to `wait_s` for
        the list to drain."""
        self._live.required()
        deadline = time.monotonic() + wait_s
        while True:
            held = sorted({r for rank in await self.ranks.pending_sends() for r in rank})
            if not held or time.monotonic() >= deadline:
                return held
            await asyncio.sleep(0.1)
