"""Every command line says a user's mistake in one line: ``error: ...`` on stderr naming the flag or path and
what is valid, exit code 2, no usage dump and no traceback; flags are never abbreviated; ``--help`` still
prints the usage (exit 0). Each CLI runs once as a real process (what a user's console shows: the whole stderr,
the exit code); its many cases call its ``main(argv)`` in this process, which parses, checks and fails the same
way, without the 5-10 s a process takes to import torch here (62 processes were 4 min of ``make test``)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
from conftest import in_process

from nvrx_lab.bench.__main__ import available
from nvrx_lab.bench.__main__ import main as bench_main
from nvrx_lab.cli import check_writable
from nvrx_lab.launcher.__main__ import main as launch_main
from nvrx_lab.replicas.local import main as replicas_local_main
from nvrx_lab.train.main import main as train_main

TRAIN = ["-m", "nvrx_lab.train"]
LAUNCH = ["-m", "nvrx_lab.launcher"]
BENCH = ["-m", "nvrx_lab.bench"]


def cli(*args: str, timeout: float = 240, preexec_fn=None) -> subprocess.CompletedProcess:
    """A wedge's bound, not a speed goal: ``--help`` imports torch, which took over 60 s at a load of 14."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=preexec_fn)


def one_error_line(res: subprocess.CompletedProcess) -> str:
    """The one line of a usage error (asserting exit 2 and nothing else on stderr)."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    return lines[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needles", [
    (["--bogus"], ["unrecognized arguments: --bogus", "(see python -m nvrx_lab.train --help)"]),
    (["--steps", "ten"], ["argument --steps: expected an integer, got 'ten'"]),
    (["--lr", "fast"], ["argument --lr: expected a number, got 'fast'"]),
    (["--ckpt-di", "x"], ["--ckpt-di", "flags are never abbreviated: did you mean --ckpt-dir?"]),  # not --ckpt-dir
    (["--ckpt-intervl", "3"], ["--ckpt-intervl", "did you mean --ckpt-interval?"]),
    (["--device", "tpu"], ["argument --device: invalid choice: 'tpu'", "'cpu'"]),
    (["--ckpt", "async"], ["--ckpt async needs --ckpt-dir DIR"]),  # the trainer's own checks, one line too
    (["--steps"], ["argument --steps: expected one argument"]),
])
def test_trainer_usage_error_is_one_line(args, needles, capsys):
    line = one_error_line(in_process(train_main, *args, capsys=capsys))
    assert all(n in line for n in needles), line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needles", [
    (["--bogus", "w.py"], ["unrecognized arguments: --bogus", "(see python -m nvrx_lab.launcher --help)"]),
    (["--nproc", "2", "w.py"], ["flags are never abbreviated: did you mean --nproc-per-node?"]),  # torchrun's flag
    (["--heartbeat-tim", "3", "w.py"], ["did you mean --heartbeat-timeout?"]),  # one of ours
    (["--heartbeat-timeout", "-1", "w.py"], ["argument --heartbeat-timeout: must be > 0 seconds, got '-1'"]),
    (["--max-restarts", "x", "w.py"], ["--max-restarts", "expected an integer, got 'x'"]),
    (["--restart-policy", "x", "w.py"], ["argument --restart-policy: invalid choice: 'x'", "'min-healthy'"]),
    (["--nproc-per-node", "1"], ["the following arguments are required: training_script"]),
    (["--config", "/nonexistent/c.yaml", "w.py"], ["--config /nonexistent/c.yaml: cannot read"]),
])
def test_launcher_usage_error_is_one_line(args, needles, capsys):
    line = one_error_line(in_process(launch_main, *args, capsys=capsys))
    assert all(n in line for n in needles), line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needles", [
    (["--", "--stepz", "3"], ["unrecognized arguments: --stepz 3; did you mean --steps?", "python -m nvrx_lab.train"]),
    (["--", "--steps", "3", "--faults", "1:9:exception"], ["--faults entry 1:9:exception: step 9 is outside"]),
    (["--", "--faults", "6:2:exception"], ["rank 6 is not in this world of 6 rank(s) across 3 replica groups of 2"]),
    (["--coordinator-fault", "x"], ["--coordinator-fault 'x': expected STEP[:DELAY]"]),
])
def test_replicas_local_says_a_groups_usage_error_before_starting_any(args, needles, capsys, tmp_path):
    """Every group would exit 2 on it and the run would end with no step committed: said once, before any group."""
    out = tmp_path / "out"
    line = one_error_line(in_process(replicas_local_main, "--replicas", "3", "--nproc", "2", "--out", str(out), *args,
                                     capsys=capsys))
    assert all(n in line for n in needles), line
    assert not out.exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("entry, args, needle", [
    (TRAIN, ["--ckpt-di", "x"], "error: unrecognized arguments: --ckpt-di x; flags are never abbreviated: did you mean"),
    (LAUNCH, ["--heartbeat-tim", "3", "w.py"], "error: unrecognized arguments: --heartbeat-tim"),
    (BENCH, ["nope"], "error: unknown benchmark 'nope'; choose one of checkpoint,"),
    ([*BENCH, "replicas"], ["--bogus"], "error: unrecognized arguments: --bogus (see python -m nvrx_lab.bench replicas"),
])
def test_a_real_process_prints_the_one_line_and_exits_2(entry, args, needle):
    """What the in-process cases check, as the user's console has it: the whole stderr, the process's exit code."""
    line = one_error_line(cli(*entry, *args))
    assert line.startswith(needle), line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needle", [
    (["--faults", "1:99:exception"], "error: --faults entry 1:99:exception: step 99 is outside this run's steps 1..30"),
    (["--stepz", "3"], "error: unrecognized arguments: --stepz 3; did you mean --steps?"),
])
def test_the_readmes_way_says_a_usage_error_once_and_exits_2(args, needle, tmp_path):
    """Two ranks under ``python -m nvrx_lab.launcher`` (the README's commands): the trainer's error line once (the
    node's local rank 0 says it), the launcher's line, exit 2; no torchrun ChildFailedError, no traceback."""
    res = subprocess.run([sys.executable, "-m", "nvrx_lab.launcher", "--standalone", "--nproc-per-node", "2", "-m",
                          "nvrx_lab.train", "--steps", "30", *args], capture_output=True, text=True, timeout=100, cwd=tmp_path)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and errors[0].startswith(needle), res.stderr[-3000:]
    assert "exited 2 (usage error): not restarting" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.timeout(60)
def test_launcher_metrics_file_that_cannot_be_written_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    line = one_error_line(in_process(launch_main, "--metrics-file", str(tmp_path / "file" / "m.jsonl"), "w.py",
                                     capsys=capsys))
    assert f"--metrics-file {tmp_path / 'file' / 'm.jsonl'} cannot be created: {tmp_path / 'file'} is a file" in line


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launcher_does_not_retry_a_worker_usage_error():
    """``--ckpt-di`` reaches the trainer under the launcher: one error line from the worker, exit 2, no restart."""
    res = cli(*LAUNCH, "--standalone", "--nproc-per-node", "1", "--max-restarts", "3", "--monitor-interval", "0.2",
              *TRAIN, "--steps", "2", "--ckpt-di", "x", timeout=100)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "error: unrecognized arguments: --ckpt-di x" in res.stderr and "not restarting" in res.stderr, res.stderr[-3000:]
    assert "restart 1/3" not in res.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, needle", [
    (["nope"], "error: unknown benchmark 'nope'; choose one of checkpoint,"),
    ([], "error: no benchmark given; choose one of checkpoint,"),
    (["--bogus"], "error: unknown benchmark '--bogus'"),
])
def test_bench_dispatch_error_is_one_line(args, needle, capsys):
    line = one_error_line(in_process(bench_main, *args, capsys=capsys))
    assert line.startswith(needle), line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", available())
def test_every_benchmark_rejects_an_unknown_flag_in_one_line(name, capsys):
    line = one_error_line(in_process(bench_main, name, "--bogus", capsys=capsys))
    assert line == f"error: unrecognized arguments: --bogus (see python -m nvrx_lab.bench {name} --help)", line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, needle", [
    (["checkpoint", "--rep", "3"], "flags are never abbreviated: did you mean --repeats?"),
    (["checkpoint", "--repeats", "x"], "argument --repeats: expected a number > 0, got 'x'"),
    (["efficiency", "--repeats", "0"], "--repeats must be >= 1, got 0"),  # a check after parsing
    (["reliability", "--cases", "zz"], "--cases: unknown zz; choose from"),
])
def test_benchmark_usage_error_is_one_line(args, needle, capsys):
    line = one_error_line(in_process(bench_main, *args, capsys=capsys))
    assert needle in line, line


@pytest.mark.timeout(300)
def test_help_still_prints_the_usage():
    res = cli(*TRAIN, "--help")
    assert res.returncode == 0 and res.stdout.startswith("usage: ") and "--ckpt-interval" in res.stdout, res.stderr[-2000:]
    assert not res.stderr.strip(), res.stderr[-2000:]


@pytest.mark.parametrize("main, args, needle", [
    (launch_main, [], "--heartbeat-timeout"),
    (bench_main, [], "{checkpoint,"),
    (bench_main, ["checkpoint"], "--sizes-mib"),
])
def test_every_help_prints_the_usage(main, args, needle, capsys):
    res = in_process(main, *args, "--help", capsys=capsys)
    assert res.returncode in (0, None) and res.stdout.startswith("usage: ") and needle in res.stdout, res.stderr[-2000:]
    assert not res.stderr.strip(), res.stderr[-2000:]


# ------------------------------------------------------------------ a checkpoint folder that cannot be written
def _without_mode_override():
    """``preexec_fn``: drop from the bounding set the capabilities that let root ignore file modes
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER), as the reliability bench's read-only case does."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def drop() -> None:
        for cap in (1, 2, 3):
            if prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")
    return drop


CKPT = ["--steps", "2", "--global-batch", "4", "--seq-len", "32", "--ckpt", "sync", "--ckpt-dir"]


def _ckpt(folder, *more: str, preexec_fn=None) -> subprocess.CompletedProcess:
    return cli(*TRAIN, *CKPT, str(folder), *more, preexec_fn=preexec_fn)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, line", [
    (["--ckpt", "async", "--ckpt-dir", "/proc/nvrx-x"], "error: --ckpt-dir /proc/nvrx-x cannot be created: No such file "
                                                        "or directory; pass a path you can write to"),
    (["--ckpt", "async", "--ckpt-dir", "/sys/nvrx-x"], "error: --ckpt-dir /sys/nvrx-x cannot be created: "),
    (["--metrics", "/proc/nvrx-x/m.jsonl"], "error: --metrics /proc/nvrx-x/m.jsonl: its folder /proc/nvrx-x cannot be "
                                            "created: No such file or directory"),
])
def test_a_folder_the_kernel_refuses_is_one_line_for_root_too(args, line, capsys):
    """``access(2)`` lets root pass for ``/proc`` and ``/sys``; the folder is made in one place, whose ``OSError`` is
    the one line (it was a traceback)."""
    got = one_error_line(in_process(train_main, "--steps", "2", *args, capsys=capsys))
    assert got.startswith(line), got


@pytest.mark.timeout(60)
def test_ckpt_dir_under_a_file_is_one_line_and_nothing_is_written(tmp_path, capsys):
    """Fails for root too: no folder can be made under a regular file."""
    (tmp_path / "somefile").write_text("mine")
    line = one_error_line(in_process(train_main, *CKPT, str(tmp_path / "somefile" / "ckpt"), capsys=capsys))
    assert line.startswith(f"error: --ckpt-dir {tmp_path / 'somefile' / 'ckpt'} cannot be created: "
                           f"{tmp_path / 'somefile'} is a file, not a folder"), line
    assert (tmp_path / "somefile").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["somefile"]


@pytest.mark.timeout(60)
def test_ckpt_dir_in_a_folder_without_write_permission_is_one_line(tmp_path):
    """chmod 0o500; as root, the trainer runs without the capabilities that ignore file modes."""
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    drop = _without_mode_override() if os.geteuid() == 0 else None
    try:
        res = _ckpt(ro / "ckpt", preexec_fn=drop)
    except subprocess.SubprocessError as e:  # prctl refused: root here cannot be made to honour file modes
        pytest.skip(f"cannot drop CAP_DAC_OVERRIDE for a root child: {e}")
    finally:
        ro.chmod(0o700)
    line = one_error_line(res)
    assert line.startswith(f"error: --ckpt-dir {ro / 'ckpt'} cannot be written: {ro} is not writable by uid "), line
    assert "(mode 0500" in line and f"make {ro} writable" in line, line
    assert not os.listdir(ro), "something was written into the read-only folder"


@pytest.fixture
def read_only_mount(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.timeout(60)
def test_ckpt_dir_on_a_read_only_file_system_is_one_line(read_only_mount):
    """Fails for root too (the kernel refuses writes on a read-only mount whatever the capabilities)."""
    line = one_error_line(_ckpt(read_only_mount / "ckpt"))
    assert f"--ckpt-dir {read_only_mount / 'ckpt'} cannot be written: {read_only_mount} is on a read-only file system" \
        in line, line


def test_check_writable_names_the_path_and_writes_nothing(tmp_path):
    (tmp_path / "somefile").write_text("")
    with pytest.raises(ValueError, match=r"^--metrics .*/somefile/m.jsonl cannot be created: .*/somefile is a file"):
        check_writable(tmp_path / "somefile" / "m.jsonl", "--metrics")
    with pytest.raises(ValueError, match=r"^--metrics .* is a folder; pass a file path"):
        check_writable(tmp_path, "--metrics")
    with pytest.raises(ValueError, match=r"^--ckpt-dir .*/somefile is a file; pass a folder"):
        check_writable(tmp_path / "somefile", "--ckpt-dir", folder=True)
    check_writable(tmp_path / "new" / "deeper" / "m.jsonl", "--metrics")  # missing folders would be made
    check_writable(tmp_path / "new" / "ckpt", "--ckpt-dir", folder=True)
    assert sorted(os.listdir(tmp_path)) == ["somefile"]


@pytest.mark.timeout(60)
def test_metrics_path_that_cannot_be_written_is_one_line(tmp_path, capsys):
    (tmp_path / "somefile").write_text("")
    line = one_error_line(in_process(train_main, "--steps", "2", "--metrics", str(tmp_path / "somefile" / "m.jsonl"),
                                     capsys=capsys))
    assert f"--metrics {tmp_path / 'somefile' / 'm.jsonl'} cannot be created" in line, line
