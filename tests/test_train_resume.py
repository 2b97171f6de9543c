"""Resume is an invariant: a run stopped and resumed reproduces the uninterrupted loss curve."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from nvrx_lab.observe.events import read_events

ARGS = ["-m", "nvrx_lab.train", "--log-every", "0", "--global-batch", "4", "--seq-len", "32",
        "--ckpt", "async", "--ckpt-interval", "4"]


def losses(path) -> list[float]:
    return [e["loss"] for e in read_events(path, "step")]


@pytest.mark.slow  # make test keeps the invariant through every fault test's assert_one_curve (a redone step
@pytest.mark.timeout(240)  # gives the same loss) and the resharding through test_checkpoint_dist
def test_stopped_and_resumed_run_matches_the_uninterrupted_curve(torchrun, tmp_path):
    whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
    res = torchrun(2, *ARGS, "--steps", "12", "--ckpt-dir", str(tmp_path / "a"), "--metrics", str(whole))
    assert res.returncode == 0, res.stdout[-3000:]
    for steps in (8, 12):  # stop after step 8, then resume from its checkpoint
        res = torchrun(2, *ARGS, "--steps", str(steps), "--ckpt-dir", str(tmp_path / "b"), "--metrics", str(parts))
        assert res.returncode == 0, res.stdout[-3000:]
    assert len(losses(whole)) == 12
    assert losses(parts) == losses(whole)  # bit for bit
    (resume,) = [e for e in read_events(parts, "resume") if e["rank"] == 0]
    assert resume["step"] == 8 and resume["world_size"] == 2

    # A world-size change (2 ranks → 1 process) reshards the checkpoint; only the summation order differs.
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    shutil.rmtree(tmp_path / "c" / "step_00000012")
    one = tmp_path / "one.jsonl"
    res = subprocess.run([sys.executable, *ARGS, "--steps", "12", "--ckpt-dir", str(tmp_path / "c"), "--metrics", str(one)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert read_events(one, "resume")[0]["step"] == 8
    assert losses(one) == pytest.approx(losses(whole)[8:], rel=1e-4)


@pytest.mark.parametrize("flags, message", [
    (["--ckpt", "async"], "--ckpt async needs --ckpt-dir DIR"),
    (["--ckpt", "sync", "--ckpt-dir", "{tmp}", "--ckpt-interval", "0"], "--ckpt-interval must be >= 1"),
    (["--faults", "1:x:hang"], "--faults entry '1:x:hang'"),
    (["--restart", "launcher"], "needs the workers to run under `python -m nvrx_lab.launcher`"),
    (["--soft-timeout", "5", "--hard-timeout", "2"], "need 0 < --soft-timeout (5.0) <= --hard-timeout (2.0)"),
])
def test_bad_flags_fail_before_anything_is_written(tmp_path, flags, message):
    flags = [f.replace("{tmp}", str(tmp_path / "ck")) for f in flags]
    res = subprocess.run([sys.executable, "-m", "nvrx_lab.train", "--metrics", str(tmp_path / "m.jsonl"), *flags],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert message in res.stderr
    assert list(tmp_path.iterdir()) == []  # no metrics, no checkpoint folder
