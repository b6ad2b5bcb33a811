"""Starting Ray: join a cluster (`RAY_ADDRESS`, as `ray job submit` sets it), or start a local one on loopback.

A local instance is one machine, so nothing it runs has to be reachable from elsewhere. While it starts, this
process's environment holds what keeps the listeners that vLLM, UCX and torch let a caller place on loopback there
(`LOOPBACK_ENV`); Ray's daemons, and so every actor and vLLM process they start, inherit it, and this process gets
its own environment back (what it starts later - another Ray cluster, a server - is not bound by it). A variable
already set wins (a pool's `env` wins over both). Ray's own servers (GCS, raylet, agents, each worker's gRPC port)
bind every interface whatever they are given (Ray turns even a node address of 127.0.0.1 into the machine's), and
are guarded by Ray's token authentication (docs/operations.md, Security).
"""

from __future__ import annotations

import os
from typing import Any

LOOPBACK_ENV = {
    "GLOO_SOCKET_IFNAME": "lo",  # torch.distributed's gloo devices (TP groups of an engine's ranks)
    "UCX_NET_DEVICES": "lo",  # UCX's TCP interfaces (NIXL's agents; same-host bytes move by shared memory anyway)
    "VLLM_HOST_IP": "127.0.0.1",  # the address vLLM gives its own processes' endpoints
}
LOCAL_CPUS = 2  # what a local instance offers: the test and CI machines' cores


def start_ray(namespace: str | None = None, address: str | None = None, **kwargs: Any) -> bool:
    """`ray.init` for this project: join `address` (default `RAY_ADDRESS`) when set; otherwise start a local
    instance (LOCAL_CPUS CPUs, no dashboard) on loopback. Returns whether it started a local instance."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    options: dict[str, Any] = {"log_to_driver": False, **({"namespace": namespace} if namespace else {})}
    if address:
        ray.init(address=address, **options, **kwargs)
        return False
    added = [name for name in LOOPBACK_ENV if name not in os.environ]
    os.environ.update({name: LOOPBACK_ENV[name] for name in added})
    try:
        # "local": a new instance, never one a `ray start` left running on this machine
        options.update(address="local", num_cpus=LOCAL_CPUS, include_dashboard=False)
        ray.init(**{**options, **kwargs})
    finally:
        for name in added:
            del os.environ[name]
    return True
