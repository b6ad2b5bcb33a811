"""Real architectures built locally, without their weights: a published model's config (configs/models/NAME.json, or
any config.json) made into a model directory that vLLM serves - the config's own architecture (the text part of a
multimodal config), every layer at its real dimensions, seeded random weights, a locally trained tokenizer.

`python -m cluster build-model --config configs/models/qwen3.5-0.8b.json [--layers N] [--vocab N] [--out DIR]`:
`--layers` keeps the first N layers of the real pattern (attention and state layers as the model has them, each at
its real size); `--vocab` shrinks only the embedding and output head, to the local tokenizer; `--experts` keeps fewer
of a mixture-of-experts model's experts (each at its real size, as many active per token: a Nemotron-3-Nano MoE
layer holds 1.3 billion parameters in its 128 experts). It prints the
parameters, the bytes, and the state one request carries per 1k tokens (GDN / Mamba state, attention KV: what moves
from a prefill to a decode engine), and how informative the weights' logits are.

Weights: transformers' own init (seeded) leaves the logits of these models flat (every log-probability ~ ln(1/V):
greedy repeats one token, and any output check passes). Here every linear map is drawn from N(0, 1/fan_in) and the
embeddings from N(0, 1), so each layer keeps its input's scale and the output depends on the whole input; the output
head is scaled by HEAD_SCALE so that logits spread over a few nats (`informative_share` measures it). A tied head
(Qwen3.5-0.8B ties it to the embedding) takes the head's init.

`BUILT` names the builds `model.builtin` accepts (`ensure_real_model`, built on first use like the tiny models)."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.core.hf_config import ConfigError, gdn_layer_types, load_config, model_shape, nemotron_pattern
from cluster.cli.tiny_circuit import BENCH_KINDS, KINDS
from cluster.cli.tiny_model import MIN_VOCAB, source_hash, staged, stamped, tokenizer_hash
from cluster.core.layout import dtype_bytes

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAD_SCALE = 4.0  # output head rows ~ N(0, HEAD_SCALE^2 / hidden): logits of std ~4 nats on a unit-RMS hidden state
# Attention without query/key norms (Nemotron-H): q_proj and k_proj scaled by this each, so that scores spread ~4 nats
# instead of ~1 and each query attends to a few positions, as a trained model's do. With the N(0, 1/fan_in) draw alone
# attention is near uniform: noise written over a request's K or V cache averaged out and left the greedy tokens as
# they were (tests/test_real_size_nemotron.py). Qwen3.5's attention normalizes q and k itself (q_norm, k_norm).
QK_SCALE = 2.0

# multimodal checkpoints' architectures -> the text model vLLM serves from their text config
TEXT_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
_ATTENTION = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
_GDN = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim")
_QWEN_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
# what a build needs of each model type beyond the class defaults (a default would silently change the model)
REQUIRED = {
    "qwen3_5_text": (*_ATTENTION, *_GDN, "intermediate_size"),
    "qwen3_5_moe_text": (*_ATTENTION, *_GDN, *_QWEN_MOE),
    "qwen3_next": (*_ATTENTION, *_GDN, *_QWEN_MOE),
    "nemotron_h": ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                   "hybrid_override_pattern", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
                   "conv_kernel", "intermediate_size"),
}
NEMOTRON_MOE = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                "moe_shared_expert_intermediate_size")
# builds `model.builtin` accepts: name -> (config under configs/models, --layers, --vocab, --experts)
BUILT = {
    "qwen3.5-0.8b": ("qwen3.5-0.8b.json", None, 1024, None),
    "nemotron-h-8l": ("nemotron-h-8b.json", 8, 1024, None),  # M-M-M-M*: 4 Mamba2, 3 MLP, 1 attention
}
BUILTIN_NAMES = (*KINDS, *BENCH_KINDS, *BUILT)  # every name `builtin_model` (and `model.builtin`) builds
EXPERTS_FIELD = {"qwen3_5_moe_text": "num_experts", "qwen3_next": "num_experts", "nemotron_h": "n_routed_experts"}


class BuildError(ConfigError):
    """A config the builder cannot make into a model, naming the field."""


@dataclass(frozen=True)
class Built:
    """What `build` made: the directory and the figures it prints."""

    out_dir: Path
    architecture: str
    layers: int
    parameters: int
    bytes: int
    state_bytes: int  # GDN / Mamba state of one request (conv + recurrent), whatever its length
    kv_bytes_per_1k: int  # attention KV of 1,024 tokens
    informative: float  # share of positions whose top logit beats the fifth by more than 1 nat

    def report(self) -> str:
        per_1k = self.state_bytes + self.kv_bytes_per_1k
        return (f"{self.architecture}, {self.layers} layers: {self.parameters / 1e6:,.1f}M parameters, "
                f"{self.bytes / 2**20:,.0f} MiB; per request: state {self.state_bytes / 2**20:.2f} MiB + KV "
                f"{self.kv_bytes_per_1k / 2**20:.2f} MiB per 1k tokens = {per_1k / 2**20:.2f} MiB at 1k tokens; "
                f"top logit > fifth + 1 nat at {self.informative:.0%} of positions")


def text_config(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the text architecture, its config) of a Hugging Face config: the text part of a multimodal one."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch in TEXT_ARCHITECTURES:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise BuildError("text_config", f"{arch} keeps its language model under text_config; there is none")
        arch, model_type = TEXT_ARCHITECTURES[arch]
        return arch, {**text, "model_type": model_type, "architectures": [arch]}
    if not arch:
        raise BuildError("architectures", "the config names no architecture")
    return arch, dict(cfg)


def prepare(cfg: dict[str, Any], layers: int | None = None, vocab: int | None = None,
            experts: int | None = None) -> tuple[str, dict[str, Any]]:
    """The text config to build: checked for what the build needs (BuildError naming the field), cut to `layers`
    (keeping the real layer pattern), `vocab` and `experts`."""
    arch, text = text_config(cfg)
    model_type = text.get("model_type")
    if model_type == "nemotron_h" and text.get("layers_block_type") is not None:  # as transformers 5 writes it
        text["hybrid_override_pattern"] = nemotron_pattern(text)
    text.pop("layers_block_type", None)  # the pattern is rewritten below (cut to --layers)
    if model_type not in REQUIRED:
        raise BuildError("model_type", f"no builder for {model_type!r} ({arch}); builds: {sorted(REQUIRED)}")
    need = list(REQUIRED[model_type])
    if model_type == "nemotron_h" and "E" in str(text.get("hybrid_override_pattern", "")):
        need += NEMOTRON_MOE
    for name in need:
        if text.get(name) is None:
            raise BuildError(name, f"{arch} needs {name} to be built (add it to the config: the class default would "
                                   "change the model)")
    text = {k: v for k, v in text.items() if not k.startswith("_")}
    first_attention = (model_shape(text).attention_layers or ["?"])[0]  # of the whole model, for the refusal below
    if model_type == "nemotron_h":
        pattern = text["hybrid_override_pattern"][:layers]  # [:None]: all of it
        text["hybrid_override_pattern"] = pattern
        text["num_hidden_layers"] = len(pattern)
    else:
        text["layer_types"] = list(gdn_layer_types(text)[:layers])
        text["num_hidden_layers"] = len(text["layer_types"])
    if layers is not None and layers < 1:
        raise BuildError("--layers", f"{layers}: at least one layer")
    shape = model_shape(text)
    if not shape.state_layers or not shape.attention_layers:
        raise BuildError("--layers", f"{layers} layers of {arch} keep no "
                                     f"{'attention' if shape.state_layers else 'state'} layer: a hybrid needs both "
                                     f"(the first attention layer is layer {first_attention})")
    if experts is not None:
        field = EXPERTS_FIELD.get(model_type)
        if field is None or text.get(field) is None:
            raise BuildError("--experts", f"{arch} here has no experts")
        if experts < int(text["num_experts_per_tok"]):
            raise BuildError("--experts", f"{experts}: fewer than the {text['num_experts_per_tok']} active per token")
        text[field] = experts
    if vocab is not None:
        text["vocab_size"] = vocab
    if int(text["vocab_size"]) < MIN_VOCAB:  # named as the user gave it: the option, or the config's field
        raise BuildError("--vocab" if vocab is not None else "vocab_size", f"{text['vocab_size']}: at least "
                         f"{MIN_VOCAB} (the local tokenizer's bytes, specials and think markers)")
    text.setdefault("torch_dtype", "bfloat16")
    text.update({"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    return arch, text


def state_figures(text: dict[str, Any]) -> tuple[int, int]:
    """(state bytes of one request, attention KV bytes per 1,024 tokens) - the planner's shapes and dtypes."""
    shape = model_shape(text)
    dtype = str(text.get("torch_dtype") or "bfloat16")
    ssm = str(text.get("mamba_ssm_dtype") or text.get("mamba_ssm_cache_dtype") or dtype)
    state = 0
    if shape.state is not None:
        conv = shape.state.conv_rows * sum(p.units * p.unit_elems for p in shape.state.conv_projs) * dtype_bytes(dtype)
        rec = shape.state.ssm.units * shape.state.ssm.unit_elems * dtype_bytes(ssm)
        state = len(shape.state_layers) * (conv + rec)
    kv = 0
    if shape.attention is not None:
        a = shape.attention
        kv = len(shape.attention_layers) * 2 * a.num_kv_heads * a.head_dim * 1024 * dtype_bytes(dtype)
    return state, kv


def _config_object(arch: str, text: dict[str, Any]):
    import transformers

    model_cls = getattr(transformers, arch, None)
    if model_cls is None:
        raise BuildError("architectures", f"transformers {transformers.__version__} has no {arch}")
    config = model_cls.config_class(**{k: v for k, v in text.items() if k not in ("architectures", "model_type")})
    config.architectures = [arch]
    return model_cls, config


def init_weights(model, seed: int) -> None:
    """Every linear map N(0, 1/fan_in) (attention's q and k maps times QK_SCALE where no norm follows them), embeddings
    N(0, 1), the output head N(0, HEAD_SCALE^2/hidden) (a tied head is the embedding: it takes the head's init). Norms,
    convolutions, gates' biases and decays keep transformers' init."""
    import torch

    g = torch.Generator().manual_seed(seed)
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head is not None and head.weight is embed.weight
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=g) / w.shape[1] ** 0.5)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, torch.nn.Embedding) and module is not embed:
                module.weight.copy_(torch.randn(module.weight.shape, generator=g))
        for module in model.modules():
            if all(hasattr(module, n) for n in ("q_proj", "k_proj")) and not hasattr(module, "q_norm"):
                module.q_proj.weight.mul_(QK_SCALE)
                module.k_proj.weight.mul_(QK_SCALE)
        if not tied:
            embed.weight.copy_(torch.randn(embed.weight.shape, generator=g))
        if head is not None:
            w = head.weight
            w.copy_(torch.randn(w.shape, generator=g) * HEAD_SCALE / w.shape[1] ** 0.5)


def informative_share(model, vocab: int, seed: int, prompts: int = 4, length: int = 32) -> float:
    """Share of positions (random prompts, teacher-forced) whose top logit beats the fifth by more than 1 nat."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(3, vocab, (prompts, length), generator=g)
    ids[:, 0] = 1
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    top = logits.topk(5, dim=-1).values
    return float(((top[..., 0] - top[..., 4]) > 1.0).float().mean())


def build(config_path: str | Path, out_dir: str | Path, layers: int | None = None, vocab: int | None = None,
          seed: int = 0, experts: int | None = None) -> Built:
    """Build the model of `config_path` into `out_dir` (replacing it; written beside it and renamed into place)."""
    import torch

    from cluster.cli.tiny_circuit import VOCAB_SIZE
    from cluster.cli.tiny_model import build_tokenizer

    t0 = time.monotonic()
    cfg = load_config(config_path)
    arch, text = prepare(cfg, layers, vocab, experts)
    model_cls, config = _config_object(arch, text)
    out_dir = Path(out_dir)
    print(f"building {arch} from {config_path}: {text['num_hidden_layers']} layers, vocab {text['vocab_size']}, "
          f"seed {seed}", flush=True)
    with staged(out_dir, _stamp(config_path, layers, vocab, seed, experts)) as tmp:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config)
        init_weights(model, seed)
        model = model.to(torch.bfloat16).eval()
        parameters = sum(p.numel() for p in model.parameters())
        informative = informative_share(model, min(int(text["vocab_size"]), VOCAB_SIZE), seed)
        model.save_pretrained(str(tmp))
        build_tokenizer(tmp, min(int(text["vocab_size"]), VOCAB_SIZE))
        state, kv = state_figures(text)
        built = Built(out_dir, arch, int(text["num_hidden_layers"]), parameters,
                      sum(f.stat().st_size for f in tmp.glob("*.safetensors")), state, kv, informative)
        (tmp / "build-report.json").write_text(json.dumps({**built.__dict__, "out_dir": str(out_dir)}) + "\n")
    print(f"built into {out_dir} in {time.monotonic() - t0:.1f} s: {built.report()}", flush=True)
    return built


def _stamp(config_path: str | Path, layers: int | None, vocab: int | None, seed: int,
           experts: int | None) -> dict[str, Any]:
    config = json.dumps(load_config(config_path), sort_keys=True).encode()
    return {"config": hashlib.sha256(config).hexdigest()[:16], "layers": layers, "vocab": vocab, "experts": experts,
            "seed": seed, "builder": source_hash(__name__), "tokenizer": tokenizer_hash()}


def ensure_real_model(name: str, root: Path = Path("models"), seed: int = 0) -> Path:
    """`<root>/<name>` for a build of BUILT, built on first use or when its config or the builder changed."""
    if name not in BUILT:
        raise BuildError("model.builtin", f"{name!r} is not a real-architecture build; builds: {sorted(BUILT)}")
    config_name, layers, vocab, experts = BUILT[name]
    config_path = REPO_ROOT / "configs" / "models" / config_name
    root = root if root.is_absolute() else REPO_ROOT / root
    out_dir = root / name
    if not stamped(out_dir, _stamp(config_path, layers, vocab, seed, experts)):
        build(config_path, out_dir, layers, vocab, seed, experts)
    return out_dir


def builtin_model(name: str) -> Path:
    """The directory of `model.builtin` `name`, built on first use: a real-architecture build of BUILT, else a tiny
    model (`cluster.cli.tiny_model.ensure_model`)."""
    if name in BUILT:
        return ensure_real_model(name)
    from cluster.cli.tiny_model import ensure_model

    return ensure_model(name)


def resolve_config(value: str) -> Path:
    """`--config`: a path, or the name of a file under configs/models (with or without .json)."""
    p = Path(value)
    if p.exists():
        return p
    named = REPO_ROOT / "configs" / "models" / (value if value.endswith(".json") else f"{value}.json")
    if named.exists():
        return named
    known = sorted(f.stem for f in (REPO_ROOT / "configs" / "models").glob("*.json"))
    raise BuildError("--config", f"{value!r}: no such file, nor a config under configs/models ({', '.join(known)})")


def default_name(config: Path, layers: int | None, vocab: int | None, experts: int | None) -> str:
    """`build-model --config`'s directory under models/: the config's name and the cuts, ending in "-built" - never a
    `model.builtin` directory (a build there would replace the model a running cluster serves)."""
    cuts = (f"-{layers}l" if layers else "") + (f"-v{vocab}" if vocab else "") + (f"-{experts}e" if experts else "")
    return f"{config.stem}{cuts}-built"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="build-model --config", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a config.json (or model directory), or a name under "
                        "configs/models (e.g. qwen3.5-0.8b)")
    parser.add_argument("--layers", type=int, help="keep the first N layers of the real pattern")
    parser.add_argument("--vocab", type=int, help="embedding rows (default: the real vocabulary)")
    parser.add_argument("--experts", type=int, help="experts per MoE layer (default: the real count)")
    parser.add_argument("--out", type=Path, help="output directory (default: models/<config name>[-<N>l][-v<V>]"
                        "[-<E>e]-built)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        path = resolve_config(args.config)
        out = args.out or REPO_ROOT / "models" / default_name(path, args.layers, args.vocab, args.experts)
        build(path, out, args.layers, args.vocab, args.seed, args.experts)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
