"""The two sources of an engine layout agree: offline (HF config + TP) and run-time (what vLLM builds for an engine:
its hybrid block-size alignment, KV cache groups and specs, read out by actors/engine/report.py)."""

from __future__ import annotations

import json

import pytest

from cluster.core.hf_config import model_shape
from cluster.core.layout import LayoutError, layout_from_report, offline_layout


@pytest.fixture(autouse=True)
def ds_conv_layout(monkeypatch):
    """vLLM reads its conv-state layout from the environment when it builds an engine: DS here (the engines' own
    setting), for these tests only - not for the session that imports this module."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")

TINY_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "vocab_size": 1024,
    "linear_num_key_heads": 4, "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "partial_rotary_factor": 0.25, "norm_topk_prob": True,
}


def vllm_engine_report(model_dir, cfg: dict, tp: int, block_size: int | None):
    """What vLLM 0.32 sets up for an engine of this model at this TP (no weights loaded): the hybrid block-size
    alignment, the KV cache groups and tensors, read out as the engine actor does."""
    import torch
    from vllm.config.vllm import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from actors.engine.report import report_from_vllm

    vc = EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=tp, dtype="bfloat16", max_model_len=1024,
        kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"}, enable_prefix_caching=False,
        block_size=block_size, distributed_executor_backend="mp",
    ).create_engine_config()
    with set_current_vllm_config(vc):
        type(current_platform)._align_hybrid_block_size(vc, CPUAttentionBackend)
    cc = vc.cache_config
    cc.kv_cache_layout = "LBHNC"  # what a running engine leaves it as (None); on this CPU platform it reports CPU_TILED
    mamba = MambaSpec(
        shapes=Qwen3NextForCausalLM.get_mamba_state_shape_from_config(vc),
        dtypes=Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(vc),
        block_size=cc.mamba_block_size, page_size_padded=cc.mamba_page_size_padded, mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )
    attn = FullAttentionSpec(block_size=cc.block_size, num_kv_heads=vc.model_config.get_num_kv_heads(vc.parallel_config),
                             head_size=cfg["head_dim"], dtype=torch.bfloat16)
    n = cfg["num_hidden_layers"]
    specs = {
        f"model.layers.{i}.linear_attn" if (i + 1) % 4 else f"model.layers.{i}.self_attn.attn": mamba if (i + 1) % 4 else attn
        for i in range(n)
    }
    kv_cache_config = get_kv_cache_config_from_groups(vc, get_kv_cache_groups(vc, specs), 64 * attn.page_size_bytes)
    return report_from_vllm(vc, kv_cache_config)


@pytest.mark.parametrize("value_heads", [4, 8])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("block_size", [None, 32])
@pytest.mark.parametrize("layers", [4, 12])
def test_offline_layout_equals_vllm_runtime_layout(tmp_path, value_heads, tp, block_size, layers):
    cfg = dict(TINY_QWEN3_NEXT, linear_num_value_heads=value_heads, num_hidden_layers=layers)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    report = vllm_engine_report(tmp_path, cfg, tp, block_size)
    model = model_shape(cfg)
    runtime = layout_from_report(report, model)
    offline = offline_layout(model, tp, "bfloat16", report["ssm_dtype"], block_size=block_size, kv_layout="CPU_TILED")
    assert runtime == offline, (report, offline.summary())


def test_report_that_disagrees_with_the_model_is_refused(tmp_path):
    cfg = dict(TINY_QWEN3_NEXT)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    report = vllm_engine_report(tmp_path, cfg, 2, None)
    other = model_shape(dict(cfg, linear_num_value_heads=8))  # a model with twice the value heads
    with pytest.raises(LayoutError, match=r"report.conv_state_bytes: the engine reports 1152, the model's shape at TP 2 gives 1536"):
        layout_from_report(report, other)
    with pytest.raises(LayoutError, match=r"report.page_bytes: missing"):
        layout_from_report({k: v for k, v in report.items() if k != "page_bytes"}, model_shape(cfg))
