"""Real architectures built locally (`cluster.cli.real_model`): the config's own architecture at its real dimensions,
cut to fewer layers or a smaller vocabulary on request, refused with the field named when a build cannot be made; the
weights' logits informative (transformers' own init leaves them flat); the figures it prints the planner's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import real_model as rm
from cluster.core.config import ModelConfig
from cluster.core.hf_config import ConfigError, load_config, model_shape

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"


def _cfg(name: str) -> dict:
    return load_config(MODELS / f"{name}.json")


def test_every_config_in_configs_models_can_be_prepared_and_keeps_its_shape():
    """Each published config has what a build needs; the text part of a multimodal one is built as its text model."""
    for path in sorted(MODELS.glob("*.json")):
        cfg = load_config(path)
        arch, text = rm.prepare(cfg)
        assert arch.endswith("ForCausalLM"), (path.name, arch)
        real = model_shape(cfg)
        built = model_shape(text)
        assert (built.state_layers, built.attention_layers, built.state, built.attention) == \
            (real.state_layers, real.attention_layers, real.state, real.attention), path.name


def test_layers_keep_the_real_pattern_and_vocab_only_the_embedding():
    arch, text = rm.prepare(_cfg("qwen3.5-0.8b"), layers=8, vocab=512)
    assert arch == "Qwen3_5ForCausalLM" and text["model_type"] == "qwen3_5_text"
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + \
        ["full_attention"]
    assert (text["num_hidden_layers"], text["vocab_size"], text["hidden_size"], text["intermediate_size"]) == \
        (8, 512, 1024, 3584)
    _, nem = rm.prepare(_cfg("nemotron-h-8b"), layers=8)
    assert nem["hybrid_override_pattern"] == "M-M-M-M*" and nem["num_hidden_layers"] == 8


@pytest.mark.parametrize("name, kwargs, field, words", [
    ("qwen3.5-0.8b", {"layers": 3}, "--layers", "keep no attention layer"),
    ("nemotron-h-8b", {"layers": 7}, "--layers", "(the first attention layer is layer 7)"),
    ("qwen3.5-0.8b", {"layers": 0}, "--layers", "at least one layer"),
    ("qwen3.5-35b-a3b", {"experts": 4}, "--experts", "fewer than the 8 active per token"),
    ("qwen3.5-0.8b", {"experts": 8}, "--experts", "has no experts"),
    ("qwen3.5-0.8b", {"vocab": 260}, "--vocab", "at least 261"),
])
def test_a_build_that_cannot_be_made_is_refused_naming_the_option(name, kwargs, field, words):
    with pytest.raises(rm.BuildError, match=field) as e:
        rm.prepare(_cfg(name), **kwargs)
    assert words in str(e.value)


def test_a_config_missing_what_the_build_needs_is_refused_naming_the_field():
    cfg = _cfg("qwen3.5-0.8b")
    del cfg["text_config"]["intermediate_size"]
    with pytest.raises(rm.BuildError, match="intermediate_size.*needs intermediate_size"):
        rm.prepare(cfg)
    moe = _cfg("nemotron-3-nano-30b-a3b")
    del moe["moe_shared_expert_intermediate_size"]  # needed only because its pattern has MoE layers ("E")
    with pytest.raises(rm.BuildError, match="moe_shared_expert_intermediate_size"):
        rm.prepare(moe)
    small = _cfg("qwen3.5-0.8b")
    small["text_config"]["vocab_size"] = 200  # the local tokenizer's ids would run past the embedding
    with pytest.raises(rm.BuildError, match="vocab_size.*at least 261"):
        rm.prepare(small)
    with pytest.raises(rm.BuildError, match="no builder for 'llama'"):
        rm.prepare({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(rm.BuildError, match="text_config"):
        rm.prepare({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"})


def test_state_figures_are_the_planners():
    """Qwen3.5-0.8B: 18 GDN layers of conv (3 rows x (16*128*2 + 16*128) channels, bf16) and recurrent state
    (16 heads x 128 x 128, fp32), 6 attention layers of 2 KV heads x 256 (bf16). The Qwen3-Next-shaped model of
    the same dimensions moved 670 MB in 21 requests of ~1k tokens (32 MB each) between live engines."""
    _, text = rm.prepare(_cfg("qwen3.5-0.8b"))
    state, kv = rm.state_figures(text)
    assert state == 18 * (3 * (16 * 128 * 3) * 2 + 16 * 128 * 128 * 4)
    assert kv == 6 * 2 * 2 * 256 * 1024 * 2
    assert 30e6 < state + kv < 34e6


def test_a_built_model_loads_with_its_real_classes_and_its_logits_are_informative(tmp_path):
    """Four layers of Qwen3.5-0.8B (three GDN, one attention) at a 512-token vocabulary: transformers loads it as the
    architecture it names, every tensor at the real width; its top logit beats the fifth by more than a nat at most
    positions, where transformers' own init gives (nearly) none - what makes an output check able to fail."""
    import torch
    from transformers import AutoModelForCausalLM

    built = rm.build(MODELS / "qwen3.5-0.8b.json", tmp_path / "m", layers=4, vocab=512)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["num_hidden_layers"] == 4
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == built.parameters
    assert model.model.layers[0].mlp.gate_proj.weight.shape == (3584, 1024)
    assert built.informative > 0.6, built.report()
    _, text = rm.prepare(_cfg("qwen3.5-0.8b"), layers=4, vocab=512)
    model_cls, cfg = rm._config_object("Qwen3_5ForCausalLM", text)
    torch.manual_seed(0)
    flat = model_cls(cfg).to(torch.bfloat16).eval()
    assert rm.informative_share(flat, 512, 0) < 0.1
    assert (tmp_path / "m" / "tokenizer.json").exists() and json.loads(
        (tmp_path / "m" / "build-report.json").read_text())["state_bytes"] == built.state_bytes


def test_the_builds_model_builtin_names_are_the_builders():
    names = set(ModelConfig.model_fields["builtin"].annotation.__args__[0].__args__)
    assert set(rm.BUILT) <= names and set(rm.BUILTIN_NAMES) == names  # the benchmarks' --model choices too
    for name, (config, layers, vocab, experts) in rm.BUILT.items():
        rm.prepare(load_config(MODELS / config), layers, vocab, experts)


def test_the_command_line_names_a_missing_config():
    r = subprocess.run([sys.executable, "-m", "cluster", "build-model", "--config", "no-such-model"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "--config" in r.stderr and "qwen3.5-0.8b" in r.stderr


def test_a_nemotron_config_as_transformers_writes_it_has_the_same_shape():
    """transformers 5 saves Nemotron-H's pattern as `layers_block_type` (a list of layer kinds), which is what an
    engine serving a built model reports at registration: the shape read from it is the pattern's."""
    _, text = rm.prepare(_cfg("nemotron-h-8b"), layers=8)
    _, config = rm._config_object("NemotronHForCausalLM", text)
    saved = config.to_dict()
    assert "layers_block_type" in saved
    saved.pop("hybrid_override_pattern", None)
    assert model_shape(saved) == model_shape(text)
    with pytest.raises(ConfigError, match="layers_block_type: unknown layer kinds \\['conv'\\]"):
        model_shape({**saved, "layers_block_type": ["conv", *saved["layers_block_type"][1:]]})
    # and the builder takes it in that form too
    saved["architectures"] = ["NemotronHForCausalLM"]
    _, again = rm.prepare(saved, layers=8)
    assert again["hybrid_override_pattern"] == "M-M-M-M*" and "layers_block_type" not in again


def test_the_command_lines_default_directory_is_never_a_builtin_one():
    """`build-model --config qwen3.5-0.8b` must not replace models/qwen3.5-0.8b, which `model.builtin` serves."""
    for config, layers, vocab, experts in [("qwen3.5-0.8b", None, None, None), ("qwen3.5-0.8b", None, 1024, None),
                                           ("nemotron-h-8b", 8, 1024, None), ("qwen3.5-35b-a3b", 4, None, 8)]:
        name = rm.default_name(MODELS / f"{config}.json", layers, vocab, experts)
        assert name.endswith("-built") and name not in rm.BUILT, name
    assert rm.default_name(MODELS / "nemotron-h-8b.json", 8, 1024, None) == "nemotron-h-8b-8l-v1024-built"
