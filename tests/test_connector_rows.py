"""The connector's per-request descriptor rows (`PlannedPullWorker._pd_rows`, built with whole-array operations) are
exactly the planner's reads replicated over their regions and split by prefill rank - the same rows, in the same order,
as one loop per (read pattern, region, prefill rank) gives - and the transfer benchmark builds the same ones."""

from __future__ import annotations

import types

import numpy as np
import pytest

from cluster.cli.bench.transfer import MODELS, sample_blocks
from cluster.core.hf_config import load_config, model_shape, ssm_dtype
from cluster.core.layout import offline_layout
from cluster.core.planner import lane_rows, plan_pair, plan_request

PAIRS = ((1, 1), (1, 2), (2, 1), (2, 4), (4, 2))


def _reference_rows(plan, rank: int, remote_bases: list[list[int]], local_bases: list[int]):
    """One loop per (read pattern, region, prefill rank): rows (remote address, local address, bytes) per prefill rank,
    and the verify checks (prefill rank, region, rows of remote offset, local offset, bytes)."""
    parts: dict[int, list[np.ndarray]] = {}
    checks = []
    for rr in plan.reads[rank]:
        rows = rr.rows
        if not len(rows):
            continue
        for region in rr.regions:
            for r in np.unique(rows[:, 0]):
                sel = rows[rows[:, 0] == r]
                parts.setdefault(int(r), []).append(
                    np.stack([sel[:, 1] + remote_bases[r][region], sel[:, 2] + local_bases[region], sel[:, 3]], axis=1))
                checks.append((int(r), region, sel[:, 1:4]))
    return {r: np.concatenate(p).astype(np.uint64) for r, p in parts.items()}, checks


def _fake_worker(pair, rank: int, num_blocks: int):
    remote_bases = [[(1 << 44) + (r << 40) + (i << 32) for i in range(pair.prefill.num_regions)]
                    for r in range(pair.prefill.tp)]
    local_bases = [(1 << 43) + (i << 32) for i in range(pair.decode.num_regions)]
    worker = types.SimpleNamespace(
        engine_id="decode-0", tp_rank=rank, _logical_num_blocks=num_blocks,
        _pd_remote={"prefill-0": [{"region_bases": b} for b in remote_bases]},
        kv_caches_base_addr={"decode-0": {rank: local_bases}},
    )
    return worker, remote_bases, local_bases


def _sorted_checks(checks):
    return sorted((r, region, rows.tolist()) for r, region, rows in checks)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("p_tp,d_tp", PAIRS)
def test_rows_match_one_loop_per_region_and_rank(model: str, p_tp: int, d_tp: int):
    from actors.engine.connector import PlannedPullWorker

    cfg = load_config(MODELS[model])
    shape, sdtype = model_shape(cfg), ssm_dtype(cfg, "bfloat16")
    pair = plan_pair(*(offline_layout(shape, tp, "bfloat16", sdtype, conv_layout="SD") for tp in (p_tp, d_tp)))
    for tokens, scattered in ((1024, False), (4096, True)):
        pb, db, pool = sample_blocks(pair, tokens, scattered, 2048)
        plan = plan_request(pair, pb, db, tokens - 1)
        for rank in range(d_tp):
            worker, remote_bases, local_bases = _fake_worker(pair, rank, pool)
            checks: list = []
            got = PlannedPullWorker._pd_rows(worker, "prefill-0", pair, plan, checks)
            want, want_checks = _reference_rows(plan, rank, remote_bases, local_bases)
            assert got.keys() == want.keys()
            for r in want:
                assert got[r].dtype == np.uint64
                np.testing.assert_array_equal(got[r], want[r])
            assert _sorted_checks(checks) == _sorted_checks(want_checks)
            assert sum(len(v) for v in got.values()) == plan.descriptors(rank)


def test_rows_refuse_a_read_outside_the_local_regions():
    from actors.engine.connector import PlannedPullWorker

    cfg = load_config(MODELS["qwen3.5-0.8b"])
    shape, sdtype = model_shape(cfg), ssm_dtype(cfg, "bfloat16")
    pair = plan_pair(*(offline_layout(shape, tp, "bfloat16", sdtype, conv_layout="SD") for tp in (1, 2)))
    pb, db, pool = sample_blocks(pair, 1024)
    plan = plan_request(pair, pb, db, 1023)
    worker, _, _ = _fake_worker(pair, 0, pool - 1)  # the last block the plan writes lies past this engine's cache
    with pytest.raises(ValueError, match="falls outside"):
        PlannedPullWorker._pd_rows(worker, "prefill-0", pair, plan)


def test_transfer_bench_builds_the_connectors_rows():
    """`bench transfer` measures the connector's reads: its descriptors are the connector's rows."""
    from actors.engine.connector import PlannedPullWorker
    from cluster.cli.bench.transfer_side import TransferSide

    cfg = load_config(MODELS["qwen3.5-35b-a3b"])
    shape, sdtype = model_shape(cfg), ssm_dtype(cfg, "bfloat16")
    pair = plan_pair(*(offline_layout(shape, tp, "bfloat16", sdtype, conv_layout="SD") for tp in (2, 1)))
    pb, db, pool = sample_blocks(pair, 4096, True, 2048)
    plan = plan_request(pair, pb, db, 4095)
    worker, remote_bases, local_bases = _fake_worker(pair, 0, pool)
    rows = PlannedPullWorker._pd_rows(worker, "prefill-0", pair, plan)
    for lanes in (1, 2):  # the connector posts lane_rows(rows, its lanes) (actors/engine/nixl_setup.py)
        side = types.SimpleNamespace(remote_bases=remote_bases, lanes=lanes,
                                     regions=[[types.SimpleNamespace(ctypes=types.SimpleNamespace(data=b)) for b in local_bases]])
        descs = TransferSide.__ray_actor_class__._descs(side, 0, plan.reads[0])
        assert descs.keys() == rows.keys()
        for r, (loc, rem) in descs.items():
            posted = lane_rows(rows[r], lanes)
            assert lanes == 1 or not np.array_equal(posted, rows[r])
            np.testing.assert_array_equal(rem[:, 0].astype(np.uint64), posted[:, 0])
            np.testing.assert_array_equal(loc[:, 0].astype(np.uint64), posted[:, 1])
            np.testing.assert_array_equal(loc[:, 1].astype(np.uint64), posted[:, 2])
