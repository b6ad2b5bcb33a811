"""The engine-output channel, both ends of its protocol: one stream per (front end, engine) carrying every output
the engine produced for that front end's requests - decode outputs, and the answers of prefills submitted with
`EngineClient.submit_prefill` (an item (request id, Prefilled)).

Protocol. The front end opens a channel on an engine (`EngineClient.decode_channel`, a Ray streaming call) and then
submits requests to it (`EngineClient.submit_decode` or `submit_prefill`, naming the channel). Each message is a
batch [(request id, vLLM RequestOutput | Prefilled | DecodeError)] of everything produced since the last one - typically
one engine step for all of the front end's requests there - so a message is paid once per step, not once per token and
request.
  - On one node the messages go over a ZeroMQ socket on a Unix path in a directory private to the front end (0700):
    the front end binds a PULL socket and passes its ipc:// address; the engine connects a PUSH socket and says hello
    on it first (an empty batch). The Ray stream then yields only its opening item and stays open as the channel's
    lifeline: it breaks when the engine dies, failing every request on the channel.
  - Across nodes (or without a socket) the messages are the Ray stream's own items.
  - A front end that stops reading is bounded: SOCKET_BACKLOG unread messages on the socket end the channel; on the
    Ray stream, `backlog` unread messages hold the engine back (Ray's generator backpressure) and as many more steps'
    outputs waiting end it. Ending a channel on the engine's side aborts its requests still running.
  - A request that fails inside the engine arrives as a `DecodeError`; one the front end gives up on is aborted with
    `EngineClient.abort`.

Engine end: `Outbox` (a channel's pending outputs) and `send_outputs` (the loop behind `EngineActor.decode_channel`).
Front-end end: `DecodeChannel` (reads a channel, hands outputs to each request's `Inbox`, and watches for a hung
engine).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import logging
import os
import pickle
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import zmq

from actors.clients.engine_client import HEALTH_TIMEOUT_S, EngineClient, error_text

log = logging.getLogger("pd.channel")
SOCKET_BACKLOG = 10_000  # decode-channel messages a front end may leave unread on the socket before its channel ends
HELLO_TIMEOUT_S = 10.0  # a decode engine must reach a new channel's local socket within this
NODE_TIMEOUT_S = 10.0  # an engine that does not say which node it runs on within this gets the Ray stream
PEER_CHECK_S = 1.0  # an idle local channel checks this often whether its front end's socket is still there
STALL_S = 5.0  # a decode stream (or a prefill) silent this long has its engine's health asked; a hung one fails over


def probe_timeout_s(stall_s: float) -> float:
    """How long a stalled stream's (or prefill's) health question may take: an engine's actor answers it from
    memory within milliseconds, even mid-step; one that does not within this is counted slow (twice in a row: hung)."""
    return min(HEALTH_TIMEOUT_S, max(stall_s, 3.0))


class EngineStuck(RuntimeError):
    """An engine alive but not serving: a request had nothing from it for the stall time and `EngineClient.stuck`
    said so (a decode channel's watchdog, the router's wait for a prefill)."""


@dataclass(frozen=True)
class DecodeError:
    """A request (decode or prefill) that failed inside the engine, as a channel item: the exception's type name and
    message."""

    kind: str
    message: str


# ---- the engine's end ----------------------------------------------------------------------------------------------
class Outbox:
    """One decode channel's pending outputs; `take` waits for at least one and returns all. Past `limit` engine
    steps' worth of outputs waiting (`limit` x the requests on the channel) - the channel's reader stopped reading and
    its stream is held back by Ray's backpressure - it overflows: every request on it is cancelled (aborted in the
    engine, its blocks freed) rather than kept decoding into memory for nobody."""

    def __init__(self, limit: int | None = None) -> None:
        self.items: list[tuple[str, Any]] = []
        self.ready = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.limit = limit
        self.overflowed = False

    def put(self, item: tuple[str, Any]) -> None:
        self.items.append(item)
        self.ready.set()
        if self.limit is not None and not self.overflowed and len(self.items) > self.limit * max(1, len(self.tasks)):
            self.overflowed = True
            for task in list(self.tasks):
                task.cancel()

    async def take(self) -> list[tuple[str, Any]]:
        await self.ready.wait()
        await asyncio.sleep(0)  # let the other requests of this engine step add theirs
        items, self.items = self.items, []
        self.ready.clear()
        return items


def push_socket(address: str) -> "zmq.Socket":
    """The engine's end of a decode channel's local socket (sends never block: see SOCKET_BACKLOG)."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SOCKET_BACKLOG)
    sock.connect(address)
    return sock


async def send_outputs(outbox: Outbox, channel_id: str, address: str | None) -> AsyncIterator[list]:
    """The engine's end of one channel: yields the opening item (an empty batch: requests may join from now on), then
    each batch taken from `outbox` - or, with `address`, sends them on the front end's socket instead (after a hello)
    and yields nothing more while the channel lasts. When it ends (the engine stops, Ray cancels the stream, the front
    end stops reading, or its socket closes), the requests still running on it are cancelled: their generate()
    aborts them in the engine.

    A front end that dies (SIGKILL, OOM) takes its socket with it, but neither the channel's Ray stream - which
    yields nothing more once the socket carries the messages, so Ray never finds the reader gone - nor the socket's
    queue (SOCKET_BACKLOG messages, minutes of steps) would tell: its requests would decode to their last token for
    nobody. The socket's monitor does, at once: the front end's end disconnecting ends the channel (checked before
    each message, and every PEER_CHECK_S while none is sent)."""
    sock = monitor = None
    try:
        if address is not None:
            sock = push_socket(address)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.send(pickle.dumps([]), zmq.NOBLOCK)  # hello: the front end opens the channel once it arrives
        yield []
        while True:
            if monitor is None:
                items = await outbox.take()
            else:
                try:
                    items = await asyncio.wait_for(outbox.take(), PEER_CHECK_S)
                except asyncio.TimeoutError:
                    items = None
                if monitor.poll(0):
                    log.warning("decode channel %s: the front end's socket closed (the front end is gone); ended its "
                                "%d requests", channel_id, len(outbox.tasks))
                    return
                if items is None:
                    continue
            if outbox.overflowed:
                log.warning("decode channel %s: the front end stopped reading its stream; ended its requests",
                            channel_id)
                return
            if sock is None:
                yield items
                continue
            try:
                sock.send(pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)
            except zmq.Again:  # SOCKET_BACKLOG messages unread: the front end is gone or wedged
                log.warning("decode channel %s: the front end stopped reading; ending its requests", channel_id)
                return
    finally:
        for task in list(outbox.tasks):
            task.cancel()
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        if sock is not None:
            sock.close(linger=0)


# ---- the front end's end --------------------------------------------------------------------------------------------

class Inbox:
    """One request's outputs as they arrive from its decode channel. Deltas that pile up while the consumer is busy
    are merged into one output (vLLM's own `RequestOutput.add`), so a slow client costs a merge, not a backlog."""

    def __init__(self, channel: "DecodeChannel", request_id: str, delta: bool):
        self.channel, self.request_id, self.delta = channel, request_id, delta
        self.items: collections.deque = collections.deque()
        self.ready = asyncio.Event()

    def put(self, out: Any) -> None:
        last = self.items[-1] if self.items else None
        if self.delta and hasattr(last, "outputs") and hasattr(out, "outputs"):
            last.add(out, aggregate=True)
        else:
            self.items.append(out)
        self.ready.set()

    async def get(self) -> Any:
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        return self.items.popleft()

    def leave(self) -> None:
        self.channel.inboxes.pop(self.request_id, None)


class DecodeChannel:
    """This front end's one stream of outputs from one decode engine (`EngineActor.decode_channel`): each message
    carries everything the engine produced for our requests since the last one, and is handed out to the requests'
    inboxes. With `local` and the engine on this node, the messages arrive on a ZeroMQ PULL socket bound in this
    process's private directory (the engine says hello on it first: an empty batch) and the Ray stream carries only
    its opening; otherwise they are the Ray stream's items. Either way, when the Ray stream breaks (the engine died
    or left) every request on the channel fails."""

    def __init__(self, engine_id: str, engine: EngineClient, local: bool = False, stall_s: float = STALL_S):
        self.engine_id, self.engine, self.stall_s = engine_id, engine, stall_s
        self.last_message = time.monotonic()  # when the engine last sent anything on the channel
        self._joined = self.last_message  # when the channel last went from no request waiting to one
        self.id = f"{engine_id}/{uuid.uuid4().hex[:12]}"
        self.inboxes: dict[str, Inbox] = {}
        self.closed = False
        self.unreachable = False  # the engine never said hello on the local socket
        self.error: BaseException = RuntimeError(f"the decode stream from {engine_id} ended")
        self.loop = asyncio.get_running_loop()
        self.transport = "ray"  # "zmq" once the local socket is bound
        self.received = {"ray": 0, "zmq": 0}  # messages received by way of each (openings included)
        self._local = local
        self._hello = asyncio.Event()
        self._open = self.loop.create_future()
        self._reader = asyncio.ensure_future(self._read())
        self._watch = asyncio.ensure_future(self._watchdog())

    async def opened(self) -> None:
        await asyncio.shield(self._open)

    async def _watchdog(self) -> None:
        """A hung engine sends nothing and its Ray stream stays open: while requests wait on the channel and nothing
        has come for `stall_s`, ask whether the engine is stuck (`EngineClient.stuck`: failed - not stepping - or dead,
        or no answer to its health twice in a row); if so, end the channel: its requests fail over as for a dead
        engine. A healthy (busy) engine is asked again after another `stall_s`. Late outputs, should it
        continue, reach no inbox."""
        try:
            while not self.closed:
                await asyncio.sleep(min(1.0, self.stall_s / 4))
                silent = time.monotonic() - max(self.last_message, self._joined)
                if not self.inboxes or silent < self.stall_s:
                    continue
                verdict = await self.engine.stuck(probe_timeout_s(self.stall_s))  # the rule: `EngineClient.stuck`
                if verdict is None:  # healthy (busy): asked again after another stall_s of silence
                    self.last_message = time.monotonic()
                    continue
                silent = time.monotonic() - max(self.last_message, self._joined)
                if silent < self.stall_s:  # it spoke while being asked
                    continue
                self.error = EngineStuck(f"no output from decode engine {self.engine_id} for {silent:.1f} s, and it "
                                          f"is {verdict.why}")
                log.warning("decode channel %s: %s; its %d requests fail over", self.id, self.error, len(self.inboxes))
                self._reader.cancel()
                return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the watchdog must not die silently
            log.warning("decode channel %s: watchdog failed: %s", self.id, e)

    def join(self, request_id: str, delta: bool = True) -> Inbox:
        if not self.inboxes:  # silence counts from the first request waiting, not from an idle channel's last message
            self._joined = time.monotonic()
        inbox = self.inboxes[request_id] = Inbox(self, request_id, delta)
        if self.closed:  # broke between opening and now: fail at once rather than wait for nothing
            inbox.put(self.error)
        return inbox

    def _deliver(self, batch: list[tuple[str, Any]], via: str) -> None:
        self.received[via] += 1
        self.last_message = time.monotonic()
        for request_id, out in batch:
            inbox = self.inboxes.get(request_id)
            if inbox is not None:
                inbox.put(out)

    def _bind(self) -> tuple[Any, str] | None:
        """The local PULL socket and its address, or None (then the Ray stream carries everything)."""
        import zmq

        path = os.path.join(_socket_dir(), f"{uuid.uuid4().hex[:16]}.sock")
        sock = _zmq_context().socket(zmq.PULL)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"ipc://{path}")
        except zmq.ZMQError as e:  # e.g. a path too long for a Unix socket
            log.warning("decode channel %s: no local socket (%s); outputs over the Ray stream", self.id, e)
            sock.close(linger=0)
            return None
        self.transport = "zmq"
        return sock, path

    async def _read(self) -> None:
        sock = path = pump = stream = None
        ended = False
        try:
            if self._local and await _same_node(self.engine):
                bound = self._bind()
                if bound is not None:
                    sock, path = bound
                    pump = asyncio.ensure_future(self._pump(sock))
            stream = self.engine.decode_channel(self.id, f"ipc://{path}" if path else None)
            async for ref in stream:
                batch = await ref
                if not self._open.done():
                    if sock is not None:  # the engine's hello on the socket: it can reach us
                        try:
                            await asyncio.wait_for(self._hello.wait(), HELLO_TIMEOUT_S)
                        except asyncio.TimeoutError:
                            self.unreachable = True
                            raise RuntimeError(f"decode engine {self.engine_id} did not reach this front end's "
                                               f"socket within {HELLO_TIMEOUT_S:.0f} s") from None
                    self._open.set_result(None)
                self._deliver(batch, "ray")
            ended = True
        except Exception as e:  # noqa: BLE001 - RayActorError and friends: every request on it fails
            self.error = e
        finally:
            if pump is not None:
                pump.cancel()
            if stream is not None and not ended:  # we stopped reading: end the engine's side of the channel too
                with contextlib.suppress(Exception):
                    import ray

                    ray.cancel(stream)
            if sock is not None:
                with contextlib.suppress(Exception):  # what the engine sent before its stream ended still counts
                    self._drain(sock)
                sock.close(linger=0)
                with contextlib.suppress(OSError):
                    os.unlink(path)
            self.closed = True
            if self._watch is not asyncio.current_task():
                self._watch.cancel()
            if not self._open.done():
                self._open.set_exception(self.error)
            for inbox in list(self.inboxes.values()):
                inbox.put(self.error)

    def _drain(self, sock: Any) -> None:
        """Hand out every message waiting on the socket (never awaits: a message is never left in a future)."""
        import zmq

        raw = zmq.Socket.shadow(sock.underlying)
        while True:
            try:
                message = raw.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            batch = pickle.loads(message)
            if not batch:
                self._hello.set()
            self._deliver(batch, "zmq")

    async def _pump(self, sock: Any) -> None:
        """Messages from the local socket (pickled by the engine actor: same user, a private directory). A broken
        socket or message closes the channel like a broken stream: its requests fail instead of waiting."""
        import zmq

        try:
            while True:
                await sock.poll(flags=zmq.POLLIN)
                self._drain(sock)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self.error = RuntimeError(f"the decode socket from {self.engine_id} broke: {error_text(e)}")
            self._reader.cancel()


_SOCKET_DIR: str | None = None


def _socket_dir() -> str:
    """This process's private directory (0700) for decode-channel sockets, removed at exit."""
    global _SOCKET_DIR
    if _SOCKET_DIR is None or not os.path.isdir(_SOCKET_DIR):
        _SOCKET_DIR = tempfile.mkdtemp(prefix="pd-router-")
        atexit.register(shutil.rmtree, _SOCKET_DIR, True)
    return _SOCKET_DIR


def _zmq_context() -> Any:
    import zmq.asyncio

    return zmq.asyncio.Context.instance()


async def _same_node(engine: EngineClient) -> bool:
    """Whether the engine runs on this process's Ray node (False when that cannot be told: then the Ray stream)."""
    try:
        import ray

        return await asyncio.wait_for(engine.node_id(), NODE_TIMEOUT_S) == \
            ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - an engine without the call, or gone: the Ray stream decides
        return False
