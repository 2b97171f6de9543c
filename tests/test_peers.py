"""Every peer row of the benchmarks runs, at smoke size, as its users would run it, so none can rot silently.

DCP ships with torch: its rows always run. NVRx's rows (``ft_launcher``, the in-process ``Wrapper``) run when
the ``peers`` extra is installed (``make peers``), else they are skipped here."""

import importlib.util
import json
import subprocess
import sys

import pytest

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
NVRX = importlib.util.find_spec("nvidia_resiliency_ext") is not None
needs_nvrx = pytest.mark.skipif(not NVRX, reason="the peers extra is not installed (make peers)")


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvrx_lab.bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dcp_async_rows_reuse_a_stager_and_stay_consistent(tmp_path):
    out = tmp_path / "checkpoint.json"
    methods = ["memcpy", "dcp.async_save[thread]", "dcp.async_save[process]", "dcp.async_save[process,shm]"]
    res = bench("checkpoint", "--sizes-mib", "4", "--repeats", "2", "--methods", *methods, "--out", str(out),
                "--dir", str(tmp_path / "ckpt"), timeout=280)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted(methods)
    for name in methods[1:]:  # a reused stager is overwritten by the next save: each one still loads as taken
        assert rows[name]["consistent"] == "yes" and rows[name]["block_med_s"] > 0, rows[name]


def test_a_failing_row_is_an_error_with_its_output_and_exit_1(tmp_path, monkeypatch, capsys):
    from nvrx_lab.bench import checkpoint
    from nvrx_lab.runner import RunResult

    def broken(cmd, *args, **kwargs):  # the row's process dies as a peer that cannot run here would
        return RunResult(cmd, 1, "Traceback (most recent call last):\nRuntimeError: no such executor", 0.1)

    monkeypatch.setattr(checkpoint, "run", broken)
    out = tmp_path / "c.json"
    assert checkpoint.main(["--sizes-mib", "4", "--methods", "dcp.async_save[thread]", "--out", str(out),
                            "--dir", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err
    assert "dcp.async_save[thread] @ 4 MiB failed (exit 1):" in err and "RuntimeError: no such executor" in err, err
    assert json.loads(out.read_text())["rows"] == []  # no row of nan


@needs_nvrx
@pytest.mark.timeout(300)
def test_ft_launcher_recovers_a_kill_and_a_hang_with_heartbeats_from_nvrx_own_client(tmp_path):
    out = tmp_path / "launcher.json"
    res = bench("launcher", "--faults-per-kind", "1", "--launchers", "ft_launcher", "--out", str(out), timeout=280)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = {r["fault"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(rows[k]["recovered"] == rows[k]["injected"] == 1 for k in ("kill", "hang")), rows
    # found by a missed heartbeat, well before the 10 s gloo timeout that is all torchrun has
    assert rows["hang"]["median_s"] < 10, rows["hang"]


@needs_nvrx
@pytest.mark.timeout(300)
def test_nvrx_wrapper_recovers_exceptions_in_process(tmp_path):
    out = tmp_path / "recovery.json"
    res = bench("recovery", "--faults-per-kind", "2", "--kinds", "exception", "--modes", "nvrx-inprocess",
                "--out", str(out), timeout=280)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["recovered"] == "2/2" and row["median_s"] > 0, row
