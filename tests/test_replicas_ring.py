"""The replica groups' data plane (nvrx_lab.replicas.ring, .group): sums over a ring of real processes and real
sockets, and what a failure does to them: a member that dies or is cut ends every member's wait at once."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from nvrx_lab.replicas.group import ReplicaGroup, StepAborted
from nvrx_lab.replicas.protocol import Quorum
from nvrx_lab.replicas.ring import Endpoint, open_store

SPAWN = mp.get_context("spawn")  # clean interpreters: a forked TCPStore client can hang on the parent's locks


def _member(replica: int, members: tuple[int, ...], port: int, numel: int, plan: str, out) -> None:
    torch.set_num_threads(1)
    endpoint = Endpoint("127.0.0.1", open_store("127.0.0.1", port, timeout=30), replica, 0)
    results = []
    for qid in (1, 2):  # two quorums of the same members: a new ring each
        group = ReplicaGroup(endpoint, Quorum(qid, qid, members, None), replica, 0).connect(timeout=30)
        flat = torch.arange(numel, dtype=torch.float32) * (replica + 1)
        if plan == "die" and replica == members[-1] and qid == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # the last member dies in the second quorum, before its part
        if plan == "hang" and replica == members[-1] and qid == 2:
            time.sleep(60)
        t0 = time.monotonic()
        try:
            group.all_reduce(flat, lambda: False, 0.2 if plan == "hang" else 60, group.cut)
            results.append(("sum", flat.tolist()))
        except StepAborted as e:
            results.append(("aborted", round(time.monotonic() - t0, 3), str(e)))
        group.close()
    out.put((replica, results))


def _run(members: tuple[int, ...], numel: int, plan: str = "sum", timeout: float = 60.0) -> dict[int, list]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=_member, args=(r, members, store.port, numel, plan, out), daemon=True) for r in members]
    for p in procs:
        p.start()
    try:
        expect = len(members) - (plan in ("die", "hang"))
        got = dict(out.get(timeout=timeout) for _ in range(expect))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("members,numel", [((0, 1), 1000), ((0, 2, 5), 7), ((1, 2, 3, 4), 100_003)])
def test_the_ring_sums_over_every_member_in_every_quorum(members, numel):
    got = _run(members, numel)
    want = (torch.arange(numel, dtype=torch.float32) * sum(r + 1 for r in members)).tolist()
    assert sorted(got) == sorted(members)
    assert all(res == [("sum", want), ("sum", want)] for res in got.values()), {r: [x[0] for x in v] for r, v in got.items()}


@pytest.mark.timeout(120)
def test_a_member_that_dies_ends_the_others_sum_at_once():
    got = _run((0, 1, 2), 300_000, "die")
    for replica, (first, second) in got.items():
        assert first[0] == "sum", first
        assert second[0] == "aborted" and second[1] < 5, (replica, second)  # its closed sockets, not a timeout


@pytest.mark.timeout(120)
def test_a_hung_member_is_cut_out_when_the_coordinator_says_so():
    """The hung member makes no progress; the others' patience runs out, and the cut (what the coordinator's abort
    does) ends their wait: neither waits for the hung one."""
    got = _run((0, 1, 2), 1000, "hang")
    assert sorted(got) == [0, 1]
    assert all(res[1][0] == "aborted" and res[1][1] < 5 for res in got.values()), got


@pytest.mark.timeout(60)
def test_a_cut_while_waiting_for_a_member_that_never_connects_ends_the_wait():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = Endpoint("127.0.0.1", open_store("127.0.0.1", store.port), 0, 0)
    store.set("ep/1/0", f"127.0.0.1:{endpoint.sock.getsockname()[1]}")  # replica 1 "listens", but never dials back
    group = ReplicaGroup(endpoint, Quorum(7, 3, (0, 1), None), 0, 0)
    threading.Timer(0.3, group.cut).start()
    t0 = time.monotonic()
    with pytest.raises(StepAborted, match="quorum 7: the members could not meet"):
        group.connect(timeout=30)
    assert time.monotonic() - t0 < 5
