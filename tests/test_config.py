"""deploy.yaml and the example deployment files: valid files load, bad ones are refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config import DeployConfig, DeployError, load_deploy

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, data) -> Path:
    p = tmp_path / "deploy.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def test_default_deployment_is_the_embedded_one():
    cfg = load_deploy(ROOT / "deploy.yaml")
    assert (cfg.model.builtin, cfg.prefill.tp, cfg.decode.tp, cfg.device) == ("gdn", 1, 2, "cpu")
    assert cfg.prefill.autoscaling and cfg.decode.autoscaling  # each pool 1..2 engines
    assert cfg.http.host == "127.0.0.1" and cfg.http.api_key is None
    assert DeployConfig().http.host == "127.0.0.1"  # loopback also when the file says nothing


def test_gpu_example_is_4p2d(tmp_path, monkeypatch):
    data = yaml.safe_load((ROOT / "configs/deploy-gpu-qwen3.5-35b-a3b-4p2d.yaml").read_text())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data["model"]["path"] = str(model)
    cfg = load_deploy(write(tmp_path, data))
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
    from cluster.launch import main

    assert main([str(write(tmp_path, {"prefill": {"tp": 6}}))]) == 2
    assert "prefill.tp" in capsys.readouterr().err
