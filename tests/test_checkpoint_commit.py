"""The commit protocol's cost: every filesystem metadata operation and store operation of one save, counted.

Simulated ranks (threads) run the real write path (:func:`write_shards`, the writer's function) and
post on a :class:`StoreBoard` over a real ``TCPStore``; rank 0 runs the real :func:`commit_ready`.
A save of N ranks costs at most N + 10 metadata operations in all, a training step with a save
pending costs one store operation and no filesystem operation, and a step without one costs nothing.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from nvrx_lab.checkpoint import CheckpointWriteError, KeepLast, committed_steps, step_dir, verify
from nvrx_lab.checkpoint import commit as cm
from nvrx_lab.checkpoint.completion import LocalBoard, StoreBoard, done_entry, error_entry, write_results
from nvrx_lab.checkpoint.planning import plan_ranks
from nvrx_lab.checkpoint.shards import write_shards

META_EVENTS = {"open", "os.rename", "os.remove", "os.mkdir", "os.rmdir", "os.scandir", "os.listdir"}
_counting: dict = {"root": None, "ops": []}
_lock = threading.Lock()


def _note(event: str, path) -> None:
    """Count ``path`` if it is under the root, or relative to a directory fd (shutil.rmtree's way)."""
    root = _counting["root"]
    if root is None or path is None:
        return
    try:
        name = str(path) if isinstance(path, int) else os.fsdecode(os.fspath(path))
    except TypeError:
        return
    if name.startswith(root) or not name.startswith("/"):
        with _lock:
            _counting["ops"].append((event, name))


sys.addaudithook(lambda event, args: _note(event, args[0]) if event in META_EVENTS and args else None)


@contextmanager
def fs_ops(root: Path):
    """Every metadata operation under ``root`` in this process (audit events + a wrapped os.stat/lstat)."""
    real = {name: getattr(os, name) for name in ("stat", "lstat")}

    def wrapped(name):
        def call(path, *args, **kwargs):
            _note(name, path)
            return real[name](path, *args, **kwargs)
        return call

    ops: list = []
    _counting.update(root=str(root), ops=ops)
    for name in real:
        setattr(os, name, wrapped(name))
    try:
        yield ops
    finally:
        os.stat, os.lstat = real["stat"], real["lstat"]
        _counting["root"] = None


class CountingStore:
    """A store client that counts its operations."""

    def __init__(self, store):
        self.store, self.ops = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.ops += 1
            return method(*args, **kwargs)
        return counted


@pytest.fixture
def tcp_store():
    """A real TCPStore server on loopback; the fixture's value makes one client (a rank) per call, with
    the prefix an attempt's process group has."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False)
    port = server.port
    yield lambda: dist.PrefixStore("attempt_0", dist.TCPStore("127.0.0.1", port, is_master=False,
                                                               timeout=timedelta(seconds=20)))


def states(world: int, step: int) -> list[dict]:
    return [{f"w{r}": torch.full((300 + r,), float(step * 10 + r)), "step": step} for r in range(world)]


def simulated_save(root: Path, step: int, world: int, boards: list, fail: dict | None = None) -> dict:
    """Plan (rank 0 creates the folder), then each rank writes its shards in a thread and posts."""
    planned = plan_ranks(states(world, step))
    sid = planned[0].save_id
    cm.make_tmp(root, step, sid)
    tmp = cm.tmp_dir(root, step, sid)

    def rank(r: int) -> None:
        if fail and r in fail:  # an error entry, or None: this rank has not posted yet
            if fail[r] is not None:
                boards[r].post(sid, r, fail[r])
            return
        p = planned[r]
        data = {**dict(zip((i.index for i in p.tensor_items), p.tensors, strict=True)), **p.byte_items}
        results, files, write_s = write_shards(tmp, r, p.plan, data, None, step)
        boards[r].post(sid, r, done_entry(files, results, write_s))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return {"step": step, "tmp": tmp, "metadata": planned[0].metadata, "t0": 0.0, "save_id": sid}


def ready(pending, root, board, world, keep=3, timeout=0.0):
    errors, events = [], []
    steps = cm.commit_ready(pending, root, board, world, KeepLast(keep), timeout, errors.append,
                            lambda kind, **f: events.append((kind, f)), failed_steps=set())
    return steps, errors, events


@pytest.mark.timeout(60)
def test_one_save_costs_n_plus_a_constant_and_idle_steps_nothing(tmp_path, tcp_store):
    world, root = 4, tmp_path / "ckpt"
    root.mkdir()  # the very first save also creates D: 2 operations more, once
    coordinator = CountingStore(tcp_store())
    boards = [StoreBoard(coordinator)] + [StoreBoard(tcp_store()) for _ in range(1, world)]
    pending: list = []
    with fs_ops(root) as idle:
        assert ready(pending, root, StoreBoard(coordinator), world) == ([], [], [])
    assert idle == [] and coordinator.ops == 0, "a step without a pending save touches nothing"

    with fs_ops(root) as first:
        p = simulated_save(root, 10, world, boards, fail={3: None})  # rank 3 is still writing
        pending.append(p)
    coordinator.ops = 0
    with fs_ops(root) as idle:
        for _ in range(5):  # five training steps while rank 3 is still writing
            assert ready(pending, root, boards[0], world)[0] == []
    assert idle == [] and coordinator.ops == 5, "a step with a pending save: one store op, no FS op"
    with fs_ops(root) as last:  # rank 3 finishes, the next step commits
        planned = plan_ranks(states(world, 10))[3]
        data = {**dict(zip((i.index for i in planned.tensor_items), planned.tensors, strict=True)), **planned.byte_items}
        results, files, write_s = write_shards(p["tmp"], 3, planned.plan, data, None, 10)
        boards[3].post(p["save_id"], 3, done_entry(files, results, write_s))
        coordinator.ops = 0
        steps, errors, events = ready(pending, root, boards[0], world)
    assert steps == [10] and not errors and [k for k, _ in events] == ["ckpt_commit"]
    assert coordinator.ops == 4  # tally, collect, forget (2)
    total = first + last
    print(f"\nFS metadata ops of one {world}-rank save: {len(total)} = N + {len(total) - world}: "
          f"{sorted(e for e, _ in total)}")
    assert len(total) <= world + 10, total
    assert committed_steps(root) == [10] and sorted(os.listdir(root)) == ["step_00000010"]
    verify(step_dir(root, 10))
    target = {f"w{r}": torch.zeros(300 + r) for r in range(world)} | {"step": 0}
    dcp.load(target, checkpoint_id=step_dir(root, 10), no_dist=True)
    assert all(torch.equal(target[f"w{r}"], states(world, 10)[r][f"w{r}"]) for r in range(world)) and target["step"] == 10


def test_simulated_save_idle_step_costs_zero_fs_ops(tmp_path):
    """The non-blocking finalize of a pending save: 1 store op, 0 FS ops, at any N."""
    world, root = 64, tmp_path / "ckpt"
    board = LocalBoard()
    planned = plan_ranks(states(world, 1))
    cm.make_tmp(root, 1, planned[0].save_id)
    pending = [{"step": 1, "tmp": cm.tmp_dir(root, 1, planned[0].save_id), "metadata": planned[0].metadata,
                "t0": 0.0, "save_id": planned[0].save_id}]
    for r in range(world - 1):
        board.post(planned[0].save_id, r, done_entry({}, b"", 0.0))
    with fs_ops(root) as ops:
        for _ in range(10):
            assert ready(pending, root, board, world) == ([], [], [])
    assert ops == [] and len(pending) == 1


@pytest.mark.timeout(60)
def test_retention_and_resave_are_counted_apart(tmp_path):
    """Deleting the checkpoint retention drops costs its own files: reported apart from the save."""
    world, root = 4, tmp_path / "ckpt"
    boards = [LocalBoard()] * world
    for step in (1, 2):
        assert ready([simulated_save(root, step, world, boards)], root, boards[0], world, keep=1)[0] == [step]
    with fs_ops(root) as ops:
        assert ready([simulated_save(root, 3, world, boards)], root, boards[0], world, keep=1)[0] == [3]
    dropped = [op for op in ops if "step_00000002" in op[1] or not op[1].startswith(str(root))]  # rmtree: dir fds
    print(f"\nsave with retention: {len(ops) - len(dropped)} ops for the save, {len(dropped)} to delete step 2")
    assert len(ops) - len(dropped) <= world + 10
    assert committed_steps(root) == [3] and sorted(os.listdir(root)) == ["step_00000003"]
    with fs_ops(root) as ops:  # re-saving a committed step swaps the old folder out
        assert ready([simulated_save(root, 3, world, boards)], root, boards[0], world, keep=1)[0] == [3]
    verify(step_dir(root, 3))
    assert sorted(os.listdir(root)) == ["step_00000003"]


@pytest.mark.timeout(60)
def test_a_failed_rank_drops_the_save_at_once_naming_step_and_path(tmp_path, tcp_store):
    world, root = 4, tmp_path / "ckpt"
    board = StoreBoard(tcp_store())
    bad = {2: error_entry("step 5: rank 2 could not write /x/__2_0.distcp: No space left", "/x/__2_0.distcp")}
    p = simulated_save(root, 5, world, [board] * world, fail=bad)
    steps, errors, _ = ready([p], root, board, world)
    assert steps == [] and len(errors) == 1 and isinstance(errors[0], CheckpointWriteError)
    assert errors[0].step == 5 and errors[0].path == "/x/__2_0.distcp" and "failed on rank 2" in str(errors[0])
    assert not p["tmp"].exists() and committed_steps(root) == []
    # failed before the others finished: dropped at once, the folder left to the next commit's sweep
    q = simulated_save(root, 6, world, [board] * world, fail={1: bad[2], 3: None})
    steps, errors, _ = ready([q], root, board, world)
    assert steps == [] and errors[0].step == 6 and q["tmp"].exists()
    assert ready([simulated_save(root, 7, world, [board] * world)], root, board, world)[0] == [7]
    assert sorted(os.listdir(root)) == ["step_00000007"]


@pytest.mark.timeout(60)
def test_a_blocking_wait_names_the_missing_ranks(tmp_path):
    world, root = 3, tmp_path / "ckpt"
    board = LocalBoard()
    q = simulated_save(root, 9, world, [board] * world, fail={0: None, 2: None})
    steps, errors, _ = ready([q], root, board, world, timeout=0.3)
    assert steps == [] and "only 1 of 3 ranks finished within 0.3 s (missing: ranks [0, 2])" in str(errors[0])


def test_board_entries_round_trip_and_are_forgotten(tcp_store):
    board = StoreBoard(tcp_store(), prefix="t")
    results = [1, torch.Size([2, 3])]
    entry = lambda r: done_entry({f"__{r}_0.distcp": {"size": r}}, pickle.dumps(results), 0.5)  # noqa: E731
    threads = [threading.Thread(target=StoreBoard(tcp_store(), prefix="t").post, args=("sid", r, entry(r)))
               for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert board.tally("sid") == (8, 0) and board.count("sid") == 8
    entries = board.collect("sid")
    assert sorted(entries) == list(range(8)) and entries[5]["files"] == {"__5_0.distcp": {"size": 5}}
    assert write_results(entries[5]) == results
    board.post("sid", 9, error_entry("boom", "/p"))
    assert board.tally("sid") == (9, 1)
    board.forget("sid")
    assert board.tally("sid") == (0, 0)
    board.forget("sid")


def test_posted_results_are_unpickled_safely():
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    entry = done_entry({}, pickle.dumps(Evil()), 0.0)
    with pytest.raises(Exception, match="refusing to unpickle global"):
        write_results(entry)


def test_the_stop_line_says_what_became_of_the_save_in_flight():
    from nvrx_lab.checkpoint.pending import stopped_line

    assert stopped_line(0, 10, [10]) == "the save of step 10 committed as the run stopped"
    assert stopped_line(0, 10, []).startswith("the save of step 10 was abandoned (not every rank had finished it)")
    assert stopped_line(1, 10, []).startswith("this rank's write of step 10 was stopped; rank 0 commits step 10 only if")
