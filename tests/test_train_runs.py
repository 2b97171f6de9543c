"""A run ends clean and says what happened: usage errors in one line (exit 2), one run per metrics
record, faults printed and reset for a new run, Ctrl-C during a save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nvrx_lab.checkpoint.commit import committed_steps
from nvrx_lab.observe.events import last_run, read_events
from nvrx_lab.observe.goodput import analyze

TRAIN = [sys.executable, "-m", "nvrx_lab.train", "--log-every", "0", "--global-batch", "4", "--seq-len", "32"]


def train(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAIN, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needle", [
    (["--steps", "-3"], "--steps must be >= 0, got -3"),
    (["--steps", "10", "--faults", "0:12:exception"], "step 12 is outside this run's steps 1..10"),
])
def test_a_usage_error_is_one_line_and_exit_2(args, needle):
    res = train(*args)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr


@pytest.mark.timeout(240)
def test_rerun_starts_a_new_record_resume_continues_it_and_faults_fire_again(tmp_path):
    metrics = tmp_path / "m.jsonl"
    for _ in range(2):  # the same command twice, no checkpoints: two runs in one file
        res = train("--steps", "3", "--faults", "0:2:exception", "--restart", "none", "--metrics", str(metrics))
        assert res.returncode != 0 and "FAULT injected: exception in step 2 (0:2:exception)" in res.stderr, res.stderr
    events = read_events(metrics)
    assert [e["kind"] for e in events].count("fault") == 2  # the second run's fault fired again
    assert len(last_run(events)) < len(events) and [e["kind"] for e in last_run(events)][0] == "start"
    # a relaunch with the run's id (a pod restart) continues it: its fault does not fire again
    m3 = tmp_path / "m3.jsonl"
    for _ in range(2):
        res = train("--steps", "3", "--faults", "0:2:exception", "--run-id", "job-7", "--metrics", str(m3))
    assert res.returncode == 0 and "FAULT" not in res.stderr, res.stderr
    assert [e["new_run"] for e in read_events(m3) if e["kind"] == "start"] == [True, False]
    assert analyze(read_events(m3)).final_step == 3 and len(analyze(read_events(m3)).faults) == 1
    # a resume of a checkpointed run stays in its record and keeps its identity
    ckpt, m2 = tmp_path / "ckpt", tmp_path / "m2.jsonl"
    assert train("--steps", "4", "--ckpt", "sync", "--ckpt-interval", "2", "--ckpt-dir", str(ckpt),
                 "--metrics", str(m2)).returncode == 0
    res = train("--steps", "6", "--ckpt", "sync", "--ckpt-interval", "2", "--ckpt-dir", str(ckpt), "--metrics", str(m2))
    assert res.returncode == 0, res.stderr
    events = read_events(m2)
    assert last_run(events) == events and analyze(events).final_step == 6
    assert [e["new_run"] for e in events if e["kind"] == "start"] == [True, False]
    res = train("--steps", "8", "--seed", "1", "--ckpt", "sync", "--ckpt-dir", str(ckpt))
    assert res.returncode == 2 and "--seed 1 (the run has 0)" in res.stderr, res.stderr
    assert committed_steps(ckpt) == [2, 4, 6]


@pytest.mark.timeout(180)
def test_ctrl_c_during_an_async_save_says_so_and_keeps_the_committed_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    # slow writes (1 MiB/s, ~5 s a save of 5.3 MB, saves every 2 steps): a save is always in flight.
    # Started as a terminal starts its foreground job: SIGINT at its default. Run from a shell's background
    # (`make test &`), this process ignores SIGINT, the trainer would inherit that, and Python then leaves
    # Ctrl-C ignored (it installs KeyboardInterrupt only where SIGINT is not ignored at start).
    proc = subprocess.Popen([*TRAIN, "--steps", "400", "--ckpt", "async", "--ckpt-interval", "2", "--ckpt-dir",
                             str(ckpt), "--ckpt-write-bandwidth", str(1 << 20), "--step-sleep", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})  # SIGABRT dumps every thread's stack
    try:
        deadline = time.monotonic() + 120
        while not committed_steps(ckpt) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert committed_steps(ckpt), "no checkpoint committed in time"
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGABRT)
            pytest.fail(f"still running 60 s after Ctrl-C; its threads:\n{proc.communicate(timeout=30)[1][-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted (Ctrl-C): training stopped; the committed checkpoints in" in err and "are intact" in err, err
    assert "inline_container" not in err and "a save in flight was abandoned" not in err, err  # no claim it cannot know
    assert "Traceback" not in err, err
    steps = committed_steps(ckpt)
    manifest = json.loads((ckpt / f"step_{steps[-1]:08d}" / "nvrx_commit.json").read_text())
    assert manifest["step"] == steps[-1]
