"""transfer.verify, an engine actor's component (`EngineVerify`): every byte range a verified request's read landed
on a decode engine is checked (CRC-32, per range) against the prefill engine's bytes before the request runs; a
mismatch ends the request with a DecodeError the router retries. It owns the verification state - the fraction
verified, the requests expected and the failures that end them - which the serving component reaches through
`expect`, `forget` and `failure_of`; the prefill engines' checksums come through the pairs component (which knows
their clients), the outcomes go into the engine's `TransferTotals`. The sampling and the wire format are in
`cluster.core.verify`; the workers' side (holding a sampled read until its verdict) in `actors.engine.connector`."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Awaitable, Callable

from actors.engine.connector_ranks import ConnectorRanks
from actors.engine.procs import LiveEngine
from cluster.core.metrics import TransferTotals
from cluster.core.verify import VERIFY_ENV, VERIFY_TIMEOUT_S, sampled, verify_fraction

VERIFY_POLL_S = 0.002  # how often the actor collects landed reads while some are expected
VERIFY_FAILED_KEPT = 1000  # verify failures remembered for the requests they end
VERIFY_TIMINGS_KEPT = 4096  # verdict timings kept until someone reads them
log = logging.getLogger("pd.engine")


# (prefill engine id, items, still_checking) -> checksums by item: `EnginePairs.prefill_checksums`
Checksums = Callable[[str, list[tuple[int, int, list[int], list[int]]], Callable[[], Awaitable[Any]]],
                     Awaitable[dict[int, int]]]


class EngineVerify:
    """`EngineActor`'s transfer.verify. `ranks`: its connector's workers; `live`: the engine; `totals`: the engine's
    running totals (the pairs component's), counted into; `prefill_checksums(prefill engine id, items)`: a prefill
    engine's checksums (`EnginePairs.prefill_checksums`)."""

    def __init__(self, engine_id: str, tp: int, ranks: ConnectorRanks, live: LiveEngine, totals: TransferTotals,
                 prefill_checksums: Checksums) -> None:
        self.engine_id, self.tp, self.ranks, self._live = engine_id, tp, ranks, live
        self._totals, self._prefill_checksums = totals, prefill_checksums
        # the fraction of requests verified; requests submitted for verification and not finished (by prefill-side
        # request id); landed reads by request and decode rank until every rank's are in; verify failures by
        # prefill-side request id (what ended them)
        self.fraction = verify_fraction(os.environ.get(VERIFY_ENV))
        self._expected: set[str] = set()
        self._parts: dict[str, dict[int, dict[str, Any]]] = {}
        self._seen: dict[str, float] = {}
        self._failed: dict[str, str] = {}
        self._task: asyncio.Task | None = None
        self._checks: set[asyncio.Task] = set()  # one prefill engine's check each, under way (`_check`)
        self._grace_until = 0.0
        self._ms: list[float] = []

    # ---- transfer.verify: every byte range read checked against the prefill side's before the request runs ---------
    async def set_verify(self, fraction: float) -> None:
        """Verify this fraction of the requests from now on (0: off, 1: all)."""
        self._live.required()
        fraction = verify_fraction(fraction)
        await self.ranks.set_verify(fraction)  # the workers first: they hold a sampled read for the actor
        self.fraction = fraction
        if fraction:  # requests submitted before the change may be read after it: watch the workers a while
            self._grace_until = time.monotonic() + VERIFY_TIMEOUT_S
            self._watch(None)

    async def plant_corruption(self, count: int = 1, rank: int = 0) -> None:
        """Test hook: flip a byte of each of the next `count` verified reads on decode rank `rank` right after it
        lands (what transfer.verify must catch)."""
        self._live.required()
        await self.ranks.plant_corruption(count, rank)

    async def corrupt_next_read(self, specs_by_rank: list[list[dict[str, Any]]], seed: int = 0) -> None:
        """Test hook: overwrite byte ranges of the next read that lands on each rank with noise before its request
        runs (`PlannedPullWorker.pd_corrupt_next_read`; `specs_by_rank[r]` for rank r)."""
        self._live.required()
        await self.ranks.corrupt_next_read(specs_by_rank, seed)

    def verify_timings(self) -> list[float]:
        """Milliseconds from a verified request's first landed read to its verdict, oldest first (drained on read)."""
        out, self._ms = self._ms, []
        return out

    # ---- what the serving component asks ---------------------------------------------------------------------------
    def expect(self, kv_transfer_params: dict[str, Any]) -> str | None:
        """A request about to read its state: if transfer.verify samples it, expect its verification and return its
        prefill-side id (else None)."""
        remote_id = kv_transfer_params.get("remote_request_id", "")
        if not sampled(remote_id, self.fraction):
            return None
        self._watch(remote_id)
        return remote_id

    def forget(self, remote_request_id: str | None) -> None:
        """The request `expect` returned this id for has ended: no verdict is waited for on its behalf any more."""
        self._expected.discard(remote_request_id)

    def failure_of(self, remote_request_id: str | None) -> str | None:
        """Why the request's check failed (said once: the failure is forgotten), or None if it did not fail."""
        return self._failed.pop(remote_request_id, None)

    def _watch(self, remote_request_id: str | None) -> None:
        if remote_request_id is not None:
            self._expected.add(remote_request_id)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        """Collect landed verified reads from every rank, check each request once all its ranks' reads are in, and
        send the verdicts; runs while requests are expected or the workers hold any. A failure here leaves the
        workers' own timeout (VERIFY_TIMEOUT_S) to fail the requests: never a pass without a check."""
        try:
            while True:
                polls = await self.ranks.verify_poll()
                now = time.monotonic()
                for rank, poll in enumerate(polls):
                    for entry in poll["ready"]:
                        self._parts.setdefault(entry["req_id"], {})[rank] = entry
                        self._seen.setdefault(entry["req_id"], now)
                for req_id in [r for r in self._parts if now - self._seen[r] > VERIFY_TIMEOUT_S]:
                    del self._parts[req_id]  # a rank's read failed: the request fails without a verdict
                    self._seen.pop(req_id, None)
                complete = {r: parts for r, parts in self._parts.items() if len(parts) == self.tp}
                if complete:
                    by_prefill: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
                    for req_id, parts in complete.items():
                        del self._parts[req_id]
                        by_prefill.setdefault(parts[0]["prefill_engine"], {})[req_id] = parts
                    # each prefill engine's check on its own: one in a long step is waited for (EnginePairs.
                    # prefill_checksums) while the others' are checked and new reads keep being collected
                    for prefill_id, batch in by_prefill.items():
                        task = asyncio.get_running_loop().create_task(self._check(prefill_id, batch))
                        self._checks.add(task)
                        task.add_done_callback(self._checks.discard)
                    continue
                if not (self._expected or self._parts or self._checks or any(p["pending"] for p in polls)
                        or time.monotonic() < self._grace_until):
                    return
                await asyncio.sleep(VERIFY_POLL_S)
        except Exception as e:  # noqa: BLE001 - the workers fail what they hold once its verdict is overdue
            log.error("transfer verify loop of %s stopped: %s: %s", self.engine_id, type(e).__name__, e)

    async def _check(self, prefill_id: str, batch: dict[str, dict[int, dict[str, Any]]]) -> None:
        """The verdicts of one prefill engine's requests, sent to the workers. A failure here leaves the workers' own
        timeout (VERIFY_TIMEOUT_S) to fail the requests: never a pass without a check."""
        try:
            await self.ranks.verify_done(await self._verdicts(prefill_id, batch))
        except Exception as e:  # noqa: BLE001 - reported; the workers fail what they hold once its verdict is overdue
            log.error("transfer verify of %s's reads from %s failed: %s: %s", self.engine_id, prefill_id,
                      type(e).__name__, e)

    async def _verdicts(self, prefill_id: str, complete: dict[str, dict[int, dict[str, Any]]]) -> dict[str, bool]:
        """Compare each request's CRCs with prefill engine `prefill_id`'s over the same ranges (its requests all read
        from it); log and count mismatches."""
        items, expect = [], []
        for req_id, parts in complete.items():
            for d_rank, part in sorted(parts.items()):
                for p_rank, region, offsets, lengths, crc in part["checks"]:
                    items.append((p_rank, region, offsets, lengths))
                    expect.append((req_id, d_rank, p_rank, region, sum(lengths), crc))
        unverifiable = None
        try:
            got = await self._prefill_checksums(
                prefill_id, items, lambda ids=tuple(complete): self.ranks.verify_done({}, list(ids)))
        except Exception as e:  # noqa: BLE001 - unverifiable is not verified
            got, unverifiable = {}, f"no checksums from prefill engine {prefill_id} ({type(e).__name__}: {e})"
            log.error("transfer verify: %s", unverifiable)
        bad: dict[str, list[str]] = {}
        for i, (req_id, d_rank, p_rank, region, nbytes, crc) in enumerate(expect):
            if unverifiable is not None:
                bad[req_id] = [f"could not be checked: {unverifiable}"]
            elif got.get(i) != crc:
                bad.setdefault(req_id, []).append(
                    f"region {region} (decode rank {d_rank} from prefill rank {p_rank}, {nbytes} bytes) differs "
                    "from the prefill side")
        verdicts: dict[str, bool] = {}
        now = time.monotonic()
        for req_id, parts in complete.items():
            remote_id = parts[0]["remote_request_id"]
            verdicts[req_id] = req_id not in bad
            self._expected.discard(remote_id)
            ms = (now - self._seen.pop(req_id, now)) * 1e3
            self._ms = (self._ms + [ms])[-VERIFY_TIMINGS_KEPT:]
            self._totals.verify_seconds += ms / 1e3
            if req_id in bad:
                what = "; ".join(bad[req_id])
                log.error("transfer verify failed: request %s, pair %s -> %s: %s", remote_id, prefill_id,
                          self.engine_id, what)
                self._totals.verify_failures += 1
                self._failed[remote_id] = f"pair {prefill_id} -> {self.engine_id}: {what}"
                while len(self._failed) > VERIFY_FAILED_KEPT:
                    del self._failed[next(iter(self._failed))]
            else:
                self._totals.verified += 1
        return verdicts

    async def checksums(self, items: list[tuple[int, int, list[int], list[int]]]) -> dict[int, int]:
        """Prefill side: CRC-32 of each item's byte ranges [(prefill rank, region, offsets, lengths)] in this engine's
        cache, by item index (transfer.verify)."""
        self._live.required()
        out: dict[int, int] = {}
        for rank in await self.ranks.checksums(items):
            out.update(rank)
        return out
