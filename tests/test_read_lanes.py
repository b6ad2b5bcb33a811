"""Read lanes: one NIXL READ run on several UCX threads (actors/engine/nixl_setup.py `install_read_lanes`), its
descriptors laid out by `cluster.core.planner.lane_rows` so that every thread copies an equal share.

Pure parts: `lane_rows` moves exactly the bytes it is given (every source byte to the same destination, once), in a
multiple of `lanes` rows whose consecutive runs carry equal bytes; `rank_cores` reads a rank's cores from vLLM's
binding; `read_lanes` refuses a bad PD_NIXL_READ_LANES. Real NIXL: two processes, a READ laid out for two lanes with a
notification, every byte compared (and the comparison shown to see a dropped piece)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from cluster.core.cores import CoreSpecError, rank_cores
from cluster.core.planner import LANE_ALIGN, LANE_MIN_BYTES, LANE_MIN_ROWS, LANE_PIECES, lane_rows, lane_run_bytes

NBYTES = 24 << 20
READS = 10  # of the lanes layout, in the real-NIXL test


def _rows(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    """n disjoint (remote, local, bytes) rows with random sizes in [lo, hi), in a random order."""
    sizes = rng.integers(lo, hi, n)
    gaps = rng.integers(0, 4096, n)
    local = (1 << 32) + np.cumsum(np.r_[0, (sizes + gaps)[:-1]])
    remote = (5 << 32) + rng.permutation(n) * int(hi + 4096)
    order = rng.permutation(n)
    return np.stack([remote[order], local[order], sizes[order]], axis=1).astype(np.uint64)


def _byte_map(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """The rows as maximal (local start, local end, remote - local) runs: equal for two layouts that move the same bytes
    to the same places."""
    spans = sorted((int(l), int(l + n), int(r) - int(l)) for r, l, n in rows.tolist() if n)
    merged: list[list[int]] = []
    for start, end, shift in spans:
        if merged and merged[-1][1] == start and merged[-1][2] == shift:
            merged[-1][1] = end
        else:
            assert not merged or start >= merged[-1][1], "two rows write the same bytes"
            merged.append([start, end, shift])
    return [tuple(m) for m in merged]


@pytest.mark.parametrize("lanes", [2, 3, 4])
@pytest.mark.parametrize("shape", ["few large", "many small", "one huge", "mixed"])
def test_lane_rows_move_the_same_bytes_in_equal_shares(lanes: int, shape: str) -> None:
    rng = np.random.default_rng(lanes * 100 + len(shape))
    rows = {
        "few large": lambda: _rows(rng, 5, 1 << 20, 8 << 20),
        "many small": lambda: _rows(rng, 600, 512, 16 << 10),
        "one huge": lambda: _rows(rng, 1, 40 << 20, (40 << 20) + 1),
        "mixed": lambda: np.concatenate([_rows(rng, 3, 4 << 20, 12 << 20), _rows(rng, 200, 256, 4096)]),
    }[shape]()
    if shape == "mixed":  # two generators: make the local ranges disjoint again
        rows[3:, 1] += np.uint64(1 << 31)
    out = lane_rows(rows, lanes)
    assert _byte_map(out) == _byte_map(rows)
    assert int(out[:, 2].sum()) == int(rows[:, 2].sum())
    n = len(out)
    assert n % lanes == 0 and n >= lanes * LANE_MIN_ROWS
    shares = lane_run_bytes(out, lanes)
    assert len(shares) == lanes
    total = sum(shares)
    # NIXL gives thread i the rows [i n/lanes, (i+1) n/lanes): each run within one piece (<= total/(lanes x
    # LANE_PIECES), rounded to a cache line) of an equal share
    slack = total / (lanes * LANE_PIECES) + LANE_ALIGN
    assert max(shares) - min(shares) <= slack, shares
    # the cuts fall on cache lines: every piece starts a multiple of LANE_ALIGN bytes into the row it was cut from
    by_start = rows[np.argsort(rows[:, 1])]
    src = np.searchsorted(by_start[:, 1], out[:, 1], side="right") - 1
    assert np.all((out[:, 1] - by_start[src, 1]) % LANE_ALIGN == 0)


def test_which_reads_are_laid_out() -> None:
    rng = np.random.default_rng(3)
    few = _rows(rng, LANE_MIN_ROWS - 1, 512, 4096)  # NIXL posts it unsplit from the calling thread: left alone
    assert lane_rows(few, 2) is few
    large = _rows(rng, 20, 1 << 20, 2 << 20)
    assert lane_rows(large, 1) is large
    assert len(lane_rows(large[:0], 4)) == 0
    # NIXL splits any READ of LANE_MIN_ROWS descriptors or more: a small one is dealt evenly all the same
    small = _rows(rng, 21, 512, 4096)
    assert int(small[:, 2].sum()) < LANE_MIN_BYTES
    out = lane_rows(small, 2)
    assert _byte_map(out) == _byte_map(small) and len(out) % 2 == 0 and len(out) >= 2 * LANE_MIN_ROWS
    # empty rows are dropped; rows of a cache line or less are never cut
    with_empty = small.copy()
    with_empty[::5, 2] = 0
    out = lane_rows(with_empty, 2)
    assert _byte_map(out) == _byte_map(with_empty) and np.all(out[:, 2] > 0)
    assert lane_rows(with_empty * 0, 2) is not None
    tiny = _rows(rng, 9, 1, 65)  # 9 rows that cannot be cut into 16: left as planned
    assert lane_rows(tiny, 2) is tiny
    lines = _rows(rng, 9, 100, 129)  # rows of two cache lines: cut on them
    out = lane_rows(lines, 2)
    assert len(out) % 2 == 0 and len(out) >= 2 * LANE_MIN_ROWS and _byte_map(out) == _byte_map(lines) and np.all(out[:, 2] > 0)


def test_rank_cores_follow_vllms_binding() -> None:
    assert rank_cores("0-1", 0) == (0, 1)
    assert rank_cores("0|1", 1) == (1,)
    assert rank_cores("4-5|6-7", 1) == (6, 7)
    assert rank_cores("2-3", 3) == (2, 3)  # one list serves every rank
    assert rank_cores("auto", 0) is None and rank_cores("", 0) is None and rank_cores("nobind", 1) is None
    with pytest.raises(CoreSpecError):
        rank_cores("0-x", 0)


def test_read_lanes_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from actors.engine.nixl_setup import MAX_READ_LANES, READ_LANES_ENV, read_lanes

    monkeypatch.setenv(READ_LANES_ENV, "3")
    assert read_lanes() == min(3, MAX_READ_LANES)
    monkeypatch.setenv(READ_LANES_ENV, "64")
    assert read_lanes() == MAX_READ_LANES
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(READ_LANES_ENV, bad)
        with pytest.raises(ValueError, match=READ_LANES_ENV):
            read_lanes()
    monkeypatch.delenv(READ_LANES_ENV)
    assert read_lanes() == min(len(os.sched_getaffinity(0)), MAX_READ_LANES)


# ---- real NIXL: a READ split over two UCX threads -----------------------------------------------------------------
def _agent(name: str, lanes: int):
    os.environ["PD_NIXL_READ_LANES"] = str(lanes)
    from actors.engine.nixl_setup import install_progress_delay, install_read_lanes

    install_progress_delay()
    install_read_lanes()  # as actors/engine/connector.py does before vLLM creates its agents
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _target(to_initiator, from_initiator, results) -> None:
    src = np.random.default_rng(7).integers(0, 256, NBYTES, dtype=np.uint8)
    agent = _agent("lanes-target", 1)
    agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    to_initiator.put((agent.get_agent_metadata(), src.ctypes.data))
    want = from_initiator.get()  # how many notifications the initiator's READs sent
    got: list[str] = []
    deadline = time.monotonic() + 30
    while len(got) < want and time.monotonic() < deadline:  # the progress thread files them as they arrive
        got += [m.decode() for msgs in agent.get_new_notifs().values() for m in msgs]
        time.sleep(0.01)
    results.put(sorted(got))


def _cpu_ns(tid: str) -> int:
    """CPU time thread `tid` of this process has run (ns)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except OSError:  # ended
        return 0


def _initiator(to_initiator, from_initiator, results) -> None:
    from actors.engine.nixl_setup import agent_read_lanes

    meta, base = to_initiator.get()
    expected = np.random.default_rng(7).integers(0, 256, NBYTES, dtype=np.uint8)
    # the threads an agent starts without lanes (its progress thread; the first agent also starts UCX's own)
    one_lane = [_agent("one-lane-a", 1)]
    threads = [len(os.listdir("/proc/self/task"))]
    one_lane.append(_agent("one-lane-b", 1))
    threads.append(len(os.listdir("/proc/self/task")))
    before = set(os.listdir("/proc/self/task"))
    agent = _agent("lanes-initiator", 2)
    threads.append(len(os.listdir("/proc/self/task")))
    own = set(os.listdir("/proc/self/task")) - before  # the lanes agent's threads
    ucx_threads = (threads[2] - threads[1]) - (threads[1] - threads[0])  # the lanes' own threads
    dst = np.zeros(NBYTES, np.uint8)
    agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(meta)
    # a request's READ as the planner shapes one: a few long runs (attention blocks) and many short slices (state)
    rng = np.random.default_rng(11)
    sizes = np.r_[rng.integers(1 << 20, 4 << 20, 4), rng.integers(64, 8192, 150)]
    offsets = np.cumsum(np.r_[0, (sizes + 4096)[:-1]])
    assert offsets[-1] + sizes[-1] < NBYTES
    remote_off = rng.permutation(offsets)  # remote ranges elsewhere than the local ones, same sizes
    order = np.argsort(remote_off)
    remote_off = np.cumsum(np.r_[0, (sizes[order] + 512)[:-1]])[np.argsort(order)]
    rows = np.stack([base + remote_off, dst.ctypes.data + offsets, sizes], axis=1).astype(np.uint64)
    laid = lane_rows(rows, agent_read_lanes(agent))
    want = np.zeros(NBYTES, np.uint8)
    for r, l, n in rows.tolist():
        want[l - dst.ctypes.data:l - dst.ctypes.data + n] = expected[r - base:r - base + n]
    outcomes, sent = {}, 0
    cpu0 = {t: _cpu_ns(t) for t in own}
    for label, use, reps in (("lanes", laid, READS), ("a piece dropped", laid[:-1], 1)):
        zeros = np.zeros((len(use), 1), np.uint64)
        local = agent.get_xfer_descs(np.hstack([use[:, 1:2], use[:, 2:3], zeros]), "DRAM")
        remote = agent.get_xfer_descs(np.hstack([use[:, 0:1], use[:, 2:3], zeros]), "DRAM")
        equal = []
        for i in range(reps):
            dst[:] = 0
            handle = agent.initialize_xfer("READ", local, remote, peer, f"{label} {i}".encode())
            state, t0 = agent.transfer(handle), time.monotonic()
            while state not in ("DONE", "ERR") and time.monotonic() - t0 < 30:
                state = agent.check_xfer_state(handle)
                time.sleep(0.001)
            agent.release_xfer_handle(handle)
            sent += 1
            equal.append(state == "DONE" and bool(np.array_equal(dst, want)))
        outcomes[label] = {"equal": equal, "moved": int(np.count_nonzero(dst != 0))}
        if label == "lanes":  # CPU time of the lanes agent's threads over its READs, most first (ms)
            lane_ms = sorted(((_cpu_ns(t) - cpu0[t]) / 1e6 for t in own), reverse=True)
    del one_lane
    results.put({"lanes": agent_read_lanes(agent), "rows": len(rows), "laid": len(laid), "ucx_threads": ucx_threads,
                 "lane_ms": lane_ms, "bytes": int(rows[:, 2].sum()), "outcomes": outcomes})
    from_initiator.put(sent)


def test_a_read_split_over_two_ucx_threads_moves_every_byte() -> None:
    ctx = mp.get_context("spawn")
    to_initiator, from_initiator, results, notifs = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    target = ctx.Process(target=_target, args=(to_initiator, from_initiator, notifs), daemon=True)
    initiator = ctx.Process(target=_initiator, args=(to_initiator, from_initiator, results), daemon=True)
    target.start()
    initiator.start()
    try:
        got = results.get(timeout=180)
        delivered = notifs.get(timeout=30)
    finally:
        for p in (initiator, target):
            p.join(5)
            if p.is_alive():
                p.kill()
    assert got["lanes"] == 2
    assert got["ucx_threads"] >= 2, f"NIXL started {got['ucx_threads']} more threads for a 2-lane UCX backend than for one"
    assert got["laid"] % 2 == 0 and got["laid"] >= 2 * LANE_MIN_ROWS and got["laid"] != got["rows"]
    ok = got["outcomes"]["lanes"]
    assert all(ok["equal"]) and len(ok["equal"]) == READS, ok
    # the READ ran on the lanes: two of the agent's threads each copied for a while (its READs moved
    # READS x ~10 MiB; a kernel copy runs at ~6 GB/s a thread: ~8 ms apiece when shared evenly)
    assert got["lane_ms"][1] >= 1.0, f"CPU ms of the lanes agent's threads over its READs: {got['lane_ms']}"
    # the oracle sees every piece: the same READ less its last piece leaves bytes unread
    broken = got["outcomes"]["a piece dropped"]
    assert broken["equal"] == [False] and broken["moved"] < ok["moved"], broken
    # one notification per READ, sent by NIXL when all of its threads' runs are done
    assert delivered == sorted([f"lanes {i}" for i in range(READS)] + ["a piece dropped 0"])
