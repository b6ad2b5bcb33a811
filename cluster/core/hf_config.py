"""Model shapes from Hugging Face `config.json` files of the hybrid families.

Accepted: Qwen3-Next (`qwen3_next`), Qwen3.5 dense and MoE (`qwen3_5*`, including multimodal configs whose language
model sits under `text_config`), Nemotron-H (`nemotron_h`, `hybrid_override_pattern`), GraniteMoeHybrid
(`granitemoehybrid`), Jamba (Mamba1 + attention), pure Mamba2 (`mamba2`) and Mamba1 (`mamba`), and attention-only
models (anything with `num_attention_heads`). A missing field raises ConfigError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.core.errors import FieldError
from cluster.core.layout import AttentionShape, ModelShape, Proj, StateShape


class ConfigError(FieldError):
    """A config that cannot be read as a hybrid model; `field` names the key (with its path)."""


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a config.json, or the config.json inside a model directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError("model", f"no config.json at {p}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError("config.json", f"not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError("config.json", "top level must be an object")
    return cfg


def _text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The language model's config and the key path it was found under ('' at top level)."""
    for key in ("text_config", "language_config", "llm_config"):
        sub = cfg.get(key)
        if isinstance(sub, dict) and ("num_hidden_layers" in sub or "hidden_size" in sub):
            merged = {k: v for k, v in cfg.items() if k != key}
            merged.update(sub)
            return merged, f"{key}."
    return cfg, ""


class _Reader:
    def __init__(self, cfg: dict[str, Any], prefix: str):
        self.cfg, self.prefix = cfg, prefix

    def get(self, *names: str, default: Any = ..., kind: type = int) -> Any:
        for name in names:
            if name in self.cfg and self.cfg[name] is not None:
                value = self.cfg[name]
                if kind is int:
                    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                        raise ConfigError(self.prefix + name, f"must be a positive integer, got {value!r}")
                elif not isinstance(value, kind):
                    raise ConfigError(self.prefix + name, f"must be a {kind.__name__}, got {value!r}")
                return value
        if default is ...:
            raise ConfigError(self.prefix + names[0], "missing")
        return default


def _attention(r: _Reader) -> AttentionShape:
    heads = r.get("num_attention_heads")
    kv = r.get("num_key_value_heads", default=heads)
    head_dim = r.get("head_dim", "attention_head_dim", default=None) or r.get("hidden_size") // heads
    if head_dim < 1:
        raise ConfigError(r.prefix + "hidden_size", f"{r.get('hidden_size')} is smaller than num_attention_heads {heads} (no head_dim given)")
    return AttentionShape(num_kv_heads=kv, head_dim=head_dim)


def _gdn_state(r: _Reader) -> StateShape:
    kh, vh = r.get("linear_num_key_heads"), r.get("linear_num_value_heads")
    kd, vd = r.get("linear_key_head_dim"), r.get("linear_value_head_dim")
    if vh % kh:
        raise ConfigError(r.prefix + "linear_num_value_heads", f"{vh} is not a multiple of linear_num_key_heads {kh}")
    return StateShape(
        kind="gdn",
        conv_kernel=r.get("linear_conv_kernel_dim", "conv_kernel_size"),
        conv_projs=(Proj("q", kh, kd), Proj("k", kh, kd), Proj("v", vh, vd)),
        ssm=Proj("ssm_heads", vh, vd * kd),
    )


def _mamba2_state(r: _Reader, *, heads: str, head_dim: str, groups: str, state: str, kernel: str) -> StateShape:
    n_heads, hd = r.get(heads), r.get(head_dim)
    n_groups, d_state = r.get(groups, default=1), r.get(state)
    if n_heads % n_groups:
        raise ConfigError(r.prefix + groups, f"{n_heads} heads are not a multiple of {n_groups} groups")
    return StateShape(
        kind="mamba2",
        conv_kernel=r.get(kernel, default=4),
        conv_projs=(Proj("x", n_heads, hd), Proj("B", n_groups, d_state, True), Proj("C", n_groups, d_state, True)),
        ssm=Proj("ssm_heads", n_heads, hd * d_state),
    )


def _mamba1_state(r: _Reader, intermediate: int, d_state: int, kernel: int) -> StateShape:
    return StateShape(
        kind="mamba1",
        conv_kernel=kernel,
        conv_projs=(Proj("x", intermediate, 1),),
        ssm=Proj("ssm_channels", intermediate, d_state),
    )


def _layers_from_types(types: list[Any], field: str, state_names: set[str], attn_names: set[str]) -> tuple[list[int], list[int]]:
    state, attn = [], []
    for i, t in enumerate(types):
        if t in state_names:
            state.append(i)
        elif t in attn_names:
            attn.append(i)
        else:
            raise ConfigError(f"{field}[{i}]", f"unknown layer type {t!r}; expected one of {sorted(state_names | attn_names)}")
    return state, attn


# Nemotron-H's layer kinds as transformers 5 writes them (`layers_block_type`) -> hybrid_override_pattern's symbols
NEMOTRON_BLOCKS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-",
                   "moe": "E"}


def gdn_layer_types(text: dict[str, Any], prefix: str = "") -> list[Any]:
    """A GDN hybrid's layer kinds, one per layer: its `layer_types`, or every `full_attention_interval`-th layer
    (default 4) full attention and the others linear (GDN)."""
    r = _Reader(text, prefix)
    n = r.get("num_hidden_layers")
    types = text.get("layer_types")
    if types is None:
        interval = r.get("full_attention_interval", default=4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(prefix + "layer_types", f"must list {n} layer types (num_hidden_layers)")
    return types


def nemotron_pattern(text: dict[str, Any], prefix: str = "") -> str:
    """Nemotron-H's `hybrid_override_pattern` (M Mamba2, * attention, - MLP, E MoE), or the same read from the list of
    layer kinds transformers 5 writes instead (`layers_block_type`)."""
    names = text.get("layers_block_type")
    if "hybrid_override_pattern" not in text and isinstance(names, list):
        unknown = sorted({str(n) for n in names} - set(NEMOTRON_BLOCKS))
        if unknown:
            raise ConfigError(prefix + "layers_block_type", f"unknown layer kinds {unknown}; expected one of "
                                                            f"{sorted(NEMOTRON_BLOCKS)}")
        return "".join(NEMOTRON_BLOCKS[n] for n in names)
    return _Reader(text, prefix).get("hybrid_override_pattern", kind=str)


def model_shape(cfg: dict[str, Any]) -> ModelShape:
    """The TP-independent per-request cache shape of a model, from its HF config dict."""
    text, prefix = _text_config(cfg)
    r = _Reader(text, prefix)
    model_type = str(text.get("model_type") or cfg.get("model_type") or "")
    archs = cfg.get("architectures") or text.get("architectures") or [model_type or "unknown"]
    arch = str(archs[0]) if isinstance(archs, list) and archs else str(archs)

    if "linear_num_value_heads" in text or model_type.startswith(("qwen3_next", "qwen3_5")):
        types = gdn_layer_types(text, prefix)
        n = len(types)
        st, at = _layers_from_types(types, prefix + "layer_types", {"linear_attention"}, {"full_attention", "attention"})
        return ModelShape(arch, n, tuple(st), tuple(at), _gdn_state(r), _attention(r) if at else None)

    if model_type == "nemotron_h" or "hybrid_override_pattern" in text:
        pattern = nemotron_pattern(text, prefix)
        state_idx = [i for i, c in enumerate(pattern) if c == "M"]
        attn_idx = [i for i, c in enumerate(pattern) if c == "*"]
        bad = sorted(set(pattern) - set("M*-E"))
        if bad:
            raise ConfigError(prefix + "hybrid_override_pattern", f"unknown layer symbols {bad}; expected M, *, - or E")
        state = _mamba2_state(r, heads="mamba_num_heads", head_dim="mamba_head_dim", groups="n_groups", state="ssm_state_size", kernel="conv_kernel")
        return ModelShape(arch, len(pattern), tuple(state_idx), tuple(attn_idx), state, _attention(r) if attn_idx else None)

    if model_type == "granitemoehybrid" or "mamba_n_heads" in text:
        n = r.get("num_hidden_layers")
        types = text.get("layer_types") or ["mamba"] * n
        # transformers writes "mamba"/"attention"; vLLM's loader looks up "linear_attention"/"full_attention"
        st, at = _layers_from_types(types, prefix + "layer_types", {"mamba", "linear_attention"}, {"attention", "full_attention"})
        hidden = r.get("hidden_size")
        n_heads = r.get("mamba_n_heads")
        if "mamba_d_head" not in text or text["mamba_d_head"] in (None, "auto"):
            text = {**text, "mamba_d_head": r.get("mamba_expand", default=2) * hidden // n_heads}
            r = _Reader(text, prefix)
        state = _mamba2_state(r, heads="mamba_n_heads", head_dim="mamba_d_head", groups="mamba_n_groups", state="mamba_d_state", kernel="mamba_d_conv")
        return ModelShape(arch, n, tuple(st), tuple(at), state, _attention(r) if at else None)

    if model_type == "jamba" or "attn_layer_period" in text:
        n = r.get("num_hidden_layers")
        period, offset = r.get("attn_layer_period"), text.get("attn_layer_offset", 0)
        at = [i for i in range(n) if i % period == offset]
        st = [i for i in range(n) if i not in at]
        inter = r.get("mamba_expand", default=2) * r.get("hidden_size")
        state = _mamba1_state(r, inter, r.get("mamba_d_state", default=16), r.get("mamba_d_conv", default=4))
        return ModelShape(arch, n, tuple(st), tuple(at), state, _attention(r))

    if model_type == "mamba2":
        n = r.get("num_hidden_layers")
        state = _mamba2_state(r, heads="num_heads", head_dim="head_dim", groups="n_groups", state="state_size", kernel="conv_kernel")
        return ModelShape(arch, n, tuple(range(n)), (), state, None)

    if model_type in ("mamba", "falcon_mamba"):
        n = r.get("num_hidden_layers")
        inter = r.get("intermediate_size", default=None) or r.get("expand", default=2) * r.get("hidden_size")
        state = _mamba1_state(r, inter, r.get("state_size", default=16), r.get("conv_kernel", default=4))
        return ModelShape(arch, n, tuple(range(n)), (), state, None)

    if "num_attention_heads" in text:
        n = r.get("num_hidden_layers")
        return ModelShape(arch, n, (), tuple(range(n)), None, _attention(r))

    raise ConfigError(prefix + "model_type", f"unrecognised model family {model_type!r} (no hybrid or attention fields)")


def torch_dtype(cfg: dict[str, Any]) -> str | None:
    text, _ = _text_config(cfg)
    value = text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
    return str(value) if value else None


def ssm_dtype(cfg: dict[str, Any], default: str) -> str:
    """The recurrent state's dtype: the config's `mamba_ssm_dtype` if set, else float32 for GDN (vLLM keeps it in
    fp32) and the model dtype otherwise."""
    text, _ = _text_config(cfg)
    value = text.get("mamba_ssm_dtype")
    return str(value) if value else default
