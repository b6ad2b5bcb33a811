"""transfer.verify, an engine actor's part (`VerifyMixin`): every byte range a verified request's read landed on a
decode engine is checked (CRC-32, per range) against the prefill engine's bytes before the request runs; a mismatch
ends the request with a DecodeError the router retries. The sampling and the wire format are in
`cluster.core.verify`; the workers' side (holding a sampled read until its verdict) in `actors.connector`."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from cluster.core.metrics import TransferTotals
from cluster.core.verify import VERIFY_ENV, VERIFY_TIMEOUT_S, sampled, verify_fraction

VERIFY_POLL_S = 0.002  # how often the actor collects landed reads while some are expected
VERIFY_FAILED_KEPT = 1000  # verify failures remembered for the requests they end
VERIFY_TIMINGS_KEPT = 4096  # verdict timings kept until someone reads them
log = logging.getLogger("pd.engine")


class VerifyMixin:
    """`EngineActor`'s transfer.verify (needs `engine_id`, `tp`, `_totals`, `ranks`, `_require_engine` and the
    coordinator it registered with, set by the actor)."""

    engine_id: str
    tp: int
    _totals: TransferTotals
    _coordinator: Any

    def _init_verify(self) -> None:
        # the fraction of requests verified; requests submitted for verification and not finished (by prefill-side
        # request id); landed reads by request and decode rank until every rank's are in; verify failures by
        # prefill-side request id (what ended them)
        self.verify = verify_fraction(os.environ.get(VERIFY_ENV))
        self._verify_expected: set[str] = set()
        self._verify_parts: dict[str, dict[int, dict[str, Any]]] = {}
        self._verify_seen: dict[str, float] = {}
        self._verify_failed: dict[str, str] = {}
        self._verify_task: asyncio.Task | None = None
        self._verify_grace_until = 0.0
        self._verify_ms: list[float] = []
        self._prefill_clients: dict[str, Any] = {}  # prefill engine id -> its client, asked of the coordinator once

    # ---- transfer.verify: every byte range read checked against the prefill side's before the request runs ---------
    async def set_verify(self, fraction: float) -> None:
        """Verify this fraction of the requests from now on (0: off, 1: all)."""
        self._require_engine()
        fraction = verify_fraction(fraction)
        await self.ranks.set_verify(fraction)  # the workers first: they hold a sampled read for the actor
        self.verify = fraction
        if fraction:  # requests submitted before the change may be read after it: watch the workers a while
            self._verify_grace_until = time.monotonic() + VERIFY_TIMEOUT_S
            self._expect_verify(None)

    async def plant_corruption(self, count: int = 1, rank: int = 0) -> None:
        """Test hook: flip a byte of each of the next `count` verified reads on decode rank `rank` right after it
        lands (what transfer.verify must catch)."""
        self._require_engine()
        await self.ranks.plant_corruption(count, rank)

    async def corrupt_next_read(self, specs_by_rank: list[list[dict[str, Any]]], seed: int = 0) -> None:
        """Test hook: overwrite byte ranges of the next read that lands on each rank with noise before its request
        runs (`PlannedPullWorker.pd_corrupt_next_read`; `specs_by_rank[r]` for rank r)."""
        self._require_engine()
        await self.ranks.corrupt_next_read(specs_by_rank, seed)

    def verify_timings(self) -> list[float]:
        """Milliseconds from a verified request's first landed read to its verdict, oldest first (drained on read)."""
        out, self._verify_ms = self._verify_ms, []
        return out

    def _expect_verify_of(self, kv_transfer_params: dict[str, Any]) -> str | None:
        """A request about to read its state: if transfer.verify samples it, expect its verification and return its
        prefill-side id (else None)."""
        remote_id = kv_transfer_params.get("remote_request_id", "")
        if not sampled(remote_id, self.verify):
            return None
        self._expect_verify(remote_id)
        return remote_id

    def _expect_verify(self, remote_request_id: str | None) -> None:
        if remote_request_id is not None:
            self._verify_expected.add(remote_request_id)
        if self._verify_task is None or self._verify_task.done():
            self._verify_task = asyncio.get_running_loop().create_task(self._verify_loop())

    async def _verify_loop(self) -> None:
        """Collect landed verified reads from every rank, check each request once all its ranks' reads are in, and
        send the verdicts; runs while requests are expected or the workers hold any. A failure here leaves the
        workers' own timeout (VERIFY_TIMEOUT_S) to fail the requests: never a pass without a check."""
        try:
            while True:
                polls = await self.ranks.verify_poll()
                now = time.monotonic()
                for rank, poll in enumerate(polls):
                    for entry in poll["ready"]:
                        self._verify_parts.setdefault(entry["req_id"], {})[rank] = entry
                        self._verify_seen.setdefault(entry["req_id"], now)
                for req_id in [r for r in self._verify_parts if now - self._verify_seen[r] > VERIFY_TIMEOUT_S]:
                    del self._verify_parts[req_id]  # a rank's read failed: the request fails without a verdict
                    self._verify_seen.pop(req_id, None)
                complete = {r: parts for r, parts in self._verify_parts.items() if len(parts) == self.tp}
                if complete:
                    for req_id in complete:
                        del self._verify_parts[req_id]
                    await self.ranks.verify_done(await self._verdicts(complete))
                    continue
                if not (self._verify_expected or self._verify_parts or any(p["pending"] for p in polls)
                        or time.monotonic() < self._verify_grace_until):
                    return
                await asyncio.sleep(VERIFY_POLL_S)
        except Exception as e:  # noqa: BLE001 - the workers fail what they hold once its verdict is overdue
            log.error("transfer verify loop of %s stopped: %s: %s", self.engine_id, type(e).__name__, e)

    async def _verdicts(self, complete: dict[str, dict[int, dict[str, Any]]]) -> dict[str, bool]:
        """Compare each request's CRCs with its prefill engine's over the same ranges; log and count mismatches."""
        by_prefill: dict[str, list[str]] = {}
        for req_id, parts in complete.items():
            by_prefill.setdefault(parts[0]["prefill_engine"], []).append(req_id)
        verdicts: dict[str, bool] = {}
        for prefill_id, req_ids in by_prefill.items():
            items, expect = [], []
            for req_id in req_ids:
                for d_rank, part in sorted(complete[req_id].items()):
                    for p_rank, region, offsets, lengths, crc in part["checks"]:
                        items.append((p_rank, region, offsets, lengths))
                        expect.append((req_id, d_rank, p_rank, region, sum(lengths), crc))
            unverifiable = None
            try:
                got = await self._prefill_checksums(prefill_id, items)
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
            now = time.monotonic()
            for req_id in req_ids:
                remote_id = complete[req_id][0]["remote_request_id"]
                verdicts[req_id] = req_id not in bad
                self._verify_expected.discard(remote_id)
                ms = (now - self._verify_seen.pop(req_id, now)) * 1e3
                self._verify_ms = (self._verify_ms + [ms])[-VERIFY_TIMINGS_KEPT:]
                self._totals.verify_seconds += ms / 1e3
                if req_id in bad:
                    what = "; ".join(bad[req_id])
                    log.error("transfer verify failed: request %s, pair %s -> %s: %s", remote_id, prefill_id,
                              self.engine_id, what)
                    self._totals.verify_failures += 1
                    self._verify_failed[remote_id] = f"pair {prefill_id} -> {self.engine_id}: {what}"
                    while len(self._verify_failed) > VERIFY_FAILED_KEPT:
                        del self._verify_failed[next(iter(self._verify_failed))]
                else:
                    self._totals.verified += 1
        return verdicts

    async def _prefill_checksums(self, prefill_id: str, items: list[tuple[int, int, list[int], list[int]]]) -> dict[int, int]:
        """The prefill engine's checksums of `items`. Its client is asked of the coordinator once and kept until a
        call to it fails: a coordinator that is restarting (or wedged) must not fail the checks of requests whose
        prefill engine is alive (unverifiable is not verified: they would fail)."""
        prefill = self._prefill_clients.get(prefill_id)
        if prefill is None:
            if self._coordinator is None:
                raise RuntimeError("this engine has not registered with a coordinator")
            prefill = await asyncio.wait_for(self._coordinator.client(prefill_id), 10)
            if prefill is None:
                raise RuntimeError(f"prefill engine {prefill_id} has left")
            self._prefill_clients[prefill_id] = prefill
        try:
            return await asyncio.wait_for(prefill.checksums(items), 10)
        except Exception:
            self._prefill_clients.pop(prefill_id, None)  # gone, or replaced under its id: ask again next time
            raise

    def _forget_prefill(self, prefill_id: str) -> None:
        """A prefill engine's pair was removed: its client is not kept (`_prefill_checksums`)."""
        self._prefill_clients.pop(prefill_id, None)

    async def checksums(self, items: list[tuple[int, int, list[int], list[int]]]) -> dict[int, int]:
        """Prefill side: CRC-32 of each item's byte ranges [(prefill rank, region, offsets, lengths)] in this engine's
        cache, by item index (transfer.verify)."""
        self._require_engine()
        out: dict[int, int] = {}
        for rank in await self.ranks.checksums(items):
            out.update(rank)
        return out
