"""The typed calls that reach the cluster's two kinds of actor: an engine (`engine_client.EngineClient`) and the
coordinator (`coordinator_client.CoordinatorClient`). No other module calls those actors' methods
(`tests/test_layers.py`). Imports from `actors.host` only."""
