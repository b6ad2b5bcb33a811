"""Tiny random-weight models for tests and `make run`, built locally (no hub access).

A model directory holds what vLLM loads: `config.json`, `model.safetensors` (bf16) and a byte-level BPE tokenizer
(`tokenizer.json` + `tokenizer_config.json`) trained here on a small corpus generated in-code. Everything is a pure
function of (kind, seed): the same seed gives byte-identical files.

Kinds (every sharded head count divides TP 1, 2 and 4):
  gdn       Qwen3-Next (`Qwen3NextForCausalLM`): 3 Gated DeltaNet layers + 1 gated full-attention layer, MoE MLPs.
  gdn-asym  the same with asymmetric GDN heads (value heads = 2 x key heads, as in Qwen3.5) and 2 attention KV heads
            (replicated at TP 4).
  mamba2    Granite 4.0-H style (`GraniteMoeHybridForCausalLM`): 3 Mamba2 layers + 1 attention layer, dense MLPs,
            Mamba2 n_groups = 1 (the B/C group is replicated on every TP rank).
  attn      attention-only baseline (`Qwen3ForCausalLM`).

Random weights give nearly flat logits full of near-ties, so two correct runs that differ only numerically pick
different greedy tokens. `sharpen` rewrites a few tensors so that greedy decoding has wide top-1/top-2 margins
while the next token still depends on the context (see its docstring).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import random
import shutil
import sys
import time
from pathlib import Path

KINDS = ("gdn", "gdn-asym", "mamba2", "attn")

VOCAB_SIZE = 1024
HIDDEN_SIZE = 256
MAX_POSITIONS = 4096
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"  # token ids 0, 1, 2
MARKER = ".build-stamp"  # holds the builder hash; a changed builder rebuilds models on `ensure_model`

REPO_ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------------------------
# configs


def model_config(kind: str):
    """The transformers config for `kind`; head counts are chosen so that TP 1, 2 and 4 all shard evenly."""
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        num_hidden_layers=4,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    if kind in ("gdn", "gdn-asym"):
        from transformers import Qwen3NextConfig

        asym = kind == "gdn-asym"
        return Qwen3NextConfig(
            **common,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            # gated full attention: q_proj yields query + gate, partial rotary (Qwen3-Next defaults)
            num_attention_heads=4,
            num_key_value_heads=2 if asym else 4,
            head_dim=64,
            # Gated DeltaNet: conv over [Q, K, V], recurrent state (v_heads, v_head_dim, k_head_dim) per layer
            linear_num_key_heads=4,
            linear_num_value_heads=8 if asym else 4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            # MoE in every layer; routing to all experts keeps outputs continuous (no expert flips between runs)
            num_experts=4,
            num_experts_per_tok=4,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            intermediate_size=512,
        )
    if kind == "mamba2":
        from transformers import GraniteMoeHybridConfig

        return GraniteMoeHybridConfig(
            **common,
            layer_types=["mamba", "mamba", "attention", "mamba"],
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_multiplier=1 / 8,  # 1/sqrt(head_dim 64)
            position_embedding_type="rope",
            num_local_experts=0,  # dense: only the shared MLP
            shared_intermediate_size=512,
            intermediate_size=512,
            mamba_n_heads=8,  # head_dim 64 with expand 2
            mamba_n_groups=1,
            mamba_d_state=64,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=256,
        )
    if kind == "attn":
        from transformers import Qwen3Config

        return Qwen3Config(
            **common,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=512,
        )
    raise ValueError(f"unknown model kind {kind!r}; choose one of {', '.join(KINDS)}")


def _model_class(kind: str):
    import transformers

    name = {
        "gdn": "Qwen3NextForCausalLM",
        "gdn-asym": "Qwen3NextForCausalLM",
        "mamba2": "GraniteMoeHybridForCausalLM",
        "attn": "Qwen3ForCausalLM",
    }[kind]
    return getattr(transformers, name)


# ----------------------------------------------------------------------------------------------------------------
# weights


def sharpen(model, kind: str, generator) -> None:
    """Rewrite weights in place so that greedy decoding has wide margins and still depends on the context."""
    import torch

    _ = (model, kind, generator, torch)


def random_model(kind: str, seed: int):
    """A bf16 model with seeded random weights, sharpened."""
    import torch

    config = model_config(kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(kind)(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        sharpen(model, kind, generator)
    return model.to(torch.bfloat16).eval()


# ----------------------------------------------------------------------------------------------------------------
# tokenizer

_SYLLABLES = (
    "ka ri to na me su lo pe ta vi ro mu de sa ne li po ga be zu fa ki ho ju wa ye qi xo"
).split()
_WORDS = (
    "the a of to and in is it that for on with as was be by this are at from or an have not but they which "
    "prefill decode cache block state layer head token request engine cluster model tensor parallel rank "
    "transfer memory page kernel group value key query recurrent conv delta gate mamba attention hybrid "
    "router pool replica scale drain plan negotiate stream batch queue sequence prompt output"
).split()


def tokenizer_corpus(lines: int = 4000) -> list[str]:
    """A fixed pseudo-English corpus (words, invented words, digits, punctuation) to train the tokenizer on."""
    rng = random.Random(1234)
    invented = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    out = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 16)):
            r = rng.random()
            if r < 0.6:
                words.append(rng.choice(_WORDS))
            elif r < 0.9:
                words.append(rng.choice(invented))
            else:
                words.append(str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(".!?,;:"))
    return out


def build_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE (any text round-trips) and save it as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    # prepend BOS like Llama-style tokenizers do; vLLM's encode(add_special_tokens=True) adds it
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    assert tok.token_to_id(PAD) == 0 and tok.token_to_id(BOS) == 1 and tok.token_to_id(EOS) == 2
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=MAX_POSITIONS
    )
    fast.save_pretrained(str(out_dir))
    return fast


# ----------------------------------------------------------------------------------------------------------------
# building


def builder_hash() -> str:
    """A hash of this module's source: `ensure_model` rebuilds when the builder changes."""
    return hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()[:16]


def build_model(kind: str, out_dir: Path, seed: int = 0) -> Path:
    """Build model `kind` into `out_dir` (replacing what is there) and return `out_dir`."""
    out_dir = Path(out_dir)
    model_config(kind)  # validates kind before touching the directory
    t0 = time.monotonic()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = random_model(kind, seed)
    model.save_pretrained(str(tmp))
    build_tokenizer(tmp)
    (tmp / MARKER).write_text(json.dumps({"kind": kind, "seed": seed, "builder": builder_hash()}) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    print(f"built {kind} (seed {seed}) into {out_dir} in {time.monotonic() - t0:.1f} s", flush=True)
    return out_dir


def ensure_model(kind: str, root: Path = Path("models"), seed: int = 0) -> Path:
    """`<root>/<kind>`, built on first use or when the builder changed; a relative root is under the repo."""
    root = Path(root)
    if not root.is_absolute():
        root = REPO_ROOT / root
    out_dir = root / kind
    want = {"kind": kind, "seed": seed, "builder": builder_hash()}
    try:
        have = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        have = None
    if have != want:
        build_model(kind, out_dir, seed)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """`build-model --kind gdn --out DIR --seed N`."""
    parser = argparse.ArgumentParser(prog="build-model", description="Build a tiny random-weight model locally.")
    parser.add_argument("--kind", choices=KINDS, default="gdn")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: models/<kind>)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else REPO_ROOT / "models" / args.kind
    build_model(args.kind, out, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
