"""The trainer with --restart inprocess under torchrun: an exception and a hang are restarted inside the
same processes, resume from the async checkpoint, and land on the very same loss curve."""

from __future__ import annotations

import pytest
from conftest import assert_one_curve

from nvrx_lab.observe.events import read_events
from nvrx_lab.runner import Spawn, trainer
from nvrx_lab.runner import run as run_group


@pytest.mark.timeout(150)
def test_exception_and_hang_restart_in_process_onto_the_same_curve(torchrun, tmp_path):
    metrics = tmp_path / "m.jsonl"
    res = torchrun(2, "-m", "nvrx_lab.train", "--restart", "inprocess", "--soft-timeout", "3", "--hard-timeout", "30",
                   "--ckpt", "async", "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-interval", "3", "--ckpt-wait-writer",
                   "--steps", "14",
                   "--faults", "1:7:exception,1:11:hang", "--metrics", str(metrics), "--log-every", "0",
                   "--global-batch", "4", "--seq-len", "32", timeout=130)
    assert res.returncode == 0, res.stdout[-4000:]
    events = read_events(metrics)
    assert_one_curve(events, steps=14)
    starts = [e for e in events if e["kind"] == "start"]
    assert len(starts) == 2, "in-process restart must not start new processes"
    restarts = [e for e in events if e["kind"] == "restart"]
    assert sorted((e["iteration"], e["rank"]) for e in restarts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first, second = (sorted(e["cause"] for e in restarts if e["iteration"] == i) for i in (0, 1))
    assert first == ["exception", "exception"], first
    assert second == ["hang", "hang"], second
    resumes = [e["step"] for e in events if e["kind"] == "resume" and e["rank"] == 0]
    # Each restart resumes from the newest committed checkpoint (steps 3, 6, 9); --ckpt-wait-writer: the
    # writer is up before step 1, so the step-3 save is written, not held.
    commits = {e["step"] for e in events if e["kind"] == "ckpt_commit"}
    assert resumes and set(resumes) <= {3, 6, 9} & commits and commits >= {12}, (resumes, commits)


@pytest.mark.timeout(150)
def test_in_process_restarts_that_resume_from_the_same_step_stop_with_exit_4(tmp_path):
    """Each attempt fails before the first checkpoint (every 5 steps; faults at steps 2, 3, 4): the attempts resume
    from step 0 again and again, and after 3 such restarts every rank stops with the no-progress code, 6 of the 10
    attempts (--max-iterations) unspent, each saying so in one line. Ranks as plain processes (the in-process
    layer's own spawn): torchrun would SIGTERM the second rank as the first one exits."""
    metrics = tmp_path / "m.jsonl"
    cmd = Spawn(nproc=2).argv(trainer(restart="inprocess", soft_timeout=5, hard_timeout=30, ckpt="async",
                                      ckpt_dir=tmp_path / "ckpt", ckpt_interval=5, steps=12, metrics=metrics, log_every=0,
                                      faults="1:2:exception,1:3:exception,1:4:exception", global_batch=4, seq_len=32))
    res = run_group(cmd, timeout=130)
    assert res.returncode == 4 and "killed by" not in res.output, res.output[-4000:]  # every rank exited 4, none aborted
    said = [line for line in res.output.splitlines() if "no progress: 3 in-process restarts in a row resumed from step 0" in line]
    assert len(said) == 2 and all("stopping with exit 4 instead of restarting" in line for line in said), res.output[-3000:]
    events = read_events(metrics)
    assert len([e for e in events if e["kind"] == "start"]) == 2  # the same processes throughout
    assert {e["iteration"] for e in events if e["kind"] == "restart"} == {0, 1, 2}
    assert "terminate called" not in res.output and "Traceback" not in res.output
