"""deploy.yaml and the example deployment files: valid files load, bad ones are refused naming the field."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from cluster.core.config import DeployConfig, DeployError, load_deploy

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, data) -> Path:
    p = tmp_path / "deploy.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def test_default_deployment_is_the_embedded_one():
    cfg = load_deploy(ROOT / "deploy.yaml")
    assert (cfg.model.builtin, cfg.prefill.tp, cfg.decode.tp, cfg.device) == ("gdn", 1, 1, "cpu")
    # cores as devices: each engine on a core of its own; the decode engine lends its core to prompts in chunks
    # of a block only while prompts queue at the prefill engine
    assert (cfg.prefill.cores_per_engine, cfg.decode.cores_per_engine) == (1, 1)
    assert cfg.transfer.local_prefill_queue is None and cfg.transfer.local_prefill_speed == 0.5
    assert cfg.decode.max_num_batched_tokens is None and cfg.prefill.max_num_batched_tokens is None  # the model's
    assert cfg.prefill.autoscaling and cfg.decode.autoscaling  # each pool 1..2 engines (as far as free cores allow)
    showcase = load_deploy(ROOT / "configs" / "deploy-tp-showcase.yaml")  # the differing-TP layout, sharing cores
    assert (showcase.prefill.tp, showcase.decode.tp) == (1, 2)
    assert showcase.prefill.share_cores and showcase.decode.share_cores
    assert cfg.http.host == "127.0.0.1" and cfg.http.api_key is None
    assert DeployConfig().http.host == "127.0.0.1"  # loopback also when the file says nothing
    # the decode engine reserves its core, the prefill engine borrows it while it is idle: defaults that follow the
    # layout, so that the file still loads with its pools' cores shared (tests and benchmarks flip share_cores; a
    # field set to true in the file would refuse that)
    assert cfg.decode.reserves_cores("decode") and not cfg.prefill.reserves_cores("prefill")
    assert cfg.prefill.borrows_cores("prefill") and not cfg.decode.borrows_cores("decode")
    data = yaml.safe_load((ROOT / "deploy.yaml").read_text())
    for role in ("prefill", "decode"):
        data[role]["share_cores"] = True
    shared = DeployConfig.model_validate(data)
    assert not shared.decode.reserves_cores("decode") and not shared.prefill.borrows_cores("prefill")


def gpu_example(tmp_path: Path):
    """The GPU example deployment, loaded with its model path pointed at a stub model directory: (config, dir)."""
    data = yaml.safe_load((ROOT / "configs/deploy-gpu-qwen3.5-35b-a3b-4p2d.yaml").read_text())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "configs/models/qwen3.5-35b-a3b.json").read_text())
    data["model"]["path"] = str(model)
    return load_deploy(write(tmp_path, data)), model


def test_gpu_example_is_4p2d(tmp_path, monkeypatch):
    cfg, _ = gpu_example(tmp_path)
    assert (cfg.device, cfg.prefill.min_replicas, cfg.prefill.tp, cfg.decode.min_replicas, cfg.decode.tp) == ("cuda", 4, 1, 2, 2)
    with pytest.raises(DeployError, match="PD_API_KEY is not set"):
        monkeypatch.delenv("PD_API_KEY", raising=False)
        cfg.http.resolved_api_key()
    monkeypatch.setenv("PD_API_KEY", "s3cret-key")
    assert cfg.http.resolved_api_key() == "s3cret-key"


@pytest.mark.parametrize(
    "data, field, reason",
    [
        ({"prefill": {"tp": 3}}, "prefill.tp", "power of two"),
        ({"decode": {"tp": 0}}, "decode.tp", "greater than or equal to 1"),
        ({"decode": {"min_replicas": 3, "max_replicas": 2}}, "decode", "exceeds max_replicas"),
        ({"http": {"port": 70000}}, "http.port", "less than or equal to 65535"),
        ({"http": {"api_key": "short"}}, "http.api_key", "at least 8"),
        ({"http": {"api_key": "longenough", "api_key_env": "K"}}, "http", "not both"),
        ({"model": {"dtype": "int3"}}, "model.dtype", "bfloat16"),
        ({"model": {"builtin": None}}, "model", "either builtin"),
        ({"model": {"max_model_len": 4}}, "model.max_model_len", "greater than or equal to 16"),
        ({"modle": {}}, "modle", "Extra inputs are not permitted"),
        ({"device": "tpu"}, "device", "'cpu' or 'cuda'"),
        ({"coordinator": {"namespace": ""}}, "coordinator.namespace", "at least 1"),
        ({"transfer": {"verify": 1.5}}, "transfer.verify", "off, all or a fraction"),
        ({"transfer": {"verify": "sometimes"}}, "transfer.verify", "off, all or a fraction"),
        ({"transfer": {"local_prefill_queue": -1}}, "transfer.local_prefill_queue", "greater than or equal to 0"),
        ({"transfer": {"local_prefill_when_idle": "sometimes"}}, "transfer.local_prefill_when_idle", "valid boolean"),
        ({"transfer": {"local_prefill_speed": 0}}, "transfer.local_prefill_speed", "greater than 0"),
        ({"transfer": {"local_prefill_speed": 1.5}}, "transfer.local_prefill_speed", "less than or equal to 1"),
        ({"transfer": {"verify": "all"}, "device": "cuda"}, "(top)", "transfer.verify: checksums are computed by the CPU over DRAM"),
        ({"decode": {"placement": {"resources": {"CPU": 1}}}}, "decode.placement.resources", "a Ray built-in"),
        ({"decode": {"placement": {"resources": {"slot": 0}}}}, "decode.placement.resources", "must be > 0"),
        ({"decode": {"placement": {"resources": {"a b": 1}}}}, "decode.placement.resources", "letters, digits"),
        ({"prefill": {"placement": {"labels": {"ray.io/node-id": "x"}}}}, "prefill.placement.labels", "Ray's own"),
        ({"prefill": {"placement": {"labels": {"pd-node": ""}}}}, "prefill.placement.labels", "non-empty"),
        ({"prefill": {"placement": {"nodes": ["a"]}}}, "prefill.placement.nodes", "Extra inputs are not permitted"),
        ({"prefill": {"env": {"UCX TLS": "tcp"}}}, "prefill.env", "not an environment variable name"),
        ({"decode": {"env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}}}, "decode.env", "set per engine"),
        ({"prefill": {"env": {"TORCHINDUCTOR_CACHE_DIR": "/x"}}}, "prefill.env", "engines.compile_cache_dir"),
        ({"engines": {"compile_cache_dir": "cache"}}, "engines.compile_cache_dir", "an absolute path"),
        ({"engines": {"busy_limit_s": 0}}, "engines.busy_limit_s", "greater than 0"),
        ({"engines": {"warm_up": "sometimes"}}, "engines.warm_up", "valid boolean"),
    ],
)
def test_bad_fields_are_named(tmp_path, data, field, reason):
    with pytest.raises(DeployError) as e:
        load_deploy(write(tmp_path, data))
    assert f"{field}: " in str(e.value) and reason in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(DeployError, match="no such deployment file"):
        load_deploy(tmp_path / "missing.yaml")
    with pytest.raises(DeployError, match="not valid YAML"):
        load_deploy(write(tmp_path, "model: [unclosed"))
    with pytest.raises(DeployError, match="top level must be a mapping"):
        load_deploy(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(DeployError, match="model.path: .* is not a model directory"):
        load_deploy(write(tmp_path, {"model": {"path": str(tmp_path / "nowhere")}}))


def test_launch_refuses_a_bad_file_before_starting_anything(tmp_path, capsys):
    from cluster.cli.launch import main

    assert main([str(write(tmp_path, {"prefill": {"tp": 6}}))]) == 2
    assert "prefill.tp" in capsys.readouterr().err


@pytest.mark.parametrize("text, fraction", [("off", 0.0), ("all", 1.0), ("0.25", 0.25), ("true", 1.0), ("false", 0.0),
                                            ("'off'", 0.0), ("0", 0.0), ("1", 1.0)])
def test_transfer_verify_spellings(tmp_path, text, fraction):
    """YAML reads a bare `off` as false and `on` as true: every spelling means what it says."""
    cfg = load_deploy(write(tmp_path, f"transfer:\n  verify: {text}\n"))
    assert cfg.transfer.verify == fraction


def test_transfer_verify_reaches_only_the_decode_engines(tmp_path):
    from cluster.cli.placement import device_options
    from cluster.cli.tiny_circuit import model_config
    from cluster.core.verify import VERIFY_ENV

    (tmp_path / "config.json").write_text(json.dumps(model_config("gdn").to_dict()))
    cfg = DeployConfig.model_validate({"transfer": {"verify": 0.1}})
    assert device_options(cfg, "decode", tmp_path)["extra_env"][VERIFY_ENV] == "0.1"
    assert VERIFY_ENV not in device_options(cfg, "prefill", tmp_path)["extra_env"]
    assert VERIFY_ENV not in device_options(DeployConfig(), "decode", tmp_path)["extra_env"]


def test_placement_and_env_reach_the_engines(tmp_path):
    """A pool's placement becomes its engines' Ray options (and its replicas' labels); its env, their environment."""
    from cluster.cli.launch import Cluster, engine_launch, pool_spec
    from cluster.cli.tiny_circuit import model_config

    (tmp_path / "config.json").write_text(json.dumps(model_config("gdn").to_dict()))
    cfg = DeployConfig.model_validate({
        "prefill": {"placement": {"resources": {"pd_prefill_slot": 1}}},
        "decode": {"tp": 2, "placement": {"labels": {"pd-node": "decode"}}, "env": {"UCX_TLS": "tcp", "OMP_WAIT_POLICY": "ACTIVE"}},
    })
    decode = engine_launch(cfg, "decode", str(tmp_path), "decode-0")
    prefill = engine_launch(cfg, "prefill", str(tmp_path), "prefill-0")
    assert decode["label_selector"] == {"pd-node": "decode"} and decode["resources"] == {}
    assert prefill["resources"] == {"pd_prefill_slot": 1.0} and prefill["label_selector"] == {}
    assert decode["env"]["UCX_TLS"] == "tcp" and decode["env"]["OMP_WAIT_POLICY"] == "ACTIVE"  # the pool's word wins
    assert "UCX_TLS" not in prefill["env"] and prefill["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    # a TP 1 CPU engine runs its model in its EngineCore ("uni"); one that owns its cores is bound when it starts,
    # to the cores it gets (tests/default_layout/test_own_cores.py), one that shares them as vLLM's mp executor binds a
    # worker
    assert prefill["vllm_args"]["distributed_executor_backend"] == "uni"
    assert (prefill["own_cores"], decode["own_cores"]) == (1, 2)
    assert (prefill["reserve_cores"], decode["reserve_cores"]) == (False, True)  # the host keeps off decode's cores
    assert prefill["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert not {"VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "GOMP_CPU_AFFINITY"} & prefill["env"].keys()
    shared = engine_launch(DeployConfig.model_validate({"prefill": {"share_cores": True}}), "prefill", str(tmp_path),
                           "prefill-0")
    assert shared["own_cores"] == 0 and "VLLM_CPU_OMP_THREADS_BIND" not in shared["env"]  # its node's cores, at start
    assert engine_launch(DeployConfig.model_validate({"decode": {"share_cores": True}}), "decode", str(tmp_path),
                         "decode-0")["reserve_cores"] is False  # shared cores are nobody's to reserve
    named = engine_launch(DeployConfig.model_validate({"prefill": {"share_cores": True, "env": {
        "VLLM_CPU_OMP_THREADS_BIND": "0-1"}}}), "prefill", str(tmp_path), "prefill-0")
    assert {k: named["env"][k] for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "GOMP_CPU_AFFINITY")} == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2", "GOMP_CPU_AFFINITY": "0 1"}
    assert decode["vllm_args"]["distributed_executor_backend"] == "mp"
    assert not {"VLLM_ENABLE_V1_MULTIPROCESSING", "GOMP_CPU_AFFINITY"} & decode["env"].keys()
    cluster = Cluster(cfg, tmp_path, coordinator=None)
    assert pool_spec(cluster, "decode").labels == {"pd-node": "decode"} and pool_spec(cluster, "prefill").labels == {}


def test_a_placement_no_node_satisfies_is_refused_naming_the_field():
    from cluster.cli.placement import check_placement

    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.11", "Labels": {"pd-node": "prefill"}, "Resources": {"CPU": 2.0}},
             {"Alive": False, "NodeManagerAddress": "10.0.0.12", "Labels": {"pd-node": "decode"}, "Resources": {"slot": 4.0}}]
    fine = DeployConfig.model_validate({"prefill": {"placement": {"labels": {"pd-node": "prefill"}}}})
    check_placement(fine, nodes)
    check_placement(DeployConfig(), [])  # no placement: any node, nothing to check
    # the labels only a dead node has, the resources only a dead node has, labels and resources not on one node
    for placement in ({"labels": {"pd-node": "decode"}}, {"resources": {"slot": 1}},
                      {"labels": {"pd-node": "prefill"}, "resources": {"slot": 1}}):
        with pytest.raises(DeployError, match="decode.placement: no live Ray node has labels") as e:
            check_placement(DeployConfig.model_validate({"decode": {"placement": placement}}), nodes)
        assert "10.0.0.11: labels {'pd-node': 'prefill'}" in str(e.value)


def test_the_verify_sample_is_a_function_of_the_request_id():
    from cluster.core.verify import sampled

    ids = [f"cmpl-{i}" for i in range(4000)]
    picked = [i for i in ids if sampled(i, 0.25)]
    assert picked == [i for i in ids if sampled(i, 0.25)]  # the actor and the workers agree without a message
    assert 0.2 < len(picked) / len(ids) < 0.3
    assert all(sampled(i, 1.0) for i in ids) and not any(sampled(i, 0.0) for i in ids)


def test_gpu_engines_get_what_vllm_needs_for_hybrid_pd(tmp_path):
    """What the launcher starts each engine of the GPU example with (nothing here runs on a GPU): one GPU per TP rank,
    the DS conv-state layout vLLM 0.32's stock NIXL transfers were built for (CPU engines run SD: launch_env), the
    project's connector over VRAM, vLLM's share of GPU memory, and vLLM's default async scheduling - which 0.32 runs
    safely with hybrid P/D because it carries both upstream fixes, checked here in the installed vLLM."""
    from cluster.cli.launch import engine_launch
    from cluster.cli.tiny_circuit import model_config
    from cluster.core.verify import VERIFY_ENV

    cfg, model = gpu_example(tmp_path)
    for role, tp in (("prefill", 1), ("decode", 2)):
        spec = engine_launch(cfg, role, str(model), f"{role}-0")
        assert spec["num_gpus"] == tp
        assert spec["env"]["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS" and VERIFY_ENV not in spec["env"]
        args = spec["vllm_args"]
        assert (args["model"], args["tensor_parallel_size"], args["gpu_memory_utilization"]) == (str(model), tp, 0.9)
        assert "async_scheduling" not in args  # vLLM's default: on
        kv = args["kv_transfer_config"]
        assert (kv["kv_connector"], kv["kv_connector_module_path"], kv["kv_buffer_device"], kv["engine_id"]) == (
            "NixlConnector", "actors.engine.connector", "cuda", f"{role}-0")
        assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        assert args["worker_extension_cls"] == "actors.engine.connector.PDWorkerExtension"
        assert args["enable_prefix_caching"] is True  # GDN state: vLLM's "align" mode on any device
        assert args["distributed_executor_backend"] == "mp"  # a process per rank on GPUs, TP 1 too
        assert not {"VLLM_ENABLE_V1_MULTIPROCESSING", "GOMP_CPU_AFFINITY"} & spec["env"].keys()
    assert "block_size" not in args  # GPU attention pages are token-major: block sizes may differ between pools
    # the CPU default: vLLM's own SD conv layout (actors.engine.settings.launch_env), the cache lives in DRAM, no GPUs
    (model / "config.json").write_text(json.dumps(model_config("gdn").to_dict()))
    cpu = engine_launch(DeployConfig(), "decode", str(model), "decode-0")
    assert cpu["env"]["VLLM_SSM_CONV_STATE_LAYOUT"] == "SD" and cpu["num_gpus"] == 0
    assert cpu["vllm_args"]["kv_transfer_config"]["kv_buffer_device"] == "cpu"


def test_a_decode_budget_under_two_blocks_is_refused_where_the_decode_engine_prefills(tmp_path):
    """A hybrid prompt's chunk that stops before its end must end on a block boundary: with a decode step budget under
    two blocks, a prompt the decode engine prefills itself would advance only while nothing decodes (measured: 0.04-
    0.12 of requests within the SLOs at a budget of 128). Where a rule of conditional disaggregation is on, the budget
    defaults to two blocks of the model (deploy.yaml leaves it out: 256 on gdn's 128-token blocks, 768 on gdn-asym's
    384), and an explicit value under that is refused naming the field; with no rule on, vLLM's budget stands."""
    from cluster.cli.placement import device_options
    from cluster.cli.tiny_circuit import model_config

    def budget(cfg: DeployConfig, role: str = "decode") -> int | None:
        return device_options(cfg, role, tmp_path)["engine_kwargs"].get("max_num_batched_tokens")

    (tmp_path / "config.json").write_text(json.dumps(model_config("gdn").to_dict()))
    shipped = load_deploy(ROOT / "deploy.yaml").model_dump(exclude_unset=True)
    shipped["model"] = {"path": str(tmp_path)}
    cfg = DeployConfig.model_validate(shipped)
    assert budget(cfg) == 256 and budget(cfg, "prefill") is None
    (tmp_path / "config.json").write_text(json.dumps(model_config("gdn-asym").to_dict()))
    assert budget(cfg) == 768  # the default follows the model's block
    explicit = {**shipped, "decode": {**shipped["decode"], "max_num_batched_tokens": 256}}
    with pytest.raises(DeployError, match=r"decode.max_num_batched_tokens: 256 is under two blocks of this model "
                                          r"\(384 tokens each\).*set at least 768"):
        budget(DeployConfig.model_validate(explicit))
    budget(DeployConfig.model_validate(explicit), "prefill")  # the prefill pool's budget is its own business
    for rules in ({"local_prefill_speed": None}, {"local_prefill_speed": None, "local_prefill_queue": 1},
                  {"local_prefill_speed": None, "local_prefill_when_idle": True}):
        data = {**explicit, "transfer": {**explicit["transfer"], **rules}}
        defaulted = {**data, "decode": shipped["decode"]}
        if rules == {"local_prefill_speed": None}:  # no rule on: any budget is the user's call, unset is vLLM's
            assert budget(DeployConfig.model_validate(data)) == 256
            assert budget(DeployConfig.model_validate(defaulted)) is None
        else:
            with pytest.raises(DeployError, match="decode.max_num_batched_tokens"):
                budget(DeployConfig.model_validate(data))
            assert budget(DeployConfig.model_validate(defaulted)) == 768


def test_cpu_pools_get_one_block_size(tmp_path):
    """vLLM gives gdn-asym 384-token blocks at TP 1 but 256 at TP 4, and CPU attention pages cannot be remapped
    between block sizes: the launcher starts both pools with the larger one (computed for an fp32 recurrent state,
    which vLLM's CPU platform uses on AVX512-BF16 machines, so that it fits everywhere)."""
    from cluster.cli.launch import engine_launch
    from cluster.cli.placement import cpu_block_size
    from cluster.cli.tiny_circuit import model_config

    (tmp_path / "config.json").write_text(json.dumps(model_config("gdn-asym").to_dict()))
    cfg = DeployConfig.model_validate({"model": {"path": str(tmp_path)}, "prefill": {"tp": 1}, "decode": {"tp": 4}})
    assert cpu_block_size(cfg, tmp_path) == 384
    for role in ("prefill", "decode"):
        assert engine_launch(cfg, role, str(tmp_path), f"{role}-0")["vllm_args"]["block_size"] == 384
    gdn = DeployConfig.model_validate({"model": {"path": str(tmp_path)}, "decode": {"tp": 2}})
    (tmp_path / "config.json").write_text(json.dumps(model_config("gdn").to_dict()))
    assert cpu_block_size(gdn, tmp_path) == 128  # what vLLM picks at TP 1 and 2 anyway

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.sched.scheduler import Scheduler

    from actors.engine.connector import NixlConnector

    # vLLM #48481: attention blocks a connector loads are not zeroed behind the transfer's back
    assert NixlConnector.get_loaded_kv_cache_group_ids is not KVConnectorBase_V1.get_loaded_kv_cache_group_ids
    # vLLM #45357: freed blocks wait for the in-flight step before a transfer may refill them
    assert hasattr(Scheduler, "_drain_deferred_frees")


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_prefix_caching_is_on_wherever_vllm_serves_it(tmp_path, kind):
    """Default: each pool caches prefixes where vLLM can (GDN and attention state, any device; not Mamba state on CPU,
    whose vLLM-CPU 0.32 mixer fails the first long prompt). Asking for it where vLLM cannot is refused naming the
    field; asking for it off is obeyed; the engines get what was decided."""
    from cluster.cli.launch import engine_launch
    from cluster.cli.placement import prefix_caching
    from cluster.cli.tiny_circuit import model_config

    (tmp_path / "config.json").write_text(json.dumps(model_config(kind).to_dict()))
    auto = DeployConfig.model_validate({"model": {"path": str(tmp_path)}})
    supported = kind == "gdn"
    for role in ("prefill", "decode"):
        assert prefix_caching(auto, role, tmp_path) is supported
        assert engine_launch(auto, role, str(tmp_path), f"{role}-0")["vllm_args"]["enable_prefix_caching"] is supported
    off = DeployConfig.model_validate({"model": {"path": str(tmp_path)}, "decode": {"enable_prefix_caching": False}})
    assert (prefix_caching(off, "prefill", tmp_path), prefix_caching(off, "decode", tmp_path)) == (supported, False)
    asked = DeployConfig.model_validate({"model": {"path": str(tmp_path)}, "prefill": {"enable_prefix_caching": True}})
    if supported:
        assert prefix_caching(asked, "prefill", tmp_path) is True
    else:
        with pytest.raises(DeployError, match=r"^prefill\.enable_prefix_caching: .*mamba2 state"):
            prefix_caching(asked, "prefill", tmp_path)
    on_gpu = DeployConfig.model_validate({"model": {"path": str(tmp_path)}, "device": "cuda"})
    assert prefix_caching(on_gpu, "decode", tmp_path) is True


def test_prefix_caching_must_be_a_boolean(tmp_path):
    with pytest.raises(DeployError, match=r"decode\.enable_prefix_caching"):
        load_deploy(write(tmp_path, {"decode": {"enable_prefix_caching": "sometimes"}}))


def test_in_process_engines_bind_their_openmp_threads():
    """TP 1 CPU engines run the model in their EngineCore with the binding vLLM's mp executor gives a worker; a pool's
    own VLLM_CPU_OMP_THREADS_BIND or executor choice wins."""
    from actors.engine.settings import in_process_env, in_process_model, launch_env

    assert in_process_model(1) and not in_process_model(2) and not in_process_model(1, "cuda")
    assert not in_process_model(1, engine_kwargs={"distributed_executor_backend": "mp"})
    assert in_process_env("0-3") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "4",
                                     "GOMP_CPU_AFFINITY": "0 1 2 3"}
    assert in_process_env("2,5-6")["GOMP_CPU_AFFINITY"] == "2 5 6"
    assert in_process_env("nobind") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env = launch_env(1, {"VLLM_CPU_OMP_THREADS_BIND": "1"}, "prefill")
    assert (env["GOMP_CPU_AFFINITY"], env["OMP_NUM_THREADS"]) == ("1", "1")
    assert "GOMP_CPU_AFFINITY" not in launch_env(1, None, "decode", engine_kwargs={"distributed_executor_backend": "mp"})
    assert launch_env(1, {"OMP_NUM_THREADS": "1"}, "decode")["OMP_NUM_THREADS"] == "1"  # extra_env wins


def test_cpu_pd_engines_keep_conv_state_in_vllms_default_layout():
    """CPU prefill and decode engines run the SD conv-state layout vLLM's plain server runs (vLLM-CPU would pick DS
    for any NIXL connector); a pool's env wins; engines without a role and CUDA engines are left to vLLM / the pool."""
    from actors.engine.settings import launch_env

    for role in ("prefill", "decode"):
        assert launch_env(2, None, role)["VLLM_SSM_CONV_STATE_LAYOUT"] == "SD"
    assert launch_env(2, {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}, "decode")["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"
    assert "VLLM_SSM_CONV_STATE_LAYOUT" not in launch_env(2, None, None)
    assert "VLLM_SSM_CONV_STATE_LAYOUT" not in launch_env(2, None, "decode", "cuda")


def test_every_engine_shares_one_gloo_device_per_process():
    """launch_env turns on the vLLM plugin's one gloo device per process for every engine (a pool's env, or the
    launching process's PD_GLOO_SHARED_DEVICE, may turn it off)."""
    from actors.engine.settings import launch_env

    for role in ("prefill", "decode", None):
        assert launch_env(2, None, role)["PD_GLOO_SHARED_DEVICE"] == "1"
    assert launch_env(2, {"PD_GLOO_SHARED_DEVICE": "0"}, "decode")["PD_GLOO_SHARED_DEVICE"] == "0"


def test_a_pools_step_budget_reaches_its_engines(tmp_path):
    """`max_num_batched_tokens` goes to vLLM as the pool's engines' step budget; unset, vLLM picks its own."""
    from cluster.cli.tiny_circuit import model_config
    from cluster.cli.launch import engine_launch

    (tmp_path / "config.json").write_text(json.dumps(model_config("gdn").to_dict()))
    cfg = DeployConfig.model_validate({"decode": {"max_num_batched_tokens": 256}})
    assert engine_launch(cfg, "decode", str(tmp_path), "decode-0")["vllm_args"]["max_num_batched_tokens"] == 256
    assert "max_num_batched_tokens" not in engine_launch(cfg, "prefill", str(tmp_path), "prefill-0")["vllm_args"]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        DeployConfig.model_validate({"decode": {"max_num_batched_tokens": 8}})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "fe80::1", "pd-head.example.org",
                                  "127.0.0.1.example.org", "node"])
def test_a_host_beyond_loopback_without_an_api_key_is_refused(tmp_path, host):
    """Refused naming http.host and http.api_key_env - unless a key is set (by variable name or in the file), or
    the dangerous opt-out is."""
    with pytest.raises(DeployError) as e:
        load_deploy(write(tmp_path, {"http": {"host": host}}))
    msg = str(e.value)
    assert "http: " in msg and f"http.host {host!r}" in msg and "http.api_key_env" in msg
    assert "http.allow_unauthenticated" in msg
    assert load_deploy(write(tmp_path, {"http": {"host": host, "api_key_env": "PD_API_KEY"}})).http.host == host
    assert load_deploy(write(tmp_path, {"http": {"host": host, "api_key": "a-long-key"}})).http.host == host
    cfg = load_deploy(write(tmp_path, {"http": {"host": host, "allow_unauthenticated": True}}))
    assert cfg.http.allow_unauthenticated and cfg.http.resolved_api_key() is None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "localhost", "LocalHost", "::ffff:127.0.0.1"])
def test_loopback_hosts_need_no_api_key(tmp_path, host):
    cfg = load_deploy(write(tmp_path, {"http": {"host": host}}))
    assert cfg.http.host == host and cfg.http.api_key is None and not cfg.http.allow_unauthenticated


def test_front_ends_on_every_node(tmp_path):
    """http.location: head (default) or every_node, nothing else; a front end's URL for clients elsewhere names its
    node where it binds every interface; "node" binds the node's own address."""
    from actors.frontend.server import bind_host
    from cluster.cli.frontends import reachable_url

    assert DeployConfig().http.location == "head"
    assert load_deploy(write(tmp_path, {"http": {"location": "every_node"}})).http.location == "every_node"
    with pytest.raises(DeployError, match="http.location: .*'head' or 'every_node'"):
        load_deploy(write(tmp_path, {"http": {"location": "everywhere"}}))
    assert reachable_url("http://0.0.0.0:8000", "10.0.0.12") == "http://10.0.0.12:8000"
    assert reachable_url("http://[::]:8000", "fd00::12") == "http://[fd00::12]:8000"
    assert reachable_url("http://10.0.0.12:8000", "10.0.0.12") == "http://10.0.0.12:8000"
    assert reachable_url("http://127.0.0.1:8000", "10.0.0.12") == "http://127.0.0.1:8000"
    assert bind_host("127.0.0.1") == "127.0.0.1"
    assert bind_host("node") not in ("node", "") and bind_host("node").count(".") == 3


def test_admission_and_n_limits_have_defaults_and_bounds(tmp_path):
    """The defaults the field descriptions explain (in flight 256, queued 512, n 128), reaching the front end's
    settings; nonsense refused naming the field."""
    from actors.frontend.server import FrontendSettings

    http = DeployConfig().http
    assert (http.max_requests_in_flight, http.max_queued_requests, http.max_n, http.retry_after_s) == (256, 512, 128, 2)
    settings = FrontendSettings(model_name="m", model_dir="/m", max_model_len=64, coordinator_name="c", namespace="n")
    assert (settings.max_requests_in_flight, settings.max_queued_requests, settings.max_n) == (256, 512, 128)
    assert load_deploy(write(tmp_path, {"http": {"max_queued_requests": 0}})).http.max_queued_requests == 0
    for data, field, reason in [
        ({"max_requests_in_flight": 0}, "http.max_requests_in_flight", "greater than or equal to 1"),
        ({"max_queued_requests": -1}, "http.max_queued_requests", "greater than or equal to 0"),
        ({"max_n": 0}, "http.max_n", "greater than or equal to 1"),
        ({"max_n": 20000}, "http.max_n", "less than or equal to 16384"),
        ({"allow_unauthenticated": "maybe"}, "http.allow_unauthenticated", "valid boolean"),
    ]:
        with pytest.raises(DeployError) as e:
            load_deploy(write(tmp_path, {"http": data}))
        assert f"{field}: " in str(e.value) and reason in str(e.value), str(e.value)


def test_the_http_limits_reach_the_front_end(tmp_path):
    """deploy.yaml's admission limits and conditional-disaggregation rules are what the front end is started with
    (`cluster.cli.frontends.frontend_settings`)."""
    from cluster.cli.frontends import frontend_settings
    from cluster.cli.launch import Cluster

    cfg = DeployConfig.model_validate({"http": {"max_requests_in_flight": 3, "max_queued_requests": 0, "max_n": 7}})
    settings = frontend_settings(Cluster(cfg, tmp_path, coordinator=None))
    assert (settings.max_requests_in_flight, settings.max_queued_requests, settings.max_n) == (3, 0, 7)
    assert settings.local_prefill_speed is None  # the rules of conditional disaggregation reach it too
    cfg = DeployConfig.model_validate({"transfer": {"local_prefill_speed": 0.4, "local_prefill_queue": 2,
                                                    "local_prefill_when_idle": True}})
    settings = frontend_settings(Cluster(cfg, tmp_path, coordinator=None))
    assert (settings.local_prefill_speed, settings.local_prefill_queue, settings.local_prefill_when_idle) == (0.4, 2, True)


def test_the_engines_settings_reach_every_engine(tmp_path, monkeypatch):
    """`engines` becomes both pools' environment (compile cache, busy limit, warm-up off), and an engine's compile
    caches live under that directory whatever its process inherited (torch writes TORCHINDUCTOR_CACHE_DIR into the
    environment of a process that used its cache, and Ray's workers inherit it)."""
    from actors.engine.settings import compile_cache_env, default_compile_cache_dir
    from cluster.cli.launch import engine_launch
    from cluster.cli.tiny_circuit import model_config

    (tmp_path / "config.json").write_text(json.dumps(model_config("gdn").to_dict()))
    cfg = DeployConfig.model_validate({"engines": {"compile_cache_dir": "~/cc", "busy_limit_s": 90, "warm_up": False}})
    for role in ("prefill", "decode"):
        env = engine_launch(cfg, role, str(tmp_path), f"{role}-0")["env"]
        assert (env["PD_COMPILE_CACHE_DIR"], env["PD_ENGINE_BUSY_LIMIT_S"], env["PD_ENGINE_WARMUP"]) == ("~/cc", "90.0", "0")
    assert not {"PD_COMPILE_CACHE_DIR", "PD_ENGINE_BUSY_LIMIT_S", "PD_ENGINE_WARMUP"} & engine_launch(
        DeployConfig(), "decode", str(tmp_path), "decode-0")["env"].keys()  # the defaults: nothing to say
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_someone")  # inherited
    monkeypatch.setenv("PD_COMPILE_CACHE_DIR", "~/cc")
    home = os.path.expanduser("~")
    assert compile_cache_env() == {"TORCHINDUCTOR_CACHE_DIR": f"{home}/cc/inductor", "VLLM_CACHE_ROOT": f"{home}/cc/vllm"}
    assert compile_cache_env("cuda")["TRITON_CACHE_DIR"] == f"{home}/cc/triton"
    monkeypatch.delenv("PD_COMPILE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_compile_cache_dir() == tmp_path / "xdg" / "hybrid-pd" / "compile"


def test_chat_options_reach_vllms_front_end_arguments_and_bad_ones_are_refused(tmp_path):
    """`chat` holds `vllm serve`'s chat options: they reach the front end's vLLM arguments as vLLM's own parser reads
    them (a tool-call parser turns auto tool choice on, without which vLLM 0.32 refuses every tool_choice); a
    parser the installed vLLM does not have, or a chat template that is neither a file nor a template, is refused
    naming the field before anything starts; auto tool choice without a parser at load."""
    from actors.frontend.server import FrontendSettings, vllm_args
    from cluster.cli.frontends import chat_flags
    from cluster.cli.placement import check_chat, device_options

    base = dict(model_name="m", model_dir="/m", max_model_len=64, coordinator_name="c", namespace="n")
    plain = vllm_args(FrontendSettings(**base))
    assert plain.tool_call_parser is None and not plain.enable_auto_tool_choice and not plain.reasoning_parser
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    cfg = load_deploy(write(tmp_path, {"chat": {
        "tool_call_parser": "hermes", "reasoning_parser": "qwen3", "tool_strict_level": "parameter",
        "chat_template": str(template), "default_chat_template_kwargs": {"enable_thinking": False}}}))
    check_chat(cfg)
    args = vllm_args(FrontendSettings(**base, chat_flags=chat_flags(cfg)))
    assert (args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser, args.tool_strict_level,
            args.chat_template, args.default_chat_template_kwargs) == \
        ("hermes", True, "qwen3", "parameter", template.read_text(), {"enable_thinking": False})  # the file's text:
    # the front ends may run on nodes without the launcher's files
    from cluster.cli.tiny_circuit import model_config

    (tmp_path / "config.json").write_text(json.dumps(model_config("gdn").to_dict()))
    for role in ("prefill", "decode"):  # the engines' structured output waits for the end of the thinking
        assert device_options(cfg, role, tmp_path)["engine_kwargs"]["reasoning_parser"] == "qwen3"
    assert load_deploy(write(tmp_path, {"chat": {"tool_call_parser": "hermes", "enable_auto_tool_choice": False}})) \
        .chat.vllm_flags() == ["--tool-call-parser", "hermes"]
    for chat, field in [({"tool_call_parser": "no-such-parser"}, "chat.tool_call_parser"),
                        ({"reasoning_parser": "no-such-parser"}, "chat.reasoning_parser"),
                        ({"chat_template": str(tmp_path / "absent.jinja")}, "chat.chat_template")]:
        with pytest.raises(DeployError, match=field):
            check_chat(load_deploy(write(tmp_path, {"chat": chat})))
    with pytest.raises(DeployError, match="chat.*enable_auto_tool_choice needs chat.tool_call_parser"):
        load_deploy(write(tmp_path, {"chat": {"enable_auto_tool_choice": True}}))
    with pytest.raises(DeployError, match="chat.tool_strict_level"):
        load_deploy(write(tmp_path, {"chat": {"tool_strict_level": "always"}}))


def test_the_deploy_files_context_default_is_the_engines():
    """model.max_model_len's default (cluster/core may not import actors/) is the engines' own default."""
    from actors.engine.settings import DEFAULT_MAX_MODEL_LEN

    assert DeployConfig.model_validate({}).model.max_model_len == DEFAULT_MAX_MODEL_LEN
