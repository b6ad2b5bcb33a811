"""The one way to talk to an engine actor: `EngineClient`, and the typed messages that cross to and from it.

Everything outside `actors/engine/` - the router, the coordinator, the pools, the HTTP front end, the launcher,
the benchmarks and the tests - holds an `EngineClient`, never a bare actor handle. Each engine method starts one call on
the engine actor and returns what Ray returns for it: an `ObjectRef` (await it in async code, `ray.get` it
elsewhere) or, for the two output streams, an `ObjectRefGenerator` (besides them: `named`, `kill`, and `verdict`, a
coroutine). What comes back is a dataclass where the project defines the
shape (`Registration`, `Leftovers`, `Prefilled`, `Load`, `Busy`, `Health`, `TransferTotals`); vLLM's own types
(`SamplingParams`, `RequestOutput`) and vLLM's `kv_transfer_params` (a dict vLLM's connector API defines) cross as
they are, and so do the workers' own JSON reports (each rank's registration report and transfer records, which the
connector writes and the planner reads).

    client = EngineClient(handle, "decode-1")       # or EngineClient.named("decode-1", namespace)
    await client.start()                            # the startup seconds
    verdict = await client.verdict()                # healthy / starting / failed / dead / unreachable / slow
    prefilled = await prefill_client.prefill(prompt, "req-1")
    await client.submit_decode(channel_id, "req-1", prompt, params, prefilled.kv_transfer_params)

One health verdict for everyone who asks (the coordinator's watch and a router's report of a failed request, the
pools' Serve health checks): `EngineClient.verdict`.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError

if TYPE_CHECKING:
    from ray import ObjectRef, ObjectRefGenerator

    from cluster.core.metrics import TransferTotals
    from cluster.core.prefix import EngineView, PrefixRoots

ENGINE_PREFIX = "pd-engine-"  # engines are named actors "pd-engine-<engine id>" in the coordinator's namespace
# decode-channel messages (engine steps) a front end may leave unread on a Ray stream before the engine stops sending
# (Ray's backpressure); as many more steps waiting end its requests (`EngineActor.decode_channel`)
CHANNEL_BACKLOG = 1000
# request ids of a negotiated pair's first transfer (`actors.control.coordinator`), which serves nobody: not an engine's
# first served request
WARMUP_REQUEST_PREFIX = "pd-warmup-"
HEALTH_TIMEOUT_S = 10.0  # an engine slower than this to answer its health question is busy, not dead

State = Literal["healthy", "starting", "failed", "dead", "unreachable", "slow", "unresponsive"]


# ---- messages -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Health:
    """What an engine actor says of itself (`EngineClient.health`)."""

    started: bool
    healthy: bool
    why: str = ""  # why not healthy, when the engine knows (e.g. it is not stepping)


@dataclass(frozen=True)
class Verdict:
    """`state`: healthy (started, its EngineCore answers) · starting (its vLLM engine is not built yet) · failed (its
    vLLM engine failed) · dead (the actor is gone) · unreachable (Ray cannot reach it right now: often a death Ray
    has not confirmed yet, ask again shortly) · slow (no answer within the timeout: a busy engine, not a dead one) ·
    unresponsive (slow or unreachable for longer than `Silence`'s limit: the actor itself is stuck). `why` says it
    in words."""

    state: State
    why: str

    @property
    def gone(self) -> bool:
        """The engine will not serve again: take it out of the cluster."""
        return self.state in ("failed", "dead", "unresponsive")


UNRESPONSIVE_S = float(os.environ.get("PD_ENGINE_UNRESPONSIVE_S", "60"))


class Silence:
    """How long an engine has gone without answering its health: slow or unreachable verdicts in a row, from the
    first. One busy moment is not a death (a slow answer is waited for), but an actor that answers nothing for
    `limit_s` (SIGSTOPped whole, a wedged event loop) is `unresponsive`: it will not be trusted again - the
    coordinator takes it out of every pair and its pool replica fails its health check, so Serve replaces it."""

    def __init__(self, limit_s: float = UNRESPONSIVE_S):
        self.limit_s = limit_s
        self.since: float | None = None  # the first of the unanswered health questions in a row

    def saw(self, verdict: "Verdict", now: float | None = None) -> "Verdict":
        """`verdict`, or an unresponsive one once the silence has lasted longer than `limit_s`."""
        now = time.monotonic() if now is None else now
        if verdict.state not in ("slow", "unreachable"):
            self.since = None
            return verdict
        if self.since is None:
            self.since = now
        if now - self.since > self.limit_s:
            return Verdict("unresponsive", f"unresponsive: no health answer for {now - self.since:.0f} s "
                                           f"({verdict.why})")
        return verdict


@dataclass(frozen=True)
class Busy:
    """What keeps a draining engine from leaving (`EngineClient.busy`): requests in prefill or decode on it, requests
    vLLM's front end still tracks, and the ids of requests its scheduler still holds (on a prefill engine: prefilled
    state no decode engine has read yet)."""

    prefills: int = 0
    decodes: int = 0
    unfinished: int = 0
    held: tuple[str, ...] = ()

    @property
    def idle(self) -> bool:
        return not (self.prefills or self.decodes or self.unfinished or self.held)

    def counts(self) -> dict[str, int]:
        """As numbers (held: how many), for logs and the pools' leave events."""
        return {"prefills": self.prefills, "decodes": self.decodes, "unfinished": self.unfinished, "held": len(self.held)}


@dataclass(frozen=True)
class Load:
    """An engine's load, the pools' autoscaling signal (`EngineClient.load`): prompt tokens queued or in prefill,
    sequences being decoded, and the fraction of its KV/state blocks in use (None while it cannot be read: unknown,
    not empty)."""

    queued_prompt_tokens: float = 0.0
    running_requests: float = 0.0
    cache_usage: float | None = None

    def metrics(self) -> dict[str, float]:
        """As Serve's custom autoscaling metrics (`actors.control.autoscale.SIGNALS` names); an unreadable usage is left
        out."""
        out = {"queued_prompt_tokens": self.queued_prompt_tokens, "running_requests": self.running_requests}
        if self.cache_usage is not None:
            out["cache_usage"] = self.cache_usage
        return out


@dataclass(frozen=True)
class Prefilled:
    """A prefill engine's answer (`EngineClient.prefill`): the transfer parameters a decode engine reads the prompt's
    state with (vLLM's `kv_transfer_params`), vLLM's prompt logprobs when they were asked for, and - when the
    prefill engine sampled the first token - that token's vLLM `RequestOutput` (else None)."""

    kv_transfer_params: dict[str, Any]
    prompt_logprobs: Any = None
    first: Any = None


@dataclass(frozen=True)
class Leftovers:
    """What an engine's processes would leave on its node if they were killed (`EngineClient.leftovers`; a graceful
    shutdown removes it all): its shared-memory files, its private TMPDIR, and the processes themselves as (pid,
    start time) - what the coordinator keeps per engine: where to sweep (`actors.engine.procs.sweep_node`) once the
    engine is known dead, and what tests and benchmarks check is gone."""

    node_id: str
    shm: tuple[str, ...]
    tmpdir: str
    procs: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Registration:
    """What an engine tells the coordinator when it registers (`EngineClient.registration`): its id, role, served
    model name and Hugging Face config, each TP rank's report in rank order (the workers' JSON: NIXL agent metadata,
    region base addresses, and the run-time `layout` vLLM built), whether it is draining (a restarted coordinator
    rebuilding its registry finds engines mid-drain), and what it would leave behind if killed."""

    engine_id: str
    role: str
    model: str
    hf_config: dict[str, Any]
    ranks: list[dict[str, Any]]
    draining: bool = False
    leftovers: Leftovers | None = None

    @property
    def layout(self) -> dict[str, Any]:
        """Rank 0's run-time layout report (every rank must report the same)."""
        return self.ranks[0]["layout"]


# ---- the client -----------------------------------------------------------------------------------------------------
class EngineClient:
    """One engine actor (`actors.engine.actor.EngineActor`), by handle. Picklable (it crosses Ray inside the
    coordinator's answers); two clients of one actor are equal."""

    def __init__(self, handle: Any, engine_id: str | None = None):
        self.handle, self.engine_id = handle, engine_id

    @classmethod
    def named(cls, engine_id: str, namespace: str) -> "EngineClient":
        """The named engine actor of `engine_id` (ValueError once it has gone)."""
        return cls(ray.get_actor(f"{ENGINE_PREFIX}{engine_id}", namespace=namespace), engine_id)

    def __repr__(self) -> str:
        return f"EngineClient({self.engine_id or self.handle})"

    @property
    def actor_id(self) -> str:
        """The Ray actor's id (hex), as the actor's runtime context gives it - what its TMPDIR's owner file names
        (`actors.engine.procs.private_tmpdir`). Ray's handle has no public accessor for it."""
        return self.handle._actor_id.hex()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineClient) and self.handle == other.handle

    def __hash__(self) -> int:
        return hash(self.handle)

    # ---- life ------------------------------------------------------------------------------------------------------
    def start(self, timeout_s: float | None = None) -> "ObjectRef[float]":
        """Build the vLLM engine (once); the startup seconds."""
        return self.handle.start.remote(*(() if timeout_s is None else (timeout_s,)))

    def phase(self) -> "ObjectRef[str]":
        """What the engine is doing while it starts ("loading vLLM", "warming up (logprobs)", "started")."""
        return self.handle.phase.remote()

    def start_report(self) -> "ObjectRef[dict[str, Any]]":
        """How its start went: vLLM's load, the warm-up by phase, the whole start (`EngineActor.start_report`)."""
        return self.handle.start_report.remote()

    def ready(self) -> "ObjectRef[None]":
        """The actor exists (its constructor ran); says nothing of the vLLM engine."""
        return self.handle.__ray_ready__.remote()

    def health(self) -> "ObjectRef[Health]":
        return self.handle.health.remote()

    async def verdict(self, timeout_s: float = HEALTH_TIMEOUT_S) -> Verdict:
        """The verdict everyone acts on: asks the engine (`health`) and reads Ray's errors."""
        try:
            health: Health = await asyncio.wait_for(self.health(), timeout_s)
        except ActorDiedError as e:
            return Verdict("dead", f"dead ({type(e).__name__})")
        except ActorUnavailableError as e:
            return Verdict("unreachable", f"unreachable ({type(e).__name__})")
        except asyncio.TimeoutError:
            return Verdict("slow", f"no answer within {timeout_s:.0f} s")
        except Exception as e:  # noqa: BLE001 - any other failure to answer: treated like a slow engine, not a death
            return Verdict("slow", f"could not answer ({type(e).__name__}: {e})")
        if not health.started:
            return Verdict("starting", "its vLLM engine is starting")
        if not health.healthy:
            return Verdict("failed", f"unhealthy ({health.why or 'its vLLM engine failed'})")
        return Verdict("healthy", f"healthy ({health.why})" if health.why else "healthy")

    async def stuck(self, timeout_s: float) -> Verdict | None:
        """The one rule for an engine gone silent under a request (a decode stream without output, a prefill without
        an answer, both for the stall time): its verdict when it is stuck - failed (not stepping) or dead, or no
        healthy answer to its health twice in a row, the second asked at once - else None (healthy: a busy engine,
        waited for)."""
        verdict = await self.verdict(timeout_s)
        if verdict.state != "healthy" and not verdict.gone:  # slow to answer once: asked again at once
            verdict = await self.verdict(timeout_s)
        return None if verdict.state == "healthy" else verdict

    def shutdown(self, timeout_s: float = 30.0) -> "ObjectRef[list[str]]":
        """Stop the vLLM engine and its processes; the shared-memory and TMPDIR files removed. Then `kill`."""
        return self.handle.shutdown.remote(timeout_s)

    def kill(self) -> None:
        """End the actor (no restart)."""
        ray.kill(self.handle, no_restart=True)

    def node_id(self) -> "ObjectRef[str]":
        return self.handle.node_id.remote()

    def pids(self) -> "ObjectRef[list[int]]":
        """The actor's pid, then every process vLLM started under it."""
        return self.handle.pids.remote()

    def rss_bytes(self) -> "ObjectRef[int]":
        return self.handle.rss_bytes.remote()

    def leftovers(self) -> "ObjectRef[Leftovers]":
        """What the engine would leave on its node if killed (`actors.engine.procs.sweep_node` removes it)."""
        return self.handle.leftovers.remote()

    def side_channel_port(self) -> "ObjectRef[int]":
        return self.handle.side_channel_port.remote()

    def cores(self) -> "ObjectRef[tuple[int, ...]]":
        """The cores this engine owns on its node (`actors.host.cores`); () when its pool shares cores."""
        return self.handle.cores.remote()

    def resumable(self, prompt_token_ids: list[int]) -> "ObjectRef[EngineView]":
        """What of this prompt the engine can resume, and its load (cache-aware routing, `cluster.core.prefix`)."""
        return self.handle.resumable.remote(prompt_token_ids)

    def prefix_roots(self, known: tuple[int, int] | None = None) -> "ObjectRef[PrefixRoots | None]":
        """The first-block hashes the engine may resume prompts from (`EngineActor.prefix_roots`)."""
        return self.handle.prefix_roots.remote(known)

    def prefix_record(self) -> "ObjectRef[dict[str, Any]]":
        """The engine's prefix record's size (`EngineActor.prefix_record`)."""
        return self.handle.prefix_record.remote()

    # ---- registration and pairs (the coordinator's side) ----------------------------------------------------------
    def registration(self) -> "ObjectRef[Registration]":
        """What the coordinator's `register` takes."""
        return self.handle.registration.remote()

    def register(self, coordinator: Any, registration: Registration | None = None) -> "ObjectRef[dict[str, Any]]":
        """The engine registers itself with `coordinator` (an edited `registration` tests what it refuses)."""
        return self.handle.register.remote(coordinator, registration)

    def install_pair(self, prefill_engine_id: str, payload: str) -> "ObjectRef[list[list[int]]]":
        """Give every decode rank the negotiated plan (JSON payload) for one prefill engine."""
        return self.handle.install_pair.remote(prefill_engine_id, payload)

    def install_pairs(self, plans: list[tuple[str, str]]) -> "ObjectRef[None]":
        return self.handle.install_pairs.remote(plans)

    def remove_pair(self, prefill_engine_id: str) -> "ObjectRef[None]":
        return self.handle.remove_pair.remote(prefill_engine_id)

    def remote_agents(self, prefill_engine_id: str) -> "ObjectRef[list[dict[str, bool]]]":
        return self.handle.remote_agents.remote(prefill_engine_id)

    def nixl_knows(self, agent_names: list[str]) -> "ObjectRef[list[list[bool]]]":
        return self.handle.nixl_knows.remote(agent_names)

    def delayed_handshakes(self) -> "ObjectRef[list[int]]":
        """Test hook: per decode rank, handshakes that have entered the `set_handshake_delay` delay."""
        return self.handle.delayed_handshakes.remote()

    def stale_handshakes(self) -> "ObjectRef[list[int]]":
        return self.handle.stale_handshakes.remote()

    def set_handshake_delay(self, seconds: float) -> "ObjectRef[None]":
        """Test hook: every decode rank's NIXL handshakes take `seconds` longer."""
        return self.handle.set_handshake_delay.remote(seconds)

    # ---- serving ---------------------------------------------------------------------------------------------------
    def generate(self, **request: Any) -> "ObjectRef[dict[str, Any]]":
        """One request run whole on this engine, to completion (`EngineActor.generate`'s keywords: prompt or
        prompt_token_ids, max_tokens, temperature, logprobs, ignore_eos, extra_args) - references and warm-ups."""
        return self.handle.generate.remote(**request)

    def prefill(self, prompt_token_ids: list[int], request_id: str, *, prompt_logprobs: int | None = None,
                first_token: Any = None, continued: int = 0) -> "ObjectRef[Prefilled]":
        """Run the prompt with remote decode requested (see `EngineActor.prefill`)."""
        return self.handle.prefill.remote(prompt_token_ids, request_id, prompt_logprobs, first_token, continued)

    def decode(self, prompt_token_ids: list[int], sampling: dict[str, Any], kv_transfer_params: dict[str, Any] | None,
               request_id: str) -> "ObjectRefGenerator":
        """One request's new tokens as a stream of {"token_ids", "text", "finish_reason"[, "logprobs"]} per step,
        reading the prompt's state with `kv_transfer_params` (None: the engine runs the prompt itself). A plain
        path for tests and benchmarks; the router uses `decode_channel` + `submit_decode`."""
        return self.handle.decode.options(num_returns="streaming").remote(
            prompt_token_ids, sampling, kv_transfer_params, request_id)

    def decode_channel(self, channel_id: str, address: str | None = None,
                       backlog: int = CHANNEL_BACKLOG) -> "ObjectRefGenerator":
        """A front end's one stream of batched decode outputs from this engine (see `EngineActor.decode_channel`):
        with Ray's backpressure, at most `backlog` messages unread; a reader that leaves them so has its requests
        ended by the engine."""
        return self.handle.decode_channel.options(num_returns="streaming", _generator_backpressure_num_objects=backlog
                                                  ).remote(channel_id, address, backlog)

    def submit_decode(self, channel_id: str, request_id: str, prompt_token_ids: list[int], params: Any,
                      kv_transfer_params: dict[str, Any] | None, continued: int = 0) -> "ObjectRef[None]":
        """Start one request whose outputs go to channel `channel_id` (see `EngineActor.submit_decode`)."""
        return self.handle.submit_decode.remote(channel_id, request_id, prompt_token_ids, params, kv_transfer_params,
                                                continued)

    def submit_prefill(self, channel_id: str, request_id: str, prompt_token_ids: list[int],
                       prompt_logprobs: int | None = None, first_token: Any = None,
                       continued: int = 0) -> "ObjectRef[None]":
        """Start a prefill whose answer (`Prefilled`) comes on channel `channel_id` (see `EngineActor.submit_prefill`)."""
        return self.handle.submit_prefill.remote(channel_id, request_id, prompt_token_ids, prompt_logprobs,
                                                 first_token, continued)

    def cancel_prefill(self, request_id: str) -> "ObjectRef[None]":
        """Stop a prefill started with `submit_prefill`, or free what it holds if it already answered."""
        return self.handle.cancel_prefill.remote(request_id)

    def abort(self, request_id: str) -> "ObjectRef[None]":
        return self.handle.abort.remote(request_id)

    def release(self, remote_request_ids: list[str]) -> "ObjectRef[list[str]]":
        """Prefill side: free the state held for requests no decode engine will read; the ids freed."""
        return self.handle.release.remote(list(remote_request_ids))

    def borrowed(self) -> "ObjectRef[dict[str, Any] | None]":
        """Core lending: the engine's steps and those that also ran on idle engines' cores (None: it does not
        borrow)."""
        return self.handle.borrowed.remote()

    def pending_sends(self, wait_s: float = 5.0) -> "ObjectRef[list[str]]":
        """Prefill side: requests whose state is still held for a decode engine (after waiting up to `wait_s`)."""
        return self.handle.pending_sends.remote(wait_s)

    # ---- load and draining ----------------------------------------------------------------------------------------
    def load(self) -> "ObjectRef[Load]":
        return self.handle.load.remote()

    def busy(self) -> "ObjectRef[Busy]":
        return self.handle.busy.remote()

    def set_draining(self) -> "ObjectRef[None]":
        """Refuse new requests from now on (what is in flight carries on)."""
        return self.handle.set_draining.remote()

    def first_served(self) -> "ObjectRef[float | None]":
        """Wall time of the engine's first served request (None: none yet)."""
        return self.handle.first_served.remote()

    def free_blocks(self) -> "ObjectRef[int]":
        return self.handle.free_blocks.remote()

    def num_unfinished(self) -> "ObjectRef[int]":
        return self.handle.num_unfinished.remote()

    # ---- transfers and transfer.verify ------------------------------------------------------------------------------
    def transfer_stats(self) -> "ObjectRef[list[dict[str, Any]]]":
        """Per request and decode rank, the NIXL reads' records (the workers' format; drained on read)."""
        return self.handle.transfer_stats.remote()

    def transfer_totals(self) -> "ObjectRef[TransferTotals]":
        return self.handle.transfer_totals.remote()

    def set_verify(self, fraction: float | str) -> "ObjectRef[None]":
        return self.handle.set_verify.remote(fraction)

    def verify_timings(self) -> "ObjectRef[list[float]]":
        return self.handle.verify_timings.remote()

    def checksums(self, items: list[tuple[int, int, list[int], list[int]]]) -> "ObjectRef[dict[int, int]]":
        """Prefill side: CRC-32 of byte ranges of this engine's cache (transfer.verify)."""
        return self.handle.checksums.remote(items)

    def plant_corruption(self, count: int = 1, rank: int = 0) -> "ObjectRef[None]":
        """Test hook: flip a byte of each of the next `count` verified reads on decode rank `rank`."""
        return self.handle.plant_corruption.remote(count, rank)

    def corrupt_next_read(self, specs_by_rank: list[list[dict[str, Any]]], seed: int = 0) -> "ObjectRef[None]":
        """Test hook: overwrite byte ranges of the next read on each rank with noise before its request runs."""
        return self.handle.corrupt_next_read.remote(specs_by_rank, seed)


def error_text(e: BaseException) -> str:
    """An error in one line for logs and messages: the type and text of what a Ray error wraps (its `cause`), or of
    the error itself; at most 500 characters."""
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {cause}".splitlines()[0][:500]
