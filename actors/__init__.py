"""The Ray runtime of the cluster, one subpackage per part of it, each importing only from those before it here
(`tests/test_layers.py` enforces the order):

    host       what a node gives the cluster: its cores, leased to engines as devices, and lent while idle
    clients    the typed calls everything else reaches an engine (`EngineClient`) or the coordinator
               (`CoordinatorClient`) with: no other module calls their actors' methods
    engine     the engine actor and what runs in its processes: vLLM's engine, the KV connector and NIXL inside
               vLLM's workers, serving, pairs, transfer verification, the warm-up, its processes and files, and the
               decode-output channel (both ends)
    control    the control plane: the coordinator (registry, pair negotiation, health), the pools as Ray Serve
               deployments and their autoscaling
    frontend   the request path in the front end: vLLM's OpenAI server over the cluster, its ASGI layers and /health,
               the router (one `Request` through routing, prefill, transfer, decode and failover) and pair choice

Below all of them, the pure core (`cluster.core`); above, the entry points (`cluster.cli`)."""
