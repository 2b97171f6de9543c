"""Shared fixtures: real processes on loopback, every wait bounded, every process group cleaned up."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from nvrx_lab.net import PORTS_ENV, free_port_pair, worker_ports
from nvrx_lab.reliability.trainer import curve_problem
from nvrx_lab.runner import Torchrun, run

ROOT = Path(__file__).resolve().parents[1]
CELL_MARGIN_S = 30


def pytest_configure(config) -> None:
    """Ports per xdist worker. ``make test`` runs two workers side by side; a test picks a free port, checks it and
    hands it to a process that binds it seconds later, and the other worker's test could pick the same port meanwhile
    (a torchrun found its rendezvous port taken, 1 fresh-clone run in 1, and its peer talked to a stranger's server).
    Each worker picks from a slice of its own (``$NVRX_LAB_PORTS``, which every process it starts inherits)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count and PORTS_ENV not in os.environ:
        ports = worker_ports(int(worker.removeprefix("gw")), int(count))
        os.environ[PORTS_ENV] = f"{ports.start}-{ports.stop - 1}"


def pytest_collection_modifyitems(config, items) -> None:
    """A notebook cell's deadline is nbval's ``--nbval-cell-timeout`` (``make test`` collects ``tests`` and
    ``notebooks`` together): pytest-timeout's suite-wide ``timeout`` (for the tests) ended a long cell first, at
    180 s, with a dump of pytest's own threads instead of the cell's output. (A ``notebooks/conftest.py`` would be
    imported as the module ``conftest`` too, and shadow this one in the test modules that import its helpers.)"""
    cell_s = config.getoption("nbval_cell_timeout", default=None)
    if cell_s:
        for item in items:
            if item.path.suffix == ".ipynb":
                item.add_marker(pytest.mark.timeout(float(cell_s) + CELL_MARGIN_S))


def run_group(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group (:func:`nvrx_lab.runner.run`); a timeout fails the test."""
    res = run(cmd, timeout, env, cwd=cwd or ROOT)
    if res.timed_out:
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{res.output[-4000:]}")
    return subprocess.CompletedProcess(cmd, res.returncode, res.output, None)


def in_process(main, *argv: str, capsys) -> subprocess.CompletedProcess:
    """``main(argv)`` in the test's process (a usage error needs no process of its own), its exit code (the parser's
    ``SystemExit`` included) and what it printed, as a finished process reports them."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


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
