"""Shared fixtures: real processes on loopback, every wait bounded, every process group cleaned up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nvrx_lab.net import free_port_pair

ROOT = Path(__file__).resolve().parents[1]


def torchrun_cmd(nproc: int, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(port), *args]


def run_group(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill the whole group and fail the test."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=cwd or ROOT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def assert_one_curve(events: list[dict], steps: int) -> None:
    """Every step 1..steps ran, and a step redone after a restart gave bit for bit the same loss."""
    by_step: dict[int, set[float]] = {}
    for e in events:
        if e["kind"] == "step":
            by_step.setdefault(e["step"], set()).add(e["loss"])
    assert sorted(by_step) == list(range(1, steps + 1))
    assert all(len(v) == 1 for v in by_step.values()), f"a redone step gave another loss: {by_step}"


@pytest.fixture
def port() -> int:
    """A free MASTER_PORT whose neighbour (MASTER_PORT + 1) is free too."""
    return free_port_pair()


@pytest.fixture
def torchrun(port):
    """``torchrun(nproc, *args, timeout=...)`` → CompletedProcess; asserts nothing itself."""

    def run(nproc: int, *args: str, timeout: float = 120, env: dict | None = None):
        return run_group(torchrun_cmd(nproc, port, *args), timeout, env)

    return run
