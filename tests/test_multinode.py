"""The cluster across Ray nodes that talk over a real network path: three Ray nodes on this machine, two of them in
network namespaces of the test's own, joined by a bridge (veth pairs, addresses in a /24 that only this test uses).
The prefill pool is placed on one node and the decode pool on another (`placement.labels`), and NIXL is told to
use TCP over the namespaces' veth interface (`env: UCX_TLS, UCX_NET_DEVICES`), so the state crosses the bridge
instead of same-host shared memory (checked with the interface's byte counters). The cluster is started with
`ray job submit` onto the head node (token authentication on, Ray 2.60's default), as the README documents it, with a
front end on every node (`http.location: every_node`), each on its node's address (`http.host: node`, an API key);
the test is an HTTP client of each.

Then the decode node is removed (every process in its namespace SIGKILLed): streams in flight continue on the
prefill engine (degraded mode), new requests are answered, `/health` says degraded, nothing hangs and the surviving
prefill engine holds no blocks for the dead requests; the decode node's front end went with it, the others serve. Last,
`ray job stop` shuts the cluster down: the launcher's clean-up runs to its end, no engine process is left, the HTTP
endpoint is gone.

Needs root (network namespaces); traffic goes only to addresses inside the namespaces this test made."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import secrets
import signal
import re
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

from actors.host.cores import thread_affinities
from actors.engine.settings import free_port
from actors.engine.procs import SHM_PREFIXES
from cluster.core.cores import parse_cores
from tests.pd_helpers import end_processes_under, metric, oracle, processes_under, wait_for

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = "tiny-hybrid"
NAMESPACE = "pd-multinode"
NODE_CORES = {"prefill": "0", "decode": "0-1"}  # PD_NODE_CORES of each pool's node (they share this machine's cores)
IFACE = "pd0"  # the veth end inside each namespace (UCX_NET_DEVICES names it)
START_TIMEOUT_S = 600
MAX_TOKENS = 300  # per stream of the node-removal test: long enough to be cut in the middle
IDS = {"return_tokens_as_token_ids": True, "ignore_eos": True}  # logprobs name each token "token_id:<id>"
API_KEY = secrets.token_hex(16)  # the front ends listen beyond loopback (on the bridge): the key is required
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def ray_cli(args: list[str], env: dict[str, str], timeout: float = 120) -> str:
    r = subprocess.run([str(BIN / "ray"), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"ray {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def sh(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> str:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r.stdout


class NetnsHosts:
    """A bridge in the root namespace (the head node's address) and one namespace per further Ray node, each with a
    veth pair into the bridge. Everything is named with a random tag and removed by `remove`."""

    def __init__(self, names: list[str]) -> None:
        tag = secrets.token_hex(2)
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(0, 256)}"
        self.bridge = f"pdbr{tag}"
        self.head_ip = f"{self.subnet}.1"
        self.hosts = {name: (f"pd{tag}-{name}", f"{self.subnet}.{11 + i}") for i, name in enumerate(names)}
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            sh("ip", "addr", "add", f"{self.head_ip}/24", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for i, (ns, ip) in enumerate(self.hosts.values()):
                outer = f"pdv{tag}{i}"
                sh("ip", "netns", "add", ns)
                sh("ip", "link", "add", outer, "type", "veth", "peer", "name", IFACE, "netns", ns)
                sh("ip", "link", "set", outer, "master", self.bridge)
                sh("ip", "link", "set", outer, "up")
                sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", IFACE)
                sh("ip", "-n", ns, "link", "set", IFACE, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise

    def netns(self, name: str) -> str:
        return self.hosts[name][0]

    def ip(self, name: str) -> str:
        return self.hosts[name][1]

    def pids(self, name: str) -> list[int]:
        r = subprocess.run(["ip", "netns", "pids", self.netns(name)], capture_output=True, text=True)
        return [int(p) for p in r.stdout.split()]

    def rx_bytes(self, name: str) -> int:
        return int(sh("ip", "netns", "exec", self.netns(name), "cat", f"/sys/class/net/{IFACE}/statistics/rx_bytes"))

    def kill_all(self, name: str) -> list[int]:
        """SIGKILL every process in the host's namespace (a node that is gone); returns their pids."""
        pids = self.pids(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def remove(self) -> None:
        for name, (ns, _) in self.hosts.items():
            if subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(ns):
                self.kill_all(name)
                wait_for(lambda: not self.pids(name), 30)
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _shm() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(SHM_PREFIXES)}


def ask_ray(env: dict[str, str], script: str) -> object:
    """Run `script` (which prints one JSON value) as a short Ray driver of the test cluster; return the value."""
    r = subprocess.run([sys.executable, "-c", "import json, ray\nray.init(log_to_driver=False)\n" + script], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


FREE_BLOCKS = f"""
from actors.clients.engine_client import EngineClient
free = {{}}
for e in ray.get(ray.get_actor("pd-coordinator", namespace="{NAMESPACE}").describe.remote())["engines"]:
    try:
        free[e] = ray.get(EngineClient.named(e, "{NAMESPACE}").free_blocks(), timeout=10)
    except Exception:  # an engine on a node that is gone, not yet taken out of the registry
        pass
print(json.dumps(free))
"""


@pytest.fixture(scope="module")
def nodes(gdn_model, tmp_path_factory):
    """The head node (root namespace, the bridge address) and two worker nodes in namespaces, labelled pd-node=prefill
    and pd-node=decode; the cluster launched onto them with `ray job submit`; everything removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    shm_before = _shm()
    hosts = NetnsHosts(["prefill", "decode"])
    temp_dir = tempfile.mkdtemp(prefix="pdm-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(16), "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    gcs_port, dashboard = free_port(), free_port()
    ray = str(BIN / "ray")
    jobs = f"http://127.0.0.1:{dashboard}"  # the job server (the dashboard) listens on loopback only
    job_id = None
    work = tmp_path_factory.mktemp("multinode")
    try:
        sh(ray, "start", "--head", "--node-ip-address", hosts.head_ip, "--port", str(gcs_port), "--num-cpus", "2",
           "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
           "--dashboard-agent-listen-port", str(free_port()), "--ray-client-server-port", str(free_port()),
           "--temp-dir", temp_dir, "--disable-usage-stats", "--labels", "pd-node=head", env=env, timeout=120)
        for name in ("prefill", "decode"):  # each pool's node has the cores its engine owns (cores as devices)
            cores = NODE_CORES[name]
            sh("ip", "netns", "exec", hosts.netns(name), ray, "start", "--address", f"{hosts.head_ip}:{gcs_port}",
               "--node-ip-address", hosts.ip(name), "--num-cpus", str(len(parse_cores(cores))), "--labels",
               f"pd-node={name}", "--disable-usage-stats", env={**env, "PD_NODE_CORES": cores}, timeout=120)
        env["RAY_ADDRESS"] = f"{hosts.head_ip}:{gcs_port}"
        port = free_port()
        ucx = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": IFACE}  # NIXL's bytes over the bridge, not shared memory
        deploy = work / "deploy.yaml"
        deploy.write_text(yaml.safe_dump({
            "model": {"path": str(gdn_model), "name": MODEL},
            "prefill": {"tp": 1, "placement": {"labels": {"pd-node": "prefill"}}, "env": ucx},
            "decode": {"tp": 2, "placement": {"labels": {"pd-node": "decode"}}, "env": ucx},
            "coordinator": {"name": "pd-coordinator", "namespace": NAMESPACE},
            "transfer": {"verify": "all"},  # every byte that crossed the bridge checked against the prefill side's
            "http": {"port": port, "host": "node", "api_key": API_KEY, "location": "every_node"},
        }))
        # the launcher's clean-up after a node's death waits up to 60 s on Serve for the dead node's replica
        out = ray_cli(["job", "submit", "--address", jobs, "--working-dir", ".", "--no-wait",
                       "--runtime-env-json", '{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "180"}}',
                       "--", "python", "-m", "cluster", "run", str(deploy)], env)
        job_id = re.search(r"raysubmit_[A-Za-z0-9]+", out).group(0)
        job = {"id": job_id, "address": jobs, "stopped": False}
        logs = lambda: ray_cli(["job", "logs", "--address", jobs, job_id], env)  # noqa: E731
        t0 = time.monotonic()
        while "ready in" not in logs():
            status = ray_cli(["job", "status", "--address", jobs, job_id], env)
            assert "RUNNING" in status or "PENDING" in status, f"{status}\n{logs()[-4000:]}"
            assert time.monotonic() - t0 < START_TIMEOUT_S, f"not serving after {START_TIMEOUT_S} s:\n{logs()[-4000:]}"
            time.sleep(3)
        print(f"job {job_id} serving after {time.monotonic() - t0:.0f} s:\n{logs()}")
        urls = {name: f"http://{ip}:{port}" for name, ip in
                (("head", hosts.head_ip), ("prefill", hosts.ip("prefill")), ("decode", hosts.ip("decode")))}
        yield {"hosts": hosts, "env": env, "url": urls["head"], "urls": urls, "job": job, "logs": logs}
    finally:
        if job_id is not None and not job["stopped"]:
            try:
                ray_cli(["job", "stop", "--address", jobs, job_id], env, timeout=240)
            except Exception as e:  # noqa: BLE001 - the head's daemons are ended below regardless
                print(f"ray job stop failed: {e}")
        hosts.remove()
        # the head node's daemons and their children, and Ray's client server, whose command line names the head's
        # address but not its temp dir (it outlived an earlier version of this teardown)
        head = f"{hosts.head_ip}:{gcs_port}"
        end_processes_under(temp_dir)
        end_processes_under(head)
        subprocess.run(["rm", "-rf", temp_dir])
        for f in _shm() - shm_before:  # what the SIGKILLed decode node's engine left (its node is gone)
            try:
                os.unlink(f"/dev/shm/{f}")
            except FileNotFoundError:
                pass
        assert not processes_under(temp_dir) and not processes_under(head), "a process of the test cluster outlived it"


def prompts(n: int, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 1024) for _ in range(length)] for length in rng.sample(range(40, 600), n)]


def test_pools_on_their_own_nodes_with_nixl_over_tcp(nodes):
    """Each pool's engines run on the node its placement names, the state crosses the bridge (the decode node's
    interface receives at least the bytes NIXL read), every transfer is verified, and the answers are the model's."""
    hosts, env, url = nodes["hosts"], nodes["env"], nodes["url"]
    where = ask_ray(env, f"""
from actors.clients.engine_client import EngineClient
ips = {{n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}}
ids = ray.get(ray.get_actor("pd-coordinator", namespace="{NAMESPACE}").describe.remote())["engines"]
print(json.dumps({{e: ips[ray.get(EngineClient.named(e, "{NAMESPACE}").node_id())] for e in ids}}))
""")
    assert {e.split("-")[0]: ip for e, ip in where.items()} == {"prefill": hosts.ip("prefill"), "decode": hosts.ip("decode")}, where
    # cores as devices across nodes: each engine owns cores of its own node (PD_NODE_CORES there), one per TP rank,
    # and every thread of its vLLM processes runs on them
    owned = ask_ray(env, f"""
from actors.clients.engine_client import EngineClient
ids = ray.get(ray.get_actor("pd-coordinator", namespace="{NAMESPACE}").describe.remote())["engines"]
print(json.dumps({{e: [ray.get(EngineClient.named(e, "{NAMESPACE}").cores()),
                      ray.get(EngineClient.named(e, "{NAMESPACE}").pids())[1:]] for e in ids}}))
""")
    for engine_id, (cores, pids) in owned.items():
        role = engine_id.split("-")[0]
        assert tuple(cores) == parse_cores(NODE_CORES[role]), (engine_id, cores)  # TP 1: core 0; TP 2: cores 0, 1
        vllm = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).name().startswith("VLLM")]
        assert len(vllm) == (1 if role == "prefill" else 3), (engine_id, pids)  # EngineCore (+ a worker per rank)
        for pid in vllm:
            assert all(set(c) <= set(cores) for c in thread_affinities(pid).values()), (engine_id, pid)
    nodes["idle_free"] = ask_ray(env, FREE_BLOCKS)
    value = lambda name: float(metric(httpx.get(f"{url}/metrics", headers=AUTH).text, name))  # noqa: E731
    rx0, bytes0, verified0 = hosts.rx_bytes("decode"), value("pd_transfer_bytes_total"), value("pd_transfer_verified_total")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    batch = prompts(4)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                                                 logprobs=0, extra_body=IDS), batch))
    tokenizer_ids = [[int(t.removeprefix("token_id:")) for t in g.choices[0].logprobs.tokens] for g in got]
    read = value("pd_transfer_bytes_total") - bytes0
    rx = hosts.rx_bytes("decode") - rx0
    print(f"NIXL read {read:.0f} bytes; the decode node's {IFACE} received {rx} bytes")
    assert read > 0 and rx >= read, "the state did not cross the bridge"
    assert value("pd_transfer_verified_total") - verified0 == len(batch)
    assert tokenizer_ids == [oracle(p) for p in batch]
    # a front end on every node, each on its node's address, each a router of its own over the same engines
    answered = {}
    for name, node_url in nodes["urls"].items():
        health = httpx.get(f"{node_url}/health", timeout=10)
        assert health.status_code == 200, (name, health.text)
        answered[name] = health.json()["frontend"]
        assert httpx.get(f"{node_url}/v1/models", timeout=10).status_code == 401  # beyond loopback: the key is required
        out = openai.OpenAI(base_url=f"{node_url}/v1", api_key=API_KEY, max_retries=0, timeout=120).completions.create(
            model=MODEL, prompt=batch[1], max_tokens=12, temperature=0, logprobs=0, extra_body=IDS)
        assert [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens] == oracle(batch[1]), name
    print(f"front ends by node: {answered}")
    assert len(set(answered.values())) == len(nodes["urls"]), answered


def test_removing_the_decode_node_fails_no_request(nodes):
    """SIGKILL every process of the decode node with streams in flight: they finish on the prefill engine (degraded
    mode), token for token what they would have been; new requests are served; the prefill engine ends up holding
    nothing for the dead requests."""
    hosts, env, url = nodes["hosts"], nodes["env"], nodes["url"]
    idle = nodes.get("idle_free") or ask_ray(env, FREE_BLOCKS)
    batch = prompts(4, seed=12)
    want = [oracle(p, MAX_TOKENS) for p in batch]
    received = [0] * len(batch)

    def stream(i: int) -> list[int]:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        out = []
        for event in client.completions.create(model=MODEL, prompt=batch[i], max_tokens=MAX_TOKENS, temperature=0,
                                               logprobs=0, stream=True, extra_body=IDS):
            if event.choices and event.choices[0].logprobs:
                out += [int(t.removeprefix("token_id:")) for t in event.choices[0].logprobs.tokens]
                received[i] = len(out)
        return out

    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        futures = [pool.submit(stream, i) for i in range(len(batch))]
        wait_for(lambda: min(received) >= 4, 120)  # every stream is being decoded on the decode node
        assert max(received) < MAX_TOKENS, f"a stream ended before the node was removed: {received}"
        killed = hosts.kill_all("decode")
        t_kill = time.monotonic()
        print(f"decode node removed ({len(killed)} processes SIGKILLed) with {received} tokens streamed")
        got = [f.result(timeout=300) for f in futures]
    print(f"streams finished {time.monotonic() - t_kill:.1f} s after the node went")
    assert got == want
    took = wait_for(lambda: httpx.get(f"{url}/health").json().get("status") == "degraded", 120)
    health = httpx.get(f"{url}/health")
    print(f"/health degraded {took:.1f} s later: {health.status_code} {health.text}")
    assert health.status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    late = client.completions.create(model=MODEL, prompt=batch[0], max_tokens=12, temperature=0, logprobs=0,
                                      extra_body=IDS)
    assert [int(t.removeprefix("token_id:")) for t in late.choices[0].logprobs.tokens] == want[0][:12]
    assert float(metric(httpx.get(f"{url}/metrics", headers=AUTH).text, 'pd_degraded{role="prefill"}')) == 1
    # the decode node's front end went with it; the prefill node's serves on, and the launcher said so
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{nodes['urls']['decode']}/health", timeout=5)
    elsewhere = openai.OpenAI(base_url=f"{nodes['urls']['prefill']}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    out = elsewhere.completions.create(model=MODEL, prompt=batch[1], max_tokens=12, temperature=0, logprobs=0,
                                       extra_body=IDS)
    assert [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens] == want[1][:12]
    wait_for(lambda: "went with its node" in nodes["logs"](), 60)
    prefill = [e for e in idle if e.startswith("prefill")]
    wait_for(lambda: {e: ask_ray(env, FREE_BLOCKS).get(e) for e in prefill} == {e: idle[e] for e in prefill}, 30)


def test_ray_job_stop_ends_the_cluster(nodes):
    """`ray job stop`: the launcher's clean-up runs to its end (after a node's death too), no engine process is left
    on the nodes that are still up, and the HTTP endpoint is gone with the job."""
    hosts, env, job = nodes["hosts"], nodes["env"], nodes["job"]

    def engine_processes() -> list[psutil.Process]:
        found = []
        for pid in hosts.pids("prefill"):
            try:
                p = psutil.Process(pid)
                if "EngineActor" in " ".join(p.cmdline()) or p.name().startswith("VLLM"):
                    found.append(p)
            except psutil.Error:
                pass
        return found

    engines = engine_processes()
    assert engines, "the job's prefill engine should run on the prefill node"
    t0 = time.monotonic()
    ray_cli(["job", "stop", "--address", job["address"], job["id"]], env, timeout=240)
    job["stopped"] = True
    logs = nodes["logs"]()
    print(f"ray job stop returned after {time.monotonic() - t0:.0f} s; the launcher's last lines:\n{logs[-1500:]}")
    assert "stopping engines" in logs and "done" in logs.splitlines()[-1], logs[-2000:]
    _, alive = psutil.wait_procs(engines, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "engine processes outlived the job"
    for node_url in (nodes["urls"]["head"], nodes["urls"]["prefill"]):  # the job's HTTP front ends went with it
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{node_url}/v1/models", timeout=5)
