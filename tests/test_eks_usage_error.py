"""Exit codes mean the same in every mode: a real trainer's usage error (``--dim 32 --n-heads 3``) fails the Job after
one pod attempt, under torchrun (through :mod:`nvrx_lab.eks.torchrun`) as under the launcher, with the trainer's
one-line error in the pod log; any other worker failure keeps torchrun's own exit code."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from nvrx_lab.eks import MODES, JobSpec, local_run, render

BAD = ("--seq-len", "16", "--dim", "32", "--n-layers", "1", "--n-heads", "3", "--hidden-dim", "64")
TRAINER_ERROR = "error: --dim 32 / --n-heads 3 must give an even head size"


# Run end to end in make test: a torchrun mode as an Indexed Job and a launcher mode as a JobSet (whose rules do not
# depend on the mode); make test-slow adds the launcher mode with the most layers as a Job and the torchrun mode as a
# JobSet. Every other mode renders the same failure rules and the same wrapper as the one run for its kind of launch
# (checked below, in milliseconds); its trainer fails the same flags the same way.
# (The replicas mode is several Jobs, run and reported per group; its usage error is not exercised here yet.)
RUN_FOR = {False: "baseline", True: "ft_launcher+inprocess"}  # MODES[m].uses_launcher -> the mode run for it
SLOW = pytest.mark.slow
CASES = [("baseline", "job"), ("ft_launcher", "jobset"),
         pytest.param("ft_launcher+inprocess", "job", marks=SLOW), pytest.param("baseline", "jobset", marks=SLOW)]


def _failure_rules_and_wrapper(mode: str) -> tuple:
    manifests = render(JobSpec(name="bad", image="i", nodes=2, mode=mode, steps=4, global_batch=16, ckpt_interval=3,
                               train_extra=BAD))
    job = next(m for m in manifests if m["kind"] == "Job")
    script = " ".join(job["spec"]["template"]["spec"]["containers"][0]["args"])
    wrapper = "nvrx_lab.launcher" if "-m nvrx_lab.launcher" in script else "nvrx_lab.eks.torchrun" \
        if "-m nvrx_lab.eks.torchrun" in script else None
    return job["spec"]["podFailurePolicy"], wrapper


@pytest.mark.parametrize("mode", [m for m in MODES if not MODES[m].replicated])
def test_every_mode_renders_the_failure_rules_of_the_mode_run_for_it(mode):
    rules, wrapper = _failure_rules_and_wrapper(mode)
    assert wrapper is not None, mode
    assert (rules, wrapper) == _failure_rules_and_wrapper(RUN_FOR[MODES[mode].uses_launcher])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode, workload", CASES)
def test_a_trainer_usage_error_fails_the_job_after_one_attempt(mode, workload, tmp_path):
    s = JobSpec(name="bad", image="i", nodes=2, mode=mode, workload=workload, steps=4, global_batch=16,
                ckpt_interval=3, train_extra=BAD)
    assert s.backoff >= 6  # it would have been retried: a usage error must not count against backoffLimit
    run = local_run(render(s), workdir=tmp_path, timeout_s=120)
    logs = "\n".join(run.log(p.index) for p in run.pods)
    assert run.status == "Failed", f"{run.status}\n{logs[-3000:]}"
    assert run.failures == 0 and run.group_restarts == 0  # the FailJob rule, not backoffLimit or maxRestarts
    assert all(len(p.logs) == 1 for p in run.pods), [p.returncodes for p in run.pods]  # one attempt per pod
    assert 2 in [c for p in run.pods for c in p.returncodes]
    assert TRAINER_ERROR in logs
    if not MODES[mode].uses_launcher:
        assert re.search(r"nvrx_lab.eks.torchrun: worker rank\(s\) \d exited 2", logs), logs[-3000:]


def _torchrun(*worker: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvrx_lab.eks.torchrun", "--standalone", "--nproc-per-node", "1",
                           "--no-python", *worker], capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_the_torchrun_wrapper_changes_exit_2_only():
    usage = _torchrun("/bin/sh", "-c", "echo 'error: bad flag' >&2; exit 2")
    assert usage.returncode == 2 and "error: bad flag" in usage.stderr
    assert usage.stderr.rstrip().endswith("exit 2, so the Job fails without a retry")
    other = _torchrun("/bin/sh", "-c", "exit 3")
    assert other.returncode == 1 and "ChildFailedError" in other.stderr  # torchrun's own outcome, traceback and all
    assert _torchrun("/bin/sh", "-c", "exit 0").returncode == 0


@pytest.mark.timeout(200)
def test_a_job_that_never_commits_stops_after_three_attempts_and_the_job_fails_not_retried(tmp_path):
    """Every attempt fails before its first checkpoint (every 5 steps; faults at steps 2, 3, 4): the launcher stops with
    its no-progress code (4) after 2 restarts, and the rendered ``podFailurePolicy`` fails the Job at once: no pod is
    retried, nothing counts against ``backoffLimit``."""
    s = JobSpec(name="stuck", image="i", nodes=2, mode="ft_launcher", workload="job", steps=12, global_batch=16,
                ckpt_interval=5, faults="1:2:exception,1:3:exception,1:4:exception", heartbeat_timeout=30,
                initial_heartbeat_timeout=60, monitor_interval=0.2,
                train_extra=("--seq-len", "16", "--dim", "32", "--n-layers", "1", "--n-heads", "2", "--hidden-dim", "64"))
    assert s.backoff >= 6 and s.launcher.max_restarts > 2  # retries and restarts were there to spend
    run = local_run(render(s), workdir=tmp_path, timeout_s=180)
    logs = "\n".join(run.log(p.index) for p in run.pods)
    assert run.status == "Failed" and run.failures == 0, f"{run.status} {run.reason}\n{logs[-3000:]}"
    assert all(len(p.logs) == 1 for p in run.pods), [p.returncodes for p in run.pods]  # one attempt per pod
    assert 4 in [c for p in run.pods for c in p.returncodes], [p.returncodes for p in run.pods]
    assert "3 attempts in a row ended without committing a newer checkpoint" in logs, logs[-3000:]
