"""End to end: the real launcher as a subprocess, 2 workers over gloo, deterministic faults.

Each test runs ``python -m nvrx_lab.launcher --nproc-per-node 2 --rdzv-backend c10d ...
tests/workers/launcher_worker.py`` in its own session with a bounded wait, reads the event stream
(steps, faults, launcher_failure/restart/ready) and checks that no launcher, zygote, monitor or
worker process is left behind.
"""

import pickle
from pathlib import Path

import psutil
import pytest

from nvrx_lab.observe.events import read_events
from nvrx_lab.runner import Launcher, Worker, run

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "workers" / "launcher_worker.py")


def launch(tmp_path, launcher_flags: dict, worker_flags: list[str], timeout=60):
    """The launcher (``launcher_flags``: :class:`~nvrx_lab.runner.Launcher` fields) running 2 workers."""
    metrics = tmp_path / "events.jsonl"
    launcher = Launcher.local(2, monitor_interval=0.1, metrics_file=metrics, **launcher_flags)
    res = run(launcher.argv(Worker.of(WORKER, *worker_flags, metrics=metrics)), timeout,
              env={"PYTHONPATH": str(ROOT), "LOGLEVEL": "WARNING", "TORCH_FR_BUFFER_SIZE": "64"})
    if res.timed_out:
        pytest.fail(f"timed out after {timeout} s (process group killed):\n{res.output[-4000:]}")
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(metrics) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, f"orphaned workers: {leftovers}"
    print(res.output[-3000:])
    return res.returncode, res.output, read_events(metrics)


def steps_by_restart(events):
    out = {}
    for e in events:
        if e["kind"] == "step":
            out.setdefault(e["restart"], set()).add((e["rank"], e["step"]))
    return out


def last_step_t(events, rank, before):
    """When ``rank`` last stepped (its heartbeat goes just before the event) before ``before``."""
    return max(e["t"] for e in events if e["kind"] == "step" and e["rank"] == rank and e["t"] < before)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sigkill_then_hang_both_restart_without_standby(tmp_path):
    """Plain torchelastic process start: a SIGKILL (attempt 0) and a hang (attempt 1) both recover."""
    rc, out, ev = launch(tmp_path, dict(max_restarts=3, heartbeat_timeout=2, standby=False),
                         ["--steps", "12", "--faults", "1:0:5:sigkill"])
    assert rc == 0, out
    fail = {e["rank"]: e for e in ev if e["kind"] == "launcher_failure"}  # rank 0 dies of losing its peer too
    assert (fail[1]["signal"], fail[1]["restart_count"]) == ("SIGKILL", 1)
    assert {e["restart_count"] for e in fail.values()} == {1} and "restart 2/3" not in out
    assert "rank 1 killed by SIGKILL" in out and "restart 1/3" in out
    done = steps_by_restart(ev)
    assert {(r, 11) for r in (0, 1)} <= done[1]  # TORCHELASTIC_RESTART_COUNT=1 seen by both ranks
    assert [e for e in ev if e["kind"] == "launcher_restart"]


@pytest.mark.timeout(90)
def test_hangs_detected_and_restarted_with_standby(tmp_path):
    rc, out, ev = launch(tmp_path, dict(max_restarts=3, heartbeat_timeout=2),
                         ["--steps", "12", "--faults", "1:0-1:5:hang"])
    assert rc == 0, out
    # Rank 1 hangs before its all-reduce and rank 0 waits in it: both last beat at the end of the step before, and
    # the agent names the first to cross the timeout, and the other if it crosses within SETTLE_S. From the events:
    # each hang is named (restart 1 and 2), every name is a hang past the 2 s timeout, and a rank left unnamed went
    # silent after a named one (it had not crossed yet).
    assert [(e["rank"], e["restart"], e["fault"]) for e in ev if e["kind"] == "fault"] == [(1, 0, "hang"), (1, 1, "hang")]
    fail = [e for e in ev if e["kind"] == "launcher_failure"]
    assert {e["restart_count"] for e in fail} == {1, 2} and all(e["reason"] == "hang" and e["detect_s"] >= 2 for e in fail)
    for restart in (1, 2):
        named = {e["rank"]: e["t"] for e in fail if e["restart_count"] == restart}
        silent = {r: last_step_t(ev, r, min(named.values())) for r in (0, 1)}
        assert all(silent[r] > min(silent[n] for n in named) for r in {0, 1} - set(named)), (restart, named, silent)
    assert "missed heartbeats" in out and "restart 2/3" in out and "restart 3/3" not in out
    assert {(r, 11) for r in (0, 1)} <= steps_by_restart(ev)[2]
    starts = [e for e in ev if e["kind"] == "worker_start" and e["restart"] > 0]
    assert starts and all(e["torch_preloaded"] for e in starts)  # warm standby: torch imported before the worker
    assert len([e for e in ev if e["kind"] == "launcher_ready"]) == 2
    # before each stop, both ranks' flight recorders (gloo's, in torch 2.13) beside the metrics, named in the log
    dumps = [e for e in ev if e["kind"] == "trace_dump"]
    assert sorted(e["rank"] for e in dumps) == [0, 0, 1, 1] and all(e["ok"] and e["entries"] > 0 for e in dumps), dumps
    prefix = tmp_path / "nccl-trace" / "rank_"
    assert out.count(f"flight recorder dumped to {prefix}<rank>: rank 0 (") == 2
    last = {r: pickle.loads(Path(f"{prefix}{r}").read_bytes())["entries"][-1] for r in (0, 1)}  # the second hang's
    assert {e["profiling_name"] for e in last.values()} == {"gloo:all_reduce"}
    # the hung rank 1 never entered the sum rank 0 waits in: the dumps say which collective, and who is missing
    assert last[0]["collective_seq_id"] == last[1]["collective_seq_id"] + 1, last


@pytest.mark.timeout(90)
def test_min_healthy_stops_the_hung_rank_and_lets_the_survivor_finish(tmp_path):
    """The survivor's stand-in for the in-process wrapper gives up on its peer after 1.5 s (gloo timeout),
    before the launcher's 4 s heartbeat timeout (as NVRx advises: launcher timeouts above in-process ones)."""
    rc, out, ev = launch(tmp_path, dict(max_restarts=2, heartbeat_timeout=4, restart_policy="min-healthy", min_healthy=1),
                         ["--steps", "40", "--faults", "1:0:3:hang", "--on-peer-loss", "continue",
                          "--pg-timeout", "1.5"])
    assert rc == 0, out
    fail = {e["rank"]: e for e in ev if e["kind"] == "launcher_failure"}
    assert fail[1]["reason"] == "hang" and fail[1]["detect_s"] >= 4, fail
    if 0 in fail:  # the survivor's gloo timeout outlasted the heartbeat timeout: then it was silent, and both restart
        named_at, survivor = fail[0]["t"], fail[0]
        assert survivor["reason"] == "hang" and named_at - last_step_t(ev, 0, named_at) >= 4, (survivor, out[-3000:])
        assert [e for e in ev if e["kind"] == "launcher_restart"] and {(0, 39), (1, 39)} <= steps_by_restart(ev)[1]
        return
    assert "continuing without restart" in fail[1]["action"] and len(fail) == 1
    assert not [e for e in ev if e["kind"] == "launcher_restart"]
    assert (0, 39) in steps_by_restart(ev)[0]  # rank 0 trained to the end, no restart


@pytest.mark.timeout(90)
def test_usage_error_stops_at_once_without_restart(tmp_path):
    """Exit 2 (a bad flag) fails the same way on every attempt: one attempt, launcher exits 2."""
    rc, out, ev = launch(tmp_path, dict(max_restarts=3),
                         ["--steps", "6", "--faults", "1:0-9:1:exit:2"])
    assert rc == 2, out
    assert "worker rank 1 exited 2 (usage error): not restarting" in out
    assert "giving up" not in out and "restart 1/3" not in out
    assert {e["restart"] for e in ev if e["kind"] == "worker_start"} == {0}
    assert not [e for e in ev if e["kind"] == "launcher_restart"]
    fail = {e["rank"]: e for e in ev if e["kind"] == "launcher_failure"}  # rank 0 may have lost its peer too
    assert fail[1]["exit_code"] == 2 and fail[1]["action"] == "usage error: not restarting"


@pytest.mark.timeout(90)
def test_bad_worker_flag_exits_2_without_restart(tmp_path):
    rc, out, _ = launch(tmp_path, dict(max_restarts=3), ["--steps", "three"])
    assert rc == 2, out
    assert "expected an integer, got 'three'" in out and "(usage error): not restarting" in out
    assert "restart 1/3" not in out


@pytest.mark.timeout(90)
def test_exit_1_is_still_restarted(tmp_path):
    rc, out, ev = launch(tmp_path, dict(max_restarts=1),
                         ["--steps", "4", "--faults", "1:0:1:exit:1"])
    assert rc == 0, out
    fail = {e["rank"]: e for e in ev if e["kind"] == "launcher_failure"}  # rank 0 may have lost its peer too
    assert (fail[1]["exit_code"], fail[1]["restart_count"]) == (1, 1)
    assert {e["restart"] for e in ev if e["kind"] == "worker_done"} == {1}
