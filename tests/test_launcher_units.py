"""Fast tests of the launcher's parts: timeouts, config errors, monitor + client over real sockets."""

import os
import stat
import subprocess
import sys
import time

import pytest
import yaml

from nvrx_lab.launcher import RankMonitorClient, RankMonitorClientError, Timeouts
from nvrx_lab.launcher.cli import ConfigError, load_yaml, parse
from nvrx_lab.launcher.config import LauncherConfig, SettingError
from nvrx_lab.launcher.monitor import MonitorServer
from nvrx_lab.launcher.policy import MinHealthy, any_failed, make_policy
from nvrx_lab.launcher.timeouts import Observed, RankClock, calculate, find_hang, parse_section_timeouts
from nvrx_lab.net import wait_for


def test_find_hang_initial_steady_and_sections():
    t = Timeouts(initial=10, steady=3, sections={"checkpoint": 20})
    c = RankClock(connected_at=0.0)
    assert find_hang(c, t, 9.0) is None
    assert "first heartbeat" in find_hang(c, t, 11.0)[0]
    c.last_heartbeat = 11.0
    assert find_hang(c, t, 13.9) is None
    assert "missed heartbeats for 3.5 s" in find_hang(c, t, 14.5)[0]
    c.open_sections["checkpoint"] = 12.0  # a long legitimate phase: heartbeat timeout suspended
    assert find_hang(c, t, 31.0) is None
    assert "section 'checkpoint'" in find_hang(c, t, 33.0)[0]
    del c.open_sections["checkpoint"]
    c.last_section_end = 30.0  # silence counts from the section's end
    assert find_hang(c, t, 32.0) is None
    c.open_sections["unconfigured"] = 40.0  # a section without a timeout is unbounded
    assert find_hang(c, t, 1000.0) is None


def test_calculate_and_parse():
    t = calculate(Observed(initial=2.0, steady=0.1, sections={"ckpt": 4.0}), Timeouts(initial=60, steady=30))
    assert t.initial == 60 and t.steady == 1.0 and t.sections == {"ckpt": 20.0}  # floor 1 s, initial never shrinks
    assert parse_section_timeouts("checkpoint=30, eval=60") == {"checkpoint": 30.0, "eval": 60.0}
    for bad in ("checkpoint", "checkpoint=x", "checkpoint=-1", "=3"):
        with pytest.raises(ValueError, match="section-timeouts"):
            parse_section_timeouts(bad)
    with pytest.raises(ValueError, match="'steady'"):
        Timeouts(steady=0)


def test_policies():
    assert any_failed(1, 2) and not any_failed(2, 2)
    assert not MinHealthy(1)(1, 2) and MinHealthy(1)(0, 2)
    with pytest.raises(ValueError, match="min_healthy=3 exceeds"):
        make_policy("min-healthy", 2, 3)


def test_cli_reuses_torchrun_and_yaml_precedence(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("heartbeat_timeout: 4\nsection_timeouts: {checkpoint: 30}\nmax_restarts: 2\n")
    args, s = parse(["--config", str(cfg), "--nproc-per-node", "2", "--heartbeat-timeout", "3", "w.py", "--x"])
    assert s.heartbeat_timeout == 3.0  # flag beats file
    assert s.section_timeouts == {"checkpoint": 30.0} and args.max_restarts == 2  # file beats default
    assert args.nproc_per_node == "2" and args.training_script_args == ["--x"] and args.shutdown_timeout == 5


@pytest.mark.parametrize("text,match", [
    ("heartbeat_timout: 3\n", "unknown key 'heartbeat_timout'"),
    ("heartbeat_timeout: fast\n", "key 'heartbeat_timeout' must be a number"),
    ("heartbeat_timeout: 0\n", "key 'heartbeat_timeout' must be > 0"),
    ("restart_policy: sometimes\n", "key 'restart_policy'"),
    ("section_timeouts: {checkpoint: -2}\n", "section_timeouts"),
    ("- a\n", "expected a mapping"),
])
def test_yaml_errors_name_the_key(tmp_path, text, match):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_yaml(str(cfg))


def test_launcher_config_loads_three_ways_alike_and_the_runner_writes_what_the_cli_reads(tmp_path):
    """One definition: keyword arguments, a YAML file of the same keys and the command line give the same config,
    and :class:`~nvrx_lab.runner.Launcher` writes a config as flags the launcher's parser reads back into it."""
    from nvrx_lab.runner import Launcher

    values = dict(max_restarts=2, monitor_interval=0.5, shutdown_timeout=9, heartbeat_timeout=2.5,
                  initial_heartbeat_timeout=40, section_timeouts={"checkpoint": 30, "eval": 7.5},
                  restart_policy="min-healthy", min_healthy=1, standby=False, standby_preload=["torch"],
                  metrics_file=str(tmp_path / "m.jsonl"))
    kwargs = LauncherConfig.from_kwargs(**values)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(values))
    assert LauncherConfig.from_yaml_file(tmp_path / "c.yaml") == kwargs
    assert parse(["--config", str(tmp_path / "c.yaml"), "w.py"])[1] == kwargs
    cmd = Launcher.local(2, 29400, settings=kwargs).argv(["w.py"])
    assert "--no-standby" in cmd and "--section-timeouts" in cmd and "--config" not in cmd
    assert parse(cmd[3:])[1] == kwargs  # after "python -m nvrx_lab.launcher"
    assert parse(Launcher.local(2, 29400).argv(["w.py"])[3:])[1] == LauncherConfig()  # defaults: no flags written


@pytest.mark.parametrize("values,field,problem", [
    (dict(heartbeat_timeout=0), "heartbeat_timeout", "must be > 0 seconds, got 0"),
    (dict(monitor_interval="fast"), "monitor_interval", "must be a number of seconds, got 'fast'"),
    (dict(max_restarts=-1), "max_restarts", "must be >= 0, got -1"),
    (dict(min_healthy=0), "min_healthy", "must be >= 1, got 0"),
    (dict(restart_policy="sometimes"), "restart_policy", "'any-failed' or 'min-healthy'"),
    (dict(section_timeouts={"checkpoint": -2}), "section_timeouts", "'checkpoint' must be > 0 seconds"),
    (dict(standby="yes"), "standby", "true or false"),
])
def test_launcher_config_names_the_bad_setting(values, field, problem):
    with pytest.raises(SettingError, match=f"^LauncherConfig.{field}: ") as err:
        LauncherConfig(**values)
    assert problem in str(err.value) and err.value.field == field


def test_environment_is_read_only_where_the_launcher_starts(tmp_path):
    """``$NVRX_LAB_METRICS`` reaches the restart log through :func:`parse`'s ``environ``, never read deeper down."""
    metrics = str(tmp_path / "m.jsonl")
    assert parse(["w.py"], environ={"NVRX_LAB_METRICS": metrics})[1].metrics_file == metrics
    assert parse(["w.py"], environ={})[1].metrics_file is None
    assert parse(["--metrics-file", "x.jsonl", "w.py"], environ={"NVRX_LAB_METRICS": metrics})[1].metrics_file == "x.jsonl"
    with pytest.raises(ConfigError, match=r"^\$NVRX_LAB_METRICS .* is a file"):
        (tmp_path / "f").write_text("")
        parse(["w.py"], environ={"NVRX_LAB_METRICS": str(tmp_path / "f" / "m.jsonl")})


def test_bad_flags_exit_2(tmp_path, capsys):
    from nvrx_lab.launcher.__main__ import main

    assert main(["--config", str(tmp_path / "missing.yaml"), "w.py"]) == 2
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--heartbeat-timeout", "-1", "w.py"])
    assert e.value.code == 2


def test_monitor_and_client_over_private_socket(tmp_path):
    server = MonitorServer(2, Timeouts(initial=5, steady=0.3, sections={"ckpt": 5}))
    try:
        assert stat.S_IMODE(os.stat(server.dir).st_mode) == 0o700
        client = RankMonitorClient(server.dir, local_rank=1)
        client.init_workload_monitoring()
        assert client.timeouts.steady == 0.3
        n, t0 = 20000, time.perf_counter()
        for _ in range(n):
            client.send_heartbeat()
        print(f"send_heartbeat: {(time.perf_counter() - t0) / n * 1e6:.2f} us")
        wait_for(lambda: server.state(1).first_heartbeat_at, 5, what="first heartbeat")
        client.start_section("ckpt")
        time.sleep(0.6)  # longer than the steady timeout, inside a section: not a hang
        assert server.hung() == []
        client.end_section("ckpt")
        client.send_heartbeat()
        wait_for(lambda: server.hung(), 3, what="missed heartbeats")
        assert server.hung()[0][0] == 1 and "missed heartbeats" in server.hung()[0][1]
        new = client.calculate_timeouts(safety_factor=5, floor=1.0)
        assert new.sections["ckpt"] >= 3.0 and new.steady >= 1.0
        wait_for(lambda: server.state(1).timeouts.sections["ckpt"] == new.sections["ckpt"], 3, what="new timeouts")
        sd = client.state_dict()
        client.shutdown_workload_monitoring()
        wait_for(lambda: server.state(1).done, 3, what="clean shutdown")
        assert server.hung() == []
        restored = RankMonitorClient(server.dir, local_rank=1)
        restored.load_state_dict(sd)
        restored.init_workload_monitoring()  # timeouts from the checkpoint reach the monitor
        wait_for(lambda: server.state(1).timeouts.to_dict() == new.to_dict(), 3, what="restored timeouts")
        restored.shutdown_workload_monitoring()
    finally:
        server.close()
    assert not os.path.exists(server.dir)


def test_monitor_refuses_strangers_and_reports_death():
    server = MonitorServer(1, Timeouts())
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        real_owner, server.owner_pid = server.owner_pid, other.pid  # we are not a descendant of `other`
        with pytest.raises(RankMonitorClientError, match="refused"):
            RankMonitorClient(server.dir, 0).init_workload_monitoring(timeout=5)
        assert server.refused == 1
        server.owner_pid = real_owner
        child = subprocess.Popen([sys.executable, "-c", (
            "import time; from nvrx_lab.launcher import RankMonitorClient as C; "
            f"c = C({server.dir!r}, 0); c.init_workload_monitoring(); c.send_heartbeat(); time.sleep(30)")])
        wait_for(lambda: server.state(0).first_heartbeat_at, 20, what="child heartbeat")
        child.kill()
        child.wait()
        wait_for(lambda: server.state(0).lost_at, 5, what="closed connection noticed")
    finally:
        other.kill()
        other.wait()
        server.close()


def test_client_without_launcher_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("NVRX_LAB_MONITOR_DIR", raising=False)
    assert not RankMonitorClient.available()
    with pytest.raises(RankMonitorClientError, match="NVRX_LAB_MONITOR_DIR"):
        RankMonitorClient().init_workload_monitoring()


def test_the_standby_imports_our_entry_modules_main_and_never_a_users_script():
    from nvrx_lab.launcher.__main__ import own_entry

    assert own_entry(["-u", "-m", "nvrx_lab.train", "--steps", "4"]) == ["nvrx_lab.train.main"]
    assert own_entry(["-u", "train.py", "-m", "nvrx_lab.train"]) == []  # a script (its own -m flag is an argument)
    assert own_entry(["-u", "-m", "mypackage.train"]) == [] and own_entry(["-u", "-m", "nvrx_lab.demo.launcher_worker"]) == []


def test_in_process_restart_keeps_the_ranks_whose_loss_would_restart_the_group_anyway(capsys):
    from nvrx_lab.dist import LaunchEnv
    from nvrx_lab.launcher.policy import MinHealthy, any_failed, tolerated_losses
    from nvrx_lab.train.attempts import inprocess_floor

    assert tolerated_losses(any_failed, 8) == 0 and tolerated_losses(MinHealthy(8), 8) == 0
    assert tolerated_losses(MinHealthy(6), 8) == 2 and tolerated_losses(MinHealthy(1), 8) == 7
    env = {"RANK": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "h"}
    assert inprocess_floor(1, LaunchEnv.read(env)) == 1  # not under nvrx_lab.launcher: as configured
    assert inprocess_floor(1, LaunchEnv.read({**env, "NVRX_LAB_LAUNCHER_TOLERATES": "2"})) == 14
    assert "at least 14 of 16 ranks" in capsys.readouterr().out
    assert inprocess_floor(15, LaunchEnv.read({**env, "NVRX_LAB_LAUNCHER_TOLERATES": "2"})) == 15


def test_a_launcher_whose_rendezvous_another_node_closed_does_not_exit_0(capsys):
    """torch's agent returns nothing after a graceful rendezvous exit (another node finished or gave up first): exit 0
    would mark this Kubernetes index Succeeded for good; the launcher exits 3 and says why in one line."""
    from types import SimpleNamespace

    from nvrx_lab.launcher.__main__ import RENDEZVOUS_CLOSED, exit_status
    from nvrx_lab.launcher.restart_log import RestartLog

    log = RestartLog(None, 3)
    trained = SimpleNamespace(admitted=True, spare=False, usage_error=None, no_progress=None)
    assert exit_status(None, trained, log, 3) == RENDEZVOUS_CLOSED == 3
    assert log.lines == ["[nvrx-lab-launch] the rendezvous was closed by another node (it finished or gave up) before "
                         "this node's workers finished: exit 3, not 0, so this node is not counted as done"]
    spare = SimpleNamespace(admitted=True, spare=True, usage_error=None, no_progress=None)  # the round full without it
    assert exit_status(None, spare, log, 3) == 0 and "waiting as a hot spare (the round was full without it)" in \
        log.lines[-1]
    done, failed = (SimpleNamespace(state=SimpleNamespace(name=n)) for n in ("SUCCEEDED", "FAILED"))
    assert exit_status(done, trained, log, 3) == 0 and exit_status(failed, trained, log, 3) == 1
    assert exit_status(failed, SimpleNamespace(usage_error=SimpleNamespace(exit_code=2)), log, 3) == 2
    assert log.lines[-1] == "[nvrx-lab-launch] workers failed after 3 restart(s); giving up"


def test_progress_is_a_newer_committed_step_and_three_attempts_without_one_stop(tmp_path):
    import json

    from nvrx_lab.eks.render import pod_failure_policy
    from nvrx_lab.launcher.progress import NO_PROGRESS, ProgressTracker

    stream = tmp_path / "m.jsonl"
    write = lambda *events: stream.open("a").write("".join(json.dumps(e) + "\n" for e in events))  # noqa: E731
    idle = ProgressTracker(str(stream), 3)
    write({"kind": "start", "rank": 0, "ckpt": "none"}, {"kind": "step", "step": 1})  # workers that never checkpoint
    assert [idle.restart() for _ in range(5)] == [False] * 5  # no progress can be seen: never stopped, and said once
    assert idle.off_line().startswith("no-progress stop: restarts not counted (the workers' events in") and \
        idle.off_line() is None
    write({"kind": "ckpt_commit", "step": 100})  # an earlier launch of the run: not this launch's progress
    t = ProgressTracker(str(stream), 3)
    assert (t.restart(), t.restart()) == (False, False) and t.without == 2
    write({"kind": "step", "step": 104}, {"kind": "ckpt_commit", "step": 105})
    assert not t.restart() and t.without == 0  # step 105 committed: the count starts again
    stream.open("a").write('{"kind": "ckpt_commit", "st')  # a torn line, read once it is whole
    assert [t.restart(), t.restart(), t.restart()] == [False, False, True] and t.committed == 105
    assert t.line().startswith("no progress: 3 attempts in a row ended without committing a newer checkpoint (the "
                               "last committed: step 105); stopping with exit 4")
    assert not ProgressTracker(None, 3).restart() and not ProgressTracker(str(stream), 0).restart()  # off
    assert ProgressTracker(None, 3).off_line().endswith("(no --metrics-file to read the workers' commits from)")
    assert ProgressTracker(str(stream), 0).off_line() is None  # turned off by the setting: nothing to say
    assert pod_failure_policy()["rules"][0]["onExitCodes"]["values"] == [2, NO_PROGRESS]  # the Job fails, not retried
