"""Shared fixtures: one local Ray instance per test session, tiny models built on first use."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray instance sized like the test machines (2 CPUs, no dashboard); shut down at session end."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def gdn_model():
    """Path of the tiny Qwen3-Next (GDN) model under <repo>/models, built if missing or stale."""
    from cluster.core.models import ensure_model

    return ensure_model("gdn")
