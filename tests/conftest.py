"""Shared fixtures: real processes on loopback, every wait bounded, every process group cleaned up."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from nvrx_lab.net import free_port_pair
from nvrx_lab.reliability.trainer import curve_problem
from nvrx_lab.runner import Torchrun, run

ROOT = Path(__file__).resolve().parents[1]


def run_group(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group (:func:`nvrx_lab.runner.run`); a timeout fails the test."""
    res = run(cmd, timeout, env, cwd=cwd or ROOT)
    if res.timed_out:
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{res.output[-4000:]}")
    return subprocess.CompletedProcess(cmd, res.returncode, res.output, None)


def assert_one_curve(events: list[dict], steps: int) -> None:
    """Every step 1..steps ran, and a step redone after a restart gave bit for bit the same loss."""
    problem = curve_problem(events, steps)
    assert problem is None, problem


@pytest.fixture
def port() -> int:
    """A free MASTER_PORT whose neighbour (MASTER_PORT + 1) is free too."""
    return free_port_pair()


@pytest.fixture
def torchrun(port):
    """``torchrun(nproc, *args, timeout=...)`` → CompletedProcess; asserts nothing itself."""

    def run(nproc: int, *args: str, timeout: float = 120, env: dict | None = None):
        return run_group(Torchrun.local(nproc, port).argv(args), timeout, env)

    return run
