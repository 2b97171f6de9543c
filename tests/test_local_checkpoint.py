"""Local checkpoints (nvrx_lab.checkpoint.local): every copy restores from where it should, a bad copy is
skipped with its reason, and nothing is left in node memory after a clean exit or a killed job."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import assert_one_curve, run_group

from nvrx_lab.checkpoint import janitor
from nvrx_lab.checkpoint.local import LocalCheckpointer, agreed_step
from nvrx_lab.checkpoint.snapshot import SnapshotError, fill, layout, load_meta
from nvrx_lab.net import free_port_pair
from nvrx_lab.observe.events import read_events
from nvrx_lab.reliability import local
from nvrx_lab.runner import Launcher, RunResult, Torchrun, run, trainer


class State:
    """A ``Stateful`` with nested tensors and plain values, as the trainer's state dict has."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.sd = {"model": {"w": torch.randn(5, 3, generator=g), "h": torch.randn(7, generator=g).to(torch.bfloat16)},
                   "optim": {"param_groups": [{"lr": 0.1 * seed, "betas": (0.9, 0.99), "params": ["w"]}]},
                   "step": seed}

    def state_dict(self) -> dict:
        return self.sd

    def load_state_dict(self, sd: dict) -> None:
        self.sd = sd


def same(a: State, b: State) -> bool:
    return (torch.equal(a.sd["model"]["w"], b.sd["model"]["w"]) and torch.equal(a.sd["model"]["h"], b.sd["model"]["h"])
            and a.sd["optim"] == b.sd["optim"] and a.sd["step"] == b.sd["step"])


def saved(folder: Path, run: str = "run-a", step: int = 3) -> State:
    ckpt = LocalCheckpointer(folder, run=run)
    state = State(step)
    ckpt.save(state.state_dict(), step)
    ckpt.wait()
    ckpt.close(keep=True)  # as a failed process leaves it
    return state


def test_memory_then_local_then_storage_when_newer(tmp_path):
    ckpt = LocalCheckpointer(tmp_path / "node", run="run-a")
    src = State(3)
    ckpt.save(src.state_dict(), 3)
    dst = State(9)
    got = ckpt.restore(dst, storage_step=None)
    assert (got.step, got.source, got.rollback_steps) == (3, "memory", 0) and same(dst, src)
    ckpt.close(keep=True)

    again = LocalCheckpointer(tmp_path / "node", run="run-a")  # a new process on the same node
    dst = State(9)
    got = again.restore(dst, storage_step=2)
    assert (got.step, got.source) == (3, "local") and same(dst, src)
    untouched = State(9)
    assert again.restore(untouched, storage_step=4) is None, "a newer storage checkpoint wins"
    assert same(untouched, State(9))
    again.close()
    assert not (tmp_path / "node").exists(), "a clean close leaves nothing behind"


def test_the_newer_of_two_snapshots_and_the_older_kept_while_writing(tmp_path):
    ckpt = LocalCheckpointer(tmp_path / "node", run="run-a")
    for step in (1, 2, 3):
        ckpt.save(State(step).state_dict(), step)
    ckpt.wait()
    steps = sorted(int(p.name.split(".")[1]) for p in (tmp_path / "node").glob("rank0.*.json"))
    assert len(steps) == 2, "two snapshots a rank: the newest and the one the next save overwrites"
    got = ckpt.restore(State(0), storage_step=None)
    assert got.step == 3
    ckpt.close()


@pytest.mark.parametrize("damage, reason", [
    ("flip", "CRC32C mismatch"),
    ("truncate", "truncated"),
    ("run", "another run"),
    ("world", "world size"),
])
def test_a_bad_copy_is_skipped_with_its_reason(tmp_path, capfd, damage, reason):
    folder = tmp_path / "node"
    saved(folder)
    data = next(folder.glob("rank0.*.data"))
    if damage == "flip":
        with open(data, "r+b") as f:
            f.seek(5)
            byte = f.read(1)
            f.seek(5)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(data, 16)
    elif damage == "world":  # taken when the job had another size (ranks shard differently)
        manifest = data.with_suffix(".json")
        manifest.write_text(manifest.read_text().replace('"world": 1', '"world": 2'))
    events = []
    run = "run-b" if damage == "run" else "run-a"
    ckpt = LocalCheckpointer(folder, run=run, emit=lambda kind, **f: events.append((kind, f)))
    assert ckpt.restore(State(9), storage_step=None) is None
    assert any(kind == "local_ckpt_skipped" and reason in f["reason"] for kind, f in events), events
    assert reason in capfd.readouterr().err
    ckpt.close()


def test_a_copy_of_another_structure_is_skipped_by_every_rank_and_nothing_written(tmp_path, capfd):
    saved(tmp_path / "node")  # an intact copy of the right run and world, but of another model: storage must win
    events = []
    ckpt = LocalCheckpointer(tmp_path / "node", run="run-a", emit=lambda kind, **f: events.append((kind, f)))
    other = State(9)
    other.sd["model"]["w"] = torch.zeros(5, 4)
    assert ckpt.restore(other, storage_step=None) is None
    assert torch.equal(other.sd["model"]["w"], torch.zeros(5, 4)) and other.sd["step"] == 9, "nothing written"
    why = "rank 0's copy does not fit its state: tensor model/w is torch.float32 (5, 3) in the snapshot"
    assert [f["copy"] for kind, f in events if why in f["reason"]] == ["step 3 (local)"], events
    assert why in capfd.readouterr().err
    ckpt.close()


def test_fill_refuses_another_model_and_writes_nothing(tmp_path):
    src = State(3)
    tensors, meta, (_, total) = layout(src.state_dict())
    region = bytearray(total + len(meta))
    offset = 0
    for t in tensors:  # as staging lays them out
        n = t.numel() * t.element_size()
        region[offset:offset + n] = t.contiguous().view(torch.uint8).numpy().tobytes()
        offset += -(-n // 64) * 64
    region[total:] = meta
    manifest = {"meta": [total, len(meta)]}
    other = State(9)
    other.sd["model"]["w"] = torch.zeros(5, 4)
    before = other.sd["model"]["h"].clone()
    with pytest.raises(SnapshotError, match=r"model/w is torch.float32 \(5, 3\) in the snapshot"):
        fill(other.state_dict(), region, manifest)
    assert torch.equal(other.sd["model"]["h"], before), "nothing is written before every leaf is checked"
    fill(State(9).state_dict(), region, manifest)  # the same structure fills


def test_the_meta_is_read_back_without_running_code():
    plain = {"t": torch.ones(2), "lr": 0.1, "betas": (0.9, 0.99), "name": "x", "none": None, "ok": True}
    meta = layout(plain)[1]
    assert meta[:2] != b"PK"  # plain values: a pickle that names no global
    assert load_meta(meta)["objects"] == [((k,), v) for k, v in plain.items() if k != "t"]
    meta = layout({"t": torch.ones(2), "dtype": torch.bfloat16})[1]  # another leaf: torch.save's weights-only format
    assert meta[:2] == b"PK" and load_meta(meta)["objects"] == [(("dtype",), torch.bfloat16)]
    crafted = pickle.dumps({"tensors": [], "objects": [(("x",), os.system)]})  # a global: code would run on load
    with pytest.raises(SnapshotError, match=r"names posix\.system: only plain values are read back"):
        load_meta(crafted)


def test_the_step_bench_times_whole_steps_with_their_snapshot():
    from nvrx_lab.observe.timeline import step_periods  # the step bench's (and the recovery bench's) step period

    step = lambda s, t: {"kind": "step", "rank": 0, "step": s, "t": t, "step_time": 0.01}  # noqa: E731
    events = [step(1, 0.0), step(2, 0.1), step(3, 0.3), {"kind": "resume", "step": 2}, step(3, 5.0), step(4, 5.2)]
    # one step event to the next (0.2 s, not the events' 0.01 s), never across a restart, the first step left out
    assert step_periods(events, after=1) == pytest.approx([0.2, 0.2])


def test_agreed_step_is_the_newest_every_rank_can_restore():
    replica_of = lambda rank, *steps: [{"rank": rank, "step": s} for s in steps]  # noqa: E731
    # two nodes of one rank: rank 1's node was replaced (no own copy), rank 0 holds its replica of step 7
    assert agreed_step([([7, 8], replica_of(1, 7), 8), ([], replica_of(0, 7), 0)], local_world=1) == 7
    # the replica is older than any copy rank 0 has: nothing in common
    assert agreed_step([([7, 8], replica_of(1, 6), 8), ([], [], 0)], local_world=1) is None
    # one node: no replica counts, each rank's own copies
    assert agreed_step([([4, 5], [], 5), ([5, 6], [], 6)], local_world=2) == 5
    # two nodes of two ranks, node 1 replaced: rank 0 holds rank 2's replicas of steps 7 and 8, rank 1 only rank 3's
    # step 7 in its newer slot and step 6 in its older one (its step 8 round had not finished): they agree on 7, which
    # is in rank 0's older slot (a table of the newest replica only agreed on nothing, and the run began again)
    table = [([7, 8], replica_of(2, 7, 8), 8), ([6, 7], replica_of(3, 6, 7), 8), ([], [], 0), ([], [], 0)]
    assert agreed_step(table, local_world=2) == 7


def holder(folder: Path, released: bool = True) -> subprocess.Popen:
    """A process that holds ``folder`` as a rank does (the lock), then sleeps; not ``released``: started, and waiting
    for :func:`release` to take the lock (no interpreter start between the release and the lock)."""
    code = f"import sys, time; sys.path.insert(0, {str(Path(janitor.__file__).parent)!r}); import janitor; " \
           f"print('ready', flush=True); sys.stdin.readline(); " \
           f"janitor.hold({str(folder)!r}); print('held', flush=True); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    if released:
        release(proc)
    return proc


def release(proc: subprocess.Popen) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "held"


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.timeout(60)
def test_the_janitor_removes_a_killed_jobs_copies_after_the_grace_and_not_before(tmp_path):
    folder = tmp_path / "node"
    saved(folder)
    first = holder(folder)
    replacement = holder(folder, released=False)  # started now: it only has to take the lock within the grace
    janitor_proc = subprocess.Popen([sys.executable, "-I", janitor.__file__, str(folder), "1.5"],
                                    start_new_session=True)
    try:
        first.kill()  # the whole job SIGKILLed: nobody holds the folder
        first.wait(10)
        time.sleep(0.6)  # unheld for longer than the janitor's poll (0.5 s), well within the grace
        release(replacement)  # ...but a replacement comes back within the grace
        time.sleep(3.0)
        assert folder.exists(), "a folder held again within the grace is kept"
        replacement.send_signal(signal.SIGKILL)
        replacement.wait(10)
        assert wait_for(lambda: not folder.exists(), 10), "removed once unheld for the grace period"
        assert janitor_proc.wait(10) == 0
    finally:
        for proc in (first, replacement, janitor_proc):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


# --------------------------------------------------------------------------- the trainer, end to end
MODEL = dict(global_batch=4, seq_len=32, log_every=0)


def local_flags(tmp_path: Path, **more) -> dict:
    return dict(ckpt="sync", ckpt_dir=tmp_path / "ckpt", ckpt_interval=10, local_ckpt_interval=1,
                local_ckpt_dir=tmp_path / "shm-node{node}", metrics=tmp_path / "m.jsonl", **MODEL, **more)


def resumes(tmp_path: Path) -> list[dict]:
    return [e for e in read_events(tmp_path / "m.jsonl") if e["kind"] == "resume"]


def left_in_memory(tmp_path: Path) -> list[str]:
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("shm-node*/*/*"))


GRACE = dict(local_ckpt_grace=30)


@pytest.mark.timeout(150)
def test_inprocess_exception_and_hang_restore_from_memory_and_redo_no_step(port, tmp_path):
    cmd = Torchrun.local(2, port).argv(trainer(steps=14, restart="inprocess", soft_timeout=3, hard_timeout=30,
                                               faults="1:7:exception,1:11:hang", **local_flags(tmp_path, **GRACE)))
    res = run_group(cmd, timeout=130)
    assert res.returncode == 0, res.stdout[-4000:]
    assert_one_curve(read_events(tmp_path / "m.jsonl"), steps=14)
    got = sorted((e["step"] >= 10, e["rank"], e["step"], e["source"], e["rollback_steps"]) for e in resumes(tmp_path))
    first, second = ([g[1:] for g in got if g[0] == later] for later in (False, True))
    # rank 1 raises as step 7 begins, having snapshotted step 6; rank 0 finished step 6 too, but if the fault is
    # reported before it reaches its snapshot (a restart enters no atomic section), it has step 5 only: all agree
    # on the newest step both hold, one step lost at most (storage has nothing before step 10)
    (step,) = {s for _, s, _, _ in first}
    assert step in (5, 6) and first == [(r, step, "memory", 6 - step) for r in (0, 1)], first
    # the hang is reported 3 s after step 11 began: both ranks had long snapshotted step 10
    assert second == [(r, 10, "memory", 0) for r in (0, 1)], second
    assert left_in_memory(tmp_path) == [], "a clean exit leaves nothing in node memory"


@pytest.mark.timeout(150)
def test_a_worker_replaced_by_the_launcher_restores_from_node_memory(port, tmp_path):
    launcher = Launcher.local(2, port, max_restarts=2, heartbeat_timeout=5, initial_heartbeat_timeout=60,
                              monitor_interval=0.2, metrics_file=tmp_path / "m.jsonl")
    res = run_group(launcher.argv(trainer(steps=12, restart="launcher", faults="1:8:sigkill",
                                          **local_flags(tmp_path, **GRACE))), timeout=130)
    assert res.returncode == 0, res.stdout[-4000:]
    assert_one_curve(read_events(tmp_path / "m.jsonl"), steps=12)
    got = resumes(tmp_path)
    # rank 1 was killed starting step 8, the launcher stopped rank 0: step 7's snapshot was staged on both, but
    # its checksum and manifest (a background thread at the lowest priority) may not have been written yet
    (step,) = {e["step"] for e in got}
    assert step in (6, 7) and {(e["rank"], e["source"]) for e in got} == {(0, "local"), (1, "local")}, got
    assert all(e["rollback_steps"] <= 7 - step for e in got), got
    assert left_in_memory(tmp_path) == []


def two_nodes(port: int, worker, env: dict, timeout: float) -> list[RunResult]:
    """Two ranks on each of two simulated nodes (torchrun --nnodes 2 --node-rank 0|1, a static store): every
    rank of a node holds the replica of its own peer, side by side in the node's memory."""
    heads = [Torchrun(nnodes=2, node_rank=n, nproc_per_node=2, master_addr="127.0.0.1", master_port=port)
             for n in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda head: run(head.argv(worker), timeout, env), heads))


@pytest.mark.timeout(200)
def test_a_replaced_node_restores_from_its_peers_replica(port, tmp_path):
    # the relaunch continues the run (as a pod restart). Node 0's copies must outlive the first job until the
    # relaunch holds them: under load its last ranks take over 30 s to exit (node 0's folder is unheld all that
    # while), so a grace longer than that wait
    flags = local_flags(tmp_path, steps=12, run_id="two-nodes", local_ckpt_grace=300)
    env: dict = {}
    first = two_nodes(port, trainer(faults="0:9:sigkill", **flags), env, 90)
    assert all(r.returncode != 0 and not r.timed_out for r in first), [r.output[-2000:] for r in first]
    shutil.rmtree(tmp_path / "shm-node1")  # node 1 is lost with its memory; a new node takes its place
    second = two_nodes(free_port_pair(), trainer(**flags), env, 90)
    assert all(r.returncode == 0 for r in second), [r.output[-3000:] for r in second]
    assert_one_curve(read_events(tmp_path / "m.jsonl"), steps=12)
    got = {(e["rank"], e["source"]) for e in resumes(tmp_path)}
    assert got == {(0, "local"), (1, "local"), (2, "peer"), (3, "peer")}, got
    (step,) = {e["step"] for e in resumes(tmp_path)}
    # rank 0 was killed starting step 9, having staged step 8; its replica of rank 1 is one save behind at most
    # (step 7 or 8); storage saves every 10 steps, so it has none. rollback_steps counts from the newest
    # snapshot committed anywhere (step 8's manifest may not have been written before the kill)
    assert step in (7, 8) and all(e["rollback_steps"] <= 8 - step for e in resumes(tmp_path)), resumes(tmp_path)
    assert left_in_memory(tmp_path) == []


@pytest.mark.timeout(90)
def test_a_job_killed_whole_leaves_nothing_in_memory_after_the_grace(port, tmp_path):
    cmd = Torchrun.local(2, port).argv(trainer(steps=400, step_sleep=0.05, **local_flags(tmp_path, local_ckpt_grace=1)))
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert wait_for(lambda: len(list(tmp_path.glob("shm-node0/*/rank*.json"))) >= 2, 60), "no snapshot taken"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert left_in_memory(tmp_path), "the copies outlive the killed job..."
    assert wait_for(lambda: not left_in_memory(tmp_path), 15), f"...until the grace is over: {left_in_memory(tmp_path)}"


@pytest.mark.timeout(120)
def test_replication_follows_a_snapshot_that_grows_and_shrinks(torchrun, tmp_path):
    # the first round, a length that grows (the receive posted for the old one is filled), one that shrinks;
    # then a lost node restores the newest step from its peer's replica
    res = torchrun(2, str(Path(__file__).parent / "workers" / "local_resize.py"), str(tmp_path), timeout=100)
    assert res.returncode == 0 and all((tmp_path / f"ok.{r}").exists() for r in (0, 1)), res.stdout[-3000:]


@pytest.mark.timeout(150)
def test_a_replica_restores_a_lost_node_unless_it_is_corrupt_or_another_runs(tmp_path):
    # three nodes of one rank: the holder of rank 0's replica (rank 1) is not the rank rank 0 replicates to
    row = local.damaged_replica(tmp_path, rounds=1)
    assert row.ok and row.trials == len(local.REPLICA_CASES), row.failures


def test_regions_of_dead_processes_are_swept_and_live_ones_kept(tmp_path):
    from nvrx_lab.checkpoint.staging import sweep_dead_regions

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = tmp_path / f"nvrx_ckpt_{gone.stdout.strip()}_r1_ab12cd34", tmp_path / f"nvrx_ckpt_{os.getpid()}_r0_x"
    other = tmp_path / "nvrx_ckpt_notapid_r0_x"
    for path in (dead, alive, other):
        path.write_bytes(b"region")
    assert sweep_dead_regions(str(tmp_path)) == [dead.name]
    assert alive.exists() and other.exists() and not dead.exists()
