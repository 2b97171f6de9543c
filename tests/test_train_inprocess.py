"""The trainer with --restart inprocess under torchrun: an exception and a hang are restarted inside the
same processes, resume from the async checkpoint, and land on the very same loss curve."""

from __future__ import annotations

import pytest
from conftest import assert_one_curve

from nvrx_lab.observe.events import read_events


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
