"""Reliability cases of :mod:`nvrx_lab.reliability.checkpoint` with small counts (the bench runs 100 trials).

Each case runs real processes on real files. A kill trial costs ~5 s on 2 cores, most of it spent
importing torch in a fresh trainer or writer, so the kill cases run 3 and 2 trials here.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys

import pytest
import torch

from nvrx_lab.checkpoint import AsyncCheckpointer, KeepLast, committed_steps, step_dir, verify
from nvrx_lab.checkpoint.commit import apply_retention
from nvrx_lab.reliability import checkpoint, local


@pytest.mark.timeout(120)
def test_sigkill_trainer_mid_save(tmp_path):
    # seed 1: trials 0 and 1 hit the first save of their run mid-write (the staging region must not be
    # left in /dev/shm), trial 1 kills the trainer alone (its writer must leave on its own, unkilled)
    row = checkpoint.sigkill_trainer_mid_save(tmp_path / "trainer", trials=3, seed=1)
    assert row.ok, row.failures
    assert row.trials == 3 and row.figures["group"] == 2 and row.figures["trainer_alone"] == 1
    assert row.figures["writer_left_on_its_own"] == 1, row.figures  # writer_outlived_s_max: how long it took
    assert committed_steps(tmp_path / "trainer" / "ckpt")[-1] >= 3  # every trial moved the run on


@pytest.mark.timeout(150)
def test_sigkill_mid_replication_restores_a_whole_step_or_nothing(tmp_path):
    # trial 0 kills the job, trial 1 the job and node 0's memory (its rank can restore from the peer only)
    row = local.sigkill_mid_replication(tmp_path, trials=2, seed=0, mib=4)
    assert row.ok, row.failures
    assert row.trials == 2


@pytest.mark.timeout(120)
def test_sigkill_writer_mid_save(tmp_path):
    row = checkpoint.sigkill_writer_mid_save(tmp_path / "writer", trials=2, seed=0)
    assert row.ok, row.failures
    assert row.trials == 2 and committed_steps(tmp_path / "writer" / "ckpt") == [1, 2]


@pytest.mark.timeout(60)
def test_corruption(tmp_path):
    row = checkpoint.corruption(tmp_path / "corruption")
    assert row.ok, row.failures
    assert row.trials == 3


@pytest.mark.timeout(60)
def test_disk_full(tmp_path):
    row = checkpoint.disk_full(tmp_path / "disk")
    assert row.ok, row.failures
    assert row.trials == 1 and row.figures["mode"] in ("tmpfs", "RLIMIT_FSIZE")
    assert not os.path.ismount(tmp_path / "disk" / "disk"), "the tmpfs was not unmounted"


@pytest.mark.timeout(90)
def test_permission_denied(tmp_path):
    row = checkpoint.permission_denied(tmp_path / "readonly")
    assert row.ok, row.failures
    assert row.trials == 2
    if os.geteuid() == 0:  # the scenario ran as root, without the capabilities that ignore file modes
        assert row.figures["ran_as"] == "uid 0 without CAP_DAC_OVERRIDE"


def _retention_killed_half_way(root) -> None:
    """In a forked process: apply retention, SIGKILLed as the second file of the dropped step is removed."""
    removed = []

    def hook(event, args):
        if event == "shutil.rmtree" and "step_00000001" in str(args[0]):
            removed.append(args[0])
        elif event == "os.remove" and removed:
            removed.append(args[0])
            if len(removed) == 3:
                os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    apply_retention(root, KeepLast(2), in_flight=set())


@pytest.mark.timeout(30)
def test_kill_during_retention_leaves_no_torn_step(tmp_path):
    """Found by the trainer-kill case (1 trial in 30): a kill while retention deleted an old checkpoint
    left it with its manifest but without its shard, a committed step that does not verify."""
    with AsyncCheckpointer(tmp_path, keep_last=3, start_writer=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"w": torch.full((1000,), float(step))}, step=step)
    child = mp.get_context("fork").Process(target=_retention_killed_half_way, args=(tmp_path,))
    child.start()
    child.join(20)
    assert child.exitcode == -signal.SIGKILL
    assert committed_steps(tmp_path) == [2, 3]
    for step in committed_steps(tmp_path):
        verify(step_dir(tmp_path, step))
    with AsyncCheckpointer(tmp_path, keep_last=2, start_writer=False) as ckpt:
        ckpt.save({"w": torch.full((1000,), 4.0)}, step=4)  # the next commit sweeps the half-deleted trash
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004"]
