"""The trainer under nvrx_lab.launcher: a SIGKILL and a hang are recovered in the same job, and the
restarted workers resume from the async checkpoint onto the very same loss curve."""

from __future__ import annotations

import pytest
from conftest import assert_one_curve, run_group

from nvrx_lab.observe.events import read_events
from nvrx_lab.observe.goodput import analyze
from nvrx_lab.runner import Launcher, trainer


@pytest.mark.timeout(200)
def test_sigkill_and_hang_recovered_onto_the_same_curve(port, tmp_path):
    metrics = tmp_path / "m.jsonl"
    launcher = Launcher.local(2, port, max_restarts=3, heartbeat_timeout=3, initial_heartbeat_timeout=60,
                              monitor_interval=0.2, metrics_file=metrics)
    cmd = launcher.argv(trainer(restart="launcher", ckpt="async", ckpt_dir=tmp_path / "ckpt", ckpt_interval=3, steps=14,
                                faults="1:8:sigkill,1:12:hang", metrics=metrics, log_every=0, global_batch=4, seq_len=32))
    res = run_group(cmd, timeout=180)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "rank 1 killed by SIGKILL" in res.stdout and "restart 1/3" in res.stdout
    assert "missed heartbeats" in res.stdout and "restart 2/3" in res.stdout
    events = read_events(metrics)
    assert_one_curve(events, steps=14)
    assert {e["restart_count"] for e in events if e["kind"] == "start"} == {0, 1, 2}
    report = analyze(events)
    assert [f.kind for f in report.faults] == ["sigkill", "hang"]
    assert all(f.recovery_s is not None for f in report.faults)
    assert report.causes.get("signal") == 1 and report.causes.get("hang", 0) >= 1
