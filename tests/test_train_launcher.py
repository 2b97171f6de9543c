"""The trainer under nvrx_lab.launcher: a SIGKILL and a hang are recovered in the same job, and the
restarted workers resume from the async checkpoint onto the very same loss curve."""

from __future__ import annotations

import re

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
    # every launcher failure answers an injected fault: restart k follows the k-th fault (fired once each, rank 1),
    # which came after the failures of restart k - 1; the kill is rank 1's SIGKILL, the hang is named a hang (of rank 1,
    # or of rank 0 waiting for it in a collective: both went silent)
    faults = [e for e in events if e["kind"] == "fault"]
    assert [(f["rank"], f["fault"]) for f in faults] == [(1, "sigkill"), (1, "hang")], faults
    failures = [e for e in events if e["kind"] == "launcher_failure"]
    after = {k: max((e["t"] for e in failures if e["restart_count"] == k), default=0.0) for k in (1, 2)}
    for e in failures:
        k = e["restart_count"]
        assert k in (1, 2) and (after[k - 1] if k > 1 else 0.0) < faults[k - 1]["t"] < e["t"], (
            f"a failure no fault explains: rank {e['rank']} {e['reason']} ({e['detail']}) -> restart {k}; faults at "
            f"{[(f['fault'], f['t']) for f in faults]}, this failure at {e['t']}\n{res.stdout[-4000:]}")
    assert [(e["reason"], e["signal"]) for e in failures if e["restart_count"] == 1 and e["rank"] == 1] == [
        ("signal", "SIGKILL")]
    assert {e["reason"] for e in failures if e["restart_count"] == 2} == {"hang"}
    assert {e["restart_count"] for e in events if e["kind"] == "start"} == set(range(len(faults) + 1))
    report = analyze(events)
    assert [f.kind for f in report.faults] == ["sigkill", "hang"]
    assert all(f.recovery_s is not None for f in report.faults)
    assert report.causes.get("signal") == 1 and report.causes.get("hang", 0) >= 1


@pytest.mark.timeout(200)
def test_a_sigkill_under_launcher_and_inprocess_restarts_the_group_once_from_the_local_copy(port, tmp_path):
    """The launcher restarts the group on a lost worker (min-healthy = every local worker), so the in-process
    survivor leaves at once instead of training a world of one that the restart would throw away; the new
    workers resume from the node's local copy of the last step, and the fault's price has no discarded steps."""
    metrics = tmp_path / "m.jsonl"
    launcher = Launcher.local(2, port, max_restarts=3, heartbeat_timeout=5, initial_heartbeat_timeout=60,
                              monitor_interval=0.2, metrics_file=metrics, restart_policy="min-healthy")
    cmd = launcher.argv(trainer(restart="launcher+inprocess", ckpt="async", ckpt_dir=tmp_path / "ckpt", ckpt_interval=5,
                                local_ckpt_interval=1, steps=12, faults="1:8:sigkill", metrics=metrics, log_every=0,
                                global_batch=4, seq_len=32, soft_timeout=10, hard_timeout=20))
    res = run_group(cmd, timeout=180)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "in-process restart goes on with at least 2 of 2 ranks" in res.stdout, res.stdout[-4000:]
    assert "[rank 0] in-process restart stops here (only 1 ranks left" in res.stdout, res.stdout[-4000:]
    assert "restart 1/3" in res.stdout and "restart 2/3" not in res.stdout, res.stdout[-4000:]
    assert re.search(r"RESUME step [67] from local \(rolled back [01] step", res.stdout), res.stdout[-4000:]  # <= 1 redone
    events = read_events(metrics)
    assert_one_curve(events, steps=12)
    (price,) = analyze(events).prices
    assert "discarded" not in price.phases and {"detect", "teardown", "start", "restore"} <= set(price.phases)
    assert price.back_s == pytest.approx(sum(price.phases[k] for k in ("detect", "teardown", "start", "rendezvous",
                                                                        "restore", "start_line") if k in price.phases))


@pytest.mark.timeout(200)
def test_attempts_that_never_commit_stop_the_launcher_with_exit_4(port, tmp_path):
    """Each attempt fails before its first checkpoint (every 5 steps: faults at steps 2, 3, 4): after 3 such attempts the launcher
    stops with its no-progress code after 2 restarts, 8 of its 10 unspent, and says so in one line."""
    metrics = tmp_path / "m.jsonl"
    launcher = Launcher.local(2, port, max_restarts=10, heartbeat_timeout=5, initial_heartbeat_timeout=60,
                              monitor_interval=0.2, metrics_file=metrics)
    cmd = launcher.argv(trainer(restart="launcher", ckpt="async", ckpt_dir=tmp_path / "ckpt", ckpt_interval=5, steps=12,
                                faults="1:2:exception,1:3:exception,1:4:exception", metrics=metrics, log_every=0,
                                global_batch=4, seq_len=32))
    res = run_group(cmd, timeout=180)
    assert res.returncode == 4, res.stdout[-4000:]
    assert "restart 2/10" in res.stdout and "restart 3/10" not in res.stdout, res.stdout[-4000:]
    assert ("no progress: 3 attempts in a row ended without committing a newer checkpoint (the last committed: none "
            "yet); stopping with exit 4") in res.stdout
    assert {e["restart_count"] for e in read_events(metrics) if e["kind"] == "start"} == {0, 1, 2}
