"""The control plane: the coordinator actor (`coordinator`: registry, pair negotiation, health checks; started by
`start_coordinator`), the prefill and decode pools as Ray Serve deployments (`pool`) and their autoscaling policy
(`autoscale`). Imports from `actors.host`, `actors.clients` and `actors.engine`."""
