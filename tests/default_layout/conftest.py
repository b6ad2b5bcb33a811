"""One cluster for this folder's modules, started once as `make run` starts the embedded default (the same functions):
the default layout - a prefill and a decode pool of one TP 1 engine each, as Ray Serve deployments, each engine
owning a core - with vLLM's OpenAI front end over it. Set on it for test_http.py: an API key, a body limit, every
transfer verified, a tool-call parser. test_http.py runs first (pytest's order in a folder); test_own_cores.py ends
by SIGKILLing the decode engine (Serve replaces it)."""

from __future__ import annotations

import time

import pytest

from tests.default_layout.shared import KEY, MODEL


@pytest.fixture(scope="package")
def served(ray_local, gdn_model):
    from actors.engine.settings import free_port
    from cluster.cli.launch import serve, stop_cluster
    from cluster.core.config import DeployConfig

    cfg = DeployConfig.model_validate({
        "model": {"path": str(gdn_model), "name": MODEL},
        "coordinator": {"name": "coordinator-default-layout", "namespace": "pd-test-default-layout"},
        "http": {"port": free_port(), "api_key": KEY, "max_body_bytes": 65536},
        "transfer": {"verify": "all"},  # every request of the API's tests has its transferred bytes checked
        "chat": {"tool_call_parser": "hermes"},  # vLLM's front-end options pass through (test_tool_calls)
    })
    t0 = time.monotonic()
    cluster = serve(cfg, progress=print)
    try:
        print(f"cluster + HTTP up in {time.monotonic() - t0:.0f} s: {cluster.timings}")
        yield cluster
    finally:
        stop_cluster(cluster, shutdown_serve=True, progress=print)
