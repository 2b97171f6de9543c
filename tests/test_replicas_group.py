"""The replica groups' data plane (nvrx_lab.replicas.group, .heal) on torch's process groups: sums over real
processes (gloo here; NCCL on a GPU), in buckets of several dtypes, and what a failure does: a member that dies or
hangs ends every other member's wait at once, and the survivors' next group sums again. The heal moves a state of
hundreds of MB in chunks, in place, and refuses a state of another layout by name."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from nvrx_lab.replicas import group as group_module
from nvrx_lab.replicas.group import ReplicaGroup, StepAborted, open_store
from nvrx_lab.replicas.heal import CHUNK_BYTES, recv_state, send_state
from nvrx_lab.replicas.protocol import Quorum

SPAWN = mp.get_context("spawn")  # clean interpreters: a forked TCPStore client can hang on the parent's locks
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _buckets(replica: int, numel: int) -> list[torch.Tensor]:
    return [(torch.arange(numel) % 97).to(dt) * (replica + 1) for dt in DTYPES]


def _member(replica: int, members: tuple[int, ...], numel: int, plan: str, port: int, out) -> None:
    torch.set_num_threads(1)
    store = open_store("127.0.0.1", port, timeout=30)
    results, quorums = [], [Quorum(1, 1, members, None), Quorum(2, 1, members, None)]
    victim = members[-1]
    if plan in ("die", "hang"):  # the victim fails in the second quorum; the survivors meet in a third without it
        quorums.append(Quorum(3, 1, members[:-1], None))
    aborted = threading.Event()
    for q in quorums:
        if replica not in q.members:
            break
        group = ReplicaGroup(store, q, replica, 0, torch.device("cpu"), timeout_s=60).connect(aborted.is_set)
        tensors = _buckets(replica, numel)
        if q.qid == 2 and replica == victim and plan == "die":
            os.kill(os.getpid(), signal.SIGKILL)  # before its part
        if q.qid == 2 and replica == victim and plan == "hang":
            store.set("hung/2", "1")  # what the coordinator's probe would find: its work makes no progress
            time.sleep(60)
        # a healthy sum is never told off, however slow this box (patience: never); in the hang's quorum a survivor
        # past patience "tells the coordinator", which aborts the quorum once the victim is seen hung
        hang = q.qid == 2 and plan == "hang"
        patience, on_stuck = (0.3, lambda: _abort_once_hung(port, aborted)) if hang else (float("inf"), aborted.set)
        t0 = time.monotonic()
        try:
            group.all_reduce(tensors, aborted.is_set, patience, on_stuck)
            results.append(("sum", [t.double().sum().item() for t in tensors]))
        except StepAborted as e:
            results.append(("aborted", round(time.monotonic() - t0, 3), str(e)))
        aborted.clear()
        group.close()
    out.put((replica, results))


def _abort_once_hung(port: int, aborted: threading.Event) -> None:
    """The coordinator's side of a stuck report: it aborts the quorum once the member is seen hung (the victim's key),
    from a thread of its own, as the coordinator's word arrives on the client's reader thread."""
    def probe() -> None:
        open_store("127.0.0.1", port, timeout=30).wait(["hung/2"])
        aborted.set()

    threading.Thread(target=probe, daemon=True).start()


def _spawn(target, arg_lists: list[tuple], expect: int, timeout: float) -> list:
    """One clean process per argument tuple (the store's port and a result queue appended); ``expect`` results, then
    every process joined (killed if it lingers: a hung member)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=target, args=(*args, store.port, out), daemon=True) for args in arg_lists]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=timeout) for _ in range(expect)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def _run(members: tuple[int, ...], numel: int, plan: str = "sum", timeout: float = 90.0) -> dict[int, list]:
    expect = len(members) - (plan in ("die", "hang"))
    return dict(_spawn(_member, [(r, members, numel, plan) for r in members], expect, timeout))


def _want(members, numel) -> list[float]:
    return [sum(_buckets(r, numel)[i].double().sum().item() for r in members) for i in range(len(DTYPES))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("members,numel", [  # make test: the four members of odd ids and size; the rest: test-slow
    pytest.param((0, 1), 1000, marks=pytest.mark.slow), pytest.param((0, 2, 5), 7, marks=pytest.mark.slow),
    ((1, 2, 3, 4), 100_003)])
def test_a_quorums_group_sums_buckets_of_every_dtype_over_every_member(members, numel):
    got = _run(members, numel)
    assert sorted(got) == sorted(members)
    want = _want(members, numel)
    for res in got.values():
        assert [r[0] for r in res] == ["sum", "sum"], res
        assert all(r[1] == pytest.approx(want, rel=1e-2) for r in res), (res, want)  # bf16 rounds


class _ShrinkingBackend:
    """What the survivors' group needs of NCCL's backend to shrink (``supports_shrinking``, ``shrink``, ``abort``),
    recorded: this box has no NCCL, and gloo cannot shrink."""

    supports_shrinking = True

    def __init__(self, size: int):
        self.size, self.calls = size, []

    def shrink(self, excluded, flags, opts):
        self.calls.append(("shrink", excluded, flags))
        return _ShrinkingBackend(self.size - len(excluded))

    def abort(self):
        self.calls.append(("abort",))


def test_the_survivors_shrink_a_group_that_can_and_make_a_new_one_for_a_joiner():
    """Replica 2 of 0-3 lost: the survivors' group is the old one shrunk without its index (``SHRINK_ABORT``: its
    pending operations end first), which is aborted only then, never at the coordinator's word; a joiner, or gloo,
    means a new group."""
    old = ReplicaGroup(dist.HashStore(), Quorum(1, 1, (0, 1, 2, 3), None), 1, 0, torch.device("cpu"))
    old.pg = backend = _ShrinkingBackend(4)
    old.cut()
    old._abort()  # the coordinator's word: the wait ends, the communicator is kept for the shrink
    assert backend.calls == []
    survivors, joined = Quorum(2, 1, (0, 1, 3), None), Quorum(2, 1, (0, 1, 3, 4), None, joiners=(4,))
    assert old.can_shrink(survivors) and not old.can_shrink(joined)
    new = old.shrink(survivors, 1).ready(lambda: False)
    assert backend.calls == [("shrink", [2], group_module.SHRINK_ABORT), ("abort",)] and old.pg is None
    assert (new.qid, new.index, new.size, new.pg.size) == (2, 1, 3, 3)
    gloo = ReplicaGroup(dist.HashStore(), Quorum(1, 1, (0, 1), None), 0, 0, torch.device("cpu"))
    gloo.pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, __import__("datetime").timedelta(seconds=5))
    assert not gloo.can_shrink(Quorum(2, 1, (0,), None))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plan", ["die", "hang"])
def test_a_member_that_dies_or_hangs_ends_the_others_sum_and_the_survivors_sum_again(plan):
    """A death closes the victim's connections (gloo fails the sum at once); a hang is ended by the coordinator's
    abort, once a survivor past its patience (0.3 s here) reported it and the victim is seen hung. Either way the
    survivors' next group sums without the victim."""
    members = (0, 1, 2)
    got = _run(members, 300_000, plan)
    assert sorted(got) == [0, 1]
    for replica, (first, second, third) in got.items():
        assert first[0] == "sum", first
        assert second[0] == "aborted" and second[1] < 5, (replica, second)
        assert third == ("sum", pytest.approx(_want((0, 1), 300_000), rel=1e-2)), (replica, third)


@pytest.mark.timeout(60)
def test_an_abort_while_waiting_for_a_member_that_never_comes_ends_the_wait():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = ReplicaGroup(open_store("127.0.0.1", store.port), Quorum(7, 3, (0, 1), None), 0, 0, torch.device("cpu"))
    aborted = threading.Event()
    threading.Timer(0.3, aborted.set).start()
    t0 = time.monotonic()
    with pytest.raises(StepAborted, match="quorum 7: the members could not meet was aborted by the coordinator"):
        group.connect(aborted.is_set)
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(60)
def test_the_data_planes_timeout_ends_a_wait_nothing_else_ends_and_names_its_flag():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = ReplicaGroup(open_store("127.0.0.1", store.port), Quorum(8, 3, (0, 1), None), 0, 0, torch.device("cpu"),
                         timeout_s=0.5)
    with pytest.raises(StepAborted, match=r"longer than the data plane's timeout \(0 s, --replica-timeout\)|"
                                          r"longer than the data plane's timeout \(1 s, --replica-timeout\)"):
        group.connect(lambda: False)


def _state(seed: int, mb: int, layers: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    per = (mb << 20) // layers // 4
    return {"model": {f"w{i}": torch.randn(per, generator=g) for i in range(layers)},
            "optim": {"state": {0: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(33, generator=g)
                                    .to(torch.bfloat16)}}, "param_groups": [{"lr": 0.1 * seed}]},
            "step": seed}


def _heal_member(index: int, mb: int, layers: int, port: int, out) -> None:
    torch.set_num_threads(1)
    store = open_store("127.0.0.1", port, timeout=60)
    group = ReplicaGroup(store, Quorum(5, 4, (0, 1), None, 0, (1,)), index, 0, torch.device("cpu")).connect(lambda: False)
    chunks = []
    if index == 0:
        sent = send_state(group, [1], _state(1, mb), lambda: False, lambda: chunks.append(1))
        group.close()  # the heal's group is left behind only while an operation of it is pending: none is
        out.put((index, sent, len(chunks), None, len(group_module._abandoned)))
        return
    mine = _state(2, mb, layers)
    ids = {k: t.data_ptr() for k, t in mine["model"].items()}
    t0 = time.monotonic()
    try:
        got = recv_state(group, 0, mine, lambda: False, lambda: chunks.append(1))
    except ValueError as e:
        out.put((index, None, len(chunks), str(e), None))
        return
    want = _state(1, mb)
    same = all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
    in_place = {k: t.data_ptr() for k, t in got["model"].items()} == ids
    plain = got["step"] == 1 and got["optim"]["param_groups"] == [{"lr": 0.1}]
    optim = torch.equal(got["optim"]["state"]["0"]["exp_avg"], want["optim"]["state"][0]["exp_avg"])
    group.close()
    out.put((index, (same, in_place, plain, optim, round(time.monotonic() - t0, 2)), len(chunks), None,
             len(group_module._abandoned)))


def _heal(mb: int, joiner_layers: int = 4) -> dict:
    args = [(i, mb, 4 if i == 0 else joiner_layers) for i in (0, 1)]
    return {i: rest for i, *rest in _spawn(_heal_member, args, 2 if joiner_layers == 4 else 1, 150)}


@pytest.mark.timeout(240)
def test_a_heal_of_512_mb_moves_in_chunks_into_the_joiners_own_tensors():
    got = _heal(512)
    sent, sender_chunks, _, sender_left = got[0]
    (same, in_place, plain, optim, seconds), chunks, error, joiner_left = got[1]
    assert error is None and same and in_place and plain and optim, got[1]
    assert sender_left == joiner_left == 0, "a finished heal's group was kept as if an operation were pending"
    assert sent >= 512 << 20 and sender_chunks == chunks >= (512 << 20) // CHUNK_BYTES, (sent, chunks)


@pytest.mark.timeout(120)
def test_a_heal_into_another_layout_is_refused_by_name():
    got = _heal(8, joiner_layers=3)
    _, chunks, error, _ = got[1]
    assert error is not None and "another layout than this rank's" in error and chunks == 0, error


@pytest.mark.timeout(200)
def test_gpuchecks_replica_abort_runs_its_three_members_on_gloo_here():
    """``gpucheck``'s check f, the script a lent GPU runs, on the CPU: a hung member's sum aborted past patience,
    the survivors' new group sums without it (gloo cannot shrink: "made")."""
    from nvrx_lab.gpucheck.replicas import check_replica_abort

    ok, figures, problems, lines = check_replica_abort(150, "cpu")
    assert ok, (problems, lines)
    assert "survivors' group made" in figures and "sums 6, 3 (gloo)" in figures, figures
