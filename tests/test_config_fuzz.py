"""Fuzzing what operators hand the system: deploy.yaml files and model configs given to the planner. Every input is
either accepted or refused with the project's own error naming a field - never another exception."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.core.config import DeployError, load_deploy
from cluster.core.hf_config import ConfigError, model_shape, ssm_dtype
from cluster.core.layout import LayoutError, offline_layout
from cluster.core.planner import IncompatiblePair, plan_pair

ROOT = Path(__file__).resolve().parents[1]
SCALARS = st.none() | st.booleans() | st.integers(-5, 5000) | st.floats(allow_nan=False, width=32) | st.text(max_size=12)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
DEPLOY_KEYS = {
    "model": ["builtin", "path", "name", "dtype", "max_model_len"],
    "prefill": ["tp", "min_replicas", "max_replicas", "kv_cache_gib", "gpu_memory_utilization", "scaling"],
    "decode": ["tp", "min_replicas", "max_replicas", "kv_cache_gib", "scaling"],
    "coordinator": ["name", "namespace", "engine_start_timeout_s"],
    "http": ["host", "port", "api_key", "api_key_env", "max_body_bytes", "retry_after_s"],
}


@st.composite
def deploy_files(draw):
    base = yaml.safe_load((ROOT / "deploy.yaml").read_text())
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from(sorted(DEPLOY_KEYS) + ["device", "extra"]))
        if section in DEPLOY_KEYS and isinstance(base.get(section), dict) and draw(st.booleans()):
            base[section][draw(st.sampled_from(DEPLOY_KEYS[section]) | st.text(max_size=6))] = draw(VALUES)
        else:
            base[section] = draw(VALUES)
    return base


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(deploy_files())
def test_any_deploy_file_loads_or_names_a_field(tmp_path, data):
    p = tmp_path / "deploy.yaml"
    p.write_text(yaml.safe_dump(data))
    try:
        cfg = load_deploy(p)
        assert 1 <= cfg.prefill.min_replicas <= cfg.prefill.max_replicas and 1 <= cfg.decode.min_replicas <= cfg.decode.max_replicas
        assert cfg.decode.scaling.target_running_requests > 0 and 0 < cfg.decode.scaling.max_cache_usage <= 1
    except DeployError as e:
        assert "invalid deployment" in str(e) and ": " in str(e).splitlines()[-1]


REAL = [json.loads(p.read_text()) for p in sorted((ROOT / "configs/models").glob("*.json"))]


def _paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


@st.composite
def model_configs(draw):
    cfg = copy.deepcopy(draw(st.sampled_from(REAL)))
    paths = list(_paths(cfg))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        node = cfg
        for k in path[:-1]:  # an earlier mutation may have removed or replaced a parent
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict) or path[-1] not in node:
            continue
        if draw(st.booleans()):
            del node[path[-1]]
        else:
            node[path[-1]] = draw(st.integers(-3, 100) | SCALARS | st.lists(st.sampled_from(["linear_attention", "full_attention", "mamba", "x"]), max_size=50))
    return cfg


@settings(max_examples=300, deadline=None)
@given(model_configs(), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_any_model_config_plans_or_names_a_field(cfg, p_tp, d_tp):
    try:
        model = model_shape(cfg)
        sd = ssm_dtype(cfg, "bfloat16")
        pair = plan_pair(offline_layout(model, p_tp, "bfloat16", sd), offline_layout(model, d_tp, "bfloat16", sd))
        assert pair.decode.tp == d_tp
    except (ConfigError, LayoutError, IncompatiblePair) as e:
        assert e.field and str(e)
