"""/health's verdict (`actors.frontend.health_report`) against a stand-in coordinator (a mock, for the race a
restarting coordinator makes - failing one question and answering the next - which the live test
tests/test_faults.py::test_coordinator_restart_rebuilds_the_registry meets only by chance): what requests are routed
on decides, never 503 while they are served."""

from __future__ import annotations

import asyncio

import pytest

from actors.frontend import health_report
from actors.router import Router


class Unavailable(Exception):
    """Stands for Ray's ActorUnavailableError: the coordinator is restarting."""


class _Call:
    def __init__(self, coordinator: "FakeCoordinator", name: str):
        self.coordinator, self.name = coordinator, name

    def remote(self, *args):
        return self.coordinator.answer(self.name, *args)


class FakeCoordinator:
    """Answers `ready(role)` and `routes()` from `ready` and `routes`; the calls named in `down` raise Unavailable."""

    def __init__(self, ready: dict[str, list[str]], routes: dict[str, list[str]]):
        self.ready_engines, self.route_map, self.down, self.asked = ready, routes, set(), []

    def __getattr__(self, name: str) -> _Call:
        return _Call(self, name)

    async def answer(self, name: str, *args):
        self.asked.append(name)
        if name in self.down:
            raise Unavailable(name)
        return self.ready_engines[args[0]] if name == "ready" else self.route_map


PAIRED = ({"prefill": ["prefill-0"], "decode": ["decode-0", "decode-1"]},
          {"prefill-0": ["decode-0", "decode-1"]})


def report(coordinator: FakeCoordinator) -> tuple[int, dict]:
    return asyncio.run(health_report(coordinator, Router(coordinator), "m", timeout_s=1))


def test_a_ready_pair_is_ok():
    assert report(FakeCoordinator(*PAIRED)) == (200, {"status": "ok", "model": "m",
                                                      "ready": {"prefill": 1, "decode": 2}})


def test_a_coordinator_back_between_the_two_questions_is_ok():
    """The first question fails (restarting), the router's answers (back): ok, and not "unreachable" (it answered)."""
    coordinator = FakeCoordinator(*PAIRED)
    coordinator.down = {"ready"}
    code, body = report(coordinator)
    assert (code, body["status"], body["ready"]) == (200, "ok", {"prefill": 1, "decode": 2}), body
    assert "coordinator" not in body
    assert coordinator.asked == ["ready", "routes"]


def test_a_dead_coordinator_with_last_routes_is_ok_and_says_so():
    coordinator = FakeCoordinator(*PAIRED)

    async def go():
        router = Router(coordinator)
        await router.routes()  # the routes a request was given before the coordinator died
        coordinator.down = {"ready", "routes"}
        return await health_report(coordinator, router, "m", timeout_s=1)

    code, body = asyncio.run(go())
    assert (code, body["status"], body["coordinator"]) == (200, "ok", "unreachable: serving on its last routes")


@pytest.mark.parametrize("down", [{"ready"}, {"ready", "routes"}])
def test_no_routes_and_no_answer_is_503(down):
    coordinator = FakeCoordinator(*PAIRED)
    coordinator.down = down
    coordinator.route_map = {"prefill-0": []}  # the router's answer, where it gets one: nothing paired
    assert report(coordinator) == (503, {"status": "unavailable", "model": "m", "error": "Unavailable"})


def test_one_pool_is_degraded_none_is_503():
    code, body = report(FakeCoordinator({"prefill": ["prefill-0"], "decode": []}, {"prefill-0": []}))
    assert (code, body["status"], body["serving"]) == (200, "degraded", "prefill engines decode")
    code, body = report(FakeCoordinator({"prefill": [], "decode": []}, {}))
    assert (code, body["status"]) == (503, "unavailable")
