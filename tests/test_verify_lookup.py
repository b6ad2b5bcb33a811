"""transfer.verify's lookup of the prefill engine (`EnginePairs.prefill_checksums`): asked of the coordinator once
and kept, so that checks go on while the coordinator restarts; dropped when a call to it fails or its pair goes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from actors.clients.coordinator_client import CoordinatorClient
from actors.engine.pairs import EnginePairs
from actors.engine.procs import LiveEngine


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


class SlowPrefill(Prefill):
    """A prefill engine whose checksums answer after `answer_after_s` (a long step), judged `verdicts` meanwhile:
    None while busy (`EngineClient.stuck`), a verdict once stuck."""

    def __init__(self, answer_after_s: float, verdicts: list):
        super().__init__()
        self.answer_after_s, self.verdicts, self.asked = answer_after_s, verdicts, 0

    async def checksums(self, items):
        await asyncio.sleep(self.answer_after_s)
        return await super().checksums(items)

    async def stuck(self, timeout_s):
        self.asked += 1
        return self.verdicts.pop(0) if self.verdicts else None


def test_a_busy_prefill_engine_is_waited_for_and_the_workers_told(monkeypatch):
    """Checksums from a prefill engine in a long step come after the patience (10 s in the product): its verdict is
    asked each time the patience runs out, it is busy (not stuck), so the check waits for the answer - telling the
    decode workers the check goes on - rather than failing as "could not be checked"."""
    import actors.engine.pairs as ep

    monkeypatch.setattr(ep, "CHECKSUM_PATIENCE_S", 0.1)
    p = SlowPrefill(0.35, verdicts=[])
    told = []

    async def still_checking():
        told.append(1)

    e = engine(coordinator([p]))
    assert asyncio.run(e.prefill_checksums("p0", [(0, 0, [0], [8])], still_checking)) == {0: 7}
    assert p.asked >= 2 and len(told) == p.asked


def test_a_stuck_prefill_engine_fails_the_check_naming_why(monkeypatch):
    """The same wait ends as soon as the engine's verdict says stuck: the check fails with its reason."""
    import actors.engine.pairs as ep
    from actors.clients.engine_client import Verdict

    monkeypatch.setattr(ep, "CHECKSUM_PATIENCE_S", 0.1)
    stuck = Verdict("failed", "unhealthy (stuck: its EngineCore has not answered between steps for 12 s)")
    p = SlowPrefill(30, verdicts=[None, stuck])
    e = engine(coordinator([p]))
    with pytest.raises(RuntimeError, match="prefill engine p0 is unhealthy .stuck"):
        asyncio.run(asyncio.wait_for(e.prefill_checksums("p0", [(0, 0, [0], [8])]), 5))
    assert p.asked == 2 and "p0" not in e._prefill_clients


def test_the_workers_keep_waiting_for_a_check_still_under_way():
    """Decode workers fail a verified read whose verdict has not come within VERIFY_TIMEOUT_S (never a pass without
    a check); a check the actor says is still under way (its prefill engine busy) starts that timeout again."""
    import time

    from actors.engine.connector import PlannedPullWorker
    from cluster.core.verify import VERIFY_TIMEOUT_S

    def worker() -> PlannedPullWorker:
        w = PlannedPullWorker.__new__(PlannedPullWorker)  # the verify bookkeeping only: no vLLM, no NIXL
        w.engine_id, w.tp_rank, w.kv_caches_base_addr = "decode-0", 0, {"decode-0": {0: [0]}}
        w._pd_verify_reads, w._pd_verify_ready = {}, {}
        w._pd_verify_passed, w._pd_verify_failed = set(), set()
        w.failed = []
        w._handle_failed_transfer = lambda req_id, *_, **__: w.failed.append(req_id)
        now = time.perf_counter()
        w._pd_verify_waiting = {"r1": {"since": now - VERIFY_TIMEOUT_S + 1}}
        return w

    told, untold = worker(), worker()
    told.pd_verify_done({}, ["r1"])  # the actor: still checking r1
    later = time.perf_counter() + 5
    for w in (told, untold):
        w._pd_verify_step(set(), set(), later)
    assert untold.failed == ["r1"] and told.failed == [] and "r1" in told._pd_verify_waiting
    told.pd_verify_done({"r1": True})
    assert "r1" in told._pd_verify_passed and not told._pd_verify_waiting


def test_a_busy_prefill_engines_check_holds_up_no_other():
    """A decode engine's verify loop checks each prefill engine's requests on their own: while one prefill engine
    is in a long step (its checksums late), requests read from another get their verdicts at once, and reads that land
    meanwhile are still collected (they would time out in the workers otherwise)."""
    from actors.engine.verify import EngineVerify
    from cluster.core.metrics import TransferTotals

    def entry(req_id: str, prefill: str) -> dict:
        return {"req_id": req_id, "prefill_engine": prefill, "remote_request_id": f"r-{req_id}",
                "checks": [(0, 0, [0], [8], 7)]}

    class Ranks:
        def __init__(self):
            self.polls = [[entry("slow", "p-busy")], [entry("fast", "p-ok")], [entry("later", "p-ok")]]
            self.done: list[tuple[float, dict, list]] = []
            self.t0 = 0.0

        async def verify_poll(self):
            return [{"ready": self.polls.pop(0) if self.polls else [], "pending": bool(self.polls)}]

        async def verify_done(self, verdicts, checking=()):
            self.done.append((asyncio.get_running_loop().time() - self.t0, dict(verdicts), list(checking)))

    async def checksums(prefill_id, items, still_checking):
        if prefill_id == "p-busy":
            await asyncio.sleep(0.5)
            await still_checking()
        return {i: 7 for i in range(len(items))}

    async def run():
        ranks = Ranks()
        ranks.t0 = asyncio.get_running_loop().time()
        v = EngineVerify("decode-0", 1, ranks, LiveEngine(), TransferTotals(), checksums)
        v._expected |= {"r-slow", "r-fast", "r-later"}
        v._watch(None)
        await asyncio.wait_for(v._task, 5)
        await asyncio.gather(*v._checks)
        return ranks.done

    done = asyncio.run(run())
    when = {req: t for t, verdicts, _ in done for req in verdicts}
    assert set(when) == {"slow", "fast", "later"} and all(ok for _, verdicts, _ in done for ok in verdicts.values())
    assert when["fast"] < 0.2 and when["later"] < 0.2 and when["slow"] >= 0.5, when
    assert any(checking == ["slow"] for _, _, checking in done)  # the workers were told its check goes on
