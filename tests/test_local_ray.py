"""`cluster.cli.local_ray.start_ray`: a local instance starts with the loopback settings in the environment its daemons
inherit, and the caller's environment comes back unchanged; joining a cluster sets none of them. (ray.init is a
stand-in that records what it was given: the live effect - every vLLM port on loopback - is checked in
tests/default_layout/test_http.py::test_the_engines_listen_on_loopback_only.)"""

from __future__ import annotations

import os

import pytest

from cluster.cli import local_ray


@pytest.fixture
def recorded(monkeypatch):
    import ray

    calls: list[tuple[dict, dict]] = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append((kw, dict(os.environ))))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for name in local_ray.LOOPBACK_ENV:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_a_local_instance_starts_on_loopback_and_gives_the_environment_back(recorded, monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "eth9")  # set by the user: theirs wins
    before = dict(os.environ)
    assert local_ray.start_ray("ns") is True
    (kwargs, env), = recorded
    assert (kwargs["address"], kwargs["num_cpus"], kwargs["include_dashboard"], kwargs["namespace"]) == (
        "local", local_ray.LOCAL_CPUS, False, "ns")
    assert (env["GLOO_SOCKET_IFNAME"], env["VLLM_HOST_IP"], env["UCX_NET_DEVICES"]) == ("lo", "127.0.0.1", "eth9")
    assert dict(os.environ) == before


def test_joining_a_cluster_sets_nothing(recorded):
    before = dict(os.environ)
    assert local_ray.start_ray("ns", address="10.0.0.1:6379") is False
    (kwargs, env), = recorded
    assert kwargs["address"] == "10.0.0.1:6379" and "num_cpus" not in kwargs
    assert env == before and not any(name in env for name in local_ray.LOOPBACK_ENV)
