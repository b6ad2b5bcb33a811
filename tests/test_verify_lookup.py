"""transfer.verify's lookup of the prefill engine (`EnginePairs.prefill_checksums`): asked of the coordinator once
and kept, so that checks go on while the coordinator restarts; dropped when a call to it fails or its pair goes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from actors.coordinator_client import CoordinatorClient
from actors.engine_pairs import EnginePairs
from actors.engine_procs import LiveEngine


class Prefill:
    def __init__(self, fail: bool = False):
        self.fail, self.calls = fail, 0

    async def checksums(self, items):
        self.calls += 1
        if self.fail:
            raise RuntimeError("engine gone")
        return {i: 7 for i in range(len(items))}


def engine(coordinator) -> EnginePairs:
    """A decode engine's pairs component (no vLLM engine started) registered with `coordinator`."""
    e = EnginePairs("decode-0", "decode", "m", "/nowhere", None, LiveEngine(), draining=lambda: False,
                    leftovers=lambda: None)
    e.coordinator = coordinator
    return e


def coordinator(answers: list):
    async def client(engine_id):
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return CoordinatorClient(SimpleNamespace(client=SimpleNamespace(remote=client)))  # a stand-in actor handle


def test_checks_go_on_while_the_coordinator_does_not_answer():
    p = Prefill()
    e = engine(coordinator([p, RuntimeError("coordinator restarting")]))
    assert asyncio.run(e.prefill_checksums("p0", [(0, 0, [0], [8])])) == {0: 7}
    assert asyncio.run(e.prefill_checksums("p0", [(0, 0, [0], [8])] * 2)) == {0: 7, 1: 7}  # no second question
    assert p.calls == 2


def test_a_failing_client_is_asked_for_again_and_a_removed_pair_forgotten():
    bad, good = Prefill(fail=True), Prefill()
    e = engine(coordinator([bad, good, good]))
    with pytest.raises(RuntimeError, match="engine gone"):
        asyncio.run(e.prefill_checksums("p0", [(0, 0, [0], [8])]))
    assert asyncio.run(e.prefill_checksums("p0", [(0, 0, [0], [8])])) == {0: 7}
    asyncio.run(e.remove_pair("p0"))  # its pair goes (no engine started: nothing to tell the workers)
    assert "p0" not in e._prefill_clients
    with pytest.raises(RuntimeError, match="has left"):
        asyncio.run(engine(coordinator([None])).prefill_checksums("p1", []))
