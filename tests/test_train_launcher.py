"""The trainer under nvrx_lab.launcher: a SIGKILL and a hang are recovered in the same job, and the
restarted workers resume from the async checkpoint onto the very same loss curve."""

from __future__ import annotations

import sys
import pytest

from conftest import assert_one_curve, run_group
from nvrx_lab.events import read_events
from nvrx_lab.goodput import analyze


@pytest.mark.timeout(200)
def test_sigkill_and_hang_recovered_onto_the_same_curve(port, tmp_path):
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "nvrx_lab.launcher", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "3", "--heartbeat-timeout", "3",
           "--initial-heartbeat-timeout", "60", "--monitor-interval", "0.2", "--metrics-file", str(metrics),
           "-m", "nvrx_lab.train", "--restart", "launcher", "--ckpt", "async", "--ckpt-dir", str(tmp_path / "ckpt"),
           "--ckpt-interval", "3", "--steps", "14", "--faults", "1:8:sigkill,1:12:hang", "--metrics", str(metrics),
           "--log-every", "0", "--global-batch", "4", "--seq-len", "32"]
    res = run_group(cmd, timeout=180)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "killed by SIGKILL; restart 1/3" in res.stdout
    assert "missed heartbeats" in res.stdout and "restart 2/3" in res.stdout
    events = read_events(metrics)
    assert_one_curve(events, steps=14)
    assert {e["restart_count"] for e in events if e["kind"] == "start"} == {0, 1, 2}
    report = analyze(events)
    assert [f.kind for f in report.faults] == ["sigkill", "hang"]
    assert all(f.recovery_s is not None for f in report.faults)
    assert report.causes.get("signal") == 1 and report.causes.get("hang", 0) >= 1
