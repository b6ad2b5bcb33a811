"""The transfer planner: which bytes each decode rank reads from which prefill rank, and why a pair is compatible.

Two steps, at two frequencies:
  * `plan_pair(prefill, decode)` once per engine pair (the coordinator caches it): validates the pair and derives the
    per-layer read templates - for every decode rank, the (prefill rank, remote offset, size, local offset) reads that
    fill one GDN/Mamba state page, and the KV-head runs it reads from each prefill rank.
  * `plan_request(pair, ...)` once per request: aligns the prefill engine's kernel blocks with the decode engine's by
    token position (each side expanded with its *own* physical_blocks_per_logical), skips the prefix the decode side
    already has cached, and expands the templates into coalesced byte descriptors.

Offsets in the templates are relative to the start of one layer's conv state, recurrent state or KV head block; the
request plan turns them into offsets relative to a region's base. Layer i of every cache group lives in region i and
the layers of a group share one descriptor pattern, so the data path replicates each pattern over its regions.

No Ray, vLLM or NIXL imports here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from cluster.core.errors import FieldError
from cluster.core.layout import HEAD_MAJOR, EngineLayout, Proj, fields_differ


class IncompatiblePair(ValueError):
    """A prefill/decode pair that cannot exchange state. Names the field and both values."""

    def __init__(self, field: str, prefill: object, decode: object, hint: str = ""):
        msg = f"{field}: prefill has {prefill!r}, decode has {decode!r}"
        super().__init__(msg + (f"; {hint}" if hint else ""))
        self.field, self.prefill, self.decode, self.hint = field, prefill, decode, hint

    def __reduce__(self):  # picklable across Ray actors
        return (type(self), (self.field, self.prefill, self.decode, self.hint))


def tp_ratio(prefill_tp: int, decode_tp: int) -> int:
    """D_TP / P_TP when decode has at least as many ranks, else -(P_TP / D_TP)."""
    if decode_tp >= prefill_tp:
        if decode_tp % prefill_tp:
            raise IncompatiblePair("tp", prefill_tp, decode_tp, "the larger TP size must be a multiple of the smaller")
        return decode_tp // prefill_tp
    if prefill_tp % decode_tp:
        raise IncompatiblePair("tp", prefill_tp, decode_tp, "the larger TP size must be a multiple of the smaller")
    return -(prefill_tp // decode_tp)


@dataclass(frozen=True)
class Read:
    """One contiguous read: `size` bytes at `remote_offset` of `remote_rank` into `local_offset` of this rank."""

    remote_rank: int
    piece: str  # which piece of the state page: conv0 / conv1 / conv2 (conv channel groups) or ssm
    remote_offset: int
    size: int
    local_offset: int


@dataclass(frozen=True)
class UnitRun:
    """`count` consecutive units (KV heads, state heads or groups, conv channel groups) read from `remote_rank`,
    starting at its unit slot `remote_slot`, into local unit slot `local_slot`."""

    remote_rank: int
    remote_slot: int
    local_slot: int
    count: int


def unit_runs(proj: Proj, prefill_tp: int, decode_tp: int, decode_rank: int) -> list[UnitRun]:
    """For one projection, where each unit held by `decode_rank` comes from: runs of consecutive units that are
    consecutive on one prefill rank too. A unit held by several prefill ranks (replication) is read from the lowest
    holder inside this decode rank's own share of the prefill ranks, so a decode rank reads from as few ranks as it
    can and no rank outside its share."""
    holders: dict[int, list[tuple[int, int]]] = {}
    for p in range(prefill_tp):
        for slot, unit in enumerate(proj.held_units(prefill_tp, p)):
            holders.setdefault(unit, []).append((p, slot))
    # this decode rank's own share of the prefill ranks (for tp_ratio > 0: the one rank it slices)
    first = decode_rank * prefill_tp // decode_tp
    share = range(first, max(-(-(decode_rank + 1) * prefill_tp // decode_tp), first + 1))
    runs: list[UnitRun] = []
    for local_slot, unit in enumerate(proj.held_units(decode_tp, decode_rank)):
        # a holder inside the share first (lowest rank), else the nearest one
        p, slot = min(holders[unit], key=lambda h: (h[0] not in share, abs(h[0] - first), h[0]))
        last = runs[-1] if runs else None
        if last and last.remote_rank == p and last.remote_slot + last.count == slot and last.local_slot + last.count == local_slot:
            runs[-1] = UnitRun(p, last.remote_slot, last.local_slot, last.count + 1)
        else:
            runs.append(UnitRun(p, slot, local_slot, 1))
    return runs


@dataclass(frozen=True)
class PairPlan:
    """The negotiated plan for one prefill/decode engine pair."""

    prefill: EngineLayout
    decode: EngineLayout
    tp_ratio: int
    # per decode rank: the reads that fill one state page (one GDN/Mamba layer), region-by-region
    state_reads: tuple[tuple[Read, ...], ...]
    # per decode rank: the KV-head runs it reads from the prefill ranks
    kv_head_runs: tuple[tuple[UnitRun, ...], ...]

    def remote_ranks(self, decode_rank: int) -> tuple[int, ...]:
        ranks = {r.remote_rank for r in self.state_reads[decode_rank]}
        ranks |= {h.remote_rank for h in self.kv_head_runs[decode_rank]}
        return tuple(sorted(ranks))

    def notify_ranks(self, decode_rank: int) -> tuple[int, ...]:
        """Prefill ranks this decode rank notifies when its reads are done: those it reads from and, on decode rank 0,
        any prefill rank that no decode rank reads from (it still holds the request's blocks)."""
        mine = set(self.remote_ranks(decode_rank))
        if decode_rank == 0:
            read = {r for d in range(self.decode.tp) for r in self.remote_ranks(d)}
            mine |= set(range(self.prefill.tp)) - read
        return tuple(sorted(mine))

    def consumers(self) -> tuple[int, ...]:
        """Per prefill rank, how many decode ranks notify it: it frees a request's blocks after the last of them."""
        counts = [0] * self.prefill.tp
        for d in range(self.decode.tp):
            for r in self.notify_ranks(d):
                counts[r] += 1
        return tuple(counts)

    def state_descriptors(self, decode_rank: int) -> list[tuple[int, int, int, int]]:
        """The state reads of one layer's page as (remote_rank, remote_offset, local_offset, size) relative to the page
        start, with reads that are adjacent on both sides merged across regions."""
        return self._state_rows[decode_rank].tolist()

    @cached_property
    def _state_rows(self) -> tuple[np.ndarray, ...]:
        p, d = self.prefill, self.decode
        out = []
        for reads in self.state_reads:
            rows = [
                (r.remote_rank, r.remote_offset + (p.ssm_offset if r.piece == "ssm" else 0),
                 r.local_offset + (d.ssm_offset if r.piece == "ssm" else 0), r.size)
                for r in reads
            ]
            out.append(coalesce(np.array(rows, dtype=np.int64).reshape(-1, 4)))
        return tuple(out)

    def describe(self) -> dict[str, object]:
        return {
            "tp_ratio": self.tp_ratio,
            "prefill": self.prefill.summary(),
            "decode": self.decode.summary(),
            "reads": [[dataclasses.asdict(r) for r in reads] for reads in self.state_reads],
            "state_descriptors_per_layer": [len(self.state_descriptors(d)) for d in range(self.decode.tp)],
            "kv_head_runs": [
                [dataclasses.asdict(h) for h in runs]
                for runs in self.kv_head_runs
            ],
            "remote_ranks": [list(self.remote_ranks(d)) for d in range(self.decode.tp)],
        }


def validate_pair(prefill: EngineLayout, decode: EngineLayout) -> int:
    """Raise IncompatiblePair naming the first field that makes the pair unable to exchange state; return tp_ratio."""
    for name, pv, dv in fields_differ(prefill.model, decode.model):
        raise IncompatiblePair(f"model.{name}", pv, dv, "prefill and decode must serve the same model")
    if prefill.groups != decode.groups:
        raise IncompatiblePair("groups", prefill.groups, decode.groups, "both engines must group cache layers alike")
    if prefill.dtype != decode.dtype:
        raise IncompatiblePair("dtype", prefill.dtype, decode.dtype, "KV cache and conv state dtypes must match")
    if prefill.model.state and prefill.ssm_dtype != decode.ssm_dtype:
        raise IncompatiblePair("ssm_dtype", prefill.ssm_dtype, decode.ssm_dtype, "recurrent state dtypes must match")
    if prefill.model.state and prefill.conv_layout != decode.conv_layout:
        raise IncompatiblePair(
            "conv_layout", prefill.conv_layout, decode.conv_layout,
            "both engines must keep conv state in one layout (VLLM_SSM_CONV_STATE_LAYOUT: a pool's `env` sets it)")
    if prefill.model.attention and prefill.kv_layout != decode.kv_layout:
        raise IncompatiblePair("kv_layout", prefill.kv_layout, decode.kv_layout, "both engines must use one KV layout")
    if prefill.model.attention and prefill.tp != decode.tp and prefill.kv_layout not in HEAD_MAJOR:
        raise IncompatiblePair(
            "kv_layout", prefill.kv_layout, decode.kv_layout, "different TP sizes need the HND layout (heads outermost)"
        )
    if (prefill.model.attention and "CPU_TILED" in (prefill.kv_layout, decode.kv_layout)
            and prefill.kernel_block_size != decode.kernel_block_size):
        raise IncompatiblePair(
            "kernel_block_size", prefill.kernel_block_size, decode.kernel_block_size,
            "vLLM's CPU attention stores V transposed inside each kernel block (K in 32-token tiles), so a token's "
            "bytes sit elsewhere at another block size and no byte-range read can move them; start both pools with "
            "one block size (vLLM's block_size engine argument)")
    return tp_ratio(prefill.tp, decode.tp)


def plan_pair(prefill: EngineLayout, decode: EngineLayout) -> PairPlan:
    ratio = validate_pair(prefill, decode)
    state_reads: list[tuple[Read, ...]] = []
    kv_runs: list[tuple[UnitRun, ...]] = []
    state = prefill.model.state
    for d in range(decode.tp):
        reads: list[Read] = []
        if state:
            for i, proj in enumerate(state.conv_projs):
                for run in unit_runs(proj, prefill.tp, decode.tp, d):
                    # one range per run in the DS layout, one per conv row in SD (equal sizes on both sides)
                    for (p_off, size), (d_off, _) in zip(prefill.conv_ranges(i, run.remote_slot, run.count),
                                                         decode.conv_ranges(i, run.local_slot, run.count)):
                        reads.append(Read(run.remote_rank, f"conv{i}", p_off, size, d_off))
            unit = state.ssm.unit_elems * prefill.ssm_elem_bytes
            for run in unit_runs(state.ssm, prefill.tp, decode.tp, d):
                reads.append(Read(run.remote_rank, "ssm", run.remote_slot * unit, run.count * unit, run.local_slot * unit))
        state_reads.append(tuple(reads))
        attn = prefill.model.attention
        kv_runs.append(tuple(unit_runs(attn.heads, prefill.tp, decode.tp, d)) if attn else ())
    return PairPlan(prefill, decode, ratio, tuple(state_reads), tuple(kv_runs))


# --------------------------------------------------------------------------------------------------------------
# Per request: block alignment by token position and descriptor expansion


class RequestError(FieldError):
    """Block lists that cannot carry the request (too few blocks, bad token counts). Names the argument."""


@dataclass(frozen=True)
class RegionReads:
    """Reads applied to each region in `regions`: rows of (remote_rank, remote_offset, local_offset, size), offsets
    relative to the region's base address on each side. Every layer of a group lives in its own region and all of them
    share the pattern, so descriptors = len(rows) * len(regions)."""

    regions: tuple[int, ...]
    rows: np.ndarray  # int64 (n, 4)

    @property
    def descriptors(self) -> int:
        return len(self.rows) * len(self.regions)

    @property
    def bytes(self) -> int:
        return int(self.rows[:, 3].sum()) * len(self.regions) if len(self.rows) else 0


def address_rows(reads: tuple[RegionReads, ...] | list[RegionReads], remote_bases: np.ndarray,
                  local_bases: np.ndarray) -> dict[int, np.ndarray]:
    """One decode rank's reads as absolute addresses: per remote (prefill) rank, int64 rows of (remote address, local
    address, bytes), in planner order. `remote_bases[rank, region]` and `local_bases[region]` are the regions' base
    addresses. Whole-array operations, a row pattern at a time over all its regions: this runs for every request
    inside the decode engine's step (the connector, `PlannedPullWorker._pd_rows`) and in `bench transfer`; a loop per
    (region, remote rank) cost 0.1-0.3 ms per decode rank, more than the NIXL request it feeds."""
    parts = []
    for rr in reads:
        rows = rr.rows
        if not len(rows):
            continue
        regions = np.asarray(rr.regions, np.int64)[:, None]
        block = np.empty((len(regions), len(rows), 4), np.int64)  # (region, row) -> rank, remote, local, bytes
        block[..., 0] = rows[:, 0]
        block[..., 1] = remote_bases[rows[:, 0], regions] + rows[:, 1]
        block[..., 2] = local_bases[regions] + rows[:, 2]
        block[..., 3] = rows[:, 3]
        parts.append(block.reshape(-1, 4))
    if not parts:
        return {}
    table = np.concatenate(parts)
    table = table[np.argsort(table[:, 0], kind="stable")]  # by remote rank, each rank's rows in planner order
    ranks, starts = np.unique(table[:, 0], return_index=True)
    return {int(r): part[:, 1:] for r, part in zip(ranks, np.split(table, starts[1:]))}


@dataclass(frozen=True)
class RequestPlan:
    """What one decode rank set reads for one request.

    `num_tokens` prompt tokens were run by the prefill engine (the prompt minus its last token for hybrid models: a
    recurrent state cannot be rewound, so the decode side runs `prompt[num_tokens:]` itself). Attention KV is read
    for token positions [first_token, end_token): first_token skips the decode side's cached prefix, end_token pads
    the tail to the end of the kernel block both sides hold."""

    num_tokens: int
    first_token: int
    end_token: int
    reads: tuple[tuple[RegionReads, ...], ...]  # per decode rank
    uncoalesced: tuple[int, ...]  # per decode rank: descriptors before coalescing (one per layer, block and region)

    def descriptors(self, decode_rank: int) -> int:
        return sum(r.descriptors for r in self.reads[decode_rank])

    def bytes(self, decode_rank: int) -> int:
        return sum(r.bytes for r in self.reads[decode_rank])


def coalesce(rows: np.ndarray) -> np.ndarray:
    """Sort (rank, remote_off, local_off, size) rows by rank and local offset and merge each row that continues the
    previous one on both sides into it."""
    if len(rows) <= 1:
        return rows
    rows = rows[np.lexsort((rows[:, 2], rows[:, 0]))]
    rank, ro, lo, size = rows.T
    cont = (rank[1:] == rank[:-1]) & (ro[1:] == ro[:-1] + size[:-1]) & (lo[1:] == lo[:-1] + size[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    ends = np.concatenate((starts[1:], [len(rows)]))
    out = rows[starts].copy()
    out[:, 3] = (ro[ends - 1] + size[ends - 1]) - ro[starts]
    return out


def _kernel_ids(logical: np.ndarray, pos: np.ndarray, layout: EngineLayout) -> np.ndarray:
    """Kernel block id holding token `pos`, from the side's own logical block ids and its own ratio."""
    ppl = layout.physical_blocks_per_logical
    return logical[pos // layout.block_size] * ppl + (pos % layout.block_size) // layout.kernel_block_size


def _attention_rows(pair: PairPlan, decode_rank: int, p_blocks: np.ndarray, d_blocks: np.ndarray, start: int, end: int) -> tuple[np.ndarray, int]:
    p, d = pair.prefill, pair.decode
    kp, kd = p.kernel_block_size, d.kernel_block_size
    if kp == kd and start % kp == 0 and end % kp == 0:  # the common case: whole kernel blocks on both sides
        a = np.arange(start, end, kp)
        p_base = _kernel_ids(p_blocks, a, p) * p.kernel_page_bytes
        d_base = _kernel_ids(d_blocks, a, d) * d.kernel_page_bytes
        runs = pair.kv_head_runs[decode_rank]
        rows = np.empty((len(runs) * len(a), 4), np.int64)
        for i, run in enumerate(runs):  # one read per (kernel block, head run)
            part = rows[i * len(a):(i + 1) * len(a)]
            part[:, 0] = run.remote_rank
            part[:, 1] = p_base + run.remote_slot * p.kv_head_bytes
            part[:, 2] = d_base + run.local_slot * d.kv_head_bytes
            part[:, 3] = run.count * p.kv_head_bytes
        return rows, len(rows)
    else:
        cuts = np.union1d(np.arange(-(-start // kp) * kp, end, kp), np.arange(-(-start // kd) * kd, end, kd))
        cuts = np.union1d(cuts, [start, end])
    a, b = cuts[:-1], cuts[1:]
    if len(a) == 0:
        return np.zeros((0, 4), np.int64), 0
    p_base = _kernel_ids(p_blocks, a, p) * p.kernel_page_bytes
    d_base = _kernel_ids(d_blocks, a, d) * d.kernel_page_bytes
    p_row, d_row = a % kp, a % kd
    whole = (p_row == 0) & (d_row == 0) & (b - a == kp) & (b - a == kd)
    tok = p.model.attention.head_dim * p.elem_bytes  # bytes of one token of one head in K (or V)
    parts = []
    for run in pair.kv_head_runs[decode_rank]:
        # whole kernel blocks on both sides (same kernel size): one read per head run
        w = np.flatnonzero(whole)
        if len(w):
            parts.append(
                np.stack(
                    [
                        np.full(len(w), run.remote_rank),
                        p_base[w] + run.remote_slot * p.kv_head_bytes,
                        d_base[w] + run.local_slot * d.kv_head_bytes,
                        np.full(len(w), run.count * p.kv_head_bytes),
                    ],
                    axis=1,
                )
            )
        # partial segments: K rows and V rows of each head separately
        s = np.flatnonzero(~whole)
        if len(s):
            for h in range(run.count):
                for kv in (0, 1):
                    parts.append(
                        np.stack(
                            [
                                np.full(len(s), run.remote_rank),
                                p_base[s] + (run.remote_slot + h) * p.kv_head_bytes + (kv * kp + p_row[s]) * tok,
                                d_base[s] + (run.local_slot + h) * d.kv_head_bytes + (kv * kd + d_row[s]) * tok,
                                (b[s] - a[s]) * tok,
                            ],
                            axis=1,
                        )
                    )
    rows = np.concatenate(parts).astype(np.int64) if parts else np.zeros((0, 4), np.int64)
    return rows, len(rows)  # before coalescing: one read per (kernel block, head run) (per head and K/V if partial)


def plan_request(
    pair: PairPlan,
    prefill_blocks: list[list[int]] | tuple,
    decode_blocks: list[list[int]] | tuple,
    num_tokens: int,
    num_cached_tokens: int = 0,
    ranks: tuple[int, ...] | None = None,
) -> RequestPlan:
    """Descriptors for one request.

    `prefill_blocks` / `decode_blocks`: each engine's logical block ids per cache group (in its group order; a state
    group's running state sits in the last block of its list). `num_tokens`: tokens whose KV and state the prefill
    engine computed. `num_cached_tokens`: the decode side's cached prefix, which is not read again. `ranks`: plan only
    these decode ranks (a decode worker needs its own; the others get no reads); default all."""
    p, d = pair.prefill, pair.decode
    for name, side, blocks in (("prefill_blocks", p, prefill_blocks), ("decode_blocks", d, decode_blocks)):
        if len(blocks) != len(side.groups):
            raise RequestError(name, f"{len(blocks)} block lists for {len(side.groups)} cache groups")
    if num_tokens < 1:
        raise RequestError("num_tokens", f"must be >= 1, got {num_tokens}")
    if num_cached_tokens < 0:
        raise RequestError("num_cached_tokens", f"must be >= 0, got {num_cached_tokens}")
    if num_cached_tokens % d.block_size:
        raise RequestError("num_cached_tokens", f"{num_cached_tokens} is not a multiple of the decode block size {d.block_size}")
    start = min(num_cached_tokens, num_tokens)
    reads: list[tuple[RegionReads, ...]] = []
    uncoalesced: list[int] = []
    end = num_tokens
    wanted = range(d.tp) if ranks is None else ranks
    for rank in range(d.tp):
        if rank not in wanted:
            reads.append(())
            uncoalesced.append(0)
            continue
        by_regions: dict[tuple[int, ...], list[np.ndarray]] = {}
        baseline = 0
        for gi, (pg, dg) in enumerate(zip(p.groups, d.groups)):
            regions = tuple(range(len(pg.layers)))
            pb = np.asarray(prefill_blocks[gi], dtype=np.int64)
            db = np.asarray(decode_blocks[gi], dtype=np.int64)
            if pg.kind == "state":
                if not len(pb) or not len(db):
                    raise RequestError("prefill_blocks" if not len(pb) else "decode_blocks", f"state group {gi} has no block")
                rows = pair._state_rows[rank] + np.array([0, int(pb[-1]) * p.page_bytes, 0, 0])
                rows[:, 2] += int(db[-1]) * d.page_bytes
                baseline += len(pair.state_reads[rank]) * len(regions)
            else:
                for name, side, blocks in (("prefill_blocks", p, pb), ("decode_blocks", d, db)):
                    if len(blocks) * side.block_size < num_tokens:
                        raise RequestError(name, f"group {gi} holds {len(blocks) * side.block_size} tokens, the request has {num_tokens}")
                kp, kd = p.kernel_block_size, d.kernel_block_size
                end = min(-(-num_tokens // kp) * kp, -(-num_tokens // kd) * kd, len(pb) * p.block_size, len(db) * d.block_size)
                rows, base = _attention_rows(pair, rank, pb, db, start, end)
                baseline += base * len(regions)
            by_regions.setdefault(regions, []).append(rows)
        reads.append(tuple(RegionReads(regs, coalesce(np.concatenate(parts))) for regs, parts in by_regions.items()))
        uncoalesced.append(baseline)
    return RequestPlan(num_tokens, start, end, tuple(reads), tuple(uncoalesced))


# ---- read lanes: one read split into equal shares for NIXL's UCX threads ---------------------------------------------
LANE_MIN_BYTES = 1 << 20  # a read this large is cut into at least LANE_MIN_ROWS rows per lane, so that NIXL splits it
LANE_MIN_ROWS = 8  # NIXL's UCX `split_batch_size` that goes with lane_rows (see actors/engine/nixl_setup.py)
LANE_PIECES = 8  # rows longer than 1/(LANE_PIECES x lanes) of the read are cut: bounds the imbalance between lanes
LANE_ALIGN = 64  # cuts fall on cache lines


def lane_rows(rows: np.ndarray, lanes: int) -> np.ndarray:
    """Rows of (remote address, local address, bytes) - one READ - reordered, and long rows cut, for NIXL's UCX thread
    pool with `lanes` threads and split_batch_size LANE_MIN_ROWS: it splits a READ of n >= LANE_MIN_ROWS descriptors
    into runs of max(n // lanes, LANE_MIN_ROWS) consecutive descriptors, each run a copy on one thread. The result
    has a multiple of `lanes` rows, at least lanes x LANE_MIN_ROWS (so the runs are n / lanes long), dealt by size so
    that every run carries the same bytes within one piece (1/(lanes x LANE_PIECES) of the read). It moves exactly the
    bytes of `rows` (same destination for every source byte, once).

    Which reads: those NIXL splits anyway (n >= LANE_MIN_ROWS) and those of at least LANE_MIN_BYTES (cut so that it
    does). A read of fewer rows and bytes comes back as it is: NIXL posts it unsplit from the calling thread, with no
    hand-off to another thread. So does any read with `lanes` <= 1, or one whose rows are too short to cut into enough
    pieces of a cache line.

    Whole-array operations (this runs for every request in the decode engine's step; 30-130 us for 30-900 rows): rows
    longer than the cap are cut into near-equal pieces on cache lines, the pieces sorted by size and dealt to lanes in
    snake order (0..L-1, L-1..0, ...), which keeps the lanes' byte totals within one piece of each other; each lane's
    pieces in address order."""
    if lanes <= 1 or not len(rows):
        return rows
    sizes = rows[:, 2].astype(np.int64)
    total = int(sizes.sum())
    if total == 0 or (total < LANE_MIN_BYTES and len(rows) < LANE_MIN_ROWS):
        return rows
    want_rows = lanes * LANE_MIN_ROWS  # fewer, and NIXL's runs would be LANE_MIN_ROWS long, not n / lanes
    cap = max(LANE_ALIGN, (total // (lanes * LANE_PIECES)) // LANE_ALIGN * LANE_ALIGN)
    pieces = -(-sizes // cap)  # 0 for an empty row: it is dropped
    n = int(pieces.sum())
    extra = max(0, want_rows - n)
    extra += (-(n + extra)) % lanes  # rows to add: at least want_rows, a multiple of lanes
    if extra:  # one more cut apiece in the largest rows that can take one, round them again if there are fewer
        room = sizes // LANE_ALIGN - pieces  # more cuts a row can take with every piece at least a cache line
        order = np.argsort(-sizes, kind="stable")
        order = order[room[order] > 0]
        if not len(order):
            return rows
        add = np.bincount(order[np.arange(extra) % len(order)], minlength=len(rows))
        if np.any(add > room):  # too few cache lines left in the rows to cut: leave the read as planned
            return rows
        pieces += add
        n += extra
    owner = np.repeat(np.arange(len(rows)), pieces)
    first = np.cumsum(pieces) - pieces  # index of each row's first piece
    k = np.arange(n) - first[owner]  # piece number within its row
    # row i cut into pieces[i] parts: the first `rem` of (base + 1) cache lines, the rest of `base`, the tail of the row
    # (its bytes past the last whole cache line) on the last piece
    lines = sizes // LANE_ALIGN
    per = np.maximum(pieces, 1)
    base, rem = lines // per, lines % per
    start = (k * base[owner] + np.minimum(k, rem[owner])) * LANE_ALIGN
    length = np.where(k == pieces[owner] - 1, sizes[owner] - start, (base[owner] + (k < rem[owner])) * LANE_ALIGN)
    out = np.empty((n, 3), rows.dtype)
    out[:, 0] = rows[owner, 0] + start.astype(rows.dtype)
    out[:, 1] = rows[owner, 1] + start.astype(rows.dtype)
    out[:, 2] = length.astype(rows.dtype)
    by_size = np.argsort(-length, kind="stable")
    rnd, pos = np.divmod(np.arange(n), lanes)
    lane = np.empty(n, np.int64)
    lane[by_size] = np.where(rnd % 2 == 0, pos, lanes - 1 - pos)
    return out[np.lexsort((out[:, 1], lane))]


def lane_run_bytes(rows: np.ndarray, lanes: int) -> list[int]:
    """The bytes of each run NIXL's UCX thread pool gives one of its `lanes` threads for a READ of `rows` laid out by
    `lane_rows` (runs of n / lanes descriptors, n >= lanes x LANE_MIN_ROWS); [] where it does not split a READ that
    way."""
    n = len(rows)
    if lanes <= 1 or n < lanes * LANE_MIN_ROWS:
        return []
    size = n // lanes
    return [int(rows[i * size:(i + 1) * size if i < lanes - 1 else n, 2].sum()) for i in range(lanes)]
