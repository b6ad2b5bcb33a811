"""Tiny hybrid models for tests and `make run`, built locally in seconds (no hub access).

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

A kind for benchmarks only (`BENCH_KINDS`), without the circuit:
  gdn-wide  Qwen3-Next, 8 layers (GDN x 3 + attention, twice) of width 512: ~10x the compute per token of `gdn`
            (39M parameters), so that prefill is most of a request's time, as it is on a real model, while the state
            per layer and so the block size stay `gdn`'s. Its weights are transformers' seeded init: the outputs are
            noise, fine for timing, useless for checking outputs.

Random weights give nearly flat logits full of near-ties, so two correct runs that differ only numerically (TP 1
vs TP 2 in bf16) pick different greedy tokens. So the weights are not noise: `cluster.cli.tiny_circuit.sharpen` sets
them to a small lookup circuit (described there) whose greedy output is an exact function of the context, with
top-1/top-2 logit margins above 4, and which needs every byte class of the state a P/D transfer moves: each conv row and
channel group, each recurrent head of each layer, attention K and V. `expected_next_token` states the rule for the
hybrid kinds, for end-to-end tests; `probe_prompts` finds prompts whose next token needs a given part of the state.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cluster.cli.tiny_circuit import (BENCH_KINDS, KINDS, MAX_POSITIONS, VOCAB_SIZE, make_model, model_class,
                                      model_config)

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"  # token ids 0, 1, 2
# The last two token ids: ordinary (not special) added tokens, as in Qwen3's tokenizer, so that vLLM's reasoning
# parsers (`chat.reasoning_parser`) find them; to the model they are tokens like any other.
THINK = ("<think>", "</think>")
MIN_VOCAB = 256 + 3 + len(THINK)  # the smallest tokenizer: every byte, the specials and the think markers
MARKER = ".build-stamp"  # holds the builder hash; a changed builder rebuilds models on `ensure_model`

REPO_ROOT = Path(__file__).resolve().parents[2]


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


# A plain-text chat template (role markers are ordinary text to this tokenizer), so that /v1/chat/completions renders
# messages the way any chat model's template does.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE (any text round-trips), add the think markers (`THINK`, the last two ids) and save it as
    a `PreTrainedTokenizerFast`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"a {vocab_size}-token vocabulary cannot hold the tokenizer (at least {MIN_VOCAB}: every byte, "
                         "the specials and the think markers)")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK),
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
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    assert [tok.token_to_id(t) for t in THINK] == list(range(vocab_size - len(THINK), vocab_size)), "vocab not full"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=MAX_POSITIONS
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


# ----------------------------------------------------------------------------------------------------------------
# building


def source_hash(module: str) -> str:
    """A hash of module `module`'s source (a builder's: its models are rebuilt when it changes)."""
    return hashlib.sha256(inspect.getsource(sys.modules[module]).encode()).hexdigest()[:16]


def tokenizer_hash() -> str:
    """A hash of what makes the local tokenizer (a model built with it is rebuilt when it changes)."""
    parts = [inspect.getsource(build_tokenizer), inspect.getsource(tokenizer_corpus), CHAT_TEMPLATE, repr(THINK),
             repr((PAD, BOS, EOS, _WORDS, _SYLLABLES))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def builder_hash() -> str:
    """A hash of the builder's source - this module and the models' own (`cluster.cli.tiny_circuit`): `ensure_model`
    rebuilds when either changes."""
    return hashlib.sha256((source_hash(__name__) + source_hash("cluster.cli.tiny_circuit")).encode()).hexdigest()[:16]


@contextlib.contextmanager
def staged(out_dir: Path, stamp: dict[str, Any]) -> Iterator[Path]:
    """A private directory beside `out_dir` to build a model into. When the block ends without an error, `stamp` is
    written into it (MARKER) and it is renamed into place, replacing `out_dir`: concurrent builders never expose a
    half-written model (the last one to finish wins). It is removed whatever happens."""
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        (tmp / MARKER).write_text(json.dumps(stamp) + "\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def stamped(out_dir: Path, stamp: dict[str, Any]) -> bool:
    """Whether `out_dir` holds a build whose MARKER is `stamp` (else it is missing, half there or stale)."""
    try:
        return json.loads((out_dir / MARKER).read_text()) == stamp
    except (OSError, ValueError):
        return False


def build_model(kind: str, out_dir: Path, seed: int = 0) -> Path:
    """Build model `kind` into `out_dir` (replacing what is there) and return `out_dir`.

    Written into a private temporary directory and renamed into place (`staged`)."""
    out_dir = Path(out_dir)
    t0 = time.monotonic()
    config = model_config(kind)  # validates kind before touching the directory
    print(f"building {kind} ({config.architectures or model_class(kind).__name__}, seed {seed})", flush=True)
    with staged(out_dir, {"kind": kind, "seed": seed, "builder": builder_hash()}) as tmp:
        model = make_model(kind, seed)
        model.save_pretrained(str(tmp))
        build_tokenizer(tmp)
    print(f"built {kind} (seed {seed}) into {out_dir} in {time.monotonic() - t0:.1f} s", flush=True)
    return out_dir


def ensure_model(kind: str, root: Path = Path("models"), seed: int = 0) -> Path:
    """`<root>/<kind>`, built on first use or when the builder changed; a relative root is under the repo."""
    root = Path(root)
    if not root.is_absolute():
        root = REPO_ROOT / root
    out_dir = root / kind
    if not stamped(out_dir, {"kind": kind, "seed": seed, "builder": builder_hash()}):
        build_model(kind, out_dir, seed)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """`build-model --kind gdn --out DIR --seed N` (`--kind all` builds every kind under DIR/<kind>)."""
    parser = argparse.ArgumentParser(prog="build-model", description="Build a tiny hybrid model locally.")
    parser.add_argument("--kind", choices=(*KINDS, *BENCH_KINDS, "all"), default="gdn",
                        help="all: every lookup-circuit kind (not the benchmark kinds)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: models/<kind>)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kinds = KINDS if args.kind == "all" else (args.kind,)
    for kind in kinds:
        if args.out is None:
            out = REPO_ROOT / "models" / kind
        else:
            out = args.out / kind if args.kind == "all" else args.out
        build_model(kind, out, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
