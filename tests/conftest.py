"""Shared fixtures: one local Ray instance per test session, tiny models built on first use."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray instance as `make run` starts one (`cluster.cli.local_ray.start_ray`: 2 CPUs, no dashboard, on
    loopback); shut down at session end."""
    import ray

    from cluster.cli.local_ray import start_ray

    if not ray.is_initialized():
        start_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def gdn_model():
    """Path of the tiny Qwen3-Next (GDN) model under <repo>/models, built if missing or stale."""
    from cluster.cli.tiny_model import ensure_model

    return ensure_model("gdn")


# ---- skips in CI --------------------------------------------------------------------------------------------------
# A test that skips in CI tests nothing there while the run looks green. In CI (CI=true, as `.ci/run` runs) every skip
# fails the run, unless the test says why it may skip there: @pytest.mark.may_skip_in_ci("why").
_SKIPPED: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED.append((report.nodeid, reason))


def pytest_sessionfinish(session, exitstatus):
    import os

    if os.environ.get("CI", "").lower() not in ("1", "true", "yes") or exitstatus != 0:
        return
    allowed = {item.nodeid for item in session.items if item.get_closest_marker("may_skip_in_ci")}
    unexplained = [(nodeid, why) for nodeid, why in _SKIPPED if nodeid not in allowed]
    if unexplained:
        print("\nskipped in CI without a listed reason (mark the test may_skip_in_ci(\"why\") if it may):")
        for nodeid, why in unexplained:
            print(f"  {nodeid}: {why}")
        session.exitstatus = 1
