"""In-process restart (nvrx_lab.inprocess): fast unit tests of the policies and the interrupt,
then end-to-end runs of ``nvrx_lab.demo.inprocess_worker`` on 2-3 real processes with
deterministic fault schedules (rank:iteration:step:kind)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nvrx_lab.inprocess import FillGaps, RestartLimitError, RestartRecord, ShiftRanks, Wrapper
from nvrx_lab.inprocess.call_wrapper import gloo_sockets
from nvrx_lab.inprocess.interrupt import MainThreadInterrupter, RankShouldRestart
from nvrx_lab.inprocess.launch import Launch
from nvrx_lab.inprocess.monitor import ThreadSettings
from nvrx_lab.inprocess.restart_log import root_cause
from nvrx_lab.inprocess.where import main_thread_at
from nvrx_lab.net import wait_for
from nvrx_lab.observe.events import read_events
from nvrx_lab.reliability.restarts import inprocess_soak, inprocess_soak_limits

ROOT = Path(__file__).resolve().parents[1]
WORKER = ["-m", "nvrx_lab.demo.inprocess_worker"]
GLOO_CUT = [str(ROOT / "tests" / "workers" / "inprocess_gloo_cut.py")]


def run_job(script: list[str], nproc: int, args: list[str], timeout: float = 60.0, env: dict | None = None):
    """Start ``nproc`` ranks of ``python *script *args`` with the survivors-keep-running launcher (``env``: more
    variables); kill the whole group after."""
    cmd = [sys.executable, "-m", "nvrx_lab.inprocess.spawn", "--nproc", str(nproc), "--",
           sys.executable, *script, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=ROOT, env={**os.environ, **(env or {})})
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        return None, f"TIMEOUT after {timeout} s\n{out}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def worker_args(tmp_path: Path, faults: str, *extra: str) -> list[str]:
    return ["--events", str(tmp_path / "ev.jsonl"), "--ckpt-dir", str(tmp_path), "--faults", faults, *extra]


# -- policies (no processes) --------------------------------------------------------------------
def test_shift_ranks_closes_holes_and_keeps_spares():
    assert ShiftRanks()([0, 2, 3], {0: 0, 1: 1, 2: 2, 3: 3}, 4) == {0: 0, 2: 1, 3: 2}
    # one spare: rank 3 idles; when 1 dies the spare steps in
    first = ShiftRanks(spares=1)([0, 1, 2, 3], {r: r for r in range(4)}, 4)
    assert first == {0: 0, 1: 1, 2: 2, 3: None}
    assert ShiftRanks(spares=1)([0, 2, 3], first, 4) == {0: 0, 2: 1, 3: 2}


def test_fill_gaps_moves_only_the_highest_rank():
    assert FillGaps()([0, 2, 3], {0: 0, 1: 1, 2: 2, 3: 3}, 4) == {0: 0, 2: 2, 3: 1}
    first = FillGaps(spares=1)([0, 1, 2, 3], {r: r for r in range(4)}, 4)
    assert FillGaps(spares=1)([0, 2, 3], first, 4) == {0: 0, 2: 2, 3: 1}


def test_wrapper_rejects_bad_settings_with_the_field_name():
    with pytest.raises(ValueError, match="hard_timeout"):
        Wrapper(soft_timeout=5, hard_timeout=2)
    with pytest.raises(ValueError, match="soft_timeout"):
        Wrapper(soft_timeout="soon")
    with pytest.raises(ValueError, match="max_iterations"):
        Wrapper(max_iterations=0)
    with pytest.raises(ValueError, match="rank_assignment"):
        Wrapper(rank_assignment=lambda *a: {})
    from datetime import timedelta
    assert Wrapper(soft_timeout=timedelta(seconds=3), hard_timeout=timedelta(seconds=4)).soft_timeout == 3.0


def test_the_launch_is_read_once_and_each_component_gets_its_settings_from_the_wrapper():
    launch = Launch.from_env({"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                              "GLOO_SOCKET_IFNAME": "eth0,eth1,"})
    assert (launch.rank, launch.world_size, launch.gloo_interfaces) == (0, 3, ("eth0", "eth1"))
    assert launch.store_address(None, None) == ("10.0.0.1", 29501) and launch.store_address("h", 7) == ("h", 7)
    assert Launch.from_env({}) == Launch(0, 1, "127.0.0.1", None)
    with pytest.raises(RuntimeError, match="MASTER_PORT is not set"):
        Launch.from_env({}).store_address(None, None)
    with pytest.raises(RuntimeError, match="WORLD_SIZE='two' is not an integer"):
        Launch.from_env({"WORLD_SIZE": "two"})
    w = Wrapper(soft_timeout=2, hard_timeout=None, monitor_interval=0.05, heartbeat_timeout=4, host_store=True)
    proc = w.process_settings(launch)
    assert (proc.store_host, proc.store_port, proc.host_store, proc.interval, proc.idle_exit) == ("10.0.0.1", 29501,
                                                                                                  True, 0.1, 12.0)
    assert proc.hard_timeout == float("inf") and proc.policy is w.rank_assignment
    assert not w.process_settings(Launch.from_env({"RANK": "1", "MASTER_PORT": "29500"})).host_store  # rank 0's only
    assert w.thread_settings() == ThreadSettings(2.0, 0.5, 0.05)
    group = w.group_settings(launch)
    assert (group.pg_timeout, group.nccl_min_timeout, group.gloo_max_timeout) == (300.0, 2.0, None)
    assert gloo_sockets("gloo", 3, group.gloo_transport, group.gloo_interfaces) == 4  # 2 peers x 2 interfaces
    assert gloo_sockets("gloo", 3, "ibverbs") == 0 and gloo_sockets("nccl", 3) == 0


def test_root_cause_prefers_a_death_over_the_collective_errors_it_caused():
    faults = [{"cause": "exception", "rank": 0, "detail": "Connection closed by peer", "t": 1.0},
              {"cause": "dead", "rank": 1, "detail": "killed", "t": 1.02}]
    assert root_cause(faults)["rank"] == 1
    err = RestartLimitError("max_iterations=2 reached", [RestartRecord(0, "dead", 1, "killed", 1.0)])
    assert "dead on rank 1" in str(err) and "max_iterations=2" in str(err)


def test_a_hang_is_blamed_on_the_rank_stuck_outside_a_collective_not_the_first_waiting_peer_to_report():
    waiting = {"cause": "hang", "rank": 0, "detail": "waiting in all_reduce", "t": 1.0, "waiting": True}
    stuck = {"cause": "hang", "rank": 1, "detail": "stuck in inject", "t": 1.01, "waiting": False}
    assert root_cause([waiting, stuck])["rank"] == 1
    assert root_cause([waiting, dict(stuck, waiting=True)])["rank"] == 0  # both waiting: the first, as before
    assert root_cause([dict(waiting, cause="dead"), stuck])["cause"] == "dead"  # a death still comes first


def main_thread_below(code) -> bool:
    """The main thread is in a call that a frame running ``code`` made (e.g. the wait ``code`` blocks in)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None or frame.f_code is code:
        return False
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame is not None


@pytest.mark.parametrize("inside", [True, False])
def test_the_monitor_sees_whether_the_main_thread_waits_in_torch_distributed(tmp_path, inside):
    """From another thread, as the monitor thread looks: the main thread blocked in a function of a file under
    ``torch/distributed/`` is waiting on a peer; blocked anywhere else, it is stuck itself."""
    import importlib.util

    folder = tmp_path / ("torch/distributed" if inside else "mine")
    folder.mkdir(parents=True)
    (folder / "blocking.py").write_text("def all_reduce(event):\n    event.wait(10)\n")
    spec = importlib.util.spec_from_file_location("blocking", folder / "blocking.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen, release = [], threading.Event()

    def look():
        wait_for(lambda: main_thread_below(module.all_reduce.__code__), 30, "the main thread to wait in all_reduce")
        seen.append(main_thread_at())
        release.set()

    threading.Thread(target=look, daemon=True).start()
    module.all_reduce(release)
    ((waiting, where),) = seen
    assert waiting is inside and where.startswith("all_reduce (blocking.py:2)") is inside, where


# -- interrupting the main thread (this process) ------------------------------------------------
def block(blocking: str, sock: socket.socket) -> None:
    time.sleep(30) if blocking == "sleep" else sock.recv(1)


@pytest.mark.parametrize("blocking", ["sleep", "socket"])
def test_signal_interrupts_sleep_and_blocking_read(blocking):
    it = MainThreadInterrupter()
    a, b = socket.socketpair()
    a.settimeout(30)  # never interrupted: a timeout error, not RankShouldRestart

    def interrupt_once_blocked():
        # block() calls no Python code: the main thread is in its sleep or recv once it stands in block()
        wait_for(lambda: main_thread_at()[1].startswith("block ("), 30, "the main thread to block")
        it.interrupt("test")

    try:
        it.armed = True  # before the interrupt can come: an unarmed one is ignored
        threading.Thread(target=interrupt_once_blocked, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(RankShouldRestart):
            block(blocking, a)
        assert time.monotonic() - t0 < 5
    finally:
        it.restore()
        a.close(), b.close()


@pytest.mark.timeout(60)
def test_cutting_sockets_unblocks_a_gloo_collective_but_pg_abort_does_not():
    """torch 2.13: ProcessGroup.abort() from another thread leaves a gloo all_reduce waiting
    (until the peer lets go); shutting the group's sockets down ends it at once."""
    rc, out = run_job(GLOO_CUT, 2, ["--peer-wait", "3"], timeout=50)
    results = {r["action"]: r for r in (json.loads(ln) for ln in out.splitlines() if ln.startswith('{"action"'))}
    assert set(results) == {"abort", "cut"}, out
    assert results["cut"]["error"] and results["cut"]["seconds"] < 1.0, results
    assert results["abort"]["seconds"] > 2.0, results


# -- end to end ---------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_exception_and_hangs_restart_every_rank_in_process(tmp_path):
    # Rank 0 saves step 5 (10) last in its loop turn 4 (9), before it enters the all_reduce of turn 5 (10): a fault
    # on rank 1 at turn 6 (11) comes after that all_reduce, so the next attempt resumes from step 5 (10) whatever the
    # timing. At turn 5 it could interrupt rank 0 before the save (then attempt 1 began at step 1).
    faults = "1:0:6:exception,0:1:8:hang,1:2:11:hang_socket"
    prefix = tmp_path / "fr" / "rank_"  # each abort dumps the rank's flight recorder first (torch's naming)
    # the soft timeout (2 s) ends these hangs; the hard one only guards a frozen rank, and at 4 s it once killed both
    # ranks in their first restart (abort, dump, collection) beside CI's other worker and two busy loops
    rc, out = run_job(WORKER, 2, worker_args(tmp_path, faults, "--steps", "16", "--hard-timeout", "10"), timeout=80,
                      env={"TORCH_FR_BUFFER_SIZE": "64", "TORCH_FR_DUMP_TEMP_FILE": str(prefix)})
    assert rc == 0, out
    assert out.count(f"flight recorder: {prefix}0") == 3, out  # in each RESTART line of rank 0
    assert all(pickle.loads(Path(f"{prefix}{r}").read_bytes())["entries"] for r in (0, 1))
    ev = tmp_path / "ev.jsonl"
    done = read_events(ev, "done")
    assert sorted(d["rank"] for d in done) == [0, 1] and all(d["step"] == 16 and d["iteration"] == 3 for d in done)
    restarts = read_events(ev, "restart")
    assert len(restarts) == 6  # 3 restarts x 2 ranks, one event each
    by_iter = {r["iteration"]: r for r in restarts if r["rank"] == 0}
    assert by_iter[0]["cause"] == "exception" and by_iter[0]["fault_rank"] == 1
    assert by_iter[1]["cause"] == "hang" and by_iter[2]["cause"] == "hang"
    for r in restarts:
        assert {"detect_s", "abort_s", "health_s", "rendezvous_s", "reload_s", "back_s"} <= set(r)
        assert r["trace_dump"] == f"{prefix}{r['rank']}", r
        assert r["back_s"] < 30 and r["reload_s"] is not None
    # reload: after each restart training resumes from the last checkpoint (every 5 steps)
    first_steps = {}
    for s in read_events(ev, "step"):
        first_steps.setdefault((s["rank"], s["iteration"]), s["step"])
    assert first_steps[(0, 1)] == 6 and first_steps[(0, 2)] == 6 and first_steps[(0, 3)] == 11


@pytest.mark.timeout(90)
def test_dead_store_host_and_frozen_rank_are_dropped_and_ranks_refilled(tmp_path):
    """3 ranks, FillGaps: rank 0 (whose monitor process hosts the store) is SIGKILLed, then
    initial rank 2 freezes with signals blocked (only the hard timeout ends it)."""
    faults = "0:0:4:sigkill,2:1:7:hang_native"
    rc, out = run_job(WORKER, 3, worker_args(tmp_path, faults, "--steps", "12", "--assignment", "fill"), timeout=80)
    assert rc == 0, out
    ev = tmp_path / "ev.jsonl"
    restarts = [r for r in read_events(ev, "restart") if r["rank"] == 1]
    # The frozen rank and the survivor stuck in its collective both report a hang at their soft timeout;
    # the hard-timeout kill is reported before the death is announced, so the survivor, which can only
    # meet without rank 2 once it is dead, always attributes the restart to it.
    causes = [(r["cause"], r["fault_rank"]) for r in restarts]
    assert causes == [("dead", 0), ("hard_timeout", 2)], restarts
    killer = "[nvrx_lab.inprocess] rank 2's monitor process, attempt 1: no progress for "  # the kill, said as it happens
    assert sum(line.startswith(killer) and line.endswith("> hard_timeout 4.0 s; killed") for line in out.splitlines()) == 1
    assert restarts[0]["world_size"] == 2 and restarts[0]["new_rank"] == 1  # FillGaps: 1 keeps 1, 2 fills 0
    (done,) = read_events(ev, "done")
    assert done["rank"] == 1 and done["world_size"] == 1 and done["step"] == 12


@pytest.mark.timeout(60)
def test_lost_node_by_heartbeat_then_min_world_size_error_lists_every_restart(tmp_path):
    """Attempt 0: rank 1 raises. Attempt 1: rank 1 and its monitor process die together (a lost
    node): only the heartbeat timeout tells rank 0; one rank left < min_world_size=2."""
    args = worker_args(tmp_path, "1:0:2:exception,1:1:4:sigkill_all", "--steps", "12", "--min-world-size", "2")
    t0 = time.monotonic()
    rc, out = run_job(WORKER, 2, args, timeout=50)
    assert rc != 0
    assert "in-process restart gave up: only 1 ranks left, min_world_size=2" in out, out
    assert "restarts (2):" in out
    assert "attempt 0: exception on rank 1: InjectedFault: injected exception on rank 1" in out
    assert "attempt 1: dead on rank 1: no heartbeat" in out
    assert time.monotonic() - t0 < 45  # the store host does not linger for a dead rank


SOAK_RESTARTS = 100


@pytest.mark.timeout(inprocess_soak_limits(SOAK_RESTARTS)[1] + 30)  # the soak's own bound, then 30 s to judge the run
def test_100_restarts_leak_nothing_then_max_iterations_stops(tmp_path):
    """Rank 1 raises in every attempt: 100 restarts in the same processes, then the limit; threads
    and fds flat, RSS within +5 %, every restart logged, nothing left running (the reliability case).
    The soak stops its job itself: an overrun fails here with its figures, never at this test's timeout."""
    row = inprocess_soak(tmp_path, restarts=SOAK_RESTARTS)
    assert row.ok, (row.failures, row.figures)
    assert row.figures["restarts_logged"] == SOAK_RESTARTS
