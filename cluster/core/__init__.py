"""The pure core: model shapes and layouts, the planner, the registry, the deploy config, the wire format. No Ray,
no vLLM engine; everything above (`actors/`, then `cluster/`'s entry points) imports from here, never the reverse."""
