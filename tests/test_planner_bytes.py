"""Property tests that move real bytes: shard a full state as the prefill TP lays it out, execute the plan with memory
copies into decode-sharded memory, and compare with sharding the full state for the decode TP directly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.core.layout import CONV_LAYOUTS, AttentionShape, EngineLayout, ModelShape, Proj, StateShape, default_groups
from cluster.core.planner import plan_pair, plan_request
from tests.memsim import RankMemory, execute, make_full_state

TP_SIZES = (1, 2, 4, 8)


@st.composite
def state_shapes(draw, kind: str | None = None) -> StateShape:
    kind = kind or draw(st.sampled_from(["gdn", "mamba2", "mamba1"]))
    kernel = draw(st.integers(2, 4))
    if kind == "gdn":
        kh = draw(st.sampled_from([8, 16]))
        vh = kh * draw(st.sampled_from([1, 2, 3]))  # K:V of 1:1, 1:2, 1:3
        kd, vd = draw(st.sampled_from([2, 4])), draw(st.sampled_from([2, 4, 6]))
        return StateShape("gdn", kernel, (Proj("q", kh, kd), Proj("k", kh, kd), Proj("v", vh, vd)), Proj("ssm_heads", vh, vd * kd))
    if kind == "mamba2":
        heads, hd, n = draw(st.sampled_from([8, 16])), draw(st.sampled_from([2, 4])), draw(st.sampled_from([2, 4]))
        groups = draw(st.sampled_from([1, 2, 4, 8]))  # < TP: B/C replicated
        return StateShape(
            "mamba2", kernel, (Proj("x", heads, hd), Proj("B", groups, n, True), Proj("C", groups, n, True)), Proj("ssm_heads", heads, hd * n)
        )
    inter, n = draw(st.sampled_from([8, 16, 24])), draw(st.sampled_from([2, 4]))
    return StateShape("mamba1", kernel, (Proj("x", inter, 1),), Proj("ssm_channels", inter, n))


@st.composite
def models(draw, kind: str | None = None, attention: bool | None = None) -> ModelShape:
    state = draw(state_shapes(kind))
    n_state = draw(st.integers(1, 4))
    n_attn = draw(st.integers(1, 3)) if attention is not False and (attention or draw(st.booleans())) else 0
    order = draw(st.permutations(["s"] * n_state + ["a"] * n_attn))
    attn = AttentionShape(draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([2, 4, 8]))) if n_attn else None
    return ModelShape(
        f"Test{state.kind}",
        len(order),
        tuple(i for i, c in enumerate(order) if c == "s"),
        tuple(i for i, c in enumerate(order) if c == "a"),
        state,
        attn,
    )


@st.composite
def engine_layout(draw, model: ModelShape, tp: int, dtype: str, ssm_dtype: str, conv_layout: str = "DS") -> EngineLayout:
    kernel = draw(st.sampled_from([2, 4, 8, 16]))
    ppl = draw(st.sampled_from([1, 2, 4]))
    probe = EngineLayout(model, tp, dtype, ssm_dtype, kernel * ppl, kernel, 1 << 40, default_groups(model), conv_layout)
    need = max(probe.min_state_page_bytes, probe.kv_kernel_block_bytes * ppl)
    pad = draw(st.sampled_from([0, 16, 64]))
    page = -(-(need + pad) // ppl) * ppl
    return dataclasses.replace(probe, page_bytes=page)


def _alloc(layout: EngineLayout, tokens: int, rng: np.random.Generator, spare: int) -> tuple[list[list[int]], int]:
    """Block ids per group from one shuffled pool, as the allocator hands them out (state groups: 1-2 blocks, the
    last one the running state)."""
    counts = [int(rng.integers(1, 3)) if g.kind == "state" else -(-tokens // layout.block_size) for g in layout.groups]
    pages = sum(counts) + spare
    pool = rng.permutation(pages).tolist()
    out = []
    for c in counts:
        out.append(pool[:c])
        pool = pool[c:]
    return out, pages


def run_plan(p_layout: EngineLayout, d_layout: EngineLayout, num_tokens: int, cached_blocks: int, seed: int,
             plan_layouts: tuple[EngineLayout, EngineLayout] | None = None) -> tuple[bool, object]:
    """Lay a random request out on both sides, execute the plan, and compare the decode memory with the expected one.
    `plan_layouts` lets a test plan with layouts other than the ones memory is laid out with (a wrong negotiation)."""
    rng = np.random.default_rng(seed)
    full = make_full_state(p_layout, num_tokens, rng)
    cached = cached_blocks * d_layout.block_size
    p_blocks, p_pages = _alloc(p_layout, num_tokens, rng, spare=2)
    d_blocks, d_pages = _alloc(d_layout, num_tokens + 1, rng, spare=2)  # decode holds the whole prompt
    prefill = [RankMemory(p_layout, r, p_pages, rng) for r in range(p_layout.tp)]
    decode = [RankMemory(d_layout, r, d_pages, rng) for r in range(d_layout.tp)]
    poison = make_full_state(p_layout, num_tokens, rng)
    for mem in prefill:
        mem.write_state(full, p_blocks)
        if p_layout.model.attention:
            mem.write_kv(poison, p_blocks, range(0, cached))  # a prefix the decode side must not read again
            mem.write_kv(full, p_blocks, range(cached, num_tokens))
    expected = []
    for mem in decode:
        if d_layout.model.attention:
            mem.write_kv(full, d_blocks, range(0, cached))  # the decode side's own cached prefix
        exp = RankMemory.__new__(RankMemory)
        exp.layout, exp.rank, exp.regions = mem.layout, mem.rank, [r.copy() for r in mem.regions]
        exp.write_state(full, d_blocks)
        if d_layout.model.attention:
            exp.write_kv(full, d_blocks, range(cached, num_tokens))
        expected.append(exp)

    pair = plan_pair(*(plan_layouts or (p_layout, d_layout)))
    plan = plan_request(pair, p_blocks, d_blocks, num_tokens, num_cached_tokens=cached)
    try:
        execute(plan, prefill, decode)
    except (AssertionError, IndexError) as e:  # a wrong plan may point outside memory
        return False, e
    assert plan.num_tokens == num_tokens
    ok = True
    for mem, exp in zip(decode, expected):
        for region, (got, want) in enumerate(zip(mem.regions, exp.regions)):
            # tokens past the prompt in the last kernel block are don't-care (the decode engine overwrites them)
            if d_layout.model.attention:
                for g, group in enumerate(d_layout.groups):
                    if group.kind == "attention" and region < len(group.layers):
                        for *_, off, size in mem.kv_token_range(d_blocks[g], range(num_tokens, plan.end_token)):
                            got[off : off + size] = want[off : off + size]
            ok &= bool(np.array_equal(got, want))
    return ok, plan


@st.composite
def pairs(draw, kind: str | None = None, attention: bool | None = None):
    model = draw(models(kind, attention))
    p_tp, d_tp = draw(st.sampled_from(TP_SIZES)), draw(st.sampled_from(TP_SIZES))
    dtype = draw(st.sampled_from(["bfloat16", "float32"]))
    ssm_dtype = draw(st.sampled_from(["float32", dtype]))
    conv = draw(st.sampled_from(CONV_LAYOUTS))
    p = draw(engine_layout(model, p_tp, dtype, ssm_dtype, conv))
    d = draw(engine_layout(model, d_tp, dtype, ssm_dtype, conv))
    tokens = draw(st.integers(1, 90))
    cached = draw(st.integers(0, tokens // d.block_size)) if draw(st.booleans()) else 0
    return p, d, tokens, cached, draw(st.integers(0, 2**31))


SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(pairs())
def test_plan_moves_exactly_the_decode_shard(case):
    p, d, tokens, cached, seed = case
    ok, plan = run_plan(p, d, tokens, cached, seed)
    assert ok, f"decode memory differs from the decode-sharded state: P tp={p.tp} D tp={d.tp} {p.conv_layout} {p.model}"


@pytest.mark.parametrize("conv", CONV_LAYOUTS)
@pytest.mark.parametrize("kind", ["gdn", "mamba2", "mamba1"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_kind_at_every_tp_pair(kind, conv, data):
    """Each state kind in each conv-state layout, each of the 16 TP pairs, with and without attention and with
    differing kernel blocks."""
    for p_tp in TP_SIZES:
        for d_tp in TP_SIZES:
            model = data.draw(models(kind, attention=data.draw(st.booleans())))
            p = data.draw(engine_layout(model, p_tp, "bfloat16", "float32", conv))
            d = data.draw(engine_layout(model, d_tp, "bfloat16", "float32", conv))
            tokens = data.draw(st.integers(1, 40))
            ok, _ = run_plan(p, d, tokens, 0, data.draw(st.integers(0, 2**31)))
            assert ok, f"{kind} {conv} P tp={p_tp} D tp={d_tp}"


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1), (2, 2)])
def test_sd_conv_state_moves_row_by_row(p_tp, d_tp):
    """SD conv state (rows of every channel): a P/D pair at differing TP reads each sub-projection as one run per
    conv row, and the memory comparison sees the layout - a plan made as if the memory were DS corrupts it (at
    differing TP sizes; at one size each page is copied whole, whatever its layout)."""
    model = _gdn_model()
    p, d = (dataclasses.replace(_layout(model, tp, 16, 16), conv_layout="SD") for tp in (p_tp, d_tp))
    ok, plan = run_plan(p, d, 40, 0, seed=5)
    assert ok
    pair = plan_pair(p, d)
    as_ds = tuple(dataclasses.replace(x, conv_layout="DS") for x in (p, d))
    conv = [r for r in pair.state_reads[0] if r.piece.startswith("conv")]
    ds_conv = [r for r in plan_pair(*as_ds).state_reads[0] if r.piece.startswith("conv")]
    assert len(conv) == len(ds_conv) * model.state.conv_rows  # each unit run of Q, K, V: one read per row
    # same TP: the rows are alike on both sides, so one layer's whole state page is one descriptor
    assert (len(pair.state_descriptors(0)) == 1) == (p_tp == d_tp)
    bad, _ = run_plan(p, d, 40, 0, seed=5, plan_layouts=as_ds)
    assert bad == (p_tp == d_tp)  # at one TP size both sides' pages are alike, whatever the layout


def _gdn_model(kv_heads=2, attn_layers=(3,)):
    state = StateShape("gdn", 4, (Proj("q", 8, 4), Proj("k", 8, 4), Proj("v", 16, 4)), Proj("ssm_heads", 16, 16))
    return ModelShape("T", 4, tuple(i for i in range(4) if i not in attn_layers), attn_layers, state, AttentionShape(kv_heads, 4))


def _layout(model, tp, block, kernel, pad=0):
    probe = EngineLayout(model, tp, "bfloat16", "float32", block, kernel, 1 << 40, default_groups(model))
    ppl = block // kernel
    page = -(-(max(probe.min_state_page_bytes, probe.kv_kernel_block_bytes * ppl) + pad) // ppl) * ppl
    return dataclasses.replace(probe, page_bytes=page)


def test_prefix_cached_on_decode_with_differing_physical_blocks_per_logical():
    """Decode has 2 logical blocks cached; P has ppl 4 (kernel 4), D ppl 2 (kernel 8): exactly the suffix tokens land
    at their token positions, and the cached prefix is not read (the prefill side's prefix is poisoned)."""
    model = _gdn_model()
    p, d = _layout(model, 1, 16, 4), _layout(model, 2, 16, 8)
    assert (p.physical_blocks_per_logical, d.physical_blocks_per_logical) == (4, 2)
    ok, plan = run_plan(p, d, 53, cached_blocks=2, seed=7)
    assert ok
    assert plan.first_token == 32 and plan.num_tokens == 53
    # a front-trim of block lists (pairing the last blocks of each list) is not what happened: tokens 32..52 moved
    assert plan.end_token == 56


def test_remote_ratio_matters():
    """Planning with the decode's physical_blocks_per_logical for the prefill side (the bug the planner exists to
    avoid) corrupts the decode memory."""
    model = _gdn_model()
    p, d = _layout(model, 1, 16, 4), _layout(model, 1, 16, 8)
    wrong_p = dataclasses.replace(p, kernel_block_size=8, page_bytes=p.page_bytes)
    ok, _ = run_plan(p, d, 40, 0, seed=3)
    assert ok
    bad, _ = run_plan(p, d, 40, 0, seed=3, plan_layouts=(wrong_p, d))
    assert not bad


def test_wrong_tp_mapping_is_caught():
    model = _gdn_model(kv_heads=4)
    p, d = _layout(model, 2, 16, 16), _layout(model, 1, 16, 16)
    assert run_plan(p, d, 20, 0, seed=1)[0]
    assert not run_plan(p, d, 20, 0, seed=1, plan_layouts=(dataclasses.replace(p, tp=4), d))[0]
