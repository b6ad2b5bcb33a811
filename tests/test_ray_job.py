"""`ray job submit` of the whole cluster onto a `ray start --head` cluster on loopback, as the README documents it:
token authentication on (Ray 2.60's default), a completion through HTTP with the `openai` client, `ray job stop`,
then the Ray cluster torn down with no process of it left."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import yaml

from actors.engine import free_port
from tests.pd_helpers import end_processes_under, processes_under

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def ray_cli(args: list[str], env: dict[str, str], timeout: float = 120) -> str:
    r = subprocess.run([str(BIN / "ray"), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"ray {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


@pytest.fixture
def head(tmp_path):
    """A `ray start --head` cluster on 127.0.0.1 with token auth, in its own temp dir; torn down afterwards (only
    its own processes: a Ray instance of the test session keeps running)."""
    temp_dir = tempfile.mkdtemp(prefix="pdj-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env.pop("RAY_ADDRESS", None)
    dashboard = free_port()
    ray_cli(["start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(free_port()), "--num-cpus", "2",
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
             "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
             "--temp-dir", temp_dir, "--disable-usage-stats"], env)
    try:
        yield {"env": env, "address": f"http://127.0.0.1:{dashboard}", "temp_dir": temp_dir}
    finally:
        end_processes_under(temp_dir)
        assert not processes_under(temp_dir)
        subprocess.run(["rm", "-rf", temp_dir])


def test_ray_job_submit_serves_and_stops(head, gdn_model, tmp_path):
    port = free_port()
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(yaml.safe_dump({
        "model": {"path": str(gdn_model), "name": "tiny-hybrid"},
        "coordinator": {"name": "pd-coordinator", "namespace": "hybrid-pd"},
        "http": {"host": "127.0.0.1", "port": port},
    }))
    env, address = head["env"], head["address"]
    t0 = time.monotonic()
    out = ray_cli(["job", "submit", "--address", address, "--working-dir", ".", "--no-wait",
                   "--runtime-env-json", '{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}}',
                   "--", "python", "-m", "cluster.launch", str(deploy)], env)
    job_id = re.search(r"raysubmit_[A-Za-z0-9]+", out).group(0)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        status = ray_cli(["job", "status", "--address", address, job_id], env)
        assert "RUNNING" in status or "PENDING" in status, status + ray_cli(["job", "logs", "--address", address, job_id], env)
        assert time.monotonic() - t0 < 600, "the job did not serve within 10 minutes"
        time.sleep(3)
    print(f"job {job_id} serving after {time.monotonic() - t0:.0f} s")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    got = client.completions.create(model="tiny-hybrid", prompt="a job on an existing cluster", max_tokens=8, temperature=0)
    assert got.usage.completion_tokens == 8 and got.choices[0].text

    engine_procs = [p for p in processes_under(head["temp_dir"]) if "EngineActor" in " ".join(p.cmdline()) or p.name().startswith("VLLM")]
    assert engine_procs, "the job's engines should run under the test cluster"
    ray_cli(["job", "stop", "--address", address, job_id], env, timeout=180)
    logs = ray_cli(["job", "logs", "--address", address, job_id], env)
    assert "stopping engines" in logs and "done" in logs.splitlines()[-1], logs[-2000:]
    _, alive = psutil.wait_procs(engine_procs, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "engine processes outlived the job"
    with pytest.raises(httpx.TransportError):  # the job's HTTP front end went with it
        httpx.get(f"{url}/v1/models", timeout=5)
