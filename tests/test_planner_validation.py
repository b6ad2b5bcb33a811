"""Every validation path: incompatible pairs, impossible layouts, bad requests and bad configs raise typed errors that
name the field and both values."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cluster.core.hf_config import ConfigError, load_config, model_shape
from cluster.core.layout import AttentionShape, CacheGroup, LayoutError, ModelShape, Proj, StateShape, offline_layout
from cluster.core.planner import IncompatiblePair, RequestError, plan_pair, plan_request, tp_ratio


def gdn(kh=4, vh=8, kv=2, layers=4):
    state = StateShape("gdn", 4, (Proj("q", kh, 8), Proj("k", kh, 8), Proj("v", vh, 8)), Proj("ssm_heads", vh, 64))
    return ModelShape("T", layers, tuple(range(layers - 1)), (layers - 1,), state, AttentionShape(kv, 16))


def mamba2(groups=1):
    state = StateShape("mamba2", 4, (Proj("x", 8, 4), Proj("B", groups, 4, True), Proj("C", groups, 4, True)), Proj("ssm_heads", 8, 16))
    return ModelShape("M", 2, (0,), (1,), state, AttentionShape(2, 16))


def test_tp_ratio_sign_convention():
    assert [tp_ratio(1, 2), tp_ratio(2, 1), tp_ratio(4, 4), tp_ratio(2, 8), tp_ratio(8, 2)] == [2, -2, 1, 4, -4]


@pytest.mark.parametrize(
    "change, field, pv, dv",
    [
        (dict(model=gdn(vh=4)), "model.state.conv_projs", None, None),
        (dict(model=gdn(kv=4)), "model.attention.num_kv_heads", 2, 4),
        (dict(model=dataclasses.replace(gdn(), architecture="Other")), "model.architecture", "T", "Other"),
        (dict(dtype="float16"), "dtype", "bfloat16", "float16"),
        (dict(ssm_dtype="bfloat16"), "ssm_dtype", "float32", "bfloat16"),
        (dict(conv_layout="SD"), "conv_layout", "DS", "SD"),  # each layout pairs with itself only
        (dict(kv_layout="NHD"), "kv_layout", "HND", "NHD"),
        (dict(groups=(CacheGroup("state", (0, 1, 2)), CacheGroup("attention", (3,)))), "groups", None, None),
    ],
)
def test_incompatible_pair_names_field_and_both_values(change, field, pv, dv):
    p = offline_layout(gdn(), 2, "bfloat16", "float32")
    d = dataclasses.replace(offline_layout(change.get("model", gdn()), 2, "bfloat16", "float32"), **{k: v for k, v in change.items() if k != "model"})
    with pytest.raises(IncompatiblePair) as e:
        plan_pair(p, d)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: prefill has ")
    if pv is not None:
        assert (e.value.prefill, e.value.decode) == (pv, dv)
        assert f"prefill has {pv!r}, decode has {dv!r}" in str(e.value)


def test_tp_sizes_that_do_not_divide():
    model = ModelShape("T", 1, (0,), (), StateShape("mamba1", 4, (Proj("x", 12, 1),), Proj("c", 12, 4)), None)
    p, d = offline_layout(model, 3), offline_layout(model, 2)
    with pytest.raises(IncompatiblePair, match=r"^tp: prefill has 3, decode has 2; the larger TP size must be a multiple"):
        plan_pair(p, d)


def test_nhd_layout_refused_across_tp_sizes():
    p = dataclasses.replace(offline_layout(gdn(), 1, "bfloat16", "float32"), kv_layout="NHD")
    d = dataclasses.replace(offline_layout(gdn(), 2, "bfloat16", "float32"), kv_layout="NHD")
    with pytest.raises(IncompatiblePair, match="kv_layout: .*HND layout"):
        plan_pair(p, d)
    plan_pair(p, dataclasses.replace(p))  # same TP: fine


def test_cpu_attention_pages_at_another_kernel_block_size_are_refused():
    """vLLM's CPU attention keeps a kernel block head-major but not token-major (measured with vLLM's own cache-write
    op, for the instruction set it picks on this machine): a token's K or V bytes sit elsewhere at another block size,
    so token-position reads between engines with different kernel block sizes would land garbage - what a live P TP 1
    (384-token blocks) -> D TP 4 (256) pair of gdn-asym did, silently, before this check. Refused, naming the field;
    equal kernel blocks, or a GPU layout (token rows in order), pair as before."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    def token_major(block: int, tokens: int = 64, head_dim: int = 64) -> tuple[bool, bool]:
        isa = _get_attn_isa(torch.bfloat16, block, head_dim)
        cache = torch.zeros(1, 1, 2 * block, head_dim, dtype=torch.bfloat16)
        k, v = cache.chunk(2, dim=2)
        key = torch.arange(1, tokens + 1, dtype=torch.bfloat16).view(tokens, 1, 1).expand(tokens, 1, head_dim).contiguous()
        ops.cpu_attn_reshape_and_cache(key, -key, k, v, torch.arange(tokens), isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
        rows = [cache[0, 0, :block].reshape(-1).float(), cache[0, 0, block:].reshape(-1).float()]
        return tuple(all(bool((r[t * head_dim:(t + 1) * head_dim] == sign * (t + 1)).all()) for t in range(tokens))
                     for r, sign in zip(rows, (1, -1)))

    assert token_major(128) != (True, True) and token_major(256) != (True, True)

    p = offline_layout(gdn(), 1, "bfloat16", "float32", kv_layout="CPU_TILED")
    d = offline_layout(gdn(), 2, "bfloat16", "float32", block_size=2 * p.block_size, kv_layout="CPU_TILED")
    assert p.kernel_block_size != d.kernel_block_size
    with pytest.raises(IncompatiblePair, match=rf"^kernel_block_size: prefill has {p.kernel_block_size}, decode has "
                                               rf"{d.kernel_block_size}; vLLM's CPU attention stores V transposed"):
        plan_pair(p, d)
    plan_pair(p, offline_layout(gdn(), 2, "bfloat16", "float32", block_size=p.block_size, kv_layout="CPU_TILED"))
    plan_pair(dataclasses.replace(p, kv_layout="HND"), dataclasses.replace(d, kv_layout="HND"))  # GPU: token rows


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: offline_layout(gdn(kh=4), 8), "q.units"),  # GDN key heads do not replicate
        (lambda: offline_layout(mamba2(groups=2), 8), None),  # B/C replicate: fine
        (lambda: offline_layout(gdn(kv=3), 2), "kv_heads.units"),
        (lambda: offline_layout(gdn(), 1, "int3"), "dtype"),
        (lambda: offline_layout(gdn(), 0), "tp"),
        (lambda: dataclasses.replace(offline_layout(gdn(), 1), kernel_block_size=48), "kernel_block_size"),
        (lambda: dataclasses.replace(offline_layout(gdn(), 1), page_bytes=64), "page_bytes"),
        (lambda: offline_layout(gdn(), 1, conv_layout="DSX"), "conv_layout"),
    ],
)
def test_impossible_layouts(build, field):
    if field is None:
        build()
        return
    with pytest.raises(LayoutError) as e:
        build()
    assert e.value.field == field and str(e.value).startswith(field + ":")


def test_layout_error_names_tp_and_count():
    with pytest.raises(LayoutError, match=r"q.units: 4 q units cannot be split over TP 8 \(must be divisible; not replicable\)"):
        offline_layout(gdn(kh=4), 8)


def _pair():
    return plan_pair(offline_layout(gdn(), 1, "bfloat16", "float32", block_size=32), offline_layout(gdn(), 2, "bfloat16", "float32", block_size=32))


@pytest.mark.parametrize(
    "args, field",
    [
        (([[1], [2], [3]], [[1], [2], [3], [4]], 10), "prefill_blocks"),
        (([[1], [2], [3], [4]], [[1], [2], [3], [4]], 0), "num_tokens"),
        (([[1], [2], [3], [4]], [[1], [2], [3], [4]], 40), "prefill_blocks"),  # 1 block of 32 < 40 tokens
        (([[1], [2], [], [4, 5]], [[1], [2], [3], [4, 5]], 40), "prefill_blocks"),
        (([[1], [2], [3], [4, 5]], [[1], [2], [3], [4]], 40), "decode_blocks"),
    ],
)
def test_bad_requests(args, field):
    with pytest.raises(RequestError) as e:
        plan_request(_pair(), *args)
    assert e.value.field == field


def test_cached_prefix_must_be_whole_decode_blocks():
    with pytest.raises(RequestError, match="num_cached_tokens: 5 is not a multiple of the decode block size"):
        plan_request(_pair(), [[1], [2], [3], [4, 5]], [[1], [2], [3], [4, 5]], 40, num_cached_tokens=5)


# ---- configs ----


def _write(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_config_errors_name_the_key(tmp_path):
    base = json.loads(open("configs/models/qwen3.5-0.8b.json").read())
    broken = json.loads(json.dumps(base))
    del broken["text_config"]["linear_num_key_heads"]
    with pytest.raises(ConfigError, match=r"^text_config.linear_num_key_heads: missing"):
        model_shape(broken)
    broken = json.loads(json.dumps(base))
    broken["text_config"]["linear_key_head_dim"] = "128"
    with pytest.raises(ConfigError, match=r"text_config.linear_key_head_dim: must be a positive integer, got '128'"):
        model_shape(broken)
    broken = json.loads(json.dumps(base))
    broken["text_config"]["layer_types"][2] = "sliding"
    with pytest.raises(ConfigError, match=r"text_config.layer_types\[2\]: unknown layer type 'sliding'"):
        model_shape(broken)
    with pytest.raises(ConfigError, match="model_type: unrecognised model family"):
        model_shape({"model_type": "bert_like"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="model: no config.json"):
        load_config(tmp_path / "nowhere")


def test_config_families():
    """Each accepted family reads into the intended shape."""
    q = model_shape(load_config("configs/models/qwen3.5-35b-a3b.json"))
    assert q.state.kind == "gdn" and [p.units for p in q.state.conv_projs] == [16, 16, 32] and len(q.attention_layers) == 10
    n = model_shape(load_config("configs/models/nemotron-3-nano-30b-a3b.json"))
    assert n.state.kind == "mamba2" and n.state.conv_projs[1].replicable and n.attention.num_kv_heads == 2
    granite = model_shape({"model_type": "granitemoehybrid", "num_hidden_layers": 2, "layer_types": ["mamba", "attention"],
                           "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 8,
                           "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_d_conv": 4})
    assert granite.state_layers == (0,) and granite.attention.head_dim == 16
    jamba = model_shape({"model_type": "jamba", "num_hidden_layers": 8, "attn_layer_period": 8, "attn_layer_offset": 4,
                         "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1})
    assert jamba.state.kind == "mamba1" and jamba.attention_layers == (4,) and jamba.state.conv_projs[0].units == 128
    m1 = model_shape({"model_type": "mamba", "num_hidden_layers": 2, "hidden_size": 32, "state_size": 8, "conv_kernel": 4})
    assert m1.attention is None and m1.state.ssm.unit_elems == 8
    assert model_shape({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}).state is None


@pytest.mark.parametrize("p_tp, d_tp, kv", [(1, 2, 2), (2, 1, 2), (4, 1, 2), (4, 2, 1), (1, 4, 4), (8, 2, 2)])
def test_every_prefill_rank_is_notified(p_tp, d_tp, kv):
    """Each prefill rank holds blocks for every request: some decode rank must notify it, and the count it waits
    for is the number of decode ranks that do."""
    model = ModelShape("A", 2, (), (0, 1), None, AttentionShape(kv, 16))  # attention only: replicated heads
    pair = plan_pair(offline_layout(model, p_tp), offline_layout(model, d_tp))
    notified = [r for d in range(d_tp) for r in pair.notify_ranks(d)]
    assert sorted(set(notified)) == list(range(p_tp))
    assert list(pair.consumers()) == [notified.count(r) for r in range(p_tp)]
    for d in range(d_tp):
        assert set(pair.remote_ranks(d)) <= set(pair.notify_ranks(d))


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (8, 1)])
def test_planning_one_rank_equals_its_part_of_the_full_plan(p_tp, d_tp):
    """What a decode worker computes for itself (ranks=(r,)) is exactly rank r's share of the whole request's plan."""
    import numpy as np

    model = model_shape(load_config("configs/models/qwen3.5-35b-a3b.json"))
    pair = plan_pair(offline_layout(model, p_tp, "bfloat16", "float32"), offline_layout(model, d_tp, "bfloat16", "float32"))
    blocks = []
    for layout in (pair.prefill, pair.decode):
        blocks.append([[5] if g.kind == "state" else list(range(10, 10 + 4096 // layout.block_size + 1)) for g in layout.groups])
    full = plan_request(pair, blocks[0], blocks[1], 4095)
    for r in range(d_tp):
        one = plan_request(pair, blocks[0], blocks[1], 4095, ranks=(r,))
        assert [x.regions for x in one.reads[r]] == [x.regions for x in full.reads[r]]
        assert all(np.array_equal(a.rows, b.rows) for a, b in zip(one.reads[r], full.reads[r]))
        assert one.uncoalesced[r] == full.uncoalesced[r] and all(not one.reads[o] for o in range(d_tp) if o != r)
