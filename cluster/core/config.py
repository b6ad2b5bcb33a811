"""The deployment file (`deploy.yaml`): one validated object describing the model, the two pools, the coordinator
and the HTTP endpoint. A bad file is rejected with each field's path and the reason."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.core.verify import verify_fraction


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    """Either a tiny locally built model (`builtin`) or a model directory (`path`)."""

    builtin: Literal["gdn", "gdn-asym", "mamba2", "attn", "gdn-wide", "qwen3.5-0.8b", "nemotron-h-8l"] | None = Field(
        "gdn", description="a model built locally on first use, under models/: a tiny hybrid (gdn, gdn-asym, mamba2, "
        "attn, gdn-wide), or a real architecture at its published dimensions with random weights and a local "
        "1,024-token vocabulary - qwen3.5-0.8b (Qwen3.5-0.8B, all 24 layers, 0.5B parameters), nemotron-h-8l (the "
        "first 8 layers of Nemotron-H-8B, 1B parameters); `python -m cluster build-model --config` builds others")
    path: str | None = None
    name: str = Field("tiny-hybrid", description="the model name clients send in requests")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    max_model_len: int = Field(2048, ge=16, le=1 << 20)

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if self.path:
            self.builtin = None
        if not self.builtin and not self.path:
            raise ValueError("set either builtin (a tiny local model) or path (a model directory)")
        return self


class ScalingConfig(_Strict):
    """How a pool autoscales between min_replicas and max_replicas (Ray Serve autoscaling with this project's policy,
    `actors/control/autoscale.py`). Each pool reads only its own signal: a prefill pool its queued prompt tokens, a
    decode pool its running sequences and KV/state cache usage."""

    target_queued_prompt_tokens: int = Field(
        2048, ge=1, description="prefill pool: prompt tokens waiting or in prefill per engine that the pool aims for")
    target_running_requests: float = Field(
        8, gt=0, description="decode pool: sequences being decoded per engine that the pool aims for")
    max_cache_usage: float = Field(
        0.9, gt=0, le=1, description="decode pool: grow when an engine's KV/state blocks are fuller than this")
    upscale_delay_s: float = Field(5, ge=0, le=3600, description="the signal must ask for more engines this long")
    downscale_delay_s: float = Field(60, ge=0, le=86400, description="the signal must ask for fewer engines this long")
    look_back_s: float = Field(5, ge=2, le=600, description="window the engines' load is averaged over (engines report every second)")
    drain_timeout_s: float = Field(
        120, gt=0, le=3600, description="a departing engine waits this long for its requests (and unread prefilled state)")


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESOURCE_NAME = re.compile(r"[A-Za-z0-9_.:/-]+")
RAY_OWN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
PER_ENGINE_ENV = ("VLLM_NIXL_SIDE_CHANNEL_PORT",)  # each engine gets its own (actors.engine.settings.engine_env)
# where the engines' compilers keep their work: `engines.compile_cache_dir` (actors.engine.settings.compile_cache_env)
COMPILE_CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR")


class PlacementConfig(_Strict):
    """Where a pool's engines may run in a multi-node Ray cluster. Nothing set: any node (one machine: here).
    `labels` are matched against the labels a node was started with (`ray start --labels key=value`); the pool's Serve
    replicas follow the same labels, so each replica sits next to its engine. `resources` are custom Ray resources
    (`ray start --resources '{"name": amount}'`) that each engine takes while it runs: a node's amount bounds how many
    of the pool's engines it hosts."""

    labels: dict[str, str] = Field(default_factory=dict, description="node labels each engine's node must carry")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources each engine takes")

    def allows(self, node: dict) -> bool:
        """Whether a Ray node (as `ray.nodes()` lists it) carries these labels and has these resources."""
        return (all((node.get("Labels") or {}).get(k) == v for k, v in self.labels.items())
                and all((node.get("Resources") or {}).get(r, 0) >= amount for r, amount in self.resources.items()))

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not key or not value:
                raise ValueError(f"label {key!r}: keys and values must be non-empty, got {key!r}: {value!r}")
            if key.startswith("ray.io/"):
                raise ValueError(f"label {key!r}: the ray.io/ prefix is Ray's own")
        return v

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        for name, amount in v.items():
            if name in RAY_OWN_RESOURCES:
                raise ValueError(f"resource {name!r}: a Ray built-in, not a custom resource (engines take no CPUs "
                                 "from Ray; GPUs follow the pool's tp)")
            if not RESOURCE_NAME.fullmatch(name):
                raise ValueError(f"resource {name!r}: letters, digits and _ . : / - only")
            if not amount > 0:
                raise ValueError(f"resource {name!r}: the amount must be > 0, got {amount}")
        return v


class PoolConfig(_Strict):
    tp: int = Field(1, ge=1, le=8)
    min_replicas: int = Field(1, ge=1, le=64, description="engines always running (a pool cannot scale to zero)")
    max_replicas: int = Field(1, ge=1, le=64)
    kv_cache_gib: float = Field(1.0, gt=0, le=1024, description="CPU hosts: DRAM for the KV/state cache per engine")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="CUDA hosts: vLLM's share of each GPU")
    enable_prefix_caching: bool | None = Field(
        None, description="cache prompt prefixes (vLLM's prefix caching; the GDN/Mamba state in its 'align' mode): a "
        "prefill engine then computes only the prompt past its longest cached prefix, a decode engine reads only the "
        "attention blocks it lacks plus the state. Default: on wherever vLLM serves it (not for Mamba state on CPU)")
    share_cores: bool = Field(
        False, description="CPU hosts: false (the default) - cores as devices: each engine takes tp x cores_per_rank "
        "free cores of its node for itself (its OpenMP threads and all its processes bound to them; Ray counts them as "
        "the engine's CPUs, so it places an engine only on a node with that many free), as a GPU engine owns its GPUs; "
        "an engine that cannot get them fails naming the cores and who holds them. true - the pool's engines share "
        "every core of their node with everything else (a prefill then slows the decode steps on those cores)")
    cores_per_rank: int = Field(1, ge=1, le=256, description="CPU hosts, share_cores false: cores each TP rank owns")
    reserve_cores: bool | None = Field(
        None, description="CPU hosts, share_cores false: the cluster's own processes on the node (HTTP front ends, "
        "the engine actors' Python side, the coordinator) keep off this pool's cores, as a GPU host's threads stay "
        "off the GPU, and run on the node's other cores (a prefill engine's included); where engines reserve every "
        "core they run anywhere. Default: true for the decode pool (a decode step preempted by a token's HTTP "
        "delivery is a late token for every request in the batch), false for the prefill pool")
    borrow_idle_cores: bool | None = Field(
        None, description="CPU hosts, share_cores false, tp 1: the pool's engines run each step on their own cores "
        "plus the node's cores whose engines have nothing in flight (core lending: at concurrency 1 a prompt is "
        "prefilled on the idle decode engine's core too); the moment such an engine has a request again, the next "
        "step runs on the engine's own cores only. Default: true for the prefill pool where it can be (tp 1, "
        "share_cores false), false for the decode pool")
    max_num_batched_tokens: int | None = Field(
        None, ge=16, le=1 << 20, description="vLLM's token budget of one engine step. On a decode pool that prefills "
        "some requests itself (transfer.local_prefill_speed, local_prefill_queue, local_prefill_when_idle), a small "
        "budget cuts such a prompt into chunks that share steps with the running decodes, instead of one long step "
        "that stalls them all; hybrid models: at least two blocks (the launcher refuses less), since a chunk that "
        "stops before the prompt's end must end on a block boundary. Default: on such a decode pool on CPU hosts, two "
        "blocks of the model (the block follows the model: 128 tokens for the tiny gdn, 640 at Qwen3.5-0.8B's "
        "dimensions); elsewhere vLLM's")
    scaling: ScalingConfig = ScalingConfig()
    placement: PlacementConfig = PlacementConfig()
    env: dict[str, str] = Field(
        default_factory=dict, description="extra environment of the pool's engines (vLLM's processes inherit it), e.g. "
        "UCX_TLS / UCX_NET_DEVICES for NIXL's transport; it overrides the project's per-engine defaults")

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not ENV_NAME.fullmatch(name):
                raise ValueError(f"env: {name!r} is not an environment variable name")
            if name in PER_ENGINE_ENV:
                raise ValueError(f"env: {name} is set per engine by the launcher (two engines on one host with one "
                                 "side-channel port hang at start)")
            if name in COMPILE_CACHE_VARS:
                raise ValueError(f"env: {name} follows engines.compile_cache_dir (every compile cache of the "
                                 "engines in one directory); set that instead")
        return v

    @model_validator(mode="after")
    def _binding_follows_cores(self) -> "PoolConfig":
        if not self.share_cores and "VLLM_CPU_OMP_THREADS_BIND" in self.env:
            raise ValueError("env: VLLM_CPU_OMP_THREADS_BIND follows the cores each engine is given (share_cores is "
                             "false); set share_cores: true to bind the pool's engines by hand")
        return self

    @model_validator(mode="after")
    def _reserve_owned_cores(self) -> "PoolConfig":
        if self.reserve_cores and self.share_cores:
            raise ValueError("reserve_cores: true needs cores of the pool's own (share_cores: false); a pool that "
                             "shares every core has none to reserve")
        return self

    @model_validator(mode="after")
    def _borrow_needs_own_cores(self) -> "PoolConfig":
        if self.borrow_idle_cores and self.share_cores:
            raise ValueError("borrow_idle_cores: true needs cores of the pool's own (share_cores: false); a pool that "
                             "shares every core has nothing to borrow")
        if self.borrow_idle_cores and self.tp != 1:
            raise ValueError(f"borrow_idle_cores: true needs tp: 1 (this pool has tp: {self.tp}): a TP 1 engine runs "
                             "its model in one process, whose thread count can follow the idle cores step by step")
        return self

    def borrows_cores(self, role: str) -> bool:
        """Whether the pool's engines borrow idle engines' cores for their steps (`borrow_idle_cores`, by default
        the prefill pool's where it owns its cores at tp 1)."""
        if self.borrow_idle_cores is not None:
            return self.borrow_idle_cores
        return role == "prefill" and not self.share_cores and self.tp == 1

    def reserves_cores(self, role: str) -> bool:
        """Whether the pool's engines keep the cluster's own processes off their cores (`reserve_cores`, by default
        the decode pool's)."""
        if self.share_cores:
            return False
        return self.reserve_cores if self.reserve_cores is not None else role == "decode"

    @property
    def cores_per_engine(self) -> int:
        """CPU hosts: the cores each engine of the pool takes for itself (0: it shares its node's cores)."""
        return 0 if self.share_cores else self.tp * self.cores_per_rank

    @field_validator("tp")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"TP size must be a power of two, got {v}")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> "PoolConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} exceeds max_replicas {self.max_replicas}")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas > self.min_replicas


class HttpConfig(_Strict):
    """The HTTP front end: where it listens, who may use it, and how much it takes on at once."""

    host: str = Field("127.0.0.1", min_length=1, description="bind address; loopback unless you mean to expose it "
                      "(anything else needs an API key, or allow_unauthenticated). 'node': each front end's node's "
                      "address as Ray knows it (with location every_node, each node's front end on the cluster's "
                      "network rather than every interface)")
    port: int = Field(8000, ge=1, le=65535)
    replicas: int = Field(
        1, ge=1, le=64, description="front-end processes per node that serves HTTP (http.location), all on http.port "
        "(SO_REUSEPORT: the kernel spreads connections over them), each with its own router. Ray restarts one that "
        "dies; the others keep serving meanwhile, so a dying front end costs only its own requests in flight. Each "
        "takes about 0.5 GiB (vLLM's app and tokenizer) and a share of a core under load")
    location: Literal["head", "every_node"] = Field(
        "head", description="where front ends run (Ray Serve's proxy_location, the same two choices): 'head' - on the "
        "launching node; 'every_node' - http.replicas on each Ray node alive at start, each on http.host:http.port of "
        "its own node (put a load balancer or DNS over the nodes' addresses; with a loopback host each serves its "
        "node's own clients). A node lost takes only its front ends and their requests in flight; nodes that join "
        "later get none")
    api_key: str | None = Field(None, min_length=8, description="require `Authorization: Bearer <key>` on every route "
                                "but /health when set")
    api_key_env: str | None = Field(None, min_length=1, description="read the API key from this environment variable")
    allow_unauthenticated: bool = Field(
        False, description="DANGEROUS: serve a non-loopback host without an API key - anyone who reaches the port can "
        "generate, read /metrics and the cluster's state. Only behind something else that authenticates clients")
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    retry_after_s: int = Field(2, ge=1, le=3600, description="Retry-After of 503 and 429 answers")
    max_requests_in_flight: int = Field(
        256, ge=1, le=1 << 20, description="generation requests (/v1/completions, /v1/chat/completions) served at "
        "once by the front end, from admission to their last byte; the others wait in the queue. 256: what the "
        "default deployment's engines can decode at once (vLLM's default of 128 sequences per engine, up to 2 decode "
        "engines) - more would only wait inside the engines, where the front end can no longer refuse them")
    max_queued_requests: int = Field(
        512, ge=0, le=1 << 20, description="generation requests waiting for one in flight to end, first come first "
        "served; past this a request is answered 429 + Retry-After at once. 512: two full rounds of "
        "max_requests_in_flight, so a burst waits rather than fails, while each waiter costs only its connection "
        "and at most 64 KiB of its body (read ahead to notice a client that leaves: it gives its place back); 0: "
        "refuse whatever cannot start now")
    max_n: int = Field(
        128, ge=1, le=16384, description="most choices (`n`, and `best_of`) one request may ask for; above it a 400 "
        "naming the limit. Each choice is a request of its own on the cluster (its own prefill and pair). 128: "
        "OpenAI's API caps n at 128 (vLLM's own cap, VLLM_MAX_N_SEQUENCES, is 16384)")

    @model_validator(mode="after")
    def _one_key_source(self) -> "HttpConfig":
        if self.api_key and self.api_key_env:
            raise ValueError("set api_key or api_key_env, not both")
        return self

    @model_validator(mode="after")
    def _exposed_needs_a_key(self) -> "HttpConfig":
        if not (self.api_key or self.api_key_env or self.allow_unauthenticated or self.is_loopback(self.host)):
            raise ValueError(
                f"http.host {self.host!r} is reachable beyond this machine and no API key is set: set http.api_key_env "
                "(clients then send `Authorization: Bearer <key>`), or bind http.host to 127.0.0.1; "
                "http.allow_unauthenticated: true serves it without a key (dangerous: only behind something else "
                "that authenticates clients)")
        return self

    def resolved_api_key(self) -> str | None:
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise DeployError(f"http.api_key_env: environment variable {self.api_key_env} is not set or empty")
            return key
        return self.api_key

    @staticmethod
    def is_loopback(host: str) -> bool:
        """Whether a bind address reaches only this machine: 127.0.0.0/8, ::1 (also IPv4-mapped) or `localhost`.
        Other names are not resolved here: they count as reachable."""
        import ipaddress

        if host.lower() == "localhost":
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        mapped = getattr(ip, "ipv4_mapped", None)
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)


class CoordinatorConfig(_Strict):
    name: str = Field("pd-coordinator", min_length=1, description="the coordinator actor's name")
    namespace: str = Field("hybrid-pd", min_length=1, description="Ray namespace of the coordinator and engines")
    engine_start_timeout_s: float = Field(600, gt=0, le=7200, description="give up on an engine that takes longer")


class EnginesConfig(_Strict):
    """What every engine of both pools shares: where compilers keep their work, how a busy engine is told from a hung
    one, and the warm-up before an engine serves."""

    compile_cache_dir: str | None = Field(
        None, min_length=1, description="where the engines' compile caches live (torch inductor's, vLLM's, on GPUs "
        "Triton's), shared by every engine of a node and kept across restarts, so that replacements and autoscaled "
        "engines load what the first ones compiled. Default: ~/.cache/hybrid-pd/compile on each node (under "
        "$XDG_CACHE_HOME if set); a path starting with ~ is that node's home")
    busy_limit_s: float | None = Field(
        None, gt=0, le=86400, description="an engine whose EngineCore has not answered between steps, while its "
        "processes burn CPU (compiling, a long step), is busy and waited for - up to this long; then it is stuck all "
        "the same. A stopped or idle one is stuck at once (past twice its slowest step plus PD_ENGINE_STALL_S). "
        "Default: 600 on CPU hosts, 180 on CUDA hosts (a hung kernel spins a host core)")
    warm_up: bool = Field(
        True, description="before an engine registers, run one request per feature that compiles or builds something "
        "on first use (logprobs, sampling paths, structured output), alone and batched, and a prompt longer than its "
        "step budget; off: the first user request of each kind pays it (tests and debugging only)")

    @field_validator("compile_cache_dir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith("/") or v.startswith("~")):
            raise ValueError(f"must be an absolute path (or start with ~), got {v!r}: engines run in other "
                             "directories, on other nodes")
        return v

    def env(self) -> dict[str, str]:
        """The engines' environment for these settings (`actors.engine.settings.compile_cache_env`,
        `actors.engine.progress.stall_rule`, `actors.engine.actor.EngineActor.start`)."""
        out = {} if self.warm_up else {"PD_ENGINE_WARMUP": "0"}
        if self.compile_cache_dir is not None:
            out["PD_COMPILE_CACHE_DIR"] = self.compile_cache_dir
        if self.busy_limit_s is not None:
            out["PD_ENGINE_BUSY_LIMIT_S"] = repr(self.busy_limit_s)
        return out


class TransferConfig(_Strict):
    verify: float = Field(0.0, description="fail-closed transfers: the fraction of requests whose every byte read by the "
                          "decode engine is checked against the prefill engine's (CRC-32 per region) before the first "
                          "token - off, all, or a fraction in between (a deterministic sample by request id)")
    first_token_from_prefill: bool = Field(
        True, description="the prefill engine samples the first token of streamed requests that allow it (greedy or "
        "unseeded, no stop strings, penalties on generated tokens, bad words or structured output): it reaches the "
        "client without waiting for the transfer and a decode step")
    local_prefill_queue: int | None = Field(
        None, ge=0, description="conditional disaggregation: a request is prefilled by its decode engine itself (no "
        "transfer) when the prefill engine chosen for it already has this many prompts in prefill from the front end; "
        "null: off. Unlike local_prefill_speed it does not look at the decode engine's own backlog; Dynamo's "
        "max_prefill_queue_size makes the same call")
    local_prefill_speed: float | None = Field(
        None, gt=0, le=1, description="conditional disaggregation by expected time to first token: a request is "
        "prefilled by its decode engine itself (no transfer) when it would reach its first token sooner there - the "
        "prompts that decode engine already prefills itself plus this one, at this fraction of the prefill engine's "
        "speed, against the prompt tokens waiting or in prefill at the prefill engine plus this one (the front "
        "end's own requests, or every front end's where the prefill engines are asked). Nothing in prefill there: "
        "never; a backlog: the decode engine takes the share it finishes sooner. Pair it with a small decode max_num_batched_tokens (at least twice the model's block size), "
        "so that such a prompt runs in chunks beside the decodes; null: off")
    local_prefill_when_idle: bool = Field(
        False, description="conditional disaggregation: a request whose decode engine has no request of the front "
        "end's in flight, nor one in prefill headed for it, is prefilled by that decode engine itself (no transfer): "
        "no decode stream is there for its prefill to stall, and it runs at the decode TP (README, Benchmarks). At "
        "concurrency 1 every request then skips the prefill pool")

    @field_validator("verify", mode="before")
    @classmethod
    def _fraction(cls, v: object) -> float:
        return verify_fraction(v)


class RoutingConfig(_Strict):
    policy: Literal["cache", "load"] = Field(
        "cache", description="how a request's pair is chosen: 'cache' - by cost, the prompt tokens each prefill engine "
        "would compute past the longest prefix it can resume (attention blocks and a recurrent-state checkpoint) plus "
        "the prompt tokens already queued on it, so that a prefix hit wins unless its engine is overloaded, and among "
        "the decode engines approved for it the least loaded; 'load' - the least-loaded engines, prefixes ignored")
    stall_timeout_s: float = Field(
        5.0, gt=0, le=3600, description="hung engines: a decode stream with requests waiting and no output for this "
        "long, or a prefill unanswered this long, has its engine's health asked; if the engine is failed (its "
        "EngineCore has not stepped for twice its slowest step plus PD_ENGINE_STALL_S, 10 s) or dead, or twice in a "
        "row does not answer within max(this, 3 s), the requests fail over to another pair as for a dead engine, and "
        "the engine is taken out of every pair")
    failover_wait_s: float = Field(
        90.0, ge=0, le=3600, description="a stream failing over (its engine failed after tokens were sent) while no "
        "engine can take it - the pool that lost it is empty until its replacement joins: it waits this long for a "
        "ready engine, then fails with the error; a replacement under the failed engine's id is used once it has "
        "registered anew. A request that has sent nothing is answered 503 at once instead (its client can retry it)")


class ChatConfig(_Strict):
    """vLLM's OpenAI front-end options for chat completions, as `vllm serve` takes them: tool calling, reasoning
    output, the chat template. Parser names are checked against the installed vLLM's when the cluster starts."""

    tool_call_parser: str | None = Field(
        None, min_length=1, description="vLLM's tool-call parser for the model's output format (`vllm serve "
        "--tool-call-parser`: hermes, qwen3_coder, qwen3_xml, llama3_json, ...). Needed for any tool_choice but none: "
        "\"auto\" (the model decides; the parser finds the calls in its text), a named function and \"required\" "
        "(decoded under a JSON schema of the tools, so any model serves them)")
    enable_auto_tool_choice: bool | None = Field(
        None, description="`--enable-auto-tool-choice`. Default: on when tool_call_parser is set. vLLM 0.32 uses the "
        "parser only with it on - off, every tool_choice but none is refused (400), a named function included")
    tool_strict_level: Literal["auto", "function", "parameter"] = Field(
        "auto", description="how far tool calls are held to the tools (`--tool-strict-level`): auto - a request's "
        "tool_choice decides the call's envelope, and a tool's own `strict: true` its arguments' schema (OpenAI's "
        "rule); function - every request with tools gets the envelope; parameter - every tool's arguments too")
    reasoning_parser: str | None = Field(
        None, min_length=1, description="vLLM's reasoning parser (`--reasoning-parser`: qwen3, deepseek_r1, ...): the "
        "model's thinking is returned apart, as `reasoning_content`; the engines get it too, so that structured output "
        "starts after the thinking, as in vLLM's own server")
    chat_template: str | None = Field(
        None, min_length=1, description="a Jinja chat template, as a file path or the template itself "
        "(`--chat-template`; default: the tokenizer's)")
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="keyword arguments every chat request's template gets unless it sets them, e.g. "
        "{enable_thinking: false} (`--default-chat-template-kwargs`)")
    exclude_tools_when_tool_choice_none: bool = Field(
        False, description="leave the tools out of the prompt when tool_choice is \"none\"")

    @model_validator(mode="after")
    def _auto_needs_a_parser(self) -> "ChatConfig":
        if self.enable_auto_tool_choice is None:
            self.enable_auto_tool_choice = self.tool_call_parser is not None
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs chat.tool_call_parser: the parser that finds tool calls "
                             "in the model's text")
        return self

    def vllm_flags(self) -> list[str]:
        """These options as `vllm serve` arguments."""
        flags: list[str] = []
        if self.tool_call_parser:
            flags += ["--tool-call-parser", self.tool_call_parser]
        if self.enable_auto_tool_choice:
            flags.append("--enable-auto-tool-choice")
        if self.tool_strict_level != "auto":
            flags += ["--tool-strict-level", self.tool_strict_level]
        if self.reasoning_parser:
            flags += ["--reasoning-parser", self.reasoning_parser]
        if self.chat_template:
            flags += ["--chat-template", self.chat_template]
        if self.default_chat_template_kwargs:
            flags += ["--default-chat-template-kwargs", json.dumps(self.default_chat_template_kwargs)]
        if self.exclude_tools_when_tool_choice_none:
            flags.append("--exclude-tools-when-tool-choice-none")
        return flags


class DeployConfig(_Strict):
    model: ModelConfig = ModelConfig()
    prefill: PoolConfig = PoolConfig(tp=1)
    decode: PoolConfig = PoolConfig(tp=1)
    coordinator: CoordinatorConfig = CoordinatorConfig()
    engines: EnginesConfig = EnginesConfig()
    http: HttpConfig = HttpConfig()
    transfer: TransferConfig = TransferConfig()
    routing: RoutingConfig = RoutingConfig()
    chat: ChatConfig = ChatConfig()
    device: Literal["cpu", "cuda"] = "cpu"

    @model_validator(mode="after")
    def _verify_needs_dram(self) -> "DeployConfig":
        if self.transfer.verify and self.device != "cpu":
            raise ValueError("transfer.verify: checksums are computed by the CPU over DRAM caches; with device "
                             f"{self.device!r} set transfer.verify to off")
        return self


class DeployError(ValueError):
    pass


def load_deploy(path: str | Path) -> DeployConfig:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except FileNotFoundError:
        raise DeployError(f"{p}: no such deployment file") from None
    except yaml.YAMLError as e:
        raise DeployError(f"{p}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise DeployError(f"{p}: the top level must be a mapping")
    try:
        cfg = DeployConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"{'.'.join(str(x) for x in err['loc']) or '(top)'}: {err['msg']}" for err in e.errors()]
        raise DeployError(f"{p}: invalid deployment\n  " + "\n  ".join(lines)) from None
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        raise DeployError(f"{p}: invalid deployment\n  model.path: {cfg.model.path} is not a model directory (no config.json)")
    return cfg
