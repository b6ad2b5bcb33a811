"""An engine actor's components without an engine (a stand-in for vLLM's `AsyncLLM`; outputs are vLLM's own objects):
`decode`, the plain per-request stream, runs on the same pump as the router's `submit_decode` - its dicts, its
errors, its request accounting, its verification, and its end when the stream is closed early. The real engine:
tests/default_layout/test_http.py and tests/test_faults.py (colocated references and reads through `decode`)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from actors.engine.load import EngineDraining, EngineLoad
from actors.engine.pairs import EnginePairs
from actors.engine.prefix import EnginePrefixes
from actors.engine.procs import LiveEngine
from actors.engine.serving import EngineServing
from actors.engine.verify import EngineVerify
from cluster.core.verify import TRANSFER_VERIFY_FAILED


def output(rid: str, token_ids: list[int], text: str, finish_reason: str | None = None, *, logprobs: bool = False,
           prompt_logprobs: list | None = None, cached: int = 0) -> Any:
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    steps = [{t: Logprob(-0.5), t + 1: Logprob(-0.1)} for t in token_ids] if logprobs else None
    c = CompletionOutput(index=0, text=text, token_ids=list(token_ids), cumulative_logprob=None, logprobs=steps,
                         finish_reason=finish_reason)
    return RequestOutput(rid, None, [1, 2, 3], prompt_logprobs, [c], finished=finish_reason is not None,
                         num_cached_tokens=cached)


class FakeVllm:
    """`AsyncLLM.generate`: `outputs` for every request, a step apart; `hold` keeps the request open after them."""

    tokenizer = None

    def __init__(self, outputs: list[Any], fail: Exception | None = None, hold: bool = False):
        self.outputs, self.fail, self.hold = outputs, fail, hold
        self.params: list[Any] = []
        self.cancelled: list[str] = []

    async def generate(self, request: dict, params: Any, request_id: str):
        self.params.append(params)
        try:
            for out in self.outputs:
                await asyncio.sleep(0.001)
                yield out
            if self.fail is not None:
                raise self.fail
            if self.hold:
                await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise


class Parts:
    """The components as `EngineActor.__init__` wires them, on a stand-in engine."""

    def __init__(self, engine: FakeVllm, verify: float = 0.0):
        self.live = LiveEngine()
        self.live.set(engine)
        self.meter = EngineLoad("decode-0", self.live)
        self.pairs = EnginePairs("decode-0", "decode", "m", "/nowhere", None, self.live,
                                 draining=lambda: self.meter.draining, leftovers=lambda: None)
        self.verifier = EngineVerify("decode-0", 1, None, self.live, self.pairs.totals, self.pairs.prefill_checksums)
        self.verifier.fraction = verify
        self.serving = EngineServing("decode-0", self.live, None, EnginePrefixes(self.pairs.totals), self.meter,
                                     self.verifier, self.pairs.totals)


async def collect(parts: Parts, sampling: dict, kv: dict | None = None) -> list[dict]:
    return [item async for item in parts.serving.decode([1, 2, 3], dict(sampling), kv, "r1")]


def test_decode_streams_the_pumps_outputs_as_dicts():
    outs = [output("r1", [5], "a", logprobs=True, prompt_logprobs=[None, {2: _lp(-1.0)}, {3: _lp(-2.0)}], cached=2),
            output("r1", [6, 7], "bc", "length", logprobs=True)]
    parts = Parts(FakeVllm(outs))
    items = asyncio.run(collect(parts, {"max_tokens": 3, "logprobs": 1, "prompt_logprobs": 1,
                                        "extra_args": {"x": 1}}))
    assert [i["token_ids"] for i in items] == [[5], [6, 7]] and [i["text"] for i in items] == ["a", "bc"]
    assert [i["finish_reason"] for i in items] == [None, "length"]
    assert items[0]["logprobs"] == [[(6, -0.1), (5, -0.5)]]  # ranked, best first
    assert items[0]["prompt_logprobs"] == [None, [(2, -1.0)], [(3, -2.0)]] and "prompt_logprobs" not in items[1]
    params = parts.serving._live().params[0]
    assert params.extra_args == {"x": 1} and params.prompt_logprobs == 1  # colocated: the prompt's logprobs stay
    assert parts.meter.decodes == 0 and parts.meter.first_served() is not None
    assert parts.pairs.totals.cached_prompt_tokens == 2  # a colocated request's own prefix-cache hit


def _lp(value: float) -> Any:
    from vllm.logprobs import Logprob

    return Logprob(value)


def test_decode_of_a_read_asks_for_the_read_and_forgets_its_verification():
    parts = Parts(FakeVllm([output("r1", [5], "a", "length")]), verify=1.0)

    async def run():
        items = await collect(parts, {"max_tokens": 1, "prompt_logprobs": 1}, {"remote_request_id": "p-1"})
        parts.verifier._task.cancel()  # its loop would poll the workers (there are none here)
        return items

    assert [i["token_ids"] for i in asyncio.run(run())] == [[5]]
    params = parts.serving._live().params[0]
    assert params.extra_args == {"kv_transfer_params": {"remote_request_id": "p-1"}}
    assert params.prompt_logprobs is None and params.skip_reading_prefix_cache is False
    assert parts.verifier._expected == set() and parts.meter.decodes == 0


def test_a_failed_check_ends_decode_with_its_error():
    parts = Parts(FakeVllm([output("r1", [], "", "error")]), verify=1.0)
    parts.verifier._failed["p-1"] = "pair p -> d: region 0 differs"

    async def run():
        try:
            await collect(parts, {"max_tokens": 1}, {"remote_request_id": "p-1"})
        finally:
            parts.verifier._task.cancel()

    with pytest.raises(RuntimeError, match=f"{TRANSFER_VERIFY_FAILED}: pair p -> d: region 0 differs"):
        asyncio.run(run())
    assert parts.verifier.failure_of("p-1") is None and parts.meter.decodes == 0


def test_an_engine_error_ends_decode_with_its_kind_after_the_outputs_before_it():
    parts = Parts(FakeVllm([output("r1", [5], "a")], fail=ValueError("bad request")))
    got: list[dict] = []

    async def run():
        async for item in parts.serving.decode([1, 2, 3], {"max_tokens": 4}, None, "r1"):
            got.append(item)

    with pytest.raises(RuntimeError, match="ValueError: bad request"):
        asyncio.run(run())
    assert [i["token_ids"] for i in got] == [[5]] and parts.meter.decodes == 0


def test_closing_decode_early_aborts_its_request():
    engine = FakeVllm([output("r1", [5], "a")], hold=True)
    parts = Parts(engine)

    async def run():
        async with contextlib.aclosing(parts.serving.decode([1, 2, 3], {"max_tokens": 4}, None, "r1")) as items:
            async for item in items:
                assert parts.meter.decodes == 1
                return item

    assert asyncio.run(run())["token_ids"] == [5]
    assert engine.cancelled == ["r1"] and parts.meter.decodes == 0


def test_a_draining_engine_refuses_decode_and_prefill():
    parts = Parts(FakeVllm([]))
    parts.meter.set_draining()
    with pytest.raises(EngineDraining):
        asyncio.run(collect(parts, {"max_tokens": 1}))
    with pytest.raises(EngineDraining):
        asyncio.run(parts.serving.prefill([1, 2, 3], "r2"))
    assert parts.meter.decodes == 0 and parts.pairs.totals.cached_prompt_tokens == 0


def _recorded_releases(parts: Parts) -> list[list[str]]:
    """The remote request ids `EngineServing.release` is asked to free, recorded instead (no workers here)."""
    released: list[list[str]] = []

    async def release(ids):
        released.append(list(ids))
        return ids

    parts.serving.release = release
    return released


def _prefilled_output(rid: str) -> Any:
    out = output(rid, [5], "a", "length")
    out.kv_transfer_params = {"remote_request_id": f"remote-{rid}"}
    return out


def test_a_prefill_submitted_on_a_channel_answers_there_and_a_late_cancel_frees_its_blocks():
    """`submit_prefill`: the answer (`Prefilled`) is the channel's item, not the call's return; `cancel_prefill`
    after it left frees the blocks held for the decode engine that will not read them; an engine error is the
    channel's `DecodeError`; no channel, or a draining engine, refuses the submission itself."""
    from actors.engine.decode_channel import DecodeError, Outbox
    from actors.clients.engine_client import Prefilled

    parts = Parts(FakeVllm([_prefilled_output("p1")]))
    released = _recorded_releases(parts)

    async def run():
        box = parts.serving._channels["c1"] = Outbox()
        assert await parts.serving.submit_prefill("c1", "p1", [1, 2, 3]) is None
        [(rid, answer)] = await asyncio.wait_for(box.take(), 5)
        await parts.serving.cancel_prefill("p1")
        with pytest.raises(RuntimeError, match="not open"):
            await parts.serving.submit_prefill("c2", "p2", [1, 2, 3])
        parts.serving._live.set(FakeVllm([], fail=ValueError("bad prompt")))
        await parts.serving.submit_prefill("c1", "p3", [1, 2, 3])
        [(failed_rid, failure)] = await asyncio.wait_for(box.take(), 5)
        parts.meter.set_draining()
        with pytest.raises(EngineDraining):
            await parts.serving.submit_prefill("c1", "p4", [1, 2, 3])
        return rid, answer, failed_rid, failure

    rid, answer, failed_rid, failure = asyncio.run(run())
    assert rid == "p1" and isinstance(answer, Prefilled) and answer.kv_transfer_params == {"remote_request_id": "remote-p1"}
    assert released == [["remote-p1"]]
    assert failed_rid == "p3" and isinstance(failure, DecodeError) and "bad prompt" in failure.message
    assert parts.serving._prefills == {} and parts.meter._prefills == 0


def test_cancelling_a_prefill_under_way_aborts_it_and_frees_nothing_twice():
    """`cancel_prefill` while the prompt is still in the engine cancels it (vLLM's generate is cancelled: it aborts
    the request); nothing reaches the channel and nothing is released."""
    from actors.engine.decode_channel import Outbox

    engine = FakeVllm([], hold=True)
    parts = Parts(engine)
    released = _recorded_releases(parts)

    async def run():
        box = parts.serving._channels["c1"] = Outbox()
        await parts.serving.submit_prefill("c1", "p1", [1, 2, 3])
        await asyncio.sleep(0.05)
        assert "p1" in parts.serving._prefills
        await parts.serving.cancel_prefill("p1")
        await asyncio.sleep(0.01)
        return box.items

    assert asyncio.run(run()) == [] and engine.cancelled == ["p1"] and released == []
    assert parts.serving._prefills == {}


def test_a_cancel_that_overtakes_its_submission_keeps_the_prefill_from_starting():
    """Ray runs an async actor's calls concurrently: a front end's `cancel_prefill` may arrive before the
    `submit_prefill` it follows. That prefill is then never started (nothing would read or free its blocks)."""
    from actors.engine.decode_channel import Outbox

    engine = FakeVllm([_prefilled_output("p1")])
    parts = Parts(engine)

    async def run():
        box = parts.serving._channels["c1"] = Outbox()
        await parts.serving.cancel_prefill("p1")
        await parts.serving.submit_prefill("c1", "p1", [1, 2, 3])
        await asyncio.sleep(0.05)
        late = list(box.items)
        await parts.serving.submit_prefill("c1", "p1", [1, 2, 3])  # the same id again later: a new request, served
        [(rid, _)] = await asyncio.wait_for(box.take(), 5)
        return late, rid

    assert asyncio.run(run()) == ([], "p1") and len(engine.params) == 1


def _reader(address: str, ready: Any) -> None:
    """A front end's end of a local decode channel, in a process of its own: binds, reads forever."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.bind(address)
    ready.set()
    while True:
        sock.recv()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "streaming"])
def test_a_front_end_killed_ends_its_local_channel_and_aborts_its_requests(tmp_path, busy):
    """A front end SIGKILLed while its requests run: its socket goes with it, nothing else tells the engine (the
    channel's Ray stream carries no more items once the socket does, the socket's queue holds minutes of steps). The
    engine's end of the channel notices the socket close and cancels the requests - vLLM's generate() is cancelled,
    which aborts them - whether they are streaming (checked before each message) or waiting (PEER_CHECK_S)."""
    import multiprocessing
    import os
    import signal
    import time

    from vllm.sampling_params import SamplingParams

    from actors.engine.decode_channel import PEER_CHECK_S

    outs = [output("r1", [5 + i % 7], "x") for i in range(100_000)] if busy else [output("r1", [5], "a")]
    engine = FakeVllm(outs, hold=True)
    parts = Parts(engine)
    address = f"ipc://{tmp_path}/channel"
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    reader = ctx.Process(target=_reader, args=(address, ready), daemon=True)
    reader.start()
    assert ready.wait(60)

    async def run() -> float:
        stream = parts.serving.decode_channel("c1", address)
        assert await stream.__anext__() == []
        ended = asyncio.ensure_future(stream.__anext__())
        await parts.serving.submit_decode("c1", "r1", [1, 2, 3], SamplingParams(max_tokens=10**6), None)
        await asyncio.sleep(0.5)
        assert not ended.done() and engine.cancelled == []  # the front end lives: the request runs on
        os.kill(reader.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(ended, 10)
        await asyncio.sleep(0.05)  # the cancelled pump's last words
        return time.monotonic() - t0

    took = asyncio.run(run())
    reader.join(10)
    print(f"{'streaming' if busy else 'idle'} channel ended {took:.3f} s after its front end was killed")
    assert engine.cancelled == ["r1"] and parts.serving._channels == {}
    assert took < (0.5 if busy else PEER_CHECK_S + 0.5)
