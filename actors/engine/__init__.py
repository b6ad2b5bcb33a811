"""The engine actor and what runs in its processes: the actor (`actor.EngineActor`, made of `serving`, `pairs`,
`verify`, `load`, `procs`, with `settings`, `warmup`, `progress`, `prefix`, `report`), the KV connector and NIXL set-up
inside vLLM's workers (`connector`, `connector_ranks`, `nixl_setup`), the vLLM plugin, and the decode-output channel
(`decode_channel`: the engine's end and the front end's). Imports from `actors.host` and `actors.clients` (an
engine registers with the coordinator through `CoordinatorClient`)."""
