"""The tiny model builder: fast, deterministic, the intended head counts, a working tokenizer, sharp outputs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cluster.cli import tiny_circuit as circuit
from cluster.cli import tiny_model as models

REPO = Path(__file__).resolve().parents[1]
BUILT: dict[tuple[str, int], object] = {}


def built(kind: str, seed: int, tmp_path_factory) -> object:
    """Build each (kind, seed) once per session."""
    if (kind, seed) not in BUILT:
        out = tmp_path_factory.mktemp(f"{kind}-{seed}")
        t0 = time.monotonic()
        models.build_model(kind, out / kind, seed)
        BUILT[(kind, seed)] = (out / kind, time.monotonic() - t0)
    return BUILT[(kind, seed)]


@pytest.mark.parametrize("kind", circuit.KINDS)
def test_builds_in_seconds_with_the_files_vllm_loads(kind, tmp_path_factory):
    path, seconds = built(kind, 0, tmp_path_factory)
    assert seconds < 30, f"building {kind} took {seconds:.1f} s"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name


@pytest.mark.parametrize("kind", circuit.KINDS)
def test_weights_are_a_function_of_the_seed(kind, tmp_path_factory):
    first = (built(kind, 0, tmp_path_factory)[0] / "model.safetensors").read_bytes()
    again = tmp_path_factory.mktemp("again") / kind
    models.build_model(kind, again, 0)
    assert (again / "model.safetensors").read_bytes() == first
    other = (built(kind, 1, tmp_path_factory)[0] / "model.safetensors").read_bytes()
    assert other != first


@pytest.mark.parametrize("kind", circuit.KINDS)
def test_head_counts_shard_at_tp_1_2_4(kind, tmp_path_factory):
    config = json.loads((built(kind, 0, tmp_path_factory)[0] / "config.json").read_text())
    heads = [config["num_attention_heads"], config["num_key_value_heads"]]
    if kind.startswith("gdn"):
        heads += [config["linear_num_key_heads"], config["linear_num_value_heads"], config["num_experts"]]
        assert config["layer_types"].count("linear_attention") >= 2
        assert config["layer_types"].count("full_attention") >= 1
    if kind == "mamba2":
        heads += [config["mamba_n_heads"]]
        assert config["mamba_n_groups"] == 1  # replicated on every rank; a group count of 2 would forbid TP 4
        assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]  # Mamba2 x 3, attention
    for tp in (1, 2, 4):
        for n in heads:
            assert n % tp == 0 or tp % n == 0, (kind, n, tp)  # sharded, or replicated (KV heads)
    if kind == "gdn":
        assert config["linear_num_value_heads"] == config["linear_num_key_heads"] == 4
    if kind == "gdn-asym":
        assert config["linear_num_value_heads"] == 2 * config["linear_num_key_heads"]


def _plan(model_dir, decode_tp: int) -> dict:
    cmd = [sys.executable, "-m", "cluster", "plan", "--model", str(model_dir), "--prefill-tp", "1", "--decode-tp",
           str(decode_tp), "--tokens", "700", "--json"]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout)


def test_the_benchmark_kind_builds_from_the_command_line_with_gdns_block_size(tmp_path_factory):
    """`python -m cluster build-model --kind gdn-wide`: ~10x gdn's weights, heads that shard at TP 1, 2 and 4, and
    the block size (so the prefix checkpoint granularity) of `gdn` at every decode TP."""
    out = tmp_path_factory.mktemp("wide") / "gdn-wide"
    subprocess.run([sys.executable, "-m", "cluster", "build-model", "--kind", "gdn-wide", "--out", str(out)],
                   check=True, cwd=REPO, capture_output=True)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (512, 8)
    assert config["layer_types"].count("full_attention") == 2
    for n in (config["num_attention_heads"], config["num_key_value_heads"], config["linear_num_key_heads"],
              config["linear_num_value_heads"], config["num_experts"]):
        for tp in (1, 2, 4):
            assert n % tp == 0 or tp % n == 0, (n, tp)
    small = built("gdn", 0, tmp_path_factory)[0]
    assert (out / "model.safetensors").stat().st_size > 8 * (small / "model.safetensors").stat().st_size
    for tp in (1, 2):
        assert _plan(out, tp)["decode"]["block_size"] == _plan(small, tp)["decode"]["block_size"]


def test_tokenizer_round_trips_text(tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built("gdn", 0, tmp_path_factory)[0]))
    text = "The prefill engine sends 42 cache blocks to the decode pool. Ünïcödé ✓ {json: [1, 2]}\n\ttabs"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok) == circuit.VOCAB_SIZE
    assert len(ids) < len(text.encode())  # merges were learned
    # the think markers: one ordinary token each (kept in decoded text), the vocabulary's last two ids
    think = tok("a <think>plan</think> b", add_special_tokens=False)["input_ids"]
    marks = [tok.convert_tokens_to_ids(t) for t in models.THINK]
    assert marks == [circuit.VOCAB_SIZE - 2, circuit.VOCAB_SIZE - 1] and all(think.count(m) == 1 for m in marks)
    assert tok.decode(think, skip_special_tokens=True) == "a <think>plan</think> b"


def test_ensure_model_builds_once_and_rebuilds_when_the_builder_changes(tmp_path, monkeypatch):
    path = models.ensure_model("attn", root=tmp_path)
    stamp = (path / models.MARKER).stat().st_mtime_ns
    assert models.ensure_model("attn", root=tmp_path) == path
    assert (path / models.MARKER).stat().st_mtime_ns == stamp
    monkeypatch.setattr(models, "builder_hash", lambda: "changed")
    models.ensure_model("attn", root=tmp_path)
    assert json.loads((path / models.MARKER).read_text())["builder"] == "changed"


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], margins


@pytest.mark.parametrize("kind", ["gdn", "gdn-asym", "mamba2"])
def test_hybrid_models_follow_their_rule_with_wide_margins(kind):
    """The circuit in transformers: tokens match `expected_next_token`, bf16 == fp32, top-1/top-2 margin > 4."""
    model = circuit.make_model(kind, 0)
    g = torch.Generator().manual_seed(1)
    prompt = [1] + torch.randint(3, circuit.VOCAB_SIZE, (40,), generator=g).tolist()
    out, margins = greedy(model, prompt, 12)
    ids = list(prompt)
    for token in out:
        assert token == circuit.expected_next_token(ids, kind=kind)
        ids.append(token)
    assert min(margins) > 4
    assert greedy(model.float(), prompt, 12)[0] == out
    # the context matters: change early tokens (not the last three) and the continuation changes
    other = prompt[:1] + torch.randint(3, circuit.VOCAB_SIZE, (37,), generator=g).tolist() + prompt[-3:]
    assert greedy(model.to(torch.bfloat16), other, 12)[0] != out


def hf_decode(model, prompt: list[int], damage=None, steps: int = 4) -> list[int]:
    """Prefill all but the last prompt token (vLLM's P/D boundary), let `damage` change the cache, decode greedily."""
    with torch.no_grad():
        cache = model(torch.tensor([prompt[:-1]]), use_cache=True).past_key_values
        if damage:
            damage(cache.layers)
        out, token = [], prompt[-1]
        for _ in range(steps):
            step = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, token = step.past_key_values, int(step.logits[0, -1].argmax())
            out.append(token)
    return out


@pytest.mark.parametrize("kind", ["gdn", "gdn-asym", "mamba2"])
def test_every_state_byte_class_changes_the_output(kind):
    """The transformers cache after all but the last token of each probe prompt (`probe_prompts`), one byte class
    overwritten with noise at a time: each conv channel group (GDN Q, K, V; Mamba2 x, B, C) and each conv row in
    every mixer layer, each recurrent head of each layer, attention K and V - the next token changes every time.
    transformers keeps the conv state's last 4 inputs; the 3 newest of them are the rows vLLM transfers."""
    model = circuit.make_model(kind, 0)
    cfg = model.config
    if kind == "mamba2":
        inner = cfg.mamba_expand * cfg.hidden_size
        splits, heads = [0, inner, inner + cfg.mamba_d_state, None], cfg.mamba_n_heads
    else:
        q = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        splits, heads = [0, q, 2 * q, None], cfg.linear_num_value_heads
    probes = circuit.probe_prompts(kind)
    gen = torch.Generator().manual_seed(0)

    def noise(t):
        t.copy_(4 * torch.randn(t.shape, generator=gen).to(t.dtype))

    def every_layer(fn):
        return lambda layers: [fn(layers[i]) for i in range(circuit.MIXER_LAYERS)]

    damages = {
        **{f"conv channels {i}": ("self", every_layer(lambda la, a=a, b=b: noise(la.conv_states[0][:, a:b, 1:])))
           for i, (a, b) in enumerate(zip(splits, splits[1:]))},
        **{f"conv row {r}": ("self", every_layer(lambda la, r=r: noise(la.conv_states[0][:, :, 1 + r])))
           for r in range(3)},
        "attention K": ("self", lambda layers: noise(layers[3].keys)),
        "attention V": ("self", lambda layers: noise(layers[3].values)),
    }
    for layer in range(circuit.MIXER_LAYERS):
        for head in range(heads):
            damages[f"recurrent layer {layer} head {head}"] = (
                f"layer {layer} head {head}",
                lambda layers, layer=layer, head=head: noise(layers[layer].recurrent_states[0][:, head]))
    unchanged = []
    for name, (probe, damage) in damages.items():
        prompt = probes[probe]
        clean = hf_decode(model, prompt)
        assert clean[0] == circuit.expected_next_token(prompt, kind=kind)
        if hf_decode(model, prompt, damage)[0] == clean[0]:
            unchanged.append(name)
    assert not unchanged, f"{kind}: noise in these byte classes leaves the next token as it was: {unchanged}"
