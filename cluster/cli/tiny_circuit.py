"""The tiny hybrid models themselves: a config per kind (`model_config`) and weights set to a small lookup circuit
(`sharpen`, `make_model`) whose greedy output is an exact function of the context (`expected_next_token`), with
top-1/top-2 logit margins above 4, and which needs every byte class of the state a P/D transfer moves: each conv row
and channel group, each recurrent head of each layer, attention K and V (`probe_prompts` finds prompts whose next
token needs a given part of it). `cluster.cli.tiny_model` builds them into model directories with a local tokenizer.
"""

from __future__ import annotations

import functools
import random

KINDS = ("gdn", "gdn-asym", "mamba2", "attn")  # the lookup-circuit kinds (`sharpen`)
BENCH_KINDS = ("gdn-wide",)  # random weights, sized for benchmarks where prefill has to dominate

VOCAB_SIZE = 1024
HIDDEN_SIZE = 256
MAX_POSITIONS = 4096


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
    if kind == "gdn-wide":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            **{**common, "hidden_size": 512, "num_hidden_layers": 8},
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            linear_num_key_heads=4,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=4,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            intermediate_size=1024,
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
            layer_types=["linear_attention"] * 3 + ["full_attention"],  # Mamba2 x 3, attention
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_multiplier=1 / 8,  # 1/sqrt(head_dim 64)
            position_embedding_type=None,  # no rotary in the attention layer, as in Granite 4.0-H
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
            # slow rotary: the lookup codes sit in dims that rotate < 5e-3 rad over 4096 positions
            rope_parameters={"rope_type": "default", "rope_theta": 1e12},
        )
    raise ValueError(f"unknown model kind {kind!r}; choose one of {', '.join(KINDS + BENCH_KINDS)}")


def model_class(kind: str):
    import transformers

    name = {
        "gdn": "Qwen3NextForCausalLM",
        "gdn-asym": "Qwen3NextForCausalLM",
        "gdn-wide": "Qwen3NextForCausalLM",
        "mamba2": "GraniteMoeHybridForCausalLM",
        "attn": "Qwen3ForCausalLM",
    }[kind]
    return getattr(transformers, name)


# ----------------------------------------------------------------------------------------------------------------
# weights: a lookup circuit instead of noise
#
# Every weight is set by hand (the seed picks the permutations and random codes), so the next token is an exact,
# discrete function of the context and numerical noise (bf16, TP reduction order) cannot flip it.
#
# Tokens 3.. are split into N_BUCKETS buckets; the residual stream has one-hot subspaces:
#   BIAS (constant 1) | SINK (1 on BOS only) | CUR (bucket of this token) | stage outputs | OUT | ID (random code)
# GDN kinds (gdn, gdn-asym): layers 0-2 are Gated DeltaNet mixers that run a "skip-gram" lookup in their recurrent
#   state: at each position s they store key = bucket(s-3) -> value = bucket(s-1) (delta rule overwrite, no
#   decay), and position t queries key = bucket(t-2): the answer is bucket(s-1) for the latest s with
#   bucket(s-3) == bucket(t-2). Key, query and value come through the causal conv from the three earlier tokens,
#   one tap each, so every row of the conv state and each of its Q, K and V channel groups carries part of every
#   lookup. Each (layer, value head) is one memory unit that stores only the value buckets it owns
#   (`bucket_owner`): a lookup is answered by exactly one recurrent head of one layer, which makes every head of
#   every layer the only copy of some answers (`probe_prompts` finds a prompt for each).
# mamba2: layers 0-2 are Mamba2 mixers with the same lookup from the same conv taps, additive with decay 1/4 per
#   token, so the latest match dominates, up to MAMBA2_WINDOW tokens back; head h of every layer stores the value
#   buckets it owns, and each layer gives a third of the answer, so every head of every layer is needed.
#   In both, layer 3 (attention) looks the answer bucket up in the KV cache (keys = CUR) and copies it into ATT.
#   The MLP of layer 3 is an AND gate: OUT[b] fires only if the mixers and attention agree on bucket b.
# attn kind: four attention layers chain membership lookups A_l = g_l(A_{l-1}) (A_{-1} = CUR): "does bucket
#   g_l(b) occur in the context?", with BOS as the attention sink for "no" (prompts should start with BOS).
# Readout: the bucket's representative token when OUT fires (logit ~25-30), else the fixed successor of the
#   current token (logit ~10, runner-up ~3). A corrupted KV cache, conv or recurrent state breaks the agreement
#   or the lookup, and the output falls back to the successor or to another bucket.

N_BUCKETS = 32
MIXER_LAYERS = 3  # mixer layers before the attention layer in the hybrid kinds
HIT_LOGIT_PER_OUT = 4.0  # lm_head weight on OUT: logit ~ 4 x OUT (OUT ~ 6-8 when the gate fires)
FALLBACK_LOGIT = 10.0  # logit of the successor token when no lookup answers


def residual_layout(kind: str) -> dict[str, int]:
    """Start index of each residual subspace (one-hot subspaces are N_BUCKETS wide)."""
    stages = ["A0", "A1", "A2", "A3"] if kind == "attn" else ["ANS", "ATT"]
    layout = {"BIAS": 0, "SINK": 1, "CUR": 2}
    at = 2 + N_BUCKETS
    for name in stages + ["OUT"]:
        layout[name] = at
        at += N_BUCKETS
    layout["ID"] = at
    return layout


def token_codes(generator, vocab_size: int = VOCAB_SIZE, n_id: int = HIDDEN_SIZE):
    """bucket per token (-1 for specials), a representative token per bucket, a successor cycle, random id codes."""
    import torch

    order = torch.randperm(vocab_size - 3, generator=generator) + 3
    bucket = torch.full((vocab_size,), -1, dtype=torch.long)
    bucket[order] = torch.arange(len(order)) % N_BUCKETS
    rep = order[:N_BUCKETS].tolist()  # bucket(order[i]) == i for i < N_BUCKETS
    cycle = order[torch.randperm(len(order), generator=generator)]
    pred = torch.zeros(vocab_size, dtype=torch.long)  # pred[v]: the token whose successor is v
    pred[cycle] = torch.roll(cycle, 1)
    ident = torch.randn(vocab_size, n_id, generator=generator)
    ident = ident / ident.norm(dim=1, keepdim=True)
    return bucket, rep, pred, cycle, ident


def _code_map(generator, width: int) -> list[int]:
    """A random injective map bucket -> index in [0, width)."""
    import torch

    return torch.randperm(width, generator=generator)[:N_BUCKETS].tolist()


def _embed_and_readout(model, kind: str, codes) -> None:
    import torch

    bucket, rep, pred, cycle, ident = codes
    L = residual_layout(kind)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    hidden = emb.shape[1]
    n_id = hidden - L["ID"]
    ident = ident[:, :n_id] / ident[:, :n_id].norm(dim=1, keepdim=True)
    id_norm = (hidden - 2) ** 0.5  # every token embedding has norm sqrt(hidden): rms 1
    emb.zero_()
    emb[:, L["BIAS"]] = 1.0
    emb[1, L["SINK"]] = 1.0  # BOS
    tokens = torch.arange(emb.shape[0])
    real = bucket >= 0
    emb[tokens[real], L["CUR"] + bucket[real]] = 1.0
    emb[:, L["ID"]:] = ident * id_norm
    head.zero_()
    scale = FALLBACK_LOGIT / id_norm
    head[cycle, L["ID"]:] = ident[pred[cycle]] * scale  # successor fallback
    for special in (0, 1, 2):  # after PAD / BOS / EOS: a fixed token each
        head[cycle[special], L["ID"]:] += ident[special] * scale
    for b, token in enumerate(rep):
        head[token, L["OUT"] + b] = HIT_LOGIT_PER_OUT


def _and_gate(gate_w, up_w, down_w, L, inputs: list[str], threshold: float, steepness: float) -> None:
    """SwiGLU rows b < N_BUCKETS: OUT[b] += silu(k * (sum of inputs[b] - threshold)) (inputs scaled by BIAS)."""
    for b in range(N_BUCKETS):
        for name in inputs:
            gate_w[b, L[name] + b] = steepness
        gate_w[b, L["BIAS"]] = -steepness * threshold
        up_w[b, L["BIAS"]] = 1.0
        down_w[L["OUT"] + b, b] = 1.0


def _gdn_lookup(la, L, gen, layer: int, n_layers: int) -> None:
    """Gated DeltaNet layer (HF Qwen3-Next layout) as a skip-gram associative memory, written into ANS.

    Query, key and value come through the causal conv from the three earlier tokens, one each (query: tap 1 =
    bucket(t-2), key: tap 0 = bucket(t-3), value: tap 2 = bucket(t-1)), so every row of the conv state and each of
    its Q, K and V channel groups carries part of the lookup. Each (layer, value head) is one memory unit that stores
    only the value buckets it owns (`bucket_owner`): the others write zero under the key, which erases it there.
    A lookup is answered by exactly one unit, so every recurrent head of every layer is the only copy of part of the
    answers."""
    import math

    nk, nv = la.num_k_heads, la.num_v_heads
    dk, dv, r = la.head_k_dim, la.head_v_dim, la.num_v_heads // la.num_k_heads
    qkvz, ba = la.in_proj_qkvz.weight, la.in_proj_ba.weight
    block = 2 * dk + 2 * r * dv  # per key head: [q | k | v (r heads) | z (r heads)]
    z_gate = 4.0
    spike = math.sqrt(dv) * z_gate / (1 + math.exp(-z_gate))  # gated-normed one-hot: sqrt(dv) * silu(z)
    units = n_layers * nv
    for kh in range(nk):
        key_map = _code_map(gen, dk)
        for b in range(N_BUCKETS):
            qkvz[kh * block + key_map[b], L["CUR"] + b] = 1.0  # query
            qkvz[kh * block + dk + key_map[b], L["CUR"] + b] = 1.0  # key
        for i in range(r):
            vh = kh * r + i
            value_map = _code_map(gen, dv)
            v0, z0 = kh * block + 2 * dk + i * dv, kh * block + 2 * dk + r * dv + i * dv
            for b in range(N_BUCKETS):
                if bucket_owner(b, units) != layer * nv + vh:  # memory_unit(kind, layer, vh)
                    continue
                qkvz[v0 + value_map[b], L["CUR"] + b] = 4.0
                la.out_proj.weight[L["ANS"] + b, vh * dv + value_map[b]] = 1.0 / spike
            qkvz[z0 : z0 + dv, L["BIAS"]] = z_gate
            ba[kh * 2 * r + i, L["BIAS"]] = 12.0  # beta = sigmoid(12): overwrite the old value
    conv = la.conv1d.weight  # (channels [Q | K | V], 1, taps); tap 3 = current token
    conv[: nk * dk, 0, 1] = 1.0  # query: bucket(t-2)
    conv[nk * dk : 2 * nk * dk, 0, 0] = 1.0  # key: bucket(t-3)
    conv[2 * nk * dk :, 0, 2] = 1.0  # value: bucket(t-1)
    la.A_log.fill_(-20.0)  # no decay
    la.norm.weight.fill_(1.0)


def bucket_owner(bucket: int, units: int) -> int:
    """The memory unit (layer * heads + head, over the mixer layers) that stores value `bucket`."""
    return bucket % units


def _mamba2_lookup(mb, L, gen, n_layers: int) -> None:
    """Mamba2 mixer (HF GraniteMoeHybrid layout) as a decaying skip-gram memory, written into ANS.

    As in `_gdn_lookup`, key, query and value come from the three conv rows (B: bucket(t-3), C: bucket(t-2), x:
    bucket(t-1)). Head h stores only the value buckets it owns (`bucket_owner(b, heads)`), the same in every layer;
    each layer's answer is a third of ANS, so the AND gate needs all three. The decay (1/4 per token) makes the
    latest match dominate; the gated RMSNorm's epsilon ends the memory MAMBA2_WINDOW tokens back (the value weight
    puts that edge between two whole distances, where the gate's margin is widest)."""
    import math

    heads, hd, inner, state = mb.num_heads, mb.head_dim, mb.intermediate_size, mb.ssm_state_size
    assert mb.n_groups == 1
    w = mb.in_proj.weight  # rows: [z (inner) | x (inner) | B (state) | C (state) | dt (heads)]
    x0, b0, c0 = inner, 2 * inner, 2 * inner + state
    w[:inner, L["BIAS"]] = 4.0
    key_map = _code_map(gen, state)
    spike = math.sqrt(inner)  # normed over all heads (one group): one spike per layer
    for b in range(N_BUCKETS):
        w[b0 + key_map[b], L["CUR"] + b] = 30.0
        w[c0 + key_map[b], L["CUR"] + b] = 30.0
    for h in range(heads):
        value_map = _code_map(gen, hd)
        for b in range(N_BUCKETS):
            if bucket_owner(b, heads) == h:
                w[x0 + h * hd + value_map[b], L["CUR"] + b] = 400.0
                mb.out_proj.weight[L["ANS"] + b, h * hd + value_map[b]] = 1.0 / (n_layers * spike)
    conv = mb.conv1d.weight  # channels [x | B | C]
    conv[:inner, 0, 2] = 1.0  # value (x): bucket(t-1)
    conv[inner : inner + state, 0, 0] = 1.0  # key (B): bucket(t-3)
    conv[inner + state :, 0, 1] = 1.0  # query (C): bucket(t-2)
    # dt = softplus(0) = ln 2; decay per token exp(-dt * exp(A_log)) = 1/4
    mb.A_log.fill_(math.log(math.log(4) / math.log(2)))
    mb.norm.weight.fill_(1.0)


MAMBA2_WINDOW = 12  # the farthest match (t - s) a Mamba2 lookup still answers from


def _attention_lookup(at, L, gen, style: str, query_from: str, write_to: str, query_map=None) -> None:
    """Attention that finds positions whose CUR bucket equals the query bucket and copies that bucket.

    style: "qwen3_next" (gated q_proj, zero-centred q/k norms, partial rotary: codes in dims 16..63),
    "granite" (no norms, no rotary), "qwen3" (q/k norms, rope_theta 1e12: codes in the slow rotary dims, BOS sink).
    """
    import math

    nq = at.config.num_attention_heads
    nkv = at.config.num_key_value_heads
    hd = at.head_dim
    q, k, v, o = at.q_proj.weight, at.k_proj.weight, at.v_proj.weight, at.o_proj.weight
    query_map = query_map or list(range(N_BUCKETS))
    if style == "qwen3":
        dims = list(range(16, 32)) + list(range(48, 64))  # rotate < 5e-3 rad over 4096 positions
        sink = 15
    else:
        dims, sink = list(range(16, 64)) if style == "qwen3_next" else list(range(hd)), None
    kv_maps = []
    for g in range(nkv):
        perm = _code_map(gen, len(dims))
        value_perm = _code_map(gen, len(dims))
        kv_maps.append(([dims[i] for i in perm], [dims[i] for i in value_perm]))
        key_map, value_map = kv_maps[g]
        for c in range(N_BUCKETS):
            k[g * hd + key_map[c], L["CUR"] + c] = 1.0 if style != "granite" else math.sqrt(320.0)
            v[g * hd + value_map[c], L["CUR"] + c] = 1.0
        if sink is not None:
            k[g * hd + sink, L["SINK"]] = 1.0
    for h in range(nq):
        key_map, value_map = kv_maps[h // (nq // nkv)]
        q_rows = 2 * hd if style == "qwen3_next" else hd
        for b in range(N_BUCKETS):
            weight = {"qwen3_next": 1.0, "granite": math.sqrt(320.0), "qwen3": 2.0}[style]
            q[h * q_rows + key_map[query_map[b]], L[query_from] + b] = weight
            o[L[write_to] + b, h * hd + value_map[b]] = 1.0 / nq
        if sink is not None:
            q[h * q_rows + sink, L["BIAS"]] = 1.0
        if style == "qwen3_next":
            q[h * q_rows + hd : (h + 1) * q_rows, L["BIAS"]] = 20.0  # output gate sigmoid(20) ~ 1
    if style == "qwen3_next":  # score = 8 (1+w)^2 for a match: 40
        at.q_norm.weight.fill_(math.sqrt(5.0) - 1)
        at.k_norm.weight.fill_(math.sqrt(5.0) - 1)
    elif style == "qwen3":  # match 40, sink 20 (no match: sink ~45)
        at.q_norm.weight.fill_(math.sqrt(5.6))
        at.k_norm.weight.fill_(math.sqrt(5.6))


def sharpen(model, kind: str, generator) -> None:
    """Replace the random weights by the lookup circuit described above (deterministic from `generator`)."""
    import torch

    for p in model.parameters():
        p.zero_()
    zero_centred = kind in ("gdn", "gdn-asym")  # Qwen3-Next RMSNorm computes x * (1 + weight)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            p.fill_(0.0 if zero_centred else 1.0)
    codes = token_codes(generator)
    _embed_and_readout(model, kind, codes)
    L = residual_layout(kind)
    layers = model.model.layers
    if kind in ("gdn", "gdn-asym"):
        for i, layer in enumerate(layers[:MIXER_LAYERS]):
            _gdn_lookup(layer.linear_attn, L, generator, i, MIXER_LAYERS)
        _attention_lookup(layers[3].self_attn, L, generator, "qwen3_next", "ANS", "ATT")
        moe = layers[3].mlp
        inter = moe.experts.gate_up_proj.shape[1] // 2
        for e in range(moe.experts.gate_up_proj.shape[0]):  # identical experts, uniform routing: exact
            gu = moe.experts.gate_up_proj[e]
            _and_gate(gu[:inter], gu[inter:], moe.experts.down_proj[e], L, ["ANS", "ATT"], 1.8, 40.0)
    elif kind == "mamba2":
        for layer in layers[:MIXER_LAYERS]:
            _mamba2_lookup(layer.mamba, L, generator, MIXER_LAYERS)
        _attention_lookup(layers[3].self_attn, L, generator, "granite", "ANS", "ATT")
        mlp = layers[3].shared_mlp
        inter = mlp.input_linear.weight.shape[0] // 2
        w = mlp.input_linear.weight
        _and_gate(w[:inter], w[inter:], mlp.output_linear.weight, L, ["ANS", "ATT"], 1.8, 40.0)
    elif kind == "attn":
        source = "CUR"
        for i, layer in enumerate(layers):
            query_map = torch.randperm(N_BUCKETS, generator=generator).tolist()  # g_l
            _attention_lookup(layer.self_attn, L, generator, "qwen3", source, f"A{i}", query_map)
            source = f"A{i}"
        mlp = layers[3].mlp
        _and_gate(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, L, ["A3"], 0.5, 16.0)
    else:
        raise ValueError(kind)


@functools.lru_cache(maxsize=8)
def _codes(seed: int):
    import torch

    return token_codes(torch.Generator().manual_seed(seed))


def expected_next_token(token_ids: list[int], seed: int = 0, kind: str = "gdn") -> int:
    """The greedy next token of a hybrid model (`gdn`, `gdn-asym` or `mamba2`) built with `seed`, computed from the
    rule its weights implement (a reference for end-to-end tests).

    Answer = bucket(s-1) for the latest s <= t with bucket(s-3) == bucket(t-2) (`lookup_position`); its
    representative token if found, else the successor of the current token."""
    bucket, rep = _codes(seed)[:2]
    b = [int(bucket[t]) for t in token_ids]
    s = lookup_position(kind, b)
    return rep[b[s - 1]] if s is not None else _successor(token_ids[-1], seed)


def _successor(token: int, seed: int = 0) -> int:
    """The token the readout falls back to after `token` when no lookup answers."""
    bucket, _, _, cycle, _ = _codes(seed)
    if bucket[token] < 0:  # PAD / BOS / EOS
        return int(cycle[token])
    return int(cycle[(int((cycle == token).nonzero()) + 1) % len(cycle)])


def lookup_position(kind: str, buckets: list[int], latest: int | None = None) -> int | None:
    """The position s whose stored value (bucket(s-1), under key bucket(s-3)) answers the mixers' lookup at the last
    position t, or None when nothing answers. GDN overwrites (delta rule): the latest key match answers, and a
    special token's value (zero) erases the entry. Mamba2 adds with decay: the latest match with a real value
    answers, if it is at most MAMBA2_WINDOW tokens back. `latest` bounds s (default t: the entry written at t
    itself counts)."""
    if kind not in ("gdn", "gdn-asym", "mamba2"):
        raise ValueError(f"{kind!r} has no mixer lookup")
    t = len(buckets) - 1
    if t < 2 or buckets[t - 2] < 0:
        return None
    for s in range(t if latest is None else latest, 2, -1):
        if kind == "mamba2" and t - s > MAMBA2_WINDOW:
            return None
        if buckets[s - 3] == buckets[t - 2]:
            if buckets[s - 1] >= 0:
                return s
            if kind != "mamba2":
                return None  # the delta rule wrote value 0: the entry is gone
    return None


def memory_unit(kind: str, layer: int, head: int) -> int:
    """The memory unit of recurrent head `head` of mixer layer `layer`: the (layer, head) pair for GDN, the head for
    Mamba2 (whose layers store the same buckets in the same head)."""
    return head if kind == "mamba2" else layer * model_config(kind).linear_num_value_heads + head


def _mixer_heads(kind: str) -> int:
    cfg = model_config(kind)
    return cfg.mamba_n_heads if kind == "mamba2" else cfg.linear_num_value_heads


def probe_prompts(kind: str, length: int = 120, seed: int = 0) -> dict[str, list[int]]:
    """Prompts (BOS + random tokens) whose next token, decoded from the state after all but the last prompt token
    (vLLM's P/D boundary), needs a given part of that state - for tests that corrupt one part and see the output
    change:

      "self": the lookup at the last position t is answered by the entry written at t itself (bucket(t-3) ==
              bucket(t-2)), from every row of the conv state (key: t-3, query: t-2, value: t-1) in every channel
              group, and an older entry under the same key would answer differently (Mamba2: one token older);
      "layer L head H": answered by an entry stored before t in the memory unit of recurrent head H of mixer layer
              L (`memory_unit`), which no other head of that layer holds.

    In every prompt the answer differs from the fallback (the current token's successor)."""

    heads = _mixer_heads(kind)
    wanted = {"self"} | {f"layer {layer} head {h}" for layer in range(MIXER_LAYERS) for h in range(heads)}
    bucket = _codes(seed)[0]
    by_bucket: dict[int, list[int]] = {}
    for token in range(3, VOCAB_SIZE):
        by_bucket.setdefault(int(bucket[token]), []).append(token)
    found: dict[str, list[int]] = {}
    for trial in range(100_000):
        rng = random.Random(trial)
        prompt = [1] + [rng.randrange(3, VOCAB_SIZE) for _ in range(length - 1)]
        t = length - 1
        if trial % 2 == 0:  # try for "self": make bucket(t-3) == bucket(t-2) (Mamba2: bucket(t-4) too)
            for i in (t - 3, t - 4) if kind == "mamba2" else (t - 3,):
                prompt[i] = rng.choice(by_bucket[int(bucket[prompt[t - 2]])])
        b = token_buckets(prompt, seed)
        s = lookup_position(kind, b)
        if s is None or expected_next_token(prompt, seed, kind) == _successor(prompt[-1], seed):
            continue
        if s == t:
            older = lookup_position(kind, b, latest=t - 1)
            # Mamba2 only weakens what a garbled key or value writes (its RMSNorm restores the scale): the next
            # match, one token older, must be there to take over with another answer
            differs = older is not None and b[older - 1] != b[t - 1]
            if "self" not in found and (differs if kind == "mamba2" else older is None or differs):
                found["self"] = prompt
        else:
            for layer in range(MIXER_LAYERS):
                for h in range(heads):
                    if memory_unit(kind, layer, h) == bucket_owner(b[s - 1], memory_units(kind)):
                        found.setdefault(f"layer {layer} head {h}", prompt)
        if set(found) == wanted:
            return found
    raise AssertionError(f"no probe prompts found for every head of {kind}: missing {sorted(wanted - set(found))}")


def memory_units(kind: str) -> int:
    """How many memory units the mixers of `kind` have (`memory_unit`)."""
    return _mixer_heads(kind) * (1 if kind == "mamba2" else MIXER_LAYERS)


def token_buckets(token_ids: list[int], seed: int = 0) -> list[int]:
    """Each token's bucket (-1 for PAD / BOS / EOS) in the model built with `seed`."""
    bucket = _codes(seed)[0]
    return [int(bucket[t]) for t in token_ids]


def make_model(kind: str, seed: int):
    """The bf16 model for `kind`: transformers' init (seeded), then the circuit of `sharpen` (not for BENCH_KINDS)."""
    import torch

    config = model_config(kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(kind)(config)
    if kind not in BENCH_KINDS:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            sharpen(model, kind, generator)
    return model.to(torch.bfloat16).eval()
