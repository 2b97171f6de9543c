"""Issue #32: the README's fault commands resume (not from step 0) and say so, one recovery figure per fault
(the RESUME line's is GOODPUT's), a rerun says there is nothing to train, --fresh starts over, a peer's fault is
one line on the survivor, and an AsyncCheckpointer made inside the in-process Wrapper's function recovers."""

from __future__ import annotations

import json
import re
import statistics
import sys

import pytest
from conftest import ROOT, run_group

from nvrx_lab.observe.events import last_launch, read_events
from nvrx_lab.observe.goodput import analyze, idle_between_launches, restart_causes
from nvrx_lab.runner import Launcher
from nvrx_lab.train.resume import Reached, Start

RESUME = re.compile(r"\[nvrx_lab\] RESUME step (\d+) from (\w+) \(rolled back (\d+) steps?, step (\d+) was reached\); "
                    r"training again ([\d.]+) s after the fault \((\w+) on rank 1 in step (\d+)\)")


def readme_inprocess(tmp, port, *extra: str) -> list[str]:
    """The README's in-process command (under ``python -m nvrx_lab.launcher``), its paths in ``tmp``."""
    return Launcher.local(2, port).argv(["-m", "nvrx_lab.train", "--steps", "40", "--ckpt", "async", "--ckpt-interval", "5",
                                         "--ckpt-dir", str(tmp / "ckpt"), "--restart", "inprocess", "--soft-timeout", "3",
                                         "--faults", "1:12:exception,1:25:hang", "--metrics", str(tmp / "m.jsonl"), *extra])


def goodput_line(out: str) -> dict:
    (line,) = [ln for ln in out.splitlines() if ln.startswith("GOODPUT ")]
    return json.loads(line.removeprefix("GOODPUT "))


@pytest.mark.timeout(300)
def test_the_readme_inprocess_command_resumes_says_so_and_reruns_truly(tmp_path, port):
    res = run_group(readme_inprocess(tmp_path, port), timeout=120)
    out = res.stdout
    assert res.returncode == 0, out[-3000:]
    assert "[nvrx_lab] START step 0 of 40: a new run" in out, out
    resumes = RESUME.findall(out)
    assert [(kind, int(step)) for *_, kind, step in resumes] == [("exception", 12), ("hang", 25)], out
    for step, source, rolled, reached, _, _, fault_step in resumes:
        assert int(step) >= 5 and source == "storage", out  # a checkpoint, not step 0
        assert int(reached) == int(fault_step) - 1 and int(rolled) == int(reached) - int(step), out
    said = [float(r[4]) for r in resumes]
    report = analyze(read_events(tmp_path / "m.jsonl"))
    assert [round(f.recovery_s, 2) for f in report.faults] == said  # one figure per fault, console and GOODPUT
    assert goodput_line(out)["back_median_s"] == pytest.approx(statistics.median(said), abs=0.006)
    assert report.causes == {"exception": 1, "hang": 1}  # once per restart, not once per rank
    # the hung rank is named, not its peer waiting for it in the collective (which stopped pinging too)
    assert re.search(r"RESTART attempt 1: hang on rank 1: no ping for [\d.]+ s \(soft_timeout 3.0 s\), stuck in inject", out), \
        [ln for ln in out.splitlines() if "RESTART" in ln]

    again = run_group(readme_inprocess(tmp_path, port), timeout=120)  # the same command: the run is done
    assert again.returncode == 0, again.stdout[-3000:]
    assert "[nvrx_lab] DONE step 40 already committed in" in again.stdout and "nothing to train" in again.stdout
    assert "FAULT" not in again.stdout and "GOODPUT" not in again.stdout, again.stdout[-3000:]
    assert idle_between_launches(read_events(tmp_path / "m.jsonl")) > 0  # the pause between launches is not downtime

    fresh = run_group(readme_inprocess(tmp_path, port, "--fresh", "--steps", "14", "--faults", "1:12:exception"),
                      timeout=120)
    assert fresh.returncode == 0, fresh.stdout[-3000:]
    assert re.search(r"--fresh: removed the \d+ committed checkpoints of the previous run in ", fresh.stdout), fresh.stdout
    assert "START step 0 of 14: a new run" in fresh.stdout and "FAULT injected: exception in step 12" in fresh.stdout
    launch = last_launch(read_events(tmp_path / "m.jsonl"))
    assert goodput_line(fresh.stdout)["faults"] == 1 == len([e for e in launch if e["kind"] == "fault"])


@pytest.mark.timeout(300)
def test_the_readme_launcher_command_resumes_and_the_survivor_says_one_line(tmp_path, port):
    metrics = tmp_path / "m.jsonl"
    launcher = Launcher.local(2, port, max_restarts=3, heartbeat_timeout=3, monitor_interval=0.2)
    cmd = launcher.argv(["-m", "nvrx_lab.train", "--restart", "launcher", "--steps", "40", "--ckpt", "async",
                         "--ckpt-interval", "5", "--ckpt-dir", str(tmp_path / "ckpt"), "--faults", "1:12:sigkill,1:25:hang",
                         "--metrics", str(metrics)])
    res = run_group(cmd, timeout=240)
    out = res.stdout
    assert res.returncode == 0, out[-4000:]
    resumes = RESUME.findall(out)
    assert [(kind, int(step)) for *_, kind, step in resumes] == [("sigkill", 12), ("hang", 25)], out
    assert all(int(r[0]) >= 5 for r in resumes), out
    assert "Traceback" not in out, out[-4000:]  # rank 0 lost its peer to the injected SIGKILL: one line
    assert re.search(r"\[rank 0\] a peer is gone \(.*\): this rank stops too, for the restart", out), out[-4000:]
    said = [float(r[4]) for r in resumes]
    assert [round(f.recovery_s, 2) for f in analyze(read_events(metrics)).faults] == said


WRAPPED = ROOT / "tests" / "workers" / "wrapped_checkpointer.py"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("trial", [0, *(pytest.param(t, marks=pytest.mark.slow) for t in (1, 2))])
def test_an_async_checkpointer_made_inside_the_wrapped_function_recovers(tmp_path, trial):
    """The pattern a user tries first (issue #32 item 4): on the exception the checkpointer abandons at once
    (the restart log names the exception, not a hang of rank 0), and closing it at the end causes no restart."""
    events = tmp_path / "ev.jsonl"
    cmd = [sys.executable, "-m", "nvrx_lab.inprocess.spawn", "--nproc", "2", "--", sys.executable, str(WRAPPED),
           str(tmp_path / "ckpt"), str(events)]
    res = run_group(cmd, timeout=150)
    assert res.returncode == 0, res.stdout[-3000:]
    restarts = [e for e in read_events(events) if e["kind"] == "restart"]
    assert {(e["iteration"], e["cause"], e["fault_rank"]) for e in restarts} == {(0, "exception", 1)}, res.stdout
    assert "injected exception on rank 1 at step 7" in restarts[0]["detail"]
    assert res.stdout.count("finished at step 12") == 2
    assert re.search(r"\[rank 0\] checkpoint: resumed step [36] from ", res.stdout), res.stdout


def test_a_checkpointer_made_before_init_process_group_in_a_job_is_an_error(tmp_path, monkeypatch):
    from nvrx_lab.checkpoint import AsyncCheckpointer

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")  # what torchrun and nvrx_lab.launcher set in every worker
    with pytest.raises(ValueError, match=r"made before torch.distributed.init_process_group in a job a launcher started"):
        AsyncCheckpointer(tmp_path, start_writer=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # a single process: a world of one is right
    AsyncCheckpointer(tmp_path, start_writer=False).close()


def test_launches_causes_and_idle_time_from_events():
    ev = [{"t": 0, "kind": "start", "rank": 0, "restart_count": 0}, {"t": 1, "kind": "start", "rank": 1, "restart_count": 0},
          {"t": 2, "kind": "restart", "rank": 0, "t_fault": 1.5, "iteration": 0, "cause": "exception"},
          {"t": 2, "kind": "restart", "rank": 1, "t_fault": 1.5, "iteration": 0, "cause": "exception"},
          {"t": 3, "kind": "launcher_failure", "rank": 1, "restart_count": 1, "action": "restart 1/3", "reason": "signal"},
          {"t": 3, "kind": "launcher_failure", "rank": 0, "restart_count": 1, "action": "restart 1/3", "reason": "exit"},
          {"t": 4, "kind": "start", "rank": 0, "restart_count": 1}, {"t": 5, "kind": "end", "rank": 0},
          {"t": 100, "kind": "start", "rank": 0, "restart_count": 0}, {"t": 101, "kind": "end", "rank": 0}]
    assert sorted(restart_causes(ev).values()) == ["exception", "signal"]
    assert [e["t"] for e in last_launch(ev)] == [100, 101]
    assert idle_between_launches(ev) == 95  # 5 -> 100, no pod restart between
    assert idle_between_launches([*ev[:8], {"t": 6, "kind": "pod_restart", "rank": -1}, *ev[8:]]) == 0


def test_the_start_lines():
    new = Start(40, "ck", None, {}, None, [], first_start=True)
    assert new.before_training() == "START step 0 of 40: a new run (nothing committed in ck yet)"
    done = Start(40, "ck", 40, {"storage": 2}, Reached(40, 9.0, 1.0), [], first_start=True)
    assert done.before_training().startswith("DONE step 40 already committed in ck: nothing to train")
    relaunch = Start(40, "ck", 20, {"storage": 2}, Reached(23, 9.0, 1.0), [], first_start=True)
    assert relaunch.before_training() == ("RESUME step 20 from storage: continuing the run in ck (relaunched; rolled back "
                                          "3 steps, step 23 was reached)")
    fault = {"t": 10.0, "kind": "sigkill", "rank": 1, "step": 12}
    back = Start(40, "ck", 10, {"local": 1, "peer": 1}, Reached(11, 9.0, 1.0), [fault], first_start=False)
    assert back.before_training() is None
    line, fields = back.after_first_step(10.25)
    assert line == ("RESUME step 10 from local on 1 rank, peer on 1 rank (rolled back 1 step, step 11 was reached); "
                    "training again 0.25 s after the fault (sigkill on rank 1 in step 12)")
    assert fields["recovery_s"] == pytest.approx(0.25) and fields["fault_t"] == 10.0 and fields["rollback_steps"] == 1
